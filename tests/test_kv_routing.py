"""Cache-aware routing (issue 31): the router's KV index fed by an instance's KV events,
the per-request decision, and the router end to end over fake instances that publish
events (a real ZMQ PUB socket, real HTTP), with the faults: an instance restarted, events
lost, a decode that refuses a local request. Every wait is bounded."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from fastapi.responses import JSONResponse

from kvpush.discovery.instance_spec import parse_instance
from kvpush.engine.inputs import SubmitRequest
from kvpush.engine.outputs import EngineStats, RequestFailure
from kvpush.kv_cache.block_pool import hash_prefix_blocks
from kvpush.kv_cache.events import (
    TOPIC,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    encode_batch,
)
from kvpush.kv_info import CacheBlocks
from kvpush.router.config import RouterConfig
from kvpush.router.decide import (
    Decision,
    Route,
    cost,
    decide,
    lacks_room,
)
from kvpush.router.job import RequestRecord
from kvpush.router.kv_index import BatchResult, InstanceIndex, KVIndex
from kvpush.router.placement import Placement
from kvpush.router.pool import Pool
from router_helpers import metric_value, wait_until
from stand_in import make_kv_info, push_kv_info, stand_in

BS = 4  # block size of the fake instances
VOCAB = 1 << 17  # the fake instances take any id of the tiny models' tokenizers


def H(i: int) -> bytes:
    return i.to_bytes(16, "big")


def batch(seq: int, *events: Any, engine: str = "e1") -> KVEventBatch:
    return KVEventBatch(engine, seq, list(events))


def snapshot(engine: str, seq: int, *hashes: bytes) -> CacheBlocks:
    """A ``/kv/cache_blocks`` answer: every hash cached, as of batch ``seq``."""
    return CacheBlocks(engine, seq, BS, [h.hex() for h in hashes])


# ---------------------------------------------------------------------- the index, pure


def test_index_applies_batches_in_order_and_shrinks_on_eviction():
    idx = InstanceIndex("e1", BS)
    assert idx.on_batch(batch(1, BlockStored([H(1)]))) is BatchResult.BUFFERED  # unsynced
    assert idx.on_snapshot(snapshot("e1", 0))
    assert idx.hashes == {H(1)} and idx.seq == 1 and idx.synced
    assert idx.on_batch(batch(2, BlockStored([H(2), H(3)]))) is BatchResult.APPLIED
    assert idx.longest_prefix([H(1), H(2), H(3), H(4)]) == 3
    assert idx.on_batch(batch(2, BlockRemoved([H(1)]))) is BatchResult.DUPLICATE
    assert idx.on_batch(batch(3, BlockRemoved([H(2)]))) is BatchResult.APPLIED
    assert idx.longest_prefix([H(1), H(2), H(3)]) == 1  # stops at the first miss
    assert idx.on_batch(batch(4, AllBlocksCleared())) is BatchResult.APPLIED
    assert idx.hashes == set() and idx.longest_prefix([H(1)]) == 0


def test_index_gap_takes_a_snapshot_and_applies_later_batches():
    idx = InstanceIndex("e1", BS)
    idx.on_snapshot(snapshot("e1", 5, H(1)))
    assert idx.on_batch(batch(7, BlockStored([H(9)]))) is BatchResult.GAP  # 6 lost
    assert not idx.synced and idx.hashes == {H(1)}  # stale, still serving
    assert idx.on_batch(batch(8, BlockStored([H(10)]))) is BatchResult.BUFFERED
    # a snapshot older than the lost batch leaves a gap: not synced yet
    assert not idx.on_snapshot(snapshot("e1", 5, H(1)))
    # the snapshot as of batch 7 (6 and 7 in it), then 8 from the buffer
    assert idx.on_snapshot(snapshot("e1", 7, H(1), H(2), H(9)))
    assert idx.synced and idx.seq == 8 and idx.hashes == {H(1), H(2), H(9), H(10)}


def test_index_restart_drops_everything():
    idx = InstanceIndex("e1", BS)
    idx.on_snapshot(snapshot("e1", 3, H(1), H(2)))
    assert idx.on_batch(batch(1, BlockStored([H(5)]), engine="e2")) is BatchResult.RESTART
    assert idx.engine_id == "e2" and idx.hashes == set() and not idx.synced
    assert idx.on_snapshot(snapshot("e2", 0))
    assert idx.hashes == {H(5)} and idx.seq == 1


# ---------------------------------------------------------------------- the decision


def test_decide_threshold():
    assert decide(300, 290, 0, 10) is Decision.LOCAL
    assert decide(300, 289, 0, 10) is Decision.REMOTE
    assert decide(300, 300, 0, 0) is Decision.LOCAL  # a full hit needs no prefill leg
    assert decide(8, 0, 0, 256) is Decision.LOCAL  # a short prompt is cheaper locally
    # decode holds no more than prefill: the prefill leg does the same work without
    # stalling decode's streams, unless decode lacks at most LOCAL_ALWAYS_TOKENS (16)
    assert decide(128, 0, 0, 128) is Decision.REMOTE  # a fresh prompt
    assert decide(1024, 992, 992, 128) is Decision.REMOTE  # a prefix both hold...
    assert decide(1024, 992, 992, 128) is decide(1024, 992, 1000, 128)
    assert decide(1008, 992, 992, 128) is Decision.LOCAL  # ...lacking <= 16: local
    assert decide(600, 512, 160, 128) is Decision.LOCAL  # a conversation's decode
    assert decide(128, 0, None, 128) is Decision.LOCAL  # no prefill instance to ask
    assert decide(129, 0, None, 128) is Decision.REMOTE


def _two_decode_pool() -> tuple[Pool, Any, Any]:
    """A cache-aware push pool of one prefill and two healthy decodes (no I/O)."""
    cfg = RouterConfig(mode="push", prefill=(parse_instance("127.0.0.1:1"),),
                       decode=tuple(parse_instance(f"127.0.0.1:{p}") for p in (2, 3)),
                       policy="cache-aware")
    pool = Pool(cfg)
    d1, d2 = pool.by_role["decode"]
    d1.healthy = d2.healthy = True
    return pool, d1, d2


def test_choice_longest_prefix_weighed_against_load():
    pool, d1, d2 = _two_decode_pool()
    cached = {d1: 0, d2: 200}

    def f(inst: Any) -> float:
        return cost(300, cached[inst], inst.in_flight, 64)

    assert pool.choose("decode", cost=f) is d2  # the longer prefix
    d2.in_flight = 3  # 100 + 192 < 300 + 0: still d2
    assert pool.choose("decode", cost=f) is d2
    d2.in_flight = 5  # 100 + 320 > 300: the idle one
    assert pool.choose("decode", cost=f) is d1
    cached[d2] = 0
    d2.in_flight = 0  # equal costs: round-robin order
    assert pool.pick("decode", cost=f) is d1
    assert pool.pick("decode", cost=lambda i: 0.0) is d2


def test_kv_tokens_in_flight_spread_the_load():
    """A decode that holds 200 of a 300-token prompt but carries a conversation's
    stream (400 KV tokens in flight) costs more than an idle one at weight 1: the old
    cost (64 a leg) kept it on the busy decode."""
    pool, d1, d2 = _two_decode_pool()
    cached = {d1: 0, d2: 200}
    d2.in_flight, d2.tokens_in_flight = 1, 400

    def f(weight: float) -> Any:
        return lambda i: cost(300, cached[i], i.in_flight, 64, i.tokens_in_flight, weight)

    assert pool.choose("decode", cost=f(0.0)) is d2  # 100 + 64 < 300
    assert pool.choose("decode", cost=f(1.0)) is d1  # 100 + 64 + 400 > 300


def test_decode_legs_charge_and_release_their_tokens():
    pool, d1, d2 = _two_decode_pool()
    placement = Placement(pool)  # the charge only (no KV index: nothing cached)
    job = RequestRecord(rid="r", kind="completion", arrival=0.0)
    job.route = Route(list(range(40)), answer_tokens=24)  # (as Placement.route makes it)
    assert placement.pick_decode(job, {d2}) is d1
    assert d1.tokens_in_flight == 64
    assert placement.pick_decode(job, {d1}) is d2  # sent again elsewhere: the charge moves
    assert (d1.tokens_in_flight, d2.tokens_in_flight) == (0, 64)
    placement.release_decode(job)
    placement.release_decode(job)  # idempotent
    assert (d1.tokens_in_flight, d2.tokens_in_flight) == (0, 0)
    assert d1.in_flight == d2.in_flight == 0


def test_an_instance_without_room_comes_after_those_with_room():
    assert not lacks_room(52, 13, 4) and lacks_room(53, 13, 4)  # every block, cached too
    pool, d1, d2 = _two_decode_pool()
    d1.info = d2.info = make_kv_info(block_size=4)
    free = {d1: 2, d2: 40}  # as their cores' latest snapshots say

    def gauges(inst: Any) -> EngineStats | None:
        return EngineStats(0, 0, free[inst], 64, 0, 0, 0) if inst in free else None

    pool.core_stats = gauges
    policy = Placement(pool)
    cached = {d1: 40, d2: 0}
    policy.cached_tokens = lambda i, _r: cached[i]  # type: ignore[method-assign]
    job = RequestRecord(rid="r", kind="completion", arrival=0.0)
    route = job.route = Route(list(range(52)))  # 13 blocks
    f = policy.cost(job)
    assert pool.choose("decode", cost=f) is d2  # d1 holds the prefix but has no room
    free[d2] = 12  # both full: the cache decides
    assert pool.choose("decode", cost=f) is d1
    free[d2] = 13
    assert pool.choose("decode", cost=f) is d2
    del free[d1]  # no snapshot from its core (yet): room assumed, d1's cache wins
    assert not policy.no_room(d1, route)
    assert pool.choose("decode", cost=f) is d1
    d1.info, free[d1] = None, 0  # no /kv/info (vLLM): room assumed
    assert not policy.no_room(d1, route)


def test_route_chain_matches_the_instances_hashes():
    r = Route(list(range(10)))
    assert r.chain(4) == hash_prefix_blocks(list(range(10)), 4)
    assert r.cached_tokens(3, 4) == 10  # capped at the prompt


# ---------------------------------------------------------------------- a fake publisher


class FakePublisher:
    """An instance's KV event side: a PUB socket and the cache it describes."""

    def __init__(self, engine_id: str = "e1") -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.engine_id, self.seq, self.cached = engine_id, 0, set()
        self.snapshots = 0
        self.lock = threading.Lock()

    def publish(self, *events: Any, send: bool = True) -> None:
        """Apply ``events`` to the cache and publish them (``send=False``: the batch is
        lost on the way, as a slow subscriber's are)."""
        with self.lock:
            self.seq += 1
            for ev in events:
                if isinstance(ev, BlockStored):
                    self.cached.update(ev.hashes)
                elif isinstance(ev, BlockRemoved):
                    self.cached.difference_update(ev.hashes)
                else:
                    self.cached.clear()
            if send:
                self.sock.send_multipart(
                    [TOPIC, encode_batch(KVEventBatch(self.engine_id, self.seq, list(events)))])

    def snapshot_json(self) -> dict[str, Any]:
        with self.lock:
            self.snapshots += 1
            return {"engine_id": self.engine_id, "seq": self.seq, "block_size": BS,
                    "hashes": sorted(h.hex() for h in self.cached)}

    def restart(self, engine_id: str) -> None:
        with self.lock:
            self.engine_id, self.seq, self.cached = engine_id, 0, set()

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def test_kv_index_follows_a_publisher_through_gap_and_restart():
    pub = FakePublisher()

    async def main() -> None:
        async def fetch(url: str) -> CacheBlocks:
            return msgspec.convert(pub.snapshot_json(), CacheBlocks)

        kv = KVIndex(fetch, retry_s=0.05)
        key = object()
        info = make_kv_info(engine_id="e1",
                            kv_events={"endpoint": pub.endpoint, "block_size": BS})
        try:
            pub.publish(BlockStored([H(1)]))  # before the subscriber: the snapshot has it
            kv.update(key, "fake", info)

            async def until(cond: Callable[[], bool], what: str) -> None:
                deadline = time.monotonic() + 10
                while not cond():
                    assert time.monotonic() < deadline, what
                    pub.publish()  # empty batches: the slow joiner catches up by them
                    await asyncio.sleep(0.02)

            idx = kv.index(key)
            assert idx is not None
            await until(lambda: idx.synced and idx.seq == pub.seq, "synced")
            assert idx.hashes == {H(1)}
            pub.publish(BlockStored([H(2), H(3)]))
            await until(lambda: idx.hashes == {H(1), H(2), H(3)}, "stored")
            # a lost batch: the next one shows the gap, a snapshot repairs it
            gaps, snaps = idx.gaps, pub.snapshots
            pub.publish(BlockStored([H(4)]), BlockRemoved([H(1)]), send=False)
            pub.publish(BlockStored([H(5)]))
            await until(lambda: idx.synced and idx.hashes == {H(2), H(3), H(4), H(5)},
                        "repaired")
            assert idx.gaps > gaps and pub.snapshots > snaps
            assert idx.longest_prefix([H(1), H(2)]) == 0  # evicted: the index shrank
            # a restart: /kv/info shows a new engine id, the old index goes
            pub.restart("e2")
            kv.update(key, "fake", msgspec.structs.replace(info, engine_id="e2"))
            idx2 = kv.index(key)
            assert idx2 is not None and idx2 is not idx and idx2.hashes == set()
            pub.publish(BlockStored([H(7)]))
            await until(lambda: idx2.synced and idx2.hashes == {H(7)}, "after restart")
            kv.update(key, "fake", make_kv_info(engine_id="e2"))
            assert kv.index(key) is None  # prefix caching off: no index
        finally:
            await kv.close()

    try:
        asyncio.run(main())
    finally:
        pub.close()


