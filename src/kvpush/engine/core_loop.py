"""The engine core's loop: one LLMEngine driven by one thread, whichever process it runs
in (a thread of the server: AsyncEngine; a child process: kvpush.engine.core_proc).

Each turn applies the inbox (blocking on it when there is no work: nothing spins),
runs one step and hands what happened to ``post`` as one EngineOutputs batch: the
outputs, the transfers that ended, the request metrics those outputs add (every front's
requests: kvpush.engine.request_stats), the replies to utility calls and, at most every
``SNAPSHOT_S`` or whenever the core goes idle, a snapshot (gauges, transfer counters,
health). Outputs the inbox produced (token #1 that arrived with pushed KV, refusals)
are posted before the step, not after a forward pass they have no part in. After each
turn the block pool's cache events go to the KVEventPublisher's queue.

Torch threads: only the loop's thread runs multi-threaded torch ops. The engine is
built (model loaded) with one thread and the loop sets ``config.threads`` for itself:
OpenMP keeps a worker pool per thread that ever ran a parallel region, and with a
second pool left on the main thread, libgomp (more managed threads than cores)
switched every barrier to sleep-and-wake, so a multi-threaded step ran markedly slower
in the server than the same engine alone (docs/MEASURED.md).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable

import torch
import zmq

from kvpush.config import ConfigError, EngineConfig
from kvpush.engine.inputs import TransferThreadDied, Utility
from kvpush.engine.llm_engine import LLMEngine
from kvpush.engine.outputs import EngineOutput, EngineOutputs, TransferRecord
from kvpush.engine.request_stats import RequestStatsTracker
from kvpush.engine.tp.group import RankDied
from kvpush.kv_cache.event_keys import EventKeys
from kvpush.kv_cache.event_publisher import KVEventPublisher
from kvpush.kv_info import KVInfo
from kvpush.kv_transfer.links import TransferLinks

log = logging.getLogger(__name__)

#: torch's own thread count, read once at import (before any engine changed it): what
#: the step loop uses when --threads is not given
DEFAULT_THREADS = torch.get_num_threads()

#: most time between two snapshots while the core is busy (it sends one when it idles)
SNAPSHOT_S = 0.02

Post = Callable[[EngineOutputs], None]


class CoreLoop:
    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None,
                 links: TransferLinks | None = None):
        """``links``: how the engine it builds reaches its peers (LLMEngine's)."""
        #: torch threads the loop sets for itself (None: an engine built by the caller
        #: keeps the caller's setting)
        self.step_threads: int | None = None
        if engine is None:
            self.step_threads = config.threads or DEFAULT_THREADS
            engine = LLMEngine(config, build_threads=1, links=links)
        self.engine = engine
        self.config = config
        connector = getattr(engine, "connector", None)  # (tests drive stub engines)
        #: this instance's id: its connector's (P/D roles) or a fresh ``both-<hex>``
        self.engine_id = (connector.engine_id if connector is not None
                          else f"both-{uuid.uuid4().hex[:8]}")
        #: the transfer thread's address (P/D roles), for the start-up log
        self.side_channel = connector.address if connector is not None else None
        #: the request plane's address (core_proc sets it; None: role both, no secret)
        self.request_plane: str | None = None
        self.kv_events = self._make_publisher(config)
        self._records: list[TransferRecord] = []
        #: request metrics of every request the core runs, whichever front sent it
        self.request_stats = RequestStatsTracker()
        if connector is not None:
            connector.record_sink = self._records.append
        utilities = getattr(engine, "utilities", None)
        if utilities is not None:
            utilities[Utility.KV_INFO] = self.kv_info
            if self.kv_events is not None:
                utilities[Utility.KV_CACHE_BLOCKS] = lambda: self.kv_events.snapshot().to_blocks()
        self._last_snapshot = 0.0
        #: what ended the loop other than a Shutdown (None while it runs or after one)
        self.fatal: BaseException | None = None

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

    def kv_info(self) -> KVInfo:
        """What /kv/info shows: the engine's (identity, role, transfer mode, layout,
        blocks) with this loop's id, where it publishes KV cache events and its request
        plane (kvpush.kv_info.KVInfo)."""
        kvt = self.engine.config.kv_transfer
        return self.engine.kv_info(
            self.engine_id,
            self.kv_events.info() if self.kv_events is not None else None,
            self.request_plane, bool(getattr(kvt, "side_channel_secret", None)))

    # ---- the loop (its own thread) ---------------------------------------------------
    def run(self, post: Post) -> None:
        engine = self.engine
        if self.step_threads:
            torch.set_num_threads(self.step_threads)
        try:
            engine.prepare_step_thread()  # at the steps' thread count
            self._post(post, [], force=True)  # the snapshot that says start-up is done
            while True:
                outputs = engine.process_inbox(block=not engine.has_work())
                if getattr(engine, "stopping", False):
                    self._post(post, outputs)
                    break
                if outputs:
                    self._post(post, outputs)
                self._post(post, engine.step())
                self._publish_events()
        except (TransferThreadDied, RankDied) as e:  # the thread or rank watch logged why
            self.fatal = e
        except BaseException as e:  # reported through the front end's health
            log.exception("step loop died")
            self.fatal = e
        finally:
            self._post(post, self._abort_all(), force=True, fatal=self._fatal_reason())
            self._publish_events()
            engine.shutdown()

    def _post(self, post: Post, outputs: list[EngineOutput], force: bool = False,
              fatal: str | None = None) -> None:
        engine = self.engine
        take = getattr(engine, "take_replies", None)
        replies = take() if take is not None else []
        snapshot = None
        now = time.perf_counter()
        if force or now - self._last_snapshot >= SNAPSHOT_S or not engine.has_work():
            snap = getattr(engine, "snapshot", None)
            if snap is not None:
                snapshot = snap()
                self._last_snapshot = now
        if not (outputs or self._records or replies or snapshot is not None
                or fatal is not None):
            return
        records = self._records.copy()  # (the connector holds its append)
        self._records.clear()
        stats = self.request_stats.observe(outputs, now) if outputs else None
        post(EngineOutputs(outputs, records, replies, snapshot, fatal, stats))

    def _publish_events(self) -> None:
        """Hand the pool's cache changes of this turn to the publisher (a queue put)."""
        if self.kv_events is not None:
            events = self.engine.scheduler.pool.take_events()
            if events:
                self.kv_events.publish(events)

    def _fatal_reason(self) -> str | None:
        e = self.fatal
        if e is None:
            return None
        if isinstance(e, (TransferThreadDied, RankDied)):
            return str(e)
        return f"the engine step loop died: {type(e).__name__}: {e}"

    def _abort_all(self) -> list[EngineOutput]:
        """End every request: aborted after a Shutdown, failed with the reason when the
        loop died (its client gets an error, not a finish it could take for its own)."""
        why = self._fatal_reason()
        outs = []
        compiling = getattr(self.engine, "compiling", {})  # (stubs have none)
        for rid in [*self.engine.scheduler.requests, *compiling]:
            out = (self.engine.abort_request(rid) if why is None  # (stubs: the id only)
                   else self.engine.abort_request(rid, why))
            if out is not None:
                outs.append(out)
        return outs
