"""Structured outputs: a request's :class:`~kvpush.sampling_params.StructuredOutput`
compiled into an llguidance grammar, matched token by token.

* :class:`GrammarCompiler`: one per process that checks or runs requests (the API
  front, the router's front, the engine core). It turns a spec into a compiled matcher
  once and keeps it (an LRU of :data:`CACHED_GRAMMARS`); each request gets a copy of
  the compiled one (``LLMatcher.deep_copy``, no recompilation). A spec that does not
  compile raises :class:`GrammarError` (a 400 at the front, before any compute).
* :class:`Grammar`: one request's matcher: it writes the allowed-token bitmask of the
  next position and consumes each token the request gets (sampled here, or token #1
  sampled on a prefill instance and sent with the KV).
* :func:`mask_logits`: the bitmasks of some rows applied to a logits batch as array
  operations (no Python loop over the vocabulary).

JSON is generated compact (no free whitespace): fewer tokens, and a JSON value that
cannot grow by whitespace alone. llguidance is imported on first use.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kvpush.sampling_params import GrammarKind, StructuredOutput

#: compiled grammars a process keeps (least recently used dropped first)
CACHED_GRAMMARS = 256
#: llguidance's JSON options: compact separators, no whitespace between tokens
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


if TYPE_CHECKING:
    import torch


class GrammarError(ValueError):
    """A spec llguidance cannot compile (the message says why)."""


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar of ``spec`` (not yet checked)."""
    from llguidance import LLMatcher

    if spec.kind in (GrammarKind.JSON_SCHEMA, GrammarKind.JSON_OBJECT):
        text = spec.spec if spec.kind is GrammarKind.JSON_SCHEMA else '{"type": "object"}'
        try:
            return LLMatcher.grammar_from_json_schema(text, defaults=_JSON_OPTIONS)
        except ValueError as e:
            raise GrammarError(f"not a JSON schema: {e}") from None
    if spec.kind is GrammarKind.REGEX:
        return LLMatcher.grammar_from_regex(spec.spec)
    if spec.kind is GrammarKind.CHOICE:
        choices = json.loads(spec.spec)
        return LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in choices))
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return LLMatcher.grammar_from_lark(any_to_lark(spec.spec))
    except Exception as e:  # noqa: BLE001 - the converter raises what its parser raises
        raise GrammarError(f"not a Lark or GBNF grammar: {e}") from None


class Grammar:
    """One request's grammar state: what the next token may be, and the tokens so far."""

    __slots__ = ("_m",)

    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write the next position's allowed tokens into ``row`` (int32, one bit a
        token, contiguous, on the CPU)."""
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def consume(self, token: int) -> None:
        """Advance by ``token`` (one the bitmask allowed, or the matcher errs)."""
        self._m.consume_token(token)

    @property
    def finished(self) -> bool:
        """The grammar is complete and has taken its end (EOS): nothing may follow."""
        return self._m.is_stopped()

    @property
    def error(self) -> str | None:
        """Why a consumed token broke the grammar, if one did (the first line of
        llguidance's report: the rest dumps the parser's state and the whole grammar)."""
        return self._m.get_error().split("\n", 1)[0] if self._m.is_error() else None


class GrammarCompiler:
    """Specs compiled against one tokenizer, cached (thread-safe: the API front checks
    specs on worker threads)."""

    def __init__(self, tokenizer: Any, vocab_size: int,
                 eos_token_ids: Iterable[int] | None = None) -> None:
        self._hf = tokenizer
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids) if eos_token_ids else None
        self._ll: Any = None
        self._compiled: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self._lock = threading.Lock()
        #: compilations done (cache misses), for tests and benchmarks
        self.compiles = 0

    def _tokenizer(self) -> Any:
        if self._ll is None:
            import llguidance.hf

            self._ll = llguidance.hf.from_tokenizer(self._hf, n_vocab=self._vocab_size,
                                                    eos_token=self._eos)
        return self._ll

    def _compiled_matcher(self, spec: StructuredOutput) -> Any:
        with self._lock:
            hit = self._compiled.get(spec)
            if hit is not None:
                self._compiled.move_to_end(spec)
                return hit
            from llguidance import LLMatcher

            matcher = LLMatcher(self._tokenizer(), grammar_text(spec), log_level=0)
            self.compiles += 1
            if matcher.is_error():
                raise GrammarError(matcher.get_error())
            self._compiled[spec] = matcher
            if len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
            return matcher

    def cached(self, spec: StructuredOutput) -> bool:
        """Whether ``spec`` is compiled already (no wait on a compile in progress)."""
        return spec in self._compiled

    def check(self, spec: StructuredOutput) -> None:
        """Compile ``spec`` (or find it compiled); GrammarError when it cannot be."""
        self._compiled_matcher(spec)

    def grammar(self, spec: StructuredOutput) -> Grammar:
        """A fresh matcher of ``spec`` for one request."""
        return Grammar(self._compiled_matcher(spec).deep_copy())


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def mask_logits(logits: torch.Tensor, rows: Sequence[int],
                grammars: Sequence[Grammar]) -> torch.Tensor:
    """``logits`` with every token of row ``rows[j]`` that ``grammars[j]`` does not allow
    next set to -inf (in place for a subset of the rows, a new tensor for all of them).
    The bitmasks are unpacked by numpy and applied with one ``torch.where``: no Python
    loop over the vocabulary (``masked_fill`` measured 2x slower than ``where`` here).
    torch is imported here: the processes that only check specs (API, router) never
    load it."""
    import numpy as np
    import torch

    vocab = logits.shape[-1]
    bits = torch.empty((len(rows), bitmask_words(vocab)), dtype=torch.int32)
    for j, g in enumerate(grammars):
        g.fill_bitmask(bits[j])
    # int32 words, little-endian: bit k of word w is token 32 w + k
    allowed = torch.from_numpy(np.unpackbits(bits.numpy().view(np.uint8), axis=1,
                                             bitorder="little")[:, :vocab].view(np.bool_))
    if len(rows) == logits.shape[0]:
        return torch.where(allowed, logits, float("-inf"))
    idx = torch.tensor(rows, dtype=torch.long)
    logits[idx] = torch.where(allowed, logits[idx], float("-inf"))
    return logits
