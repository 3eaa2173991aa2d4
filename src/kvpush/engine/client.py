"""``EngineClient``: everything the HTTP server uses of an engine, and nothing else.

Implemented by :class:`kvpush.engine.async_engine.AsyncEngine` (the step loop on a
thread of this process), by :class:`kvpush.engine.core_client.CoreClient` (the engine
core in a child process, over ZMQ) and by the tests' fake engine. Requests go in as
token ids and come out as :class:`RequestOutput` with their text; /health, /metrics,
/kv/info and /kv/cache_blocks read what the engine reports (snapshots and replies), never
its live tables.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from kvpush.config import EngineConfig
from kvpush.engine.outputs import EngineStats, IterationStats, RequestOutput
from kvpush.kv_info import CacheBlocks, KVInfo
from kvpush.kv_transfer.params import KVTransferParams
from kvpush.kv_transfer.record import TransferCounters, TransferRecord
from kvpush.sampling_params import SamplingParams


class FrontEngine(Protocol):
    """What the OpenAI front (kvpush.server.app.OpenAIFront) uses of its engine: an
    instance's EngineClient, or the router's RouterFront over many engine cores."""

    tokenizer: Any

    def health_problem(self) -> str | None:
        """Why requests cannot be served (a 503), or None."""
        ...

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_transfer_params: KVTransferParams | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; RequestError (raised before the first output) if
        it is refused. Closing the stream early aborts the request."""
        ...

    def kv_params(self, raw: object) -> KVTransferParams | None:
        """A request's ``kv_transfer_params`` checked once and typed (RequestError: a
        400; 403 when not the router's); None when it has none."""
        ...


class EngineClient(FrontEngine, Protocol):
    config: EngineConfig

    def start(self) -> None:
        """Start serving (called on the running event loop)."""
        ...

    async def shutdown(self) -> None: ...

    def starting(self) -> str | None:
        """Start-up work still running (/health's 503 "starting"; requests are queued
        meanwhile), or None once the engine steps at full speed."""
        ...

    def stats(self) -> EngineStats:
        """The scheduler's gauges as of the engine's last report."""
        ...

    def kv_stats(self) -> TransferCounters | None:
        """Transfer counters as of the engine's last report (None for role both)."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def kv_info(self) -> KVInfo:
        """What /kv/info shows (identity, role, layout, blocks, KV events)."""
        ...

    async def kv_cache_blocks(self) -> CacheBlocks | None:
        """/kv/cache_blocks' body (None: prefix caching is off)."""
        ...

    def abort_transfer(self, transfer_id: str, why: str = "aborted by the router") -> None:
        """Release what this (prefill) instance holds for a transfer."""
        ...

    def set_transfer_sink(self, sink: Callable[[TransferRecord], None]) -> None:
        """Call ``sink`` (on the event loop) with every finished transfer."""
        ...

    def set_stats_sink(self, sink: Callable[[IterationStats], None]) -> None:
        """Call ``sink`` (on the event loop) with the request metrics of every request
        the engine runs, whichever front sent it (kvpush.engine.request_stats)."""
        ...