# ---------------------------------------------------------------------- end to end


class FakeInstance:
    """A kvpush-like instance: /health, /kv/info (with kv_events and a plain request
    plane, tests/fake_plane.py), /v1/models, /kv/cache_blocks; its plane records what
    each leg carried (``bodies``: the prompt's ids and the leg's kv_transfer_params) and
    answers it with one token."""

    def __init__(self, role: str, engine_id: str, model_root: str) -> None:
        import uvicorn

        from fake_plane import FakePlane

        self.role, self.engine_id, self.root = role, engine_id, model_root
        self.pub = FakePublisher(engine_id)
        self.bodies: list[dict[str, Any]] = []
        self.refuse_local = False
        #: refuse every leg 503 "unavailable" (a dead step loop or transfer thread)
        self.cannot_serve = False
        #: answer /v1/models 503 (an instance not ready to name its model)
        self.models_fail = False
        self.plane = FakePlane(self._answer)
        app = stand_in(lambda: push_kv_info(  # the publisher's identity changes at a restart
            role, self.pub.engine_id, 9, block_size=BS, num_free_blocks=10,
            num_total_blocks=10, max_model_len=128, model="tiny", vocab_size=VOCAB,
            request_plane=self.plane.address, request_plane_members=False,
            kv_events={"endpoint": self.pub.endpoint, "block_size": BS}))

        @app.get("/kv/cache_blocks")
        async def cache_blocks() -> Any:
            return self.pub.snapshot_json()

        @app.get("/v1/models")
        async def models() -> Any:
            if self.models_fail:
                return JSONResponse({"error": {"message": "not ready"}}, status_code=503)
            return {"object": "list", "data": [{"id": "tiny", "root": self.root,
                                                "max_model_len": 128}]}

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                                    access_log=False))
        self.thread = threading.Thread(target=self.server.run,
                                       kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, 10, f"{engine_id} started")

    def _answer(self, cmd: SubmitRequest) -> list[int] | RequestFailure:
        body: dict[str, Any] = {"prompt": list(cmd.prompt_token_ids)}
        if cmd.kv_transfer_params is not None:
            body["kv_transfer_params"] = cmd.kv_transfer_params.wire()
        self.bodies.append(body)
        if self.cannot_serve:
            return RequestFailure("this instance cannot serve requests: the KV transfer "
                                  "thread died", True, None, "unavailable", 503)
        if self.refuse_local and cmd.kv_transfer_params is None:
            # what a full kvpush decode refuses a request with (server/admission.py)
            return RequestFailure("full", True, None, "queue_full", 429)
        return [7]

    def cache_prompt(self, ids: list[int]) -> None:
        """Cache (and announce) the full blocks of ``ids``, as an instance that has
        just computed them."""
        self.pub.publish(BlockStored(hash_prefix_blocks(ids, BS)))

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()
        self.pub.close()
        self.plane.close()


