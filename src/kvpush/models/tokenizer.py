"""A small byte-level BPE tokenizer for random-weight test models, trained offline.

The tokenizer is trained with the `tokenizers` library on a corpus generated in code
(fixed word list, fixed seed), so it is the same on every machine and needs no download.
It has three special tokens, ChatML style: ``<|endoftext|>`` (id 0), ``<|im_start|>``
(id 1) and ``<|im_end|>`` (id 2, the chat end-of-sequence token). Any id below
``vocab_size`` decodes without error: byte-level BPE covers all 256 bytes, and when the
corpus runs out of merges before ``vocab_size`` the remainder is filled with
``<|reserved_N|>`` tokens.

:func:`load_tokenizer` is how every kvpush process loads a model's tokenizer (the engine,
the API process and the router's cache-aware policy), so that their token ids agree.
"""

from __future__ import annotations

import json
import random
from functools import lru_cache
from pathlib import Path
from typing import Any

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
#: Token ids of the special tokens (trained first, so their ids are fixed).
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2


#: tokenizer classes a tokenizer_config.json may name that AutoTokenizer loads as the
#: plain tokenizers-backed class for kvpush's model types (llama, qwen3)
_PLAIN_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
_PLAIN_MODEL_TYPES = ("llama", "qwen3")


def plain_tokenizer_folder(path: str) -> bool:
    """Whether ``path`` is a local folder whose tokenizer AutoTokenizer would load as the
    plain tokenizers-backed class: a tokenizer.json, a tokenizer_config.json naming one
    of ``_PLAIN_CLASSES`` without remote code (``auto_map``), a llama or qwen3 config."""
    folder = Path(path)
    try:
        tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
        model_cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return ((folder / "tokenizer.json").is_file() and isinstance(tok_cfg, dict)
            and isinstance(model_cfg, dict) and "auto_map" not in tok_cfg
            and tok_cfg.get("tokenizer_class") in _PLAIN_CLASSES
            and model_cfg.get("model_type") in _PLAIN_MODEL_TYPES)


def load_tokenizer(path: str):
    """The tokenizer of the model folder (or Hugging Face name) ``path``.

    A plain folder (``plain_tokenizer_folder``) is loaded by its class directly: the
    same tokenizer AutoTokenizer gives, without AutoTokenizer's import of the model
    configuration code, which imports torch (the API process and the router never
    load torch); any other goes through AutoTokenizer."""
    if plain_tokenizer_folder(path):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)

#: ChatML template (the format SmolLM2 and Qwen use), without a default system prompt.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _w(text: str) -> list[str]:
    """The whitespace-separated words of `text`."""
    return text.split()


_WORDS = _w("""
the a an one two three four five six seven eight nine ten first last next other same
time day night year week morning evening people man woman child friend teacher doctor
city country river mountain sea island forest road house room door window garden
table chair book letter story song music picture name word question answer idea
water fire air earth stone tree flower bird dog cat horse fish apple bread milk tea
red green blue black white small large long short old new young happy quiet bright
cold warm fast slow early late good bad simple strong gentle careful curious
is are was were has have had will would can could should may might must do does did
go goes went come comes came see sees saw make makes made take takes took give gives
find finds found think thinks thought know knows knew tell tells told ask asks asked
work works worked play plays played read reads write writes wrote run runs ran walk
walks walked open opens opened close closes closed build builds built learn learns
learned help helps helped bring brings brought keep keeps kept start starts started
and or but because so if when while after before since until although
in on at to from with without into over under between through near far above below
i you he she it we they me him her us them my your his its our their this that these
those what who where why how which there here very also only just never always often
sometimes again still already soon today tomorrow yesterday now then
capital france paris england london italy rome japan tokyo river nile ocean
model token cache memory server request answer prompt decode prefill transfer block
""")

