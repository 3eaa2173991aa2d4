"""Plain-data messages the engine hands to its front ends."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # client went away or abort() was called
    ERROR = "error"  # the engine failed this request (see RequestOutput.error)


class RequestError(ValueError):
    """A request the engine refuses up front (bad length, bad ids); maps to HTTP 400, or
    to ``status_code`` when the refusal is the instance's state, not the client's
    mistake (503: its KV transfer thread died)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status_code: int = 400):
        super().__init__(message)
        self.param = param
        self.code = code
        self.status_code = status_code


@dataclass
class RequestOutput:
    """One increment of a request's output; the last one has ``finished`` set."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    new_logprobs: list[float] | None = None
    #: per new token, its top alternatives ((id, logprob), most likely first), for a
    #: request whose params ask for top_logprobs
    new_top_logprobs: list[tuple[tuple[int, float], ...]] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    #: monotonic time (time.perf_counter) of the first output token of this request
    first_token_time: float | None = None
    arrival_time: float = 0.0
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int
    prefix_cache_hit_tokens: int
    prefix_cache_query_tokens: int
