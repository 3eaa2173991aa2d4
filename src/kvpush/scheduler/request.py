"""Request: one generation request as the scheduler sees it, and its state machine.

Lifecycle::

    WAITING ──schedule──▶ RUNNING ──finish──▶ FINISHED_{STOPPED,LENGTH}
       ▲                     │  │
       └──── PREEMPTED ◀─────┘  └──abort / error──▶ FINISHED_{ABORTED,ERROR}
    (blocks freed, all tokens so far recomputed on the next schedule)

    WAITING_FOR_REMOTE_KV: a decode-role request whose KV is being written (push) or
    read (pull) from a prefill instance; it holds blocks but is not scheduled until the
    transfer completes (→ RUNNING) or fails (→ FINISHED_ERROR or WAITING for a local
    recompute). Any state can go to FINISHED_ABORTED.

A request's tokens are ``prompt_token_ids + output_token_ids``; ``num_computed_tokens``
of them have KV in the request's blocks. It is in prefill while prompt tokens remain
uncomputed, in decode afterwards (one new token per step).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from kvpush.grammar import Grammar
from kvpush.kv_cache.block_pool import BlockHash
from kvpush.sampling_params import SamplingParams, TopLogprobs


class RequestState(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def finished(self) -> bool:
        return self.value.startswith("finished")


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_total_tokens: int  # prompt + output may not exceed this (max_model_len)
    arrival_time: float = field(default_factory=time.perf_counter)
    state: RequestState = RequestState.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    #: per output token, its top alternatives (params.top_logprobs > 0 only)
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    num_preemptions: int = 0
    num_registered_blocks: int = 0  # leading full blocks already in the prefix cache
    first_token_time: float | None = None
    #: when the scheduler gave it blocks, the last time before its first token (a
    #: preempted prefill, or a failed KV transfer, is scheduled again)
    scheduled_time: float | None = None
    error: str | None = None
    generator: torch.Generator | None = None
    #: its structured output's matcher (params.structured), advanced by every token
    grammar: Grammar | None = None
    # Extension point for KV transfer: the connector keeps its per-request state here.
    kv_transfer_params: dict | None = None
    #: choice ``index`` of an ``n > 1`` request (0: the request itself); a choice past
    #: the first runs under its own id and answers under its request's (``output_id``)
    index: int = 0
    output_id: str = ""
    #: the front it came from (``AddRequest.front``), which its outputs name
    front: int = 0

    def __post_init__(self) -> None:
        if not self.output_id:
            self.output_id = self.request_id
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.state.finished

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def tokens_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]