_TEMPLATES = (
    "{A} {n} {v} the {n2} {p} the {n3}.",
    "{A} {adj} {n} {v} {adv}.",
    "Why does the {n} {v0} {p} the {n2}?",
    "{Pr} {v} that the {n} is {adj}.",
    "What is the {n} of {N}? It is {adj}.",
    "The capital of {N} is {C}.",
    "{Pr} {v} {num} {n}s and {num2} {n2}s {adv}.",
    "When the {n} {v}, the {adj} {n2} {v2} {p} {N}.",
    "user: {Pr} {v} the {n}. assistant: the {n} is {adj}!",
)
_NOUNS = _w("""
time day night year week morning evening man woman child friend teacher doctor city country
river mountain sea island forest road house room door window garden table chair book letter
story song picture name word question answer idea stone tree flower bird dog cat horse fish
apple model token cache server request prompt block
""")
_ADJ = _w("red green blue black white small large long short old new young happy quiet")
_ADV = _w("very also only never always often sometimes again still already soon today")
_PREP = _w("in on at to from with into over under between through near above below")
_PRON = _w("I You He She We They")
_VERBS = _w("sees makes takes gives finds knows tells asks reads writes opens builds keeps")
_VERBS0 = _w("see make take give find know tell ask read write open build keep")
_PLACES = [("France", "Paris"), ("England", "London"), ("Italy", "Rome"), ("Japan", "Tokyo")]


def _corpus(num_sentences: int = 1500, seed: int = 1234) -> list[str]:
    """The training corpus: `num_sentences` generated English-like lines (deterministic)."""
    rng = random.Random(seed)
    lines = [" ".join(_WORDS), " ".join(w.capitalize() for w in _WORDS)]
    for _ in range(num_sentences):
        country, capital = rng.choice(_PLACES)
        fields = {
            "A": rng.choice(["The", "A", "One", "This", "That", "Every"]),
            "n": rng.choice(_NOUNS),
            "n2": rng.choice(_NOUNS),
            "n3": rng.choice(_NOUNS),
            "v": rng.choice(_VERBS),
            "v2": rng.choice(_VERBS),
            "v0": rng.choice(_VERBS0),
            "p": rng.choice(_PREP),
            "adj": rng.choice(_ADJ),
            "adv": rng.choice(_ADV),
            "Pr": rng.choice(_PRON),
            "N": country,
            "C": capital,
            "num": str(rng.randint(0, 99)),
            "num2": str(rng.randint(100, 9999)),
        }
        lines.append(rng.choice(_TEMPLATES).format(**fields))
    return lines


@lru_cache(maxsize=8)
def _trained_tokenizer_json(vocab_size: int) -> str:
    """Train the BPE once per process and vocab size; return the tokenizer.json text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    if ids != [ENDOFTEXT_ID, IM_START_ID, IM_END_ID]:  # pragma: no cover - library change
        raise RuntimeError(f"special token ids moved: {ids}")
    return tok.to_str()


def tokenizer_config(model_max_length: int) -> dict[str, Any]:
    """The tokenizer_config.json written beside the trained tokenizer."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHATML_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, t in enumerate(SPECIAL_TOKENS)
        },
    }


def write_tokenizer(
    out_dir: str | Path, vocab_size: int = 1024, model_max_length: int = 2048
) -> Path:
    """Write tokenizer.json and tokenizer_config.json of the test tokenizer into `out_dir`.

    The tokenizer has exactly `vocab_size` tokens (>= 259: 3 special + 256 bytes).
    """
    if vocab_size < 259:
        raise ValueError(f"vocab_size must be >= 259 for a byte-level BPE, got {vocab_size}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(_trained_tokenizer_json(vocab_size))
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(model_max_length), indent=2) + "\n"
    )
    return out


def max_token_bytes(tokenizer: Any) -> int:
    """An upper bound on the UTF-8 bytes one token spells: the longest vocabulary entry
    as stored (byte-level BPE stores one character per byte, each 1-2 bytes in UTF-8;
    SentencePiece's byte tokens are longer stored than spelled). 0: unknown."""
    try:
        return max((len(str(t).encode("utf-8", "replace")) for t in tokenizer.get_vocab()),
                   default=0)
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary: no bound
        return 0


def tokens_at_least(text_bytes: int, max_token_bytes: int) -> int:
    """A lower bound on the tokens of a text of ``text_bytes`` UTF-8 bytes, known without
    tokenizing it (no token spells more than ``max_token_bytes``; 0: unknown, no bound)."""
    return -(-text_bytes // max_token_bytes) if max_token_bytes > 0 else 0
