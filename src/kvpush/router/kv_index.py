"""What each instance holds in its prefix cache, as the router knows it.

Every kvpush instance with prefix caching names a ZMQ PUB socket in its ``/kv/info``
(``kv_events: {"endpoint", "block_size"}``) and publishes each change of its cache on
it: a :class:`~kvpush.kv_cache.events.KVEventBatch` of blocks stored, blocks removed,
or the whole cache cleared, numbered ``seq`` = 1, 2, ... for the instance's life. For
each such instance the router keeps an :class:`InstanceIndex` (the set of cached block
hashes), fed by one asyncio task (:class:`_Follower`) that reads the SUB socket; the
request path only reads the sets (``longest_prefix``), and never waits on any of this.

Catching up. A follower that has just connected, or that sees a jump in ``seq`` (a
batch lost: ZMQ PUB drops for slow subscribers, and a subscriber misses what was
published before it joined), takes a snapshot, ``GET /kv/cache_blocks`` (every hash
cached now, as of batch S), installs it and applies the batches it buffered meanwhile
with seq > S. A batch from another engine id, or a new engine id in ``/kv/info`` (the
instance restarted on the same port: empty cache, seq from 1 again), drops the old
index before anything else.

Staleness costs compute only. The router sends the same request whatever the index
says; an index that is behind makes it pick a decode that recomputes more than it
expected (or send a prefill leg that was not needed), never a wrong answer. So a lost
snapshot is retried in the background, and until then the old set keeps serving.

All state lives on the router's event loop: no locks.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvpush.crypto.curve import make_client
from kvpush.kv_cache.event_keys import EventKeys
from kvpush.kv_cache.events import (
    TOPIC,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
)
from kvpush.kv_info import CacheBlocks, KVInfo
from kvpush.router.stopping import cancel_and_wait

logger = logging.getLogger("kvpush.router.kv_index")

#: batches buffered while a snapshot is on its way; more and the oldest are dropped
#: (the snapshot then shows a gap and is taken again)
MAX_PENDING_BATCHES = 4096


class BatchResult(enum.Enum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"  # seq already applied (or older than the snapshot)
    BUFFERED = "buffered"  # waiting for a snapshot
    GAP = "gap"  # a batch was lost: a snapshot is needed
    RESTART = "restart"  # another engine id: the index was dropped


@dataclass(eq=False)
class InstanceIndex:
    """The cached block hashes of one instance (one engine id): a state machine over
    batches and snapshots, no I/O."""

    engine_id: str
    block_size: int
    hashes: set[bytes] = field(default_factory=set)
    #: the last batch applied (or the snapshot's)
    seq: int = 0
    #: a snapshot has been installed and no batch has been lost since
    synced: bool = False
    pending: list[KVEventBatch] = field(default_factory=list)
    gaps: int = 0
    restarts: int = 0

    def longest_prefix(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``hashes`` (a prompt's chain) are cached."""
        n = 0
        for h in hashes:
            if h not in self.hashes:
                break
            n += 1
        return n

    def reset(self, engine_id: str) -> None:
        """A new engine behind the same instance: nothing of the old index holds."""
        self.engine_id = engine_id
        self.hashes = set()
        self.seq = 0
        self.synced = False
        self.pending = []
        self.restarts += 1

    def on_batch(self, batch: KVEventBatch) -> BatchResult:
        if batch.engine_id != self.engine_id:
            self.reset(batch.engine_id)
            self._buffer(batch)
            return BatchResult.RESTART
        if not self.synced:
            self._buffer(batch)
            return BatchResult.BUFFERED
        if batch.seq <= self.seq:
            return BatchResult.DUPLICATE
        if batch.seq != self.seq + 1:
            self.synced = False
            self.gaps += 1
            self._buffer(batch)
            return BatchResult.GAP
        self._apply(batch)
        return BatchResult.APPLIED

    def on_snapshot(self, snap: CacheBlocks) -> bool:
        """Install ``snap`` (``GET /kv/cache_blocks``: every hash cached, as of batch
        ``seq``) and the buffered batches after it; False when they do not follow on
        from it (a batch between them was lost: take another snapshot). ValueError,
        nothing changed, for a hash that is not hex."""
        hashes = {bytes.fromhex(h) for h in snap.hashes}
        if snap.engine_id != self.engine_id:
            self.reset(snap.engine_id)
        self.hashes = hashes
        self.block_size = snap.block_size
        self.seq = snap.seq
        later = sorted((b for b in self.pending if b.engine_id == self.engine_id
                        and b.seq > snap.seq), key=lambda b: b.seq)
        for i, b in enumerate(later):
            if b.seq == self.seq:
                continue  # the same batch twice
            if b.seq != self.seq + 1:
                self.pending = later[i:]
                self.gaps += 1
                return False
            self._apply(b)
        self.pending = []
        self.synced = True
        return True

    def _buffer(self, batch: KVEventBatch) -> None:
        self.pending.append(batch)
        if len(self.pending) > MAX_PENDING_BATCHES:
            del self.pending[0]

    def _apply(self, batch: KVEventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self.hashes.update(ev.hashes)
            elif isinstance(ev, BlockRemoved):
                self.hashes.difference_update(ev.hashes)
            elif isinstance(ev, AllBlocksCleared):
                self.hashes.clear()
        self.seq = batch.seq


@dataclass(frozen=True)
class EventSource:
    """Where an instance publishes, as its ``/kv/info`` says."""

    url: str
    engine_id: str
    endpoint: str
    block_size: int
    keyed: bool = False  # members only (CURVE), hashes published as keyed tags


def event_source(url: str, info: KVInfo | None) -> EventSource | None:
    """The instance's event source from its ``/kv/info`` (None: it publishes none)."""
    ev = info.kv_events if info is not None else None
    if info is None or ev is None:
        return None
    return EventSource(url, info.engine_id, ev.endpoint, ev.block_size, ev.keyed)


#: fetches an instance's snapshot, given its URL
FetchSnapshot = Callable[[str], Awaitable[CacheBlocks]]


class _Follower:
    """The task that keeps one :class:`InstanceIndex` up to date from one endpoint."""

    def __init__(self, ctx: Any, src: EventSource, index: InstanceIndex,
                 fetch: FetchSnapshot, retry_s: float, keys: EventKeys | None = None) -> None:
        self.src, self.index, self.fetch, self.retry_s = src, index, fetch, retry_s
        self.ctx = ctx
        self.keys = keys  # set when the source is keyed (and we have the keys)
        self.malformed = 0
        self.snapshots = 0
        self._snap: asyncio.Task | None = None
        self.task = asyncio.create_task(self._run(), name=f"kv-events {src.url}")

    async def _run(self) -> None:
        import zmq

        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        if self.keys is not None:
            make_client(sock, self.keys.curve)
        try:
            sock.connect(self.src.endpoint)
            self._resync()
            while True:
                frames = await sock.recv_multipart()
                if len(frames) != 2 or frames[0] != TOPIC:
                    self.malformed += 1
                    continue
                try:
                    batch = decode_batch(frames[1])
                except (msgspec.DecodeError, msgspec.ValidationError):
                    self.malformed += 1
                    if self.malformed == 1:
                        logger.warning("%s: a malformed KV event batch (dropped)",
                                       self.src.url)
                    continue
                r = self.index.on_batch(batch)
                if r is BatchResult.RESTART:
                    logger.info("%s: KV events from a new engine %s: index dropped",
                                self.src.url, batch.engine_id)
                if r in (BatchResult.GAP, BatchResult.RESTART):
                    self._resync()
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the index goes stale, the router goes on
            logger.exception("%s: following KV events on %s failed; routing on a stale "
                             "index until the instance changes", self.src.url,
                             self.src.endpoint)
        finally:
            if self._snap is not None:
                self._snap.cancel()
            sock.close(linger=0)

    def _resync(self) -> None:
        if self._snap is None or self._snap.done():
            self._snap = asyncio.create_task(self._snapshot_until_synced())

    async def _snapshot_until_synced(self) -> None:
        while True:
            try:
                synced = self.index.on_snapshot(await self.fetch(self.src.url))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - retried; the index just stays stale
                logger.warning("%s: KV cache snapshot failed (%s); trying again in %g s",
                               self.src.url, e, self.retry_s)
                await asyncio.sleep(self.retry_s)
                continue
            self.snapshots += 1
            if synced:
                return
            await asyncio.sleep(0)  # batches lost between snapshot and stream: again



class KVIndex:
    """The indexes of every instance that publishes KV events (keyed by the pool's
    instance objects), and their followers.

    ``update(inst_key, url, info)`` is called with each instance's latest ``/kv/info``
    (the pool's health checks): it starts following a new source, and drops the index
    when the engine id or endpoint changed (a restart)."""

    def __init__(self, fetch: FetchSnapshot, retry_s: float = 1.0,
                 keys: EventKeys | None = None) -> None:
        """``keys``: the cluster's event keys (from its secret), to follow instances
        whose events are keyed (kvpush.kv_cache.event_keys); without them those are
        not followed (logged once each)."""
        import zmq.asyncio

        self.keys = keys
        self.ctx = zmq.asyncio.Context()
        self._unkeyed_warned: set[str] = set()
        self.fetch = fetch
        self.retry_s = retry_s
        self._followers: dict[object, _Follower] = {}
        self._stopping: set[asyncio.Task] = set()
        #: the chain last looked up (the very list: Route.chain keeps it) and its tags
        #: so far (all keyed followers share the cluster's keys)
        self._tags: tuple[Sequence[bytes], list[bytes]] | None = None

    def update(self, key: object, url: str, info: KVInfo | None) -> None:
        src = event_source(url, info)
        cur = self._followers.get(key)
        if cur is not None and cur.src == src:
            return
        if cur is not None:
            logger.info("%s: KV event source changed (engine %s -> %s): index dropped",
                        url, cur.src.engine_id, src.engine_id if src else None)
            del self._followers[key]
            cur.task.cancel()
            self._stopping.add(cur.task)
            cur.task.add_done_callback(self._stopping.discard)
        if src is not None and src.keyed and self.keys is None:
            if src.endpoint not in self._unkeyed_warned:
                self._unkeyed_warned.add(src.endpoint)
                logger.warning("%s publishes members-only KV events and the router has no "
                               "cluster secret: not followed (cache-aware routing ignores "
                               "it)", url)
            return
        if src is not None:
            idx = InstanceIndex(src.engine_id, src.block_size)
            self._followers[key] = _Follower(self.ctx, src, idx, self.fetch, self.retry_s,
                                             self.keys if src.keyed else None)

    def index(self, key: object) -> InstanceIndex | None:
        f = self._followers.get(key)
        return f.index if f is not None else None

    def longest_prefix(self, key: object, hashes_by_size: Callable[[int], Sequence[bytes]]
                       ) -> int:
        """Leading blocks of the prompt cached on ``key`` (0 when it publishes nothing);
        ``hashes_by_size(block_size)`` gives the prompt's chain for that block size."""
        f = self._followers.get(key)
        if f is None:
            return 0
        hashes = hashes_by_size(f.index.block_size)
        if f.keys is None:
            return f.index.longest_prefix(hashes)
        # the instance publishes keyed tags of its hashes: tag the chain as far as the
        # walk goes, and keep the tags for the next look-up of the same chain (one
        # routing decision looks it up on every instance, and several times)
        memo = self._tags
        if memo is None or memo[0] is not hashes:
            memo = self._tags = (hashes, [])
        tags, have, tag = memo[1], f.index.hashes, f.keys.tag
        n = 0
        for h in hashes:
            if n == len(tags):
                tags.append(tag(h))
            if tags[n] not in have:
                break
            n += 1
        return n

    def block_size(self, key: object) -> int | None:
        idx = self.index(key)
        return idx.block_size if idx is not None else None

    def state(self, key: object) -> dict[str, Any] | None:
        f = self._followers.get(key)
        if f is None:
            return None
        i = f.index
        return {"endpoint": f.src.endpoint, "engine_id": i.engine_id, "seq": i.seq,
                "synced": i.synced, "blocks": len(i.hashes), "gaps": i.gaps,
                "snapshots": f.snapshots, "malformed": f.malformed}

    async def close(self) -> None:
        followers, self._followers = list(self._followers.values()), {}
        await cancel_and_wait([f.task for f in followers] + list(self._stopping),
                              "KV event followers")
        # destroy, not term: a follower that did not stop leaves its socket open, and
        # term() would block the event loop until it closed
        self.ctx.destroy(linger=0)
