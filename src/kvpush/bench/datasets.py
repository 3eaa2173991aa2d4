"""Benchmark prompts with an exact token count under the served model's tokenizer.

Three data sets, all deterministic for a seed and a tokenizer:

* ``random``: random token ids (vLLM's random data set). On the completions endpoint they
  are sent as a list of token ids, which is exact by construction; as text (the chat
  endpoint, or ``prompt_type="text"``) they are decoded and the text is fitted until it
  re-encodes to exactly the requested length.
* ``sonnet``: lines of Shakespeare's sonnets (public domain, bundled in ``sonnets.txt``)
  after vLLM's sonnet instruction. As in vLLM, every prompt starts with the same whole
  lines (about ``prefix_len`` tokens, 200 by default), then lines drawn at random; the
  text is cut to exactly the requested length.
* ``shared-prefix``: every prompt starts with the same ``prefix_len`` tokens of random
  ids, then a random suffix (a prefix-cache workload). Exact as token ids; as text the
  prefix text is the same in every prompt, but a tokenizer may merge across its end.

"Exactly N tokens" means the prompt the server sees: on the completions endpoint a text
prompt is encoded with the tokenizer's special tokens (its BOS, as kvpush and vLLM do); on
the chat endpoint the user message is rendered with the chat template, so the template's
own tokens count too.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

Endpoint = Literal["completions", "chat"]
DATASETS: tuple[str, ...] = ("random", "sonnet", "shared-prefix")
PROMPT_TYPES: tuple[str, ...] = ("auto", "text", "token-ids")
#: vLLM's sonnet instruction (the text before the poem lines).
SONNET_INSTRUCTION = "Pick as many lines as you can from these poem lines:\n"
#: The shared part of a sonnet prompt when no prefix length is given (vLLM's default).
DEFAULT_SONNET_PREFIX_LEN = 200
#: Rounds of decode / re-encode / trim-or-extend before giving up on a length.
_FIT_ROUNDS = 64


class DatasetError(ValueError):
    """A prompt set that cannot be built (bad lengths, tokenizer without a template...)."""


@dataclass(frozen=True)
class SampleRequest:
    """One benchmark request: the prompt (text or token ids), its length in tokens as
    the server will count it, and the number of tokens to generate."""

    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int


def load_tokenizer(path_or_name: str) -> Any:
    """A transformers tokenizer from a local folder or the local HF cache (no download)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path_or_name, local_files_only=True)
    except (OSError, ValueError) as e:
        raise DatasetError(f"cannot load a tokenizer from {path_or_name!r}: {e}") from None
    # Building over-long candidates is expected; do not warn about model_max_length.
    tok.model_max_length = 1 << 60
    return tok


def local_tokenizer_dir(name: str) -> Path | None:
    """A local folder for ``name``: a kvpush model (name or folder) or a folder with
    tokenizer files; None if there is none."""
    from kvpush.errors import ConfigError
    from kvpush.models.registry import resolve_model

    try:
        return resolve_model(name)
    except ConfigError:
        pass
    path = Path(name).expanduser()
    if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return path
    return None


def find_tokenizer(names: list[str]) -> tuple[Any, str]:
    """(tokenizer, its source) for the first of ``names`` that is a local folder or kvpush
    model; failing that, the first in the local Hugging Face cache. Never downloads."""
    for name in names:
        folder = local_tokenizer_dir(name)
        if folder is not None:
            return load_tokenizer(str(folder)), str(folder)
    for name in names:
        try:
            return load_tokenizer(name), name
        except DatasetError:
            continue
    raise DatasetError(f"no local tokenizer for {' or '.join(map(repr, names))} (looked for "
                       "folders, kvpush models and the local Hugging Face cache)")


@lru_cache(maxsize=1)
def sonnet_lines() -> tuple[str, ...]:
    """The bundled sonnet lines, each ending in a newline."""
    path = Path(__file__).parent / "sonnets.txt"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:  # an install that left the package data out
        raise DatasetError(f"the bundled sonnets are missing ({path}): {e}") from None
    return tuple(line + "\n" for line in text.splitlines() if line.strip())