@pytest.fixture
def cluster(tiny_llama):
    from router_helpers import RouterThread

    p = FakeInstance("prefill", "prefill-1", str(tiny_llama))
    d1 = FakeInstance("decode", "decode-1", str(tiny_llama))
    d2 = FakeInstance("decode", "decode-2", str(tiny_llama))
    router = None
    try:
        router = RouterThread("push", [p.url], [d1.url, d2.url], kv_secret=None,
                              policy="cache-aware", local_prefill_max_tokens=8,
                              load_cost_tokens=4)
        yield router, p, d1, d2
    finally:
        if router is not None:
            router.stop()
        for i in (p, d1, d2):
            i.stop()


def _prefill_legs(p: FakeInstance, n: int) -> None:
    """Prefill has received ``n`` legs: in push the router answers with decode's answer
    while prefill's leg may still be on its way, so wait for it (bounded)."""
    wait_until(lambda: len(p.bodies) >= n, 10, f"{n} prefill legs")
    assert len(p.bodies) == n, len(p.bodies)


def _index_of(router: Any, inst: FakeInstance) -> dict | None:
    for i in router.instances():
        if i["url"] == inst.url:
            return i.get("kv_index")
    return None


def _synced(router: Any, inst: FakeInstance) -> bool:
    """The router's index of ``inst`` holds everything it published (publishing empty
    batches until then: a fresh subscriber misses what came before it joined)."""
    st = _index_of(router, inst)
    if st is not None and st["synced"] and st["seq"] == inst.pub.seq:
        return True
    inst.pub.publish()
    return False


