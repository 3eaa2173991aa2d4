"""The ``multi-turn`` data set: chat conversations that resend their whole history.

A conversation is a system prompt shared by every conversation of the run, then
``turns`` user questions. Turn ``k`` sends the system prompt, the questions of turns
``1..k`` and the answers *the server gave* to turns ``1..k-1`` (as a chat client does),
so after turn 1 almost all of a prompt is a prefix some instance has already seen: the
earlier prompt, plus the answer a decode instance generated.

Lengths are in tokens of the text itself under the served model's tokenizer (no special
tokens): the system prompt has exactly ``system_prompt_len`` (0: no system message), each
question exactly ``question_len``. What a turn's prompt counts on the server (the chat
template, the history, the answers) is only known once the earlier answers are: the
client counts it after the run by rendering the messages it sent with the chat template,
and checks it against the server's ``usage.prompt_tokens``.

Text comes from the bundled sonnets (nothing downloads). Everything is deterministic for
a seed and a tokenizer: the system prompt, the questions (each starts with its
conversation and turn number, so no two are the same), and the think times.

Think time: the pause between the end of one answer's stream and the next question,
as a user reading. ``exponential`` (the default) draws each pause from an exponential
distribution with mean ``think_time`` seconds (a Poisson user); ``fixed`` waits exactly
``think_time``. 0 sends the next turn as soon as the answer ends.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from kvpush.bench.datasets import DatasetError, PromptCodec, sonnet_lines

MULTI_TURN = "multi-turn"
#: The start of the shared system prompt (then sonnet lines, cut to the length).
SYSTEM_INSTRUCTION = ("You are a poetry assistant. Answer every question with lines "
                      "from these sonnets:\n")
#: How each question starts (conversation and turn number, 1-based; short, so that
#: most of a question is sonnet text), then sonnet lines.
QUESTION_HEAD = "[{conversation}.{turn}] "
#: Rounds of decode / re-encode before trying every nearby cut.
_CUT_ROUNDS = 16


class ThinkTime(str, Enum):
    """How the pause before each turn after the first is drawn."""

    EXPONENTIAL = "exponential"
    FIXED = "fixed"


@dataclass(frozen=True)
class Conversation:
    """One conversation: the shared system prompt ("" for none), its questions in turn
    order, and the answer length of every turn (max_tokens, with ignore_eos)."""

    system_prompt: str
    questions: tuple[str, ...]
    output_len: int

    @property
    def turns(self) -> int:
        return len(self.questions)

    def messages(self, turn: int, answers: Sequence[str]) -> list[dict[str, str]]:
        """The chat messages of ``turn`` (1-based): the system prompt, then each earlier
        question with its answer from ``answers`` (what the server sent), then this
        turn's question."""
        if not 1 <= turn <= self.turns:
            raise ValueError(f"turn {turn} is not in 1..{self.turns}")
        if len(answers) < turn - 1:
            raise ValueError(f"turn {turn} needs the {turn - 1} earlier answer(s), "
                             f"got {len(answers)}")
        out = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        for k in range(turn - 1):
            out.append({"role": "user", "content": self.questions[k]})
            out.append({"role": "assistant", "content": answers[k]})
        out.append({"role": "user", "content": self.questions[turn - 1]})
        return out


def count_messages(codec: PromptCodec, messages: list[dict[str, str]]) -> int:
    """Prompt tokens the server sees for ``messages``: the chat template applied (with
    the assistant header), encoded without the tokenizer's own special tokens (as
    kvpush's server and vLLM do)."""
    text = codec.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                               tokenize=False)
    return len(codec.encode_plain(str(text)))


def cut_text(codec: PromptCodec, text: str, n: int) -> str:
    """The start of ``text`` that encodes to exactly ``n`` tokens (no special tokens).

    Decoding a cut and encoding it again can merge or split tokens at the cut, so the
    cut moves until the count is right; failing that every cut within 8 tokens of ``n``
    is tried. Raises :class:`DatasetError` if ``text`` is too short or no cut fits.
    """
    if n == 0:
        return ""
    ids = codec.encode_plain(text)
    if len(ids) < n:
        raise DatasetError(f"the text has {len(ids)} tokens, fewer than {n}")

    def at(m: int) -> tuple[str, int]:
        # a cut through a multi-byte character decodes to U+FFFD: drop it
        cand = codec.decode(ids[:m]).replace("\ufffd", "")
        return cand, len(codec.encode_plain(cand))

    m, tried = n, set()
    for _ in range(_CUT_ROUNDS):
        if m in tried or not 0 < m <= len(ids):
            break
        tried.add(m)
        cand, c = at(m)
        if c == n:
            return cand
        m += n - c
    for m in sorted(range(max(1, n - 8), min(len(ids), n + 8) + 1), key=lambda x: abs(x - n)):
        cand, c = at(m)
        if c == n:
            return cand
    raise DatasetError(f"could not cut the sonnet text to exactly {n} tokens")


def _sonnet_text(codec: PromptCodec, rng: random.Random, head: str, n: int) -> str:
    """``head`` then sonnet lines from a random start, cut to exactly ``n`` tokens."""
    lines = sonnet_lines()
    i = rng.randrange(len(lines))
    parts, have = [head], len(codec.encode_plain(head))
    while have < n + 8:  # a few tokens spare: the cut may need them
        parts.append(lines[i % len(lines)])
        have += len(codec.encode_plain(lines[i % len(lines)]))
        i += 1
    return cut_text(codec, "".join(parts), n)


def multi_turn_conversations(codec: PromptCodec, num: int, turns: int,
                             system_prompt_len: int, question_len: int, output_len: int,
                             seed: int = 0) -> list[Conversation]:
    """``num`` conversations of ``turns`` questions, sharing one system prompt (see the
    module docstring for the lengths)."""
    if codec.endpoint != "chat":
        raise DatasetError("the multi-turn data set needs the chat endpoint (--endpoint chat)")
    for name, value, least in (("number of conversations", num, 1), ("turns", turns, 1),
                               ("question length", question_len, 1),
                               ("output length", output_len, 1),
                               ("system prompt length", system_prompt_len, 0)):
        if value < least:
            raise DatasetError(f"the {name} must be at least {least}, got {value}")
    rng = random.Random(f"multi-turn:{seed}")
    system = _sonnet_text(codec, rng, SYSTEM_INSTRUCTION, system_prompt_len)
    out = []
    for c in range(num):
        questions = tuple(
            _sonnet_text(codec, rng, QUESTION_HEAD.format(conversation=c + 1, turn=t + 1),
                         question_len) for t in range(turns))
        out.append(Conversation(system, questions, output_len))
    return out


def think_times(num: int, turns: int, mean: float, dist: ThinkTime | str = ThinkTime.EXPONENTIAL,
                seed: int = 0) -> list[list[float]]:
    """The pause (seconds) before each turn of each conversation: ``out[c][t]`` before
    turn ``t + 1`` of conversation ``c``; 0 before turn 1. Drawn in conversation order
    from the seed, so every run with the same seed waits alike however the server
    schedules."""
    dist = ThinkTime(dist)
    if not mean >= 0:
        raise DatasetError(f"the think time must be >= 0 seconds, got {mean}")
    rng = random.Random(f"think:{seed}")

    def draw() -> float:
        if mean == 0:
            return 0.0
        return mean if dist is ThinkTime.FIXED else rng.expovariate(1.0 / mean)

    return [[0.0] + [draw() for _ in range(turns - 1)] for _ in range(num)]
