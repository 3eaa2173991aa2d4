"""What the engine hands its front ends: plain, typed data (msgspec structs), so the same
messages serve a step loop in this process and an engine core in another one.

Per step the engine core produces one :class:`EngineOutputs` batch: an
:class:`EngineOutput` (new token ids, logprobs, finish reason, a typed
:class:`RequestFailure`, the finished request's ``kv_transfer_params``) for every request
that advanced, the transfers that ended, and now and then an :class:`EngineSnapshot`
(the scheduler's gauges, the transfer counters, why the instance cannot serve).
Text is not the core's business: the front end detokenizes each request's tokens
(kvpush.engine.output_processor) and turns them into :class:`RequestOutput`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import msgspec

from kvpush.errors import RequestError
from kvpush.kv_info import CacheBlocks, KVInfo
from kvpush.kv_transfer.params import KVTransferParams
from kvpush.kv_transfer.record import TransferCounters, TransferRecord
from kvpush.sampling_params import TopLogprobs


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # client went away or abort() was called
    ERROR = "error"  # the engine failed this request (see RequestOutput.error)


class RequestFailure(msgspec.Struct, frozen=True):
    """Why the engine ended a request with FinishReason.ERROR. ``rejected``: the request
    was refused before it ran (its client gets ``status_code`` and ``param``/``code`` as
    an HTTP error, not a 200 with an error inside)."""

    message: str
    rejected: bool = False
    param: str | None = None
    code: str | None = None
    status_code: int = 400

    def to_error(self) -> RequestError:
        return RequestError(self.message or "request refused", self.param, self.code,
                            self.status_code)


class EngineOutput(msgspec.Struct, array_like=True, gc=False):
    """One request's progress in one step (the last one has ``finish_reason`` set)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float] | None = None
    #: per new token, its top alternatives ((id, logprob), most likely first)
    new_top_logprobs: list[TopLogprobs] | None = None
    finish_reason: FinishReason | None = None
    failure: RequestFailure | None = None
    #: what a finished leg answers its router with (a prefill leg's lend or push state)
    kv_transfer_params: KVTransferParams | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    #: monotonic time (time.perf_counter) of the request's first output token
    first_token_time: float | None = None
    arrival_time: float = 0.0
    #: monotonic time the scheduler gave the request blocks to run (or, decode role, to
    #: receive its KV), the last time before its first token; None until then
    scheduled_time: float | None = None
    #: which choice of an ``n > 1`` request this is (0: the first, or the only one)
    index: int = 0
    #: a finished choice's request has other choices still running (the request's last
    #: output is the one finished without it)
    more_choices: bool = False
    #: the front the request came from (``AddRequest.front``: 0 the instance's own)
    front: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def request_finished(self) -> bool:
        """Nothing more comes for this request: every choice of it has ended."""
        return self.finish_reason is not None and not self.more_choices


def rejected(request_id: str, e: RequestError, front: int = 0) -> EngineOutput:
    """A request refused before it ran (its front raises ``e`` again: an HTTP error)."""
    return EngineOutput(request_id, [], finish_reason=FinishReason.ERROR,
                        failure=RequestFailure(str(e), True, e.param, e.code, e.status_code),
                        front=front)


class EngineStats(msgspec.Struct, frozen=True):
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int
    prefix_cache_hit_tokens: int
    prefix_cache_query_tokens: int


class EngineSnapshot(msgspec.Struct, frozen=True):
    """The core's state as of one turn of its loop: what /metrics and /health read, so
    neither reaches into the step loop's live tables."""

    stats: EngineStats
    #: transfer counters (KVConnector.stats(); None for role both)
    kv_stats: TransferCounters | None = None
    #: start-up work still running on the stepping thread (the matmul autotune): /health
    #: is 503 "starting" meanwhile, requests are queued, not refused; None once done
    starting: str | None = None


#: what a utility call answers (inputs.Utility: KV_INFO, KV_CACHE_BLOCKS)
UtilityResult = KVInfo | CacheBlocks


class UtilityReply(msgspec.Struct, frozen=True):
    """The answer to an inputs.UtilityCall: the result in the field its method names
    (``error`` set: it failed)."""

    call_id: int
    kv_info: KVInfo | None = None
    kv_cache_blocks: CacheBlocks | None = None
    error: str | None = None

    @classmethod
    def of(cls, call_id: int, result: UtilityResult) -> UtilityReply:
        if isinstance(result, KVInfo):
            return cls(call_id, kv_info=result)
        return cls(call_id, kv_cache_blocks=result)


class FinishedRequestStats(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """The phases of one request that finished with ``stop`` or ``length`` (seconds)."""

    e2e_s: float  # arrival to last token
    decode_s: float | None  # first token to last token (None: no token)
    num_generation_tokens: int
    queue_s: float | None = None  # arrival to scheduled (the engine's clock)
    prefill_s: float | None = None  # scheduled to first token (the engine's clock)


class IterationStats(msgspec.Struct, array_like=True, gc=False):
    """What the requests' outputs of one engine turn (or one output at a front) add to
    the request metrics (kvpush.engine.request_stats makes them; kvpush.server.metrics
    observes them)."""

    num_prompt_tokens: int = 0  # of requests whose first token came now
    num_generation_tokens: int = 0
    ttft_s: list[float] = []
    #: one gap per token after a request's first (n tokens at once: n gaps of 1/n)
    itl_s: list[float] = []
    finished: list[FinishedRequestStats] = []


class EngineOutputs(msgspec.Struct, gc=False):
    """Everything one turn of the core's loop hands the front end, in one message."""

    outputs: list[EngineOutput] = []
    transfers: list[TransferRecord] = []
    replies: list[UtilityReply] = []
    snapshot: EngineSnapshot | None = None
    #: the last turn of a loop that died: why (every request still running fails with
    #: it, and the front end says it for those it had not yet handed the core)
    fatal: str | None = None
    #: the request metrics of this turn, for every request the core ran, whichever front
    #: sent it (only the core's own API process gets them; None: nothing to add)
    stats: IterationStats | None = None


@dataclass
class RequestOutput:
    """One increment of a request's output as the front end hands it to the server:
    the engine's tokens with their text (stop strings applied)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    new_logprobs: list[float] | None = None
    #: per new token, its top alternatives ((id, logprob), most likely first), for a
    #: request whose params ask for top_logprobs
    new_top_logprobs: list[TopLogprobs] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    #: monotonic time (time.perf_counter) of the first output token of this request
    first_token_time: float | None = None
    arrival_time: float = 0.0
    #: monotonic time the engine scheduled the request, the last time before its first
    #: token (None: not yet, or an engine that does not say)
    scheduled_time: float | None = None
    #: a finished leg's answer to its router (None for a plain request)
    kv_transfer_params: KVTransferParams | None = None
    #: which choice of an ``n > 1`` request (``finished``: this choice ended)
    index: int = 0