class PromptCodec:
    """Counts and builds prompts the way the server will tokenize them."""

    def __init__(self, tokenizer: Any, endpoint: Endpoint = "completions") -> None:
        self.tokenizer = tokenizer
        self.endpoint = endpoint
        if endpoint == "chat" and not getattr(tokenizer, "chat_template", None):
            raise DatasetError("the tokenizer has no chat template: use --endpoint completions")
        banned = set(getattr(tokenizer, "all_special_ids", []) or [])
        banned.update(tokenizer.get_added_vocab().values())
        #: Token ids a random prompt may contain: everything but special/added tokens.
        self.allowed_ids: list[int] = [i for i in range(len(tokenizer)) if i not in banned]
        if not self.allowed_ids:
            raise DatasetError("the tokenizer has no ordinary tokens")
        #: Tokens the server adds around a completions text prompt (e.g. BOS).
        self.special_prefix: list[int] = list(tokenizer.encode("", add_special_tokens=True))
        #: Tokens a prompt has before any content (BOS, or the chat template's own).
        self.overhead: int = self.count("")

    def encode_plain(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=False,
                                         clean_up_tokenization_spaces=False))

    def render(self, text: str) -> str:
        """The text the server tokenizes for a prompt (the chat template applied)."""
        if self.endpoint == "completions":
            return text
        return str(self.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False))

    def count(self, text: str) -> int:
        """Prompt tokens the server will see for ``text`` on this endpoint."""
        if self.endpoint == "completions":
            return len(self.tokenizer.encode(text, add_special_tokens=True))
        return len(self.encode_plain(self.render(text)))

    def random_ids(self, rng: random.Random, n: int) -> list[int]:
        return [rng.choice(self.allowed_ids) for _ in range(n)]

    def fit(self, ids: list[int], target: int, rng: random.Random, prefix: str = "") -> str:
        """``prefix`` + text from ``ids`` that counts exactly ``target`` tokens.

        Decodes, counts, then drops tokens from the end or appends random ones and tries
        again (decoding and re-encoding can merge or split tokens).
        """
        if self.count(prefix) > target:
            raise DatasetError(f"a {target}-token prompt cannot hold its shared prefix")
        last = -1
        for _ in range(_FIT_ROUNDS):
            # A cut through a multi-byte character decodes to U+FFFD, which re-encodes
            # to several tokens: drop it rather than let it keep the length up.
            body = self.decode(ids).replace("\ufffd", "")
            c = self.count(prefix + body)
            if c == target:
                return prefix + body
            ids = self.encode_plain(body)
            if c > target:
                extra = 1 if c == last else 0  # stuck: cut one more
                ids = ids[:max(0, len(ids) - (c - target) - extra)]
            else:
                ids = ids + self.random_ids(rng, target - c)
            last = c
        raise DatasetError(f"could not fit a text prompt to exactly {target} tokens")


def _check_lengths(codec: PromptCodec, input_len: int, output_len: int,
                   prefix_len: int | None = None) -> None:
    if output_len < 1:
        raise DatasetError(f"output length must be at least 1, got {output_len}")
    floor = codec.overhead + 1
    if input_len < floor:
        where = "the chat template" if codec.endpoint == "chat" else "the special tokens"
        raise DatasetError(f"input length {input_len} is too short: {where} alone take "
                           f"{codec.overhead} tokens; use at least {floor}")
    if prefix_len is not None and not 0 < prefix_len < input_len:
        raise DatasetError(f"prefix length must be in 1..{input_len - 1} (below the input "
                           f"length), got {prefix_len}")


def random_prompts(codec: PromptCodec, num: int, input_len: int, output_len: int,
                   seed: int = 0, token_ids: bool = True,
                   spread: float = 0.0) -> list[SampleRequest]:
    """``num`` prompts of random tokens, each exactly ``input_len`` tokens, or with
    ``spread`` > 0 of a length drawn uniformly from input_len * [1 - spread, 1 + spread]
    (vLLM's --random-range-ratio, for the prompts only)."""
    lo, hi = int(input_len * (1 - spread)), int(input_len * (1 + spread))
    _check_lengths(codec, lo, output_len)
    rng = random.Random(f"random:{seed}")
    lens = random.Random(f"random-lengths:{seed}")
    out = []
    for _ in range(num):
        if spread:
            input_len = lens.randint(lo, hi)
        if token_ids and codec.endpoint == "completions":
            sp = codec.special_prefix
            prompt: str | list[int] = sp + codec.random_ids(rng, input_len - len(sp))
        else:
            prompt = codec.fit(codec.random_ids(rng, input_len - codec.overhead), input_len,
                               rng)
        out.append(SampleRequest(prompt, input_len, output_len))
    return out