def test_router_sends_a_cached_prompt_to_its_decode_alone(cluster, tiny_llama, caplog):
    router, p, d1, d2 = cluster
    tok = router.router.tokenizer
    wait_until(lambda: tok.ready, 30, "tokenizer loaded from /v1/models")
    from kvpush.models.tokenizer import load_tokenizer

    tok = load_tokenizer(str(tiny_llama))
    prompt = "The capital of France is Paris. " * 6
    ids = list(tok.encode(prompt))
    assert len(ids) > 3 * 8
    caplog.set_level(logging.INFO, logger="kvpush.router.requests")
    with httpx.Client(timeout=30) as c:
        # turn 1: nothing cached anywhere -> a prefill leg, and ids on both legs
        r = c.post(router.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4})
        assert r.status_code == 200, r.text
        _prefill_legs(p, 1)
        assert p.bodies[0]["prompt"] == ids
        first = d1 if d1.bodies else d2
        other = d2 if first is d1 else d1
        assert first.bodies[-1]["kv_transfer_params"]["do_remote_prefill"] is True
        # the decode that answered now holds the prompt (and says so)
        other.cache_prompt(ids[:4])  # the other one holds a little of it
        first.cache_prompt(ids)
        wait_until(lambda: _synced(router, first) and _synced(router, other), 10, "synced")
        # turn 2: the prompt plus a few tokens: decode alone, no prefill leg
        r = c.post(router.url + "/v1/completions",
                   json={"prompt": ids + [5, 6, 7], "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert len(p.bodies) == 1
        assert "kv_transfer_params" not in first.bodies[-1]
        assert first.bodies[-1]["prompt"] == ids + [5, 6, 7]
        # a long new prompt: remote again, to the decode with the longest prefix
        long_ids = ids + list(range(10, 60))
        r = c.post(router.url + "/v1/completions", json={"prompt": long_ids})
        assert r.status_code == 200
        _prefill_legs(p, 2)
        assert first.bodies[-1]["kv_transfer_params"]
    m = router.metrics()
    assert metric_value(m, "kvpush_router_route_decisions_total", 'decision="local"') == 1
    assert metric_value(m, "kvpush_router_route_decisions_total", 'decision="remote"') == 2
    assert metric_value(m, "kvpush_router_requests_total", 'mode="local",outcome="ok"') == 1
    assert metric_value(m, "kvpush_router_cached_prompt_tokens_count", 'role="decode"') == 3
    lines = [r.getMessage() for r in caplog.records if r.name == "kvpush.router.requests"]
    assert any("decision=local" in ln and f"d_cached={len(ids) // BS * BS}" in ln
               for ln in lines), lines
    # every decode leg's tokens left the load with it
    assert all(i["tokens_in_flight"] == 0 for i in router.instances())


def test_router_faults_restart_gap_and_full_decode(cluster, tiny_llama):
    router, p, d1, d2 = cluster
    tok = router.router.tokenizer
    wait_until(lambda: tok.ready, 30, "tokenizer loaded")
    ids = list(range(3, 40))
    with httpx.Client(timeout=30) as c:
        def send() -> httpx.Response:
            r = c.post(router.url + "/v1/completions", json={"prompt": ids, "max_tokens": 2})
            assert r.status_code == 200, r.text
            return r

        d1.cache_prompt(ids)
        wait_until(lambda: _synced(router, d1) and _synced(router, d2), 10, "synced")
        send()
        assert "kv_transfer_params" not in d1.bodies[-1] and not p.bodies  # local
        # events lost: d1 evicts everything, the batch never arrives; the next batch
        # shows the gap and the snapshot brings the index back to the truth
        d1.pub.publish(AllBlocksCleared(), send=False)
        wait_until(lambda: _synced(router, d1), 10, "resynced after the gap")
        assert _index_of(router, d1)["blocks"] == 0 and _index_of(router, d1)["gaps"] >= 1
        send()
        _prefill_legs(p, 1)  # nothing cached anywhere now: a prefill leg
        # a decode that cannot take it locally (429: full): sent again with a prefill leg, to
        # the other decode (the one that refused would likely refuse that leg too)
        d2.cache_prompt(ids)
        wait_until(lambda: _synced(router, d2), 10, "d2 synced")
        d2.refuse_local = True
        n1, n2 = len(d1.bodies), len(d2.bodies)
        send()
        _prefill_legs(p, 2)
        assert len(d2.bodies) == n2 + 1 and "kv_transfer_params" not in d2.bodies[-1]
        assert len(d1.bodies) == n1 + 1 and d1.bodies[-1]["kv_transfer_params"]
        # d2 restarts: a new engine id, an empty cache; the router drops its index
        d2.refuse_local = False
        d2.pub.restart("decode-2b")
        wait_until(lambda: (_index_of(router, d2) or {}).get("engine_id") == "decode-2b",
                   10, "restart seen")
        wait_until(lambda: _synced(router, d2), 10, "d2 synced again")
        assert _index_of(router, d2)["blocks"] == 0
        send()
        _prefill_legs(p, 3)  # no decode holds the prompt: remote


def test_a_route_carries_the_answer_bound_its_decode_leg_is_charged():
    """Placement.route gives a cache-aware request's route its prompt, its cache salt and
    its answer bound (the front's max_tokens: max_completion_tokens, max_tokens, else
    what the context leaves): prompt + bound is what a decode leg is charged. Without
    the cache-aware policy a request has no route."""
    from kvpush.sampling_params import SamplingParams

    cfg = RouterConfig(mode="push", prefill=(parse_instance("http://127.0.0.1:9"),),
                       decode=(parse_instance("http://127.0.0.1:1"),))
    placement = Placement(Pool(cfg))
    job = RequestRecord(rid="r", kind="completion", arrival=0.0)
    placement.route(job, list(range(10)), SamplingParams(max_tokens=7))
    assert job.route is None
    placement = Placement(Pool(dataclasses.replace(cfg, policy="cache-aware")))
    placement.route(job, list(range(10)), SamplingParams(max_tokens=7, cache_salt="t"))
    assert job.route is not None
    assert (job.route.token_ids, job.route.answer_tokens, job.route.cache_salt) == (
        list(range(10)), 7, "t")
