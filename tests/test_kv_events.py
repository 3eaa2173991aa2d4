"""KV cache events: the block pool's record of what it caches and evicts, the publisher
(seq, snapshot), and real `kvpush serve` instances whose PUB socket a subscriber mirrors
to exactly what ``/kv/cache_blocks`` says (a P/D pair's: tests/test_pd_http.py, on its
shared pair)."""

from __future__ import annotations

import random
import time
import uuid

import httpx
import msgspec
import zmq

from kvpush.crypto.curve import make_client
from kvpush.crypto.membership import member_view_token
from kvpush.kv_cache.block_pool import BlockPool, hash_prefix_blocks
from kvpush.kv_cache.event_keys import EventKeys
from kvpush.kv_cache.event_publisher import KVEventPublisher
from kvpush.kv_cache.events import (
    TOPIC,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    apply_events,
    decode_batch,
    encode_batch,
)
from kvpush.kv_info import KVEvents
from kvpush.server.member_view import MEMBER_HEADER
from server_helpers import TEST_KV_SECRET, ServerProcess

KEYS = EventKeys.from_secret(TEST_KV_SECRET.encode())

BS = 16


def _h(i: int) -> bytes:
    return i.to_bytes(16, "big")


# ---- wire format ----------------------------------------------------------------------


def test_batch_round_trip_and_tags():
    b = KVEventBatch("e1", 7, [BlockStored([_h(1), _h(2)]), BlockRemoved([_h(1)]),
                               AllBlocksCleared()])
    data = encode_batch(b)
    assert decode_batch(data) == b
    assert b"BlockStored" in data and b"AllBlocksCleared" in data  # tagged on the wire
    cached: set[bytes] = {_h(9)}
    apply_events(cached, b.events)
    assert cached == set()
    apply_events(cached, [BlockStored([_h(1), _h(2)]), BlockRemoved([_h(2)])])
    assert cached == {_h(1)}


# ---- BlockPool ------------------------------------------------------------------------


def _pool(n: int) -> BlockPool:
    pool = BlockPool(n)
    pool.record_events = True
    return pool


def test_pool_records_stores_once_per_new_hash():
    pool = _pool(4)
    a = pool.allocate(2)
    pool.cache_full_block(a[0], _h(1))
    pool.cache_full_block(a[1], _h(2))
    pool.cache_full_block(a[1], _h(2))  # already registered: nothing new
    b = pool.allocate(1)
    pool.cache_full_block(b[0], _h(1))  # same hash as a cached block: kept the first
    assert pool.take_events() == [BlockStored([_h(1), _h(2)])]
    assert pool.take_events() == []
    pool.free(a + b)
    assert pool.take_events() == []  # freeing keeps blocks cached: no event
    assert pool.num_free == 4


def test_pool_records_eviction_under_pressure_in_order():
    pool = _pool(4)
    a = pool.allocate(3)
    for i, bid in enumerate(a):
        pool.cache_full_block(bid, _h(i))
    pool.free(a)  # freed in reverse: a[2] (hash 2) is evicted first of the three
    pool.take_events()
    b = pool.allocate(2)  # the never-used block, then a[2]
    assert pool.take_events() == [BlockRemoved([_h(2)])]
    pool.cache_full_block(b[0], _h(7))
    c = pool.allocate(1)  # a[1]: hash 1 leaves
    pool.cache_full_block(b[1], _h(8))
    assert pool.take_events() == [BlockStored([_h(7)]), BlockRemoved([_h(1)]),
                                  BlockStored([_h(8)])]
    assert set(pool._cached) == {_h(0), _h(7), _h(8)}
    pool.free(b + c)
    assert pool.num_free == 4


def test_pool_reset_clears_then_restores_what_is_in_use():
    pool = _pool(4)
    a = pool.allocate(2)
    pool.cache_full_block(a[0], _h(1))
    pool.cache_full_block(a[1], _h(2))
    pool.free(a[1:])  # a[1] free, a[0] still in use
    pool.take_events()
    pool.reset_prefix_cache()
    assert pool.take_events() == [AllBlocksCleared(), BlockStored([_h(1)])]
    assert pool.lookup([_h(1), _h(2)]) == [a[0]]
    pool.free(a[:1])
    pool.reset_prefix_cache()
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.num_free == 4 and pool.num_cached() == 0


