"""AsyncEngine: the asyncio front of an LLMEngine driven by its own step-loop thread.

Threads and hand-offs::

    event loop (HTTP)                      step-loop thread (owns the model)
    generate() ── engine.inbox ───────────▶ add / abort, then engine.step()
    per-request asyncio.Queue ◀── call_soon_threadsafe(one batch per step) ──┘

The step loop blocks on the engine's inbox when it has no work (it never spins) and
never waits on the event loop: outputs are posted and it goes on. The event loop never
runs model code. A consumer that stops iterating a generate() stream (client gone,
cancellation) aborts the request, which frees its blocks.

Torch threads: only the step-loop thread runs multi-threaded torch ops. The engine is
built (model loaded) with one thread and the step loop sets ``config.threads`` for
itself: OpenMP keeps a worker pool per thread that ever ran a parallel region, and with
a second pool left on the main thread, libgomp (more managed threads than cores)
switched every barrier to sleep-and-wake, so a multi-threaded step ran markedly slower
in the server than the same engine alone (docs/MEASURED.md).

KV cache events (prefix caching on): the block pool records what its cache gains and
loses; after every turn of the step loop its pending events go, as one list, to the
KVEventPublisher's queue (kvpush.kv_cache.event_publisher), whose thread numbers,
snapshots and publishes them. The step loop never waits on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import uuid
from collections.abc import AsyncIterator

import torch
import zmq

from kvpush.config import ConfigError, EngineConfig
from kvpush.engine.llm_engine import LLMEngine
from kvpush.engine.outputs import EngineStats, RequestError, RequestOutput
from kvpush.kv_cache.event_keys import EventKeys
from kvpush.kv_cache.event_publisher import CacheSnapshot, KVEventPublisher
from kvpush.kv_transfer.thread_death import died_message
from kvpush.sampling_params import SamplingParams

log = logging.getLogger(__name__)

#: torch's own thread count, read once at import (before any engine changed it): what
#: the step loop uses when --threads is not given
DEFAULT_THREADS = torch.get_num_threads()

_STOP = ("stop", "")


class AsyncEngine:
    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None):
        #: torch threads the step loop sets for itself (None: an engine built by the
        #: caller keeps the caller's setting)
        self.step_threads: int | None = None
        if engine is None:
            self.step_threads = config.threads or DEFAULT_THREADS
            engine = LLMEngine(config, build_threads=1)
        self.engine = engine
        self.config = config
        self.tokenizer = self.engine.tokenizer
        # internal engine id -> (caller's request id, its output queue)
        self._streams: dict[str, tuple[str, asyncio.Queue[RequestOutput]]] = {}
        self._internal: dict[str, str] = {}  # caller's id -> internal id
        self._seq = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._fatal: BaseException | None = None
        #: set once the step thread's start-up work (the matmul autotune) is done: until
        #: then /health answers 503 "starting" (requests are queued, not refused)
        self.prepared = threading.Event()
        connector = getattr(self.engine, "connector", None)
        #: this instance's id: its connector's (P/D roles) or a fresh ``both-<hex>``
        self.engine_id = (connector.engine_id if connector is not None
                          else f"both-{uuid.uuid4().hex[:8]}")
        self.kv_events = self._make_publisher(config)

    def _make_publisher(self, config: EngineConfig) -> KVEventPublisher | None:
        """The KV event publisher when prefix caching is on (None otherwise): bound on
        the side-channel host in a P/D role, on 127.0.0.1 for role both."""
        cache = getattr(config, "cache", None)  # (tests drive stub engines without one)
        if cache is None or not cache.enable_prefix_caching:
            return None
        kvt = config.kv_transfer
        host = kvt.side_channel_host if kvt.enabled else "127.0.0.1"
        try:
            secret = getattr(kvt, "side_channel_secret", None)  # members only, keyed
            publisher = KVEventPublisher(self.engine_id, config.cache.block_size, host,
                                         keys=EventKeys.from_secret(secret) if secret else None)
        except zmq.ZMQError as e:
            self.engine.shutdown()
            raise ConfigError(f"cannot bind the KV event socket on {host}: {e}") from e
        self.engine.scheduler.pool.record_events = True
        return publisher

    # ---- life cycle --------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        if self.kv_events is not None:
            self.kv_events.start()
        self._thread = threading.Thread(target=self._run, name="kvpush-step-loop", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        loop = asyncio.get_running_loop()
        if self._thread is not None:
            self.engine.inbox.put(_STOP)
            await loop.run_in_executor(None, self._thread.join, 30)
            self._thread = None
        if self.kv_events is not None:  # after the step loop: its last events go out
            await loop.run_in_executor(None, self.kv_events.close)

    def health_problem(self) -> str | None:
        """Why this instance cannot serve (what /health answers with its 503), or None:
        its step loop is not running, or (P/D roles) its KV transfer thread died."""
        if self._fatal is not None or self._thread is None or not self._thread.is_alive():
            return "the engine step loop is not running"
        connector = self.engine.connector
        death = connector.failure if connector is not None else None
        if death is not None:
            return died_message(death)
        return None

    def is_healthy(self) -> bool:
        return self.health_problem() is None

    def starting(self) -> str | None:
        """What start-up work is still running (/health is 503 until it is done), or
        None once the step thread is ready to step at full speed."""
        if self._thread is not None and not self.prepared.is_set():
            return "starting: the step thread is timing its matmul kernels"
        return None

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def kv_info(self) -> dict:
        """What /kv/info shows: identity, role, transfer mode, layout, blocks, and where
        the KV cache events are published (``kv_events``; null without prefix caching)."""
        info = self.engine.kv_info()
        info["engine_id"] = info.get("engine_id") or self.engine_id
        info["kv_events"] = self.kv_events.info() if self.kv_events is not None else None
        return info

    def kv_cache_blocks(self) -> CacheSnapshot | None:
        """Every block hash cached now, as of the last published batch (None without
        prefix caching): what ``GET /kv/cache_blocks`` answers."""
        return self.kv_events.snapshot() if self.kv_events is not None else None

    def kv_stats(self) -> dict:
        """Transfer counters (empty for a plain instance)."""
        c = self.engine.connector
        return c.stats() if c is not None else {}

    def abort_transfer(self, transfer_id: str, why: str = "aborted by the router") -> None:
        """Release what this (prefill) instance holds for a transfer, now."""
        self.engine.inbox.put(("kv_abort", transfer_id, why))

    def set_transfer_sink(self, sink) -> None:
        """Call ``sink(TransferRecord)`` for every finished transfer (step-loop thread)."""
        if self.engine.connector is not None:
            self.engine.connector.record_sink = sink

    # ---- requests ----------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_transfer_params: dict | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. ``request_id`` is the caller's (X-Request-Id); the
        engine runs it under a unique internal id, so an id reused right after an abort
        never receives the old request's last output."""
        problem = self.health_problem()
        if problem is not None:
            raise RequestError(f"this instance cannot serve requests: {problem}",
                               code="unavailable", status_code=503)
        if kv_transfer_params is None:
            kv_transfer_params = params.extra.get("kv_transfer_params")
        # checked and typed here, once, before anything is queued (a 400 if malformed)
        kv_transfer_params = self.engine.validate(prompt_token_ids, params,
                                                  kv_transfer_params)
        if request_id in self._internal:
            raise RequestError(f"request id {request_id!r} is already in use", "request_id")
        internal = f"{request_id}#{next(self._seq)}"
        stream: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[internal] = (request_id, stream)
        self._internal[request_id] = internal
        self.engine.inbox.put(("add", internal, prompt_token_ids, params, kv_transfer_params))
        finished = False
        try:
            while True:
                out = await stream.get()
                if out.finished:
                    finished = True
                    if out.extra.get("rejected"):
                        raise RequestError(out.error or "request refused",
                                           out.extra.get("param"), out.extra.get("code"),
                                           out.extra.get("status_code", 400))
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(internal, None)
            self._internal.pop(request_id, None)
            if not finished:
                self.engine.inbox.put(("abort", internal))

    async def abort(self, request_id: str) -> None:
        internal = self._internal.get(request_id)
        if internal is not None:
            self.engine.inbox.put(("abort", internal))

    # ---- the step loop (its own thread) --------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        if self.step_threads:
            torch.set_num_threads(self.step_threads)
        try:
            engine.prepare_step_thread()  # at the steps' thread count
            self.prepared.set()
            while True:
                outputs = engine.process_inbox(block=not engine.has_work())
                if outputs and outputs[-1] == "stop":
                    if outputs[:-1]:
                        self._post(outputs[:-1])
                    break
                if outputs:  # e.g. token #1 that arrived with pushed KV: not after a step
                    self._post(outputs)
                outputs = engine.step()
                if outputs:
                    self._post(outputs)
                self._publish_events()
        except BaseException as e:  # pragma: no cover - reported through is_healthy
            log.exception("step loop died")
            self._fatal = e
        finally:
            self._abort_all()
            self._publish_events()
            engine.shutdown()

    def _publish_events(self) -> None:
        """Hand the pool's cache changes of this turn to the publisher (a queue put)."""
        if self.kv_events is not None:
            events = self.engine.scheduler.pool.take_events()
            if events:
                self.kv_events.publish(events)

    def _post(self, outputs: list[RequestOutput]) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        # the loop may close between the check and the call
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            entry = self._streams.get(out.request_id)
            if entry is not None:
                out.request_id = entry[0]
                entry[1].put_nowait(out)

    def _abort_all(self) -> None:
        outs = []
        for rid in list(self.engine.scheduler.requests):
            out = self.engine.abort_request(rid)
            if out is not None:
                outs.append(out)
        if outs:
            self._post(outs)
