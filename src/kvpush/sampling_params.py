"""Per-request sampling parameters, validated on construction.

Validation raises :class:`SamplingParamsError`; the HTTP layer turns it into a 400 with
an OpenAI-style error body naming the offending parameter.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import NamedTuple

#: Temperatures below this sample greedily, and top_p is raised to at least this (as
#: vLLM's _SAMPLING_EPS): logits / 1e-300 overflow to inf, and a top_p that rounds to 0
#: in float32 masks every token; either would make the step's probabilities NaN.
SAMPLING_EPS = 1e-5
#: The most alternatives a sampled token's logprobs list (OpenAI's chat API caps
#: top_logprobs at 20; vLLM's max_logprobs defaults to 20)
MAX_TOP_LOGPROBS = 20
#: OpenAI's ranges: presence / frequency penalties in [-2, 2], logit_bias in [-100, 100]
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
#: logit_bias entries a request may carry (each is a scatter into the logits per step)
MAX_LOGIT_BIAS_ENTRIES = 1024
#: stop_token_ids a request may carry (vLLM sets no cap; a model's vocabulary has tens of
#: thousands of tokens, and a real stop list names a handful: EOS variants, turn ends)
MAX_STOP_TOKEN_IDS = 1024
#: stop strings a request may carry (OpenAI allows 4), and the length of each: while a
#: request runs, the detokenizer holds back the longest one's length - 1 characters
MAX_STOP_STRINGS = 16
MAX_STOP_STR_CHARS = 1024


#: the longest grammar spec (JSON schema, regex, choices, Lark) a request may carry
MAX_GRAMMAR_CHARS = 256 << 10


#: (token id, logprob) of the most likely tokens at one position, most likely first
TopLogprobs = tuple[tuple[int, float], ...]


class SampledToken(NamedTuple):
    """One sampled token: its logprob when the request asked for logprobs, the top
    alternatives when it asked for top_logprobs."""

    token: int
    logprob: float | None = None
    top: TopLogprobs | None = None


def _is_int(v: object) -> bool:
    """An int that is not a bool (JSON true would pass isinstance(v, int))."""
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    """An int or float that is not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class SamplingParamsError(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class GrammarKind(str, enum.Enum):
    """What a structured-output spec is (OpenAI's response_format, vLLM's guided_*)."""

    JSON_OBJECT = "json_object"  # any JSON object (spec unused)
    JSON_SCHEMA = "json_schema"  # spec: the schema, as JSON text
    REGEX = "regex"
    CHOICE = "choice"  # spec: a JSON list of the strings allowed
    GRAMMAR = "grammar"  # spec: a Lark or GBNF grammar


@dataclass(frozen=True)
class StructuredOutput:
    """The grammar a request's output must follow (compiled by kvpush.grammar; hashable:
    the compiled grammar is cached under it)."""

    kind: GrammarKind
    spec: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, GrammarKind):
            raise SamplingParamsError(f"unknown structured output kind {self.kind!r}",
                                      "structured_outputs")
        if not isinstance(self.spec, str) or len(self.spec) > MAX_GRAMMAR_CHARS:
            raise SamplingParamsError(f"a structured output spec must be a string of at "
                                      f"most {MAX_GRAMMAR_CHARS} characters",
                                      "structured_outputs")


#: the most choices (``n``) one request may ask for: each is a sequence that decodes
#: beside the others (OpenAI allows 128; a CPU instance batches a few dozen)
MAX_N = 64

#: top_k above this keeps every token of any vocabulary: it is clamped here, so the
#: value fits the engine core's wire format (64-bit ints)
MAX_TOP_K = 2**31 - 1

