"""The front end's side of the engine boundary, shared by the in-process AsyncEngine and
the CoreClient of an engine core in a child process.

It checks each request once (RequestChecker), gives it a unique internal id, sends
typed commands (kvpush.engine.inputs) through ``_send``, and routes each EngineOutputs
batch (``dispatch``, on the event loop) to the requests' streams, the transfer sink,
the utility calls waiting for their reply and the latest snapshot. Each stream turns
the core's token ids into text on its own consumer's task (RequestStream: incremental
detokenizer, stop strings).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from kvpush.aio import within
from kvpush.config import EngineConfig
from kvpush.engine.checks import RequestChecker
from kvpush.engine.inputs import (
    REMOTE_MARK,
    AbortRequests,
    AbortTransfer,
    AddRequest,
    FrontCommand,
    Utility,
    UtilityCall,
    choice_id,
)
from kvpush.engine.output_processor import ChoiceTexts
from kvpush.engine.outputs import (
    EngineOutput,
    EngineOutputs,
    EngineSnapshot,
    EngineStats,
    FinishReason,
    IterationStats,
    RequestError,
    RequestFailure,
    RequestOutput,
    TransferRecord,
    UtilityReply,
)
from kvpush.kv_info import CacheBlocks, KVInfo
from kvpush.kv_transfer.params import GivenKVParams, KVTransferParams
from kvpush.kv_transfer.record import TransferCounters
from kvpush.sampling_params import SamplingParams

#: how long a utility call (/kv/info, /kv/cache_blocks) waits for the core's reply
UTILITY_TIMEOUT_S = 30.0


class FrontEnd:
    def __init__(self, config: EngineConfig | None, tokenizer: Any,
                 snapshot: EngineSnapshot):
        """``config``: the instance's (None: a front that does not check requests
        itself, the core does: RemoteCore)."""
        self.config = config
        self.tokenizer = tokenizer
        self.checker = RequestChecker(config) if config is not None else None
        # internal engine id -> the request's stream of core outputs
        self._streams: dict[str, asyncio.Queue[EngineOutput]] = {}
        self._internal: dict[str, str] = {}  # caller's id -> internal id
        self._seq = itertools.count()
        self._snapshot = snapshot
        self._sink: Callable[[TransferRecord], None] | None = None
        self._stats_sink: Callable[[IterationStats], None] | None = None
        self._calls: dict[int, asyncio.Future[UtilityReply]] = {}
        self._call_seq = itertools.count()
        #: called on the event loop if the core dies without being stopped (CoreClient)
        self.on_death: Callable[[str], None] | None = None
        #: why the core's loop died, as its last message said (None: it has not)
        self.fatal: str | None = None

    # ---- what a subclass provides ----------------------------------------------------
    def _send(self, cmd: FrontCommand) -> None:
        raise NotImplementedError

    def _core_problem(self) -> str | None:
        """Why the core is not running (its thread or process ended), or None."""
        raise NotImplementedError

    def _add(self, internal: str, prompt_token_ids: list[int], params: SamplingParams,
             kv_transfer_params: GivenKVParams | None
             ) -> tuple[FrontCommand, SamplingParams]:
        """The command that adds a request under ``internal`` and the sampling
        parameters its stream runs with; RequestError if it is refused here. Here:
        checked and typed once, before anything is queued."""
        assert self.checker is not None
        kv, params = self.checker.check(prompt_token_ids, params, kv_transfer_params)
        return AddRequest(internal, list(prompt_token_ids), params, kv), params

    # ---- EngineClient ------------------------------------------------------------------
    def health_problem(self) -> str | None:
        return self._core_problem()

    def starting(self) -> str | None:
        """Start-up work the core still runs (/health is 503 "starting" until it is
        done; requests are queued meanwhile), or None."""
        return None if self._core_problem() else self._snapshot.starting

    def is_healthy(self) -> bool:
        return self.health_problem() is None

    def stats(self) -> EngineStats:
        return self._snapshot.stats

    def kv_stats(self) -> TransferCounters | None:
        return self._snapshot.kv_stats

    def kv_params(self, raw: object) -> KVTransferParams | None:
        assert self.checker is not None
        return self.checker.kv_params(raw)

    def has_streams(self) -> bool:
        """Whether any request's stream is open."""
        return bool(self._streams)

    def set_transfer_sink(self, sink: Callable[[TransferRecord], None]) -> None:
        self._sink = sink

    def set_stats_sink(self, sink: Callable[[IterationStats], None]) -> None:
        self._stats_sink = sink

    def abort_transfer(self, transfer_id: str, why: str = "aborted by the router") -> None:
        self._send(AbortTransfer(transfer_id, why))

    async def kv_info(self) -> KVInfo:
        info = (await self._utility(Utility.KV_INFO)).kv_info
        if info is None:
            raise RuntimeError("the engine core answered a kv_info call without it")
        return info

    async def kv_cache_blocks(self) -> CacheBlocks | None:
        if self.config is not None and not self.config.cache.enable_prefix_caching:
            return None
        blocks = (await self._utility(Utility.KV_CACHE_BLOCKS)).kv_cache_blocks
        if blocks is None:
            raise RuntimeError("the engine core answered a kv_cache_blocks call without them")
        return blocks

    async def _utility(self, method: Utility) -> UtilityReply:
        problem = self._core_problem()
        if problem is not None:
            raise RequestError(problem, code="unavailable", status_code=503)
        call_id = next(self._call_seq)
        fut: asyncio.Future[UtilityReply] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        try:
            self._send(UtilityCall(call_id, method))
            return await within(fut, UTILITY_TIMEOUT_S)
        finally:
            self._calls.pop(call_id, None)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_transfer_params: GivenKVParams | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs as text (:meth:`stream` through one
        RequestStream: the detokenizer, stop strings)."""
        raw = self.stream(request_id, prompt_token_ids, params, kv_transfer_params)
        async for out in detokenized(raw, request_id, self.tokenizer, params,
                                     lambda i: self._abort_choice(request_id, i)):
            yield out

    async def stream(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_transfer_params: GivenKVParams | None = None,
    ) -> AsyncIterator[EngineOutput]:
        """Stream a request's core outputs (token ids). ``request_id`` is the caller's
        (X-Request-Id); the core runs it under a unique internal id, so an id reused
        right after an abort never receives the old request's last output. A request
        refused before it ran raises RequestError; closing the stream before its last
        output (the last choice's, of n > 1) aborts the request in the core."""
        problem = self.health_problem()
        if problem is not None:
            raise RequestError(f"this instance cannot serve requests: {problem}",
                               code="unavailable", status_code=503)
        internal = f"{request_id}#{next(self._seq)}"
        if internal.startswith(REMOTE_MARK):  # the request plane's ids start with it
            internal = "_" + internal
        add, params = self._add(internal, prompt_token_ids, params, kv_transfer_params)
        if request_id in self._internal:
            raise RequestError(f"request id {request_id!r} is already in use", "request_id")
        queue: asyncio.Queue[EngineOutput] = asyncio.Queue()
        self._streams[internal] = queue
        self._internal[request_id] = internal
        finished = False
        try:
            try:
                self._send(add)
            except (OverflowError, msgspec.EncodeError) as e:  # e.g. an int over 64 bits
                finished = True  # nothing reached the core
                raise RequestError(f"a request parameter is out of range: {e}") from e
            while True:
                out = await queue.get()
                failure = out.failure
                if failure is not None and failure.rejected:
                    finished = True
                    raise failure.to_error()
                finished = out.request_finished
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(internal, None)
            self._internal.pop(request_id, None)
            if not finished:
                self._send(AbortRequests([internal]))

    def _abort_choice(self, request_id: str, index: int) -> None:
        """End one choice of a running request (a stop string ended it here)."""
        internal = self._internal.get(request_id)
        if internal is not None:
            self._send(AbortRequests([choice_id(internal, index)]))

    async def abort(self, request_id: str) -> None:
        internal = self._internal.get(request_id)
        if internal is not None:
            self._send(AbortRequests([internal]))

    # ---- the core's reports (on the event loop) --------------------------------------
    def dispatch(self, batch: EngineOutputs) -> None:
        streams = self._streams
        for out in batch.outputs:
            queue = streams.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
        if batch.snapshot is not None:
            self._snapshot = batch.snapshot
        if batch.transfers and self._sink is not None:
            for rec in batch.transfers:
                self._sink(rec)
        if batch.stats is not None and self._stats_sink is not None:
            self._stats_sink(batch.stats)
        for reply in batch.replies:
            fut = self._calls.get(reply.call_id)
            if fut is not None and not fut.done():
                if reply.error is not None:
                    fut.set_exception(RuntimeError(reply.error))
                else:
                    fut.set_result(reply)
        if batch.fatal is not None:  # the loop's last batch: it takes nothing more
            self.fatal = batch.fatal
            self._loop_died(batch.fatal)

    def _loop_died(self, why: str) -> None:
        """The core's loop died (its last batch failed what it held): a request it
        never took will get no answer, so it fails now, with the loop's reason."""
        self.fail_all(why)

    def fail_all(self, why: str) -> None:
        """The core is gone: end every stream with an error and every waiting call."""
        for internal, queue in list(self._streams.items()):
            queue.put_nowait(EngineOutput(internal, [], finish_reason=FinishReason.ERROR,
                                          failure=RequestFailure(why)))
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(RequestError(why, code="unavailable", status_code=503))


async def detokenized(outputs: AsyncIterator[EngineOutput], request_id: str, tokenizer: Any,
                      params: SamplingParams,
                      abort_choice: Callable[[int], None] | None = None,
                      ) -> AsyncIterator[RequestOutput]:
    """A request's core outputs as text, one RequestStream a choice (ChoiceTexts); a
    stop string that ends a choice early aborts it (``abort_choice``), and ends the
    request once every choice has ended (closing ``outputs`` aborts what is left)."""
    texts = ChoiceTexts(request_id, tokenizer, params)
    try:
        async for out in outputs:
            res = texts.process(out)
            if res is None:
                continue
            yield res
            if texts.done:
                return
            if texts.stopped_early(out.index) and abort_choice is not None:
                abort_choice(out.index)
    finally:
        aclose = getattr(outputs, "aclose", None)
        if aclose is not None:
            await aclose()