def shared_prefix_prompts(codec: PromptCodec, num: int, input_len: int, output_len: int,
                          prefix_len: int, seed: int = 0,
                          token_ids: bool = True) -> list[SampleRequest]:
    """``num`` prompts of ``input_len`` tokens whose first ``prefix_len`` are the same."""
    _check_lengths(codec, input_len, output_len, prefix_len)
    rng = random.Random(f"shared-prefix:{seed}")
    out = []
    if token_ids and codec.endpoint == "completions":
        sp = codec.special_prefix
        if prefix_len < len(sp):
            raise DatasetError(f"prefix length must cover the {len(sp)} special tokens")
        head = sp + codec.random_ids(rng, prefix_len - len(sp))
        for _ in range(num):
            ids = head + codec.random_ids(rng, input_len - prefix_len)
            out.append(SampleRequest(ids, input_len, output_len))
        return out
    if prefix_len <= codec.overhead:
        raise DatasetError(f"prefix length must exceed the {codec.overhead} tokens of the "
                           "template / special tokens")
    head_text = codec.fit(codec.random_ids(rng, prefix_len - codec.overhead), prefix_len, rng)
    for _ in range(num):
        text = codec.fit(codec.random_ids(rng, input_len - prefix_len), input_len, rng,
                         prefix=head_text)
        out.append(SampleRequest(text, input_len, output_len))
    return out


def sonnet_prompts(codec: PromptCodec, num: int, input_len: int, output_len: int,
                   seed: int = 0, prefix_len: int | None = None) -> list[SampleRequest]:
    """``num`` sonnet prompts of exactly ``input_len`` tokens (vLLM's layout: the
    instruction, whole lines shared by every prompt up to about ``prefix_len`` tokens,
    then random lines, cut to the length). If the instruction alone is longer than
    ``prefix_len``, the prompts are random lines only."""
    if prefix_len is None:
        prefix_len = min(DEFAULT_SONNET_PREFIX_LEN, input_len // 2)
    _check_lengths(codec, input_len, output_len, prefix_len if prefix_len > 0 else None)
    lines = sonnet_lines()
    rng = random.Random(f"sonnet:{seed}")
    head, i = SONNET_INSTRUCTION, 0
    if codec.count(head) > prefix_len:
        head = ""  # too short for vLLM's layout: random lines only
    while head and codec.count(head + lines[i % len(lines)]) <= prefix_len:
        head += lines[i % len(lines)]
        i += 1
    out = []
    for _ in range(num):
        text = head
        while codec.count(text) < input_len:
            text += "".join(rng.choices(lines, k=4))
        body = codec.encode_plain(text[len(head):])
        over = codec.count(text) - input_len
        text = codec.fit(body[:max(0, len(body) - over)], input_len, rng, prefix=head)
        out.append(SampleRequest(text, input_len, output_len))
    return out


def sample_requests(codec: PromptCodec, dataset: str, num: int, input_len: int,
                    output_len: int, seed: int = 0, prefix_len: int | None = None,
                    prompt_type: str = "auto",
                    input_len_spread: float = 0.0) -> list[SampleRequest]:
    """The prompts of one benchmark run (see the module docstring for each data set).

    ``prompt_type``: ``"auto"`` sends token ids where the endpoint takes them (random and
    shared-prefix on completions) and text otherwise; ``"text"`` always text;
    ``"token-ids"`` requires token ids (completions only; not for sonnet).
    """
    if num < 1:
        raise DatasetError(f"the number of prompts must be at least 1, got {num}")
    if prompt_type not in PROMPT_TYPES:
        raise DatasetError(f"unknown prompt type {prompt_type!r}: {', '.join(PROMPT_TYPES)}")
    if prompt_type == "token-ids" and (codec.endpoint == "chat" or dataset == "sonnet"):
        raise DatasetError("token-id prompts need --endpoint completions and a random or "
                           "shared-prefix data set")
    ids = prompt_type != "text"
    if dataset == "random":
        return random_prompts(codec, num, input_len, output_len, seed, token_ids=ids,
                              spread=input_len_spread)
    if dataset == "shared-prefix":
        if prefix_len is None:
            prefix_len = input_len // 2
        return shared_prefix_prompts(codec, num, input_len, output_len, prefix_len, seed,
                                     token_ids=ids)
    if dataset == "sonnet":
        return sonnet_prompts(codec, num, input_len, output_len, seed, prefix_len)
    raise DatasetError(f"unknown data set {dataset!r}; choose one of: {', '.join(DATASETS)}")
