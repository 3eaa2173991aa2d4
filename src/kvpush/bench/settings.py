"""A `kvpush bench` run's settings (:class:`BenchConfig`) and the requests they imply:
the arrival times (:func:`arrival_offsets`, which ``kvpush simulate`` replays too) and
each request's JSON body (:func:`request_body`). The load generator that sends them is
:mod:`kvpush.bench.client`; the multi-turn driver (:mod:`kvpush.bench.multiturn`) uses
them as well."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from kvpush.bench.conversations import MULTI_TURN, ThinkTime
from kvpush.bench.datasets import (
    DATASETS,
    DEFAULT_SONNET_PREFIX_LEN,
    PROMPT_TYPES,
    SampleRequest,
)
from kvpush.bench.metrics import DEFAULT_PERCENTILES

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class BenchError(ValueError):
    """A benchmark that cannot run as configured (bad settings, no tokenizer, ...)."""


@dataclass
class BenchConfig:
    """One benchmark run. ``model=None``: the first model the server lists."""

    url: str
    model: str | None = None
    dataset: str = "random"
    input_len: int = 1024
    #: random data set: each prompt's length drawn uniformly from input_len * [1 - s,
    #: 1 + s] (0: exactly input_len)
    input_len_spread: float = 0.0
    output_len: int = 128
    num_prompts: int = 100
    #: Requests per second (Poisson arrivals); ``math.inf`` sends all at once.
    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int = 0
    endpoint: str = "completions"
    #: Shared-prefix tokens: shared-prefix data set (default input_len // 2) and sonnet
    #: (whole lines up to about this many; default min(200, input_len // 2)).
    prefix_len: int | None = None
    #: Tokenizer folder or model name; default: ``model``, then the server's model root.
    tokenizer: str | None = None
    prompt_type: str = "auto"
    #: Whole-run bound (seconds): requests still out then are cancelled and count failed.
    timeout: float = 3600.0
    request_timeout: float = 600.0
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    label: str | None = None
    progress: bool = False
    #: Extra JSON fields merged into every request body.
    extra_body: dict[str, Any] = field(default_factory=dict)
    #: multi-turn (:mod:`kvpush.bench.conversations`): conversations, turns each, the
    #: shared system prompt's tokens (0: none), each question's tokens; ``output_len``
    #: is each answer's, ``max_concurrency`` bounds conversations, ``request_rate`` is
    #: conversations started per second
    num_conversations: int = 6
    turns: int = 4
    system_prompt_len: int = 120
    question_len: int = 40
    #: seconds between an answer's end and the next question: the mean (exponential)
    #: or exactly (fixed)
    think_time: float = 0.0
    think_time_dist: str = ThinkTime.EXPONENTIAL.value

    @property
    def multi_turn(self) -> bool:
        return self.dataset == MULTI_TURN

    def validate(self) -> None:
        """Raise :class:`BenchError` naming the first bad setting."""
        if not self.url.startswith(("http://", "https://")):
            raise BenchError(f"--url must start with http:// or https://, got {self.url!r}")
        if self.dataset not in DATASETS + (MULTI_TURN,):
            raise BenchError(f"unknown dataset {self.dataset!r}; choose one of "
                             f"{', '.join(DATASETS + (MULTI_TURN,))}")
        if self.multi_turn:
            self._validate_multi_turn()
        if self.endpoint not in ENDPOINTS:
            raise BenchError(f"unknown endpoint {self.endpoint!r}; choose one of "
                             f"{', '.join(ENDPOINTS)}")
        if self.prompt_type not in PROMPT_TYPES:
            raise BenchError(f"unknown prompt type {self.prompt_type!r}")
        if not 0 <= self.input_len_spread < 1:
            raise BenchError(f"input_len_spread must be in [0, 1), got {self.input_len_spread}")
        if self.input_len_spread and self.dataset != "random":
            raise BenchError("input_len_spread is for the random data set only")
        for name in ("input_len", "output_len", "num_prompts"):
            if getattr(self, name) < 1:
                raise BenchError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.request_rate > 0:
            raise BenchError(f"request_rate must be positive (or inf), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise BenchError(f"max_concurrency must be at least 1, got {self.max_concurrency}")
        for name in ("timeout", "request_timeout"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise BenchError(f"{name} must be a positive number of seconds, got {v}")
        if (self.prefix_len is not None and not self.multi_turn
                and not 0 < self.prefix_len < self.input_len):
            raise BenchError(f"prefix_len must be in 1..{self.input_len - 1} (below "
                             f"input_len), got {self.prefix_len}")
        if any(not 0 <= q <= 100 for q in self.percentiles):
            raise BenchError(f"percentiles must be in 0..100, got {list(self.percentiles)}")

    def _validate_multi_turn(self) -> None:
        if self.endpoint != "chat":
            raise BenchError("the multi-turn data set runs on the chat endpoint: "
                             "--endpoint chat")
        for name in ("num_conversations", "turns", "question_len"):
            if getattr(self, name) < 1:
                raise BenchError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.system_prompt_len < 0:
            raise BenchError(f"system_prompt_len must be >= 0, got {self.system_prompt_len}")
        if not (self.think_time >= 0 and math.isfinite(self.think_time)):
            raise BenchError(f"think_time must be >= 0 seconds, got {self.think_time}")
        if self.think_time_dist not in {t.value for t in ThinkTime}:
            raise BenchError(f"unknown think time distribution {self.think_time_dist!r}; "
                             f"choose one of {', '.join(t.value for t in ThinkTime)}")

    def effective_prefix_len(self) -> int | None:
        if self.multi_turn:
            return None
        if self.prefix_len is not None or self.dataset == "random":
            return self.prefix_len
        if self.dataset == "sonnet":
            return min(DEFAULT_SONNET_PREFIX_LEN, self.input_len // 2)
        return self.input_len // 2


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times (seconds after the start) of ``n`` Poisson arrivals at ``rate``/s; the
    first at 0 (as vLLM); all 0 for an infinite rate."""
    if not math.isfinite(rate):
        return [0.0] * n
    rng = random.Random(f"arrivals:{seed}")
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def request_body(config: BenchConfig, model_id: str, req: SampleRequest | None, *,
                 messages: list[dict[str, str]] | None = None,
                 max_tokens: int | None = None) -> dict[str, Any]:
    """The JSON body of one request: ``req``'s prompt, or (chat) ``messages`` as given
    with ``max_tokens`` (a multi-turn turn)."""
    body: dict[str, Any] = {"model": model_id}
    if messages is not None:
        body["messages"] = messages
    elif req is not None and config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    elif req is not None:
        body["prompt"] = req.prompt
    if max_tokens is None:
        if req is None:
            raise ValueError("request_body needs a request or max_tokens")
        max_tokens = req.expected_output_len
    body.update({
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    })
    body.update(config.extra_body)
    return body
