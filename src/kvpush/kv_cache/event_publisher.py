"""KVEventPublisher: the thread that publishes an instance's KV cache events.

Threads and hand-offs::

    step loop ── publish(events) ── SimpleQueue ──▶ publisher thread
                                                     seq += 1, snapshot updated,
                                                     PUB.send([b"kv", batch])
    HTTP (/kv/cache_blocks) ── snapshot() ── lock ──┘

The step loop only appends to a queue (``publish`` never blocks and does no I/O). The
publisher thread owns the PUB socket: it numbers batches (seq 1, 2, ... for the life of
the instance), applies each to its snapshot — the set of hashes cached as of the last
batch it numbered — and sends it. Several step batches that queued up while it sent are
merged into one (fewer, larger messages under load; the order of events is kept).

A PUB socket never blocks its sender: a subscriber that falls behind by more than the
high-water mark loses messages and sees a gap in seq, which it repairs from
``snapshot()`` (served as ``GET /kv/cache_blocks``). The snapshot is taken under the
same lock that numbers a batch, so "cached as of seq S" is exact: a batch is numbered
and applied together, and its send (outside the lock) may follow a snapshot that
already includes it — a subscriber then drops it as seq <= S.

With the cluster's :class:`~kvpush.kv_cache.event_keys.EventKeys` (``keys=``), the PUB
socket is a CURVE server admitting members only, and every hash is published (and kept
in the snapshot) as its keyed tag: the stream tells a non-member nothing it can test a
guessed prompt against.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from dataclasses import dataclass

import zmq

from kvpush.crypto.curve import ZapGuard, make_server
from kvpush.kv_cache.event_keys import EventKeys
from kvpush.kv_cache.events import TOPIC, KVEvent, KVEventBatch, apply_events, encode_batch
from kvpush.kv_info import CacheBlocks, KVEvents

log = logging.getLogger(__name__)

#: Batches the PUB socket queues per subscriber before it drops (the subscriber then
#: sees a gap and takes a snapshot).
SEND_HWM = 10_000

_STOP = None


@dataclass(frozen=True, slots=True)
class CacheSnapshot:
    """Every hash cached as of batch ``seq`` (0: before the first batch)."""

    engine_id: str
    seq: int
    block_size: int
    hashes: list[bytes]

    def to_blocks(self) -> CacheBlocks:
        """What ``GET /kv/cache_blocks`` shows of it."""
        return CacheBlocks(self.engine_id, self.seq, self.block_size,
                           [h.hex() for h in self.hashes])


class KVEventPublisher:
    def __init__(self, engine_id: str, block_size: int, host: str = "127.0.0.1",
                 port: int = 0, keys: EventKeys | None = None) -> None:
        """Bind the PUB socket at ``tcp://host:port`` (0: a free port) now, so the
        endpoint is known before :meth:`start`; ZMQError if it cannot bind. ``keys``:
        members only, keyed hashes (module docs)."""
        self.engine_id = engine_id
        self.block_size = block_size
        self._keys = keys
        self._ctx = zmq.Context(io_threads=1)
        self._zap = ZapGuard(self._ctx, keys.curve) if keys is not None else None
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        if keys is not None:
            make_server(self._sock, keys.curve)
        try:
            self._sock.bind(f"tcp://{host}:{port if port else '*'}")
        except zmq.ZMQError:
            self._sock.close()
            self._stop_zap()
            self._ctx.term()
            raise
        bound = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.endpoint = f"tcp://{host}:{bound.rsplit(':', 1)[1]}"
        self._queue: queue.SimpleQueue[list[KVEvent] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._seq = 0
        self._cached: set[bytes] = set()
        self._thread: threading.Thread | None = None
        self.num_batches_sent = 0

    def info(self) -> KVEvents:
        """What ``/kv/info`` shows under ``kv_events``."""
        return KVEvents(self.endpoint, self.block_size, self._keys is not None)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvpush-kv-events",
                                            daemon=True)
            self._thread.start()

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one step's events (step loop; never blocks)."""
        if events:
            self._queue.put(events)

    def snapshot(self) -> CacheSnapshot:
        """The hashes cached as of the last numbered batch, with its seq (any thread)."""
        with self._lock:
            return CacheSnapshot(self.engine_id, self._seq, self.block_size,
                                 list(self._cached))

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, stop the thread and close the socket."""
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join(timeout)
            if self._thread.is_alive():  # pragma: no cover - a send cannot block (PUB)
                log.warning("the KV event publisher did not stop in %.0f s", timeout)
                return
            self._thread = None
        with contextlib.suppress(zmq.ZMQError):
            self._sock.close()
            self._stop_zap()
            self._ctx.term()

    def _stop_zap(self) -> None:
        if self._zap is not None:
            self._zap.stop()
            self._zap = None

    # ---- the publisher thread --------------------------------------------------------
    def _run(self) -> None:
        stop = False
        while not stop:
            item = self._queue.get()
            if item is _STOP:
                break
            events = list(item)
            while True:  # merge what queued up meanwhile into the same batch
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is _STOP:
                    stop = True
                    break
                events += more
            if self._keys is not None:
                events = self._keys.tag_events(events)
            with self._lock:
                self._seq += 1
                apply_events(self._cached, events)
                batch = KVEventBatch(self.engine_id, self._seq, events)
            try:
                self._sock.send_multipart([TOPIC, encode_batch(batch)], copy=False)
                self.num_batches_sent += 1
            except zmq.ZMQError:  # pragma: no cover - PUB drops rather than fails
                log.exception("publishing KV event batch %d failed", batch.seq)