def test_pool_records_nothing_unless_asked():
    pool = BlockPool(2)
    a = pool.allocate(2)
    pool.cache_full_block(a[0], _h(1))
    pool.free(a)
    pool.allocate(2)
    pool.reset_prefix_cache()
    assert pool.take_events() == []


# ---- subscriber side (what the router does) --------------------------------------------


class Mirror:
    """A SUB socket on an instance's KV events, the set of hashes they add up to, and
    that set as of every seq seen (to compare with a snapshot taken at any seq)."""

    def __init__(self, endpoint: str, keys: EventKeys | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        if keys is not None:  # a member of the cluster (CURVE client)
            make_client(self.sock, keys.curve)
        self.sock.connect(endpoint)
        self.batches: list[KVEventBatch] = []
        self.cached: set[bytes] = set()
        self.at: dict[int, frozenset[bytes]] = {}
        self.seq = 0  # of the last batch applied (or of the snapshot loaded)
        self.synced = False  # True once loaded from a snapshot or seen from seq 1

    def recv(self, timeout_s: float) -> KVEventBatch | None:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        topic, payload = self.sock.recv_multipart()
        assert topic == TOPIC
        batch = decode_batch(payload)
        if self.batches:
            assert batch.engine_id == self.batches[-1].engine_id
        if batch.seq <= self.seq:  # already in the snapshot loaded
            return batch
        if self.batches or self.synced:
            assert batch.seq == self.seq + 1, f"a gap in seq: {self.seq} -> {batch.seq}"
        self.synced = self.synced or batch.seq == 1
        apply_events(self.cached, batch.events)
        self.batches.append(batch)
        self.seq = batch.seq
        self.at[batch.seq] = frozenset(self.cached)
        return batch

    def load(self, snap: dict) -> None:
        """Catch up from a snapshot, as a subscriber that just connected does."""
        self.cached = {bytes.fromhex(h) for h in snap["hashes"]}
        self.seq = snap["seq"]
        self.at[self.seq] = frozenset(self.cached)
        self.synced = True

    def drain(self, quiet_s: float = 0.3, limit: int = 10_000) -> None:
        """Receive until nothing comes for ``quiet_s``."""
        for _ in range(limit):
            if self.recv(quiet_s) is None:
                return
        raise AssertionError("events kept coming")

    def until_seq(self, seq: int, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.seq < seq:
            assert time.monotonic() < deadline, f"seq {seq} not received (at {self.seq})"
            self.recv(0.2)

    def events_after(self, seq: int, kind: type) -> list[bytes]:
        """The hashes of every ``kind`` event in batches after ``seq``, in order."""
        return [h for b in self.batches if b.seq > seq for e in b.events
                if isinstance(e, kind) for h in e.hashes]

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def _check_snapshot(mirror: Mirror, snap: dict) -> None:
    """The snapshot equals what the events add up to at its seq."""
    assert mirror.synced
    mirror.until_seq(snap["seq"])
    want = mirror.at.get(snap["seq"], frozenset())
    assert {bytes.fromhex(h) for h in snap["hashes"]} == want
    assert len(snap["hashes"]) == len(want)  # no duplicates


def _warm_up(mirror: Mirror, send, snapshot, tries: int = 20, wait_s: float = 2.0) -> None:
    """A SUB socket receives only once its subscription has reached the PUB: ``send``
    something that publishes until a batch comes through (bounded), then catch up from
    ``snapshot()`` as a router does. From here on no batch may be missed."""
    for i in range(tries):
        send(i)
        if mirror.recv(wait_s) is not None:
            break
    assert mirror.batches, "the subscriber never received a batch"
    mirror.drain()
    snap = snapshot()
    mirror.until_seq(snap["seq"])
    if mirror.batches[0].seq == 1:  # saw every batch: its sum must be the snapshot
        _check_snapshot_exact(mirror, snap)
    mirror.load(snap)


def _check_snapshot_exact(mirror: Mirror, snap: dict) -> None:
    assert {bytes.fromhex(h) for h in snap["hashes"]} == mirror.at[snap["seq"]]


def test_publisher_numbers_batches_and_snapshots_match():
    pub = KVEventPublisher("e-test", BS)
    pub.start()
    mirror = Mirror(pub.endpoint)
    try:
        assert pub.endpoint.startswith("tcp://127.0.0.1:")
        assert pub.info() == KVEvents(pub.endpoint, BS, keyed=False)
        assert pub.snapshot().seq == 0 and pub.snapshot().hashes == []
        _warm_up(mirror, lambda i: pub.publish([BlockStored([_h(1000 + i)])]),
                 lambda: msgspec.to_builtins(pub.snapshot().to_blocks()), tries=100, wait_s=0.05)
        start = mirror.seq
        pub.publish([BlockStored([_h(1), _h(2)])])
        pub.publish([BlockRemoved([_h(1)]), BlockStored([_h(3)])])
        pub.publish([])  # nothing: no batch
        mirror.drain()
        assert mirror.seq in (start + 1, start + 2)  # the two may merge into one batch
        assert {_h(2), _h(3)} <= mirror.cached and _h(1) not in mirror.cached
        snap = pub.snapshot()
        assert snap.engine_id == "e-test" and snap.seq == mirror.seq
        assert set(snap.hashes) == mirror.cached
        pub.publish([AllBlocksCleared()])
        mirror.drain()
        assert mirror.cached == set() and pub.snapshot().hashes == []
        assert pub.snapshot().seq == mirror.seq == pub.num_batches_sent
    finally:
        mirror.close()
        pub.close()
    assert pub._thread is None


# ---- real servers -----------------------------------------------------------------------


def _complete(url: str, prompt: list[int], max_tokens: int = 1, kv: dict | None = None,
              rid: str | None = None) -> dict:
    body: dict = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                  "ignore_eos": True}
    if kv is not None:
        body["kv_transfer_params"] = kv
    r = httpx.post(url + "/v1/completions", json=body, timeout=60,
                   headers={"X-Request-Id": rid or uuid.uuid4().hex})
    assert r.status_code == 200, r.text
    return r.json()


def _prompt(seed: int, n: int) -> list[int]:
    """``n`` token ids drawn from ``seed`` (distinct seeds: no shared first block)."""
    rng = random.Random(seed)
    return [rng.randrange(50, 950) for _ in range(n)]


def published(tokens: list[int], block_size: int) -> list[bytes]:
    """The names an instance with the test cluster's secret publishes for a prompt's
    full blocks: keyed tags of their hashes (kvpush.kv_cache.event_keys)."""
    return [KEYS.tag(h) for h in hash_prefix_blocks(tokens, block_size)]


def _subscribe(srv: ServerProcess) -> Mirror:
    """A Mirror on ``srv``'s events, warmed up by plain requests and caught up."""
    info = srv.get("/kv/info")["kv_events"]
    assert info["block_size"] == BS
    assert info["keyed"] is True  # test servers have the cluster secret: members only
    mirror = Mirror(info["endpoint"], KEYS)
    _warm_up(mirror, lambda i: _complete(srv.url, _prompt(10_000 + i, BS)),
             lambda: srv.get("/kv/cache_blocks"))
    return mirror


def test_serve_publishes_prefix_cache(tiny_llama, tmp_path):
    srv = ServerProcess(tiny_llama, "--block-size", str(BS), "--num-blocks", "256",
                        log_dir=tmp_path, name="both")
    mirror = None
    try:
        info = srv.get("/kv/info")
        assert info["engine_id"].startswith("both-")
        assert info["kv_events"]["endpoint"].startswith("tcp://127.0.0.1:")
        mirror = _subscribe(srv)
        snap = srv.get("/kv/cache_blocks")
        assert snap["engine_id"] == info["engine_id"] and snap["block_size"] == BS
        seq0 = mirror.seq
        prompt = _prompt(1, 3 * BS + 5)  # 3 full blocks and a partial one
        _complete(srv.url, prompt)
        mirror.drain()
        # exactly the prompt's full blocks, in chain order, nothing removed
        assert mirror.events_after(seq0, BlockStored) == published(prompt, BS)
        assert mirror.events_after(seq0, BlockRemoved) == []
        # the same prompt again: a cache hit, nothing new to publish
        seq1 = mirror.seq
        _complete(srv.url, prompt)
        mirror.drain()
        assert mirror.seq == seq1
        # generated tokens fill blocks too (prompt + output: what the next turn resends):
        # 16 + 33 tokens, the last one sampled but not computed: 3 full blocks
        short = _prompt(2, BS)
        seq2 = mirror.seq
        out = _complete(srv.url, short, max_tokens=2 * BS + 1)
        assert out["usage"]["completion_tokens"] == 2 * BS + 1
        mirror.drain()
        grown = mirror.events_after(seq2, BlockStored)
        assert len(grown) == 3 and grown[0] == published(short, BS)[0]
        assert {b.engine_id for b in mirror.batches} == {info["engine_id"]}
        assert [b.seq for b in mirror.batches] == list(
            range(mirror.batches[0].seq, mirror.seq + 1))
        _check_snapshot(mirror, srv.get("/kv/cache_blocks"))
        srv.wait_all_free()
    finally:
        if mirror is not None:
            mirror.close()
        srv.stop()


def test_serve_eviction_publishes_removals(tiny_llama, tmp_path):
    # 12 blocks of 16: a few 3-block prompts fill the cache, then each evicts
    srv = ServerProcess(tiny_llama, "--block-size", str(BS), "--num-blocks", "12",
                        "--max-model-len", "128", log_dir=tmp_path, name="small")
    mirror = None
    try:
        mirror = _subscribe(srv)
        seq0 = mirror.seq
        prompts = [_prompt(100 + i, 3 * BS) for i in range(8)]
        for p in prompts:
            _complete(srv.url, p)
        mirror.drain()
        stored = mirror.events_after(seq0, BlockStored)
        removed = mirror.events_after(seq0, BlockRemoved)
        assert stored == [h for p in prompts for h in published(p, BS)]
        assert removed, "no removal published under a 12-block pool"
        assert set(published(prompts[0], BS)) <= set(removed)
        # the index shrank with the evictions: the first prompts gone, the last there
        assert len(mirror.cached) <= 12
        assert not set(published(prompts[0], BS)) & mirror.cached
        assert set(published(prompts[-1], BS)) <= mirror.cached
        snap = srv.get("/kv/cache_blocks")
        _check_snapshot(mirror, snap)
        assert {bytes.fromhex(h) for h in snap["hashes"]} == mirror.cached
        srv.wait_all_free()
    finally:
        if mirror is not None:
            mirror.close()
        srv.stop()


def test_no_prefix_caching_no_events(tiny_llama, tmp_path):
    srv = ServerProcess(tiny_llama, "--block-size", str(BS), "--num-blocks", "64",
                        "--max-model-len", "128", "--no-prefix-caching", "--api-key", "k3y",
                        log_dir=tmp_path, name="nocache")
    try:
        auth = {"Authorization": "Bearer k3y"}
        # a member view (server/member_view.py): neither no key nor the API key opens it
        for headers in ({}, auth):
            r = httpx.get(srv.url + "/kv/cache_blocks", headers=headers, timeout=10)
            assert r.status_code == 403
        info = httpx.get(srv.url + "/kv/info", headers=auth, timeout=10).json()
        assert info["kv_events"] is None
        member = {MEMBER_HEADER: member_view_token(TEST_KV_SECRET.encode())}
        r = httpx.get(srv.url + "/kv/cache_blocks", headers=member, timeout=10)
        assert r.status_code == 404
    finally:
        srv.stop()