@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    stop: tuple[str, ...] = ()
    #: any iterable of ids on construction, kept as a frozenset: the engine checks every
    #: sampled token against it (O(1) per token, however many ids the request named)
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    logprobs: bool = False
    #: also the logprobs of this many most likely tokens at each position (needs logprobs)
    top_logprobs: int = 0
    include_stop_str_in_output: bool = False
    #: subtracted from a token's logit once it appears in the output (OpenAI)
    presence_penalty: float = 0.0
    #: subtracted from a token's logit per time it appears in the output (OpenAI)
    frequency_penalty: float = 0.0
    #: a token of the prompt or output has its logit divided by this when positive,
    #: multiplied when negative (vLLM, HF transformers; 1: off)
    repetition_penalty: float = 1.0
    #: (token id, bias) added to the logits before sampling (OpenAI's logit_bias)
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: vLLM's cache_salt: mixed into the first block's hash, so only requests with the
    #: same salt share prefix-cache blocks (tenant isolation); None: no salt
    cache_salt: str | None = None
    #: the grammar the output follows (a mask on every sampled token, token #1 too)
    structured: StructuredOutput | None = None
    #: choices to generate from the prompt (OpenAI's n): the prompt is computed once and
    #: choices 1..n-1 fork from it (kvpush.engine.llm_engine); a prefill leg runs one
    n: int = 1

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens):
            raise SamplingParamsError("max_tokens must be an integer", "max_tokens")
        if self.max_tokens <= 0:
            raise SamplingParamsError(
                f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens"
            )
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise SamplingParamsError(
                f"temperature must be >= 0, got {self.temperature}", "temperature"
            )
        if not 0 < self.top_p <= 1:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.temperature < SAMPLING_EPS:
            object.__setattr__(self, "temperature", 0.0)
        if self.top_p < SAMPLING_EPS:
            object.__setattr__(self, "top_p", SAMPLING_EPS)
        if not _is_int(self.top_k) or self.top_k < -1:
            raise SamplingParamsError(
                f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k}",
                "top_k",
            )
        if self.top_k > MAX_TOP_K:  # keeps every token, as any top_k >= the vocabulary
            object.__setattr__(self, "top_k", MAX_TOP_K)
        top = self.top_logprobs
        if not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise SamplingParamsError(
                f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {top!r}",
                "top_logprobs",
            )
        if top and not self.logprobs:
            raise SamplingParamsError("top_logprobs needs logprobs", "top_logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise SamplingParamsError(
                    f"{name} must be between -{MAX_PENALTY:g} and {MAX_PENALTY:g}, got {v!r}",
                    name)
        rp = self.repetition_penalty
        if not _is_real(rp) or not (math.isfinite(rp) and rp > 0):
            raise SamplingParamsError(f"repetition_penalty must be > 0, got {rp!r}",
                                      "repetition_penalty")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise SamplingParamsError(f"logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} tokens, "
                                      f"got {len(self.logit_bias)}", "logit_bias")
        for tid, bias in self.logit_bias:
            if not _is_int(tid) or tid < 0:
                raise SamplingParamsError(f"logit_bias: {tid!r} is not a token id",
                                          "logit_bias")
            if not _is_real(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise SamplingParamsError(
                    f"logit_bias: the bias of token {tid} must be between "
                    f"-{MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}, got {bias!r}", "logit_bias")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingParamsError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got "
                                      f"{len(self.stop)}", "stop")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingParamsError("stop must be non-empty strings", "stop")
        if any(len(s) > MAX_STOP_STR_CHARS for s in self.stop):
            raise SamplingParamsError(f"stop: each stop string must be at most "
                                      f"{MAX_STOP_STR_CHARS} characters", "stop")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise SamplingParamsError(f"n must be an integer from 1 to {MAX_N}, got "
                                      f"{self.n!r}", "n")
        self._check_stop_token_ids()

    def choice(self, index: int) -> SamplingParams:
        """The parameters choice ``index`` of an ``n > 1`` request runs with: one choice,
        and the seed moved by its index (seeded choices differ, and are reproducible)."""
        seed = None if self.seed is None else (self.seed + index) % 2**64
        return dataclasses.replace(self, n=1, seed=seed)

    def _check_stop_token_ids(self) -> None:
        """Cap the ids (counted before anything looks at them one by one) and keep them
        as a frozenset."""
        ids = self.stop_token_ids
        if not isinstance(ids, (frozenset, tuple, list)):
            ids = tuple(ids)
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingParamsError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} token "
                                      f"ids, got {len(ids)}", "stop_token_ids")
        if any(not _is_int(t) or t < 0 for t in ids):
            raise SamplingParamsError("stop_token_ids must be non-negative token ids",
                                      "stop_token_ids")
        object.__setattr__(self, "stop_token_ids", frozenset(ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether the sampler needs the request's tokens so far (penalties)."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def adjusts_logits(self) -> bool:
        return self.penalized or bool(self.logit_bias)
