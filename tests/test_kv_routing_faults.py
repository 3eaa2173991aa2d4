"""Cache-aware routing's faults (issue 31, point 5) with real `kvpush serve` processes
behind an in-process router (tests/test_kv_routing.py has them over fake instances):

* a decode whose KV blocks are all held (push legs waiting for their KV pin them) while
  it caches the prompt: the router passes it over for the decode with room;
* a decode that refuses the local leg (429: its waiting-request bound): the request goes
  again with a prefill leg, to the other decode;
* a batch of KV events lost on the router's SUB socket: the next batch shows the gap,
  the snapshot repairs the index;
* the prefix cache evicting a prompt: the router's index shrinks with it;
* a decode killed and restarted (new engine id, empty cache): its index is dropped.

Every request ends with the greedy text of a colocated instance, and every instance's
free-block count returns to its start. Block size 4, 40 blocks per decode: small enough
to fill and evict with a few short prompts. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

import server_helpers
from kvpush.crypto.auth import ParamsSigner
from kvpush.kv_cache.block_pool import hash_prefix_blocks
from kvpush.router.kv_index import BatchResult, InstanceIndex
from router_helpers import Instance, RouterThread, metric_value, start_instances, wait_until

pytestmark = pytest.mark.timeout(180)

BS = 4
D_BLOCKS = 40
MAX_LEN = 128
D1_MAX_WAITING = 3  # D1 answers 429 past 3 requests waiting for their first token
LOCAL_MAX = 16  # --local-prefill-max-tokens: a 4-token turn is local, a fresh prompt not
COMMON = ("--block-size", str(BS), "--max-model-len", str(MAX_LEN))
PUSH = ("--kv-transfer", "push", "--lease-timeout", "20", *COMMON)


@dataclass
class Cluster:
    ref: Instance  # role both: the reference answers
    p: Instance
    d1: Instance
    d2: Instance

    def all(self) -> list[Instance]:
        return [self.ref, self.p, self.d1, self.d2]


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory) -> Iterator[Cluster]:
    log_dir = tmp_path_factory.mktemp("kv-routing-faults")
    dec = ("--role", "decode", *PUSH, "--num-blocks", str(D_BLOCKS))
    insts = start_instances(tiny_llama, [
        ("ref", (*COMMON, "--num-blocks", "256")),
        ("P", ("--role", "prefill", *PUSH, "--num-blocks", "256")),
        ("D1", (*dec, "--max-waiting-requests", str(D1_MAX_WAITING))), ("D2", dec)],
        log_dir)
    c = Cluster(*insts)
    yield c
    for inst in c.all():
        inst.stop()


@pytest.fixture
def router(cluster) -> Iterator[RouterThread]:
    r = RouterThread("push", [cluster.p.url], [cluster.d1.url, cluster.d2.url],
                     policy="cache-aware", local_prefill_max_tokens=LOCAL_MAX,
                     load_cost_tokens=4)
    try:
        wait_until(lambda: r.router.tokenizer.ready, 30, "tokenizer loaded")
        for d in (cluster.d1, cluster.d2):
            wait_until(lambda d=d: _index(r, d).synced, 10, f"{d.name}'s index synced")
        yield r
    finally:
        r.stop()
    for inst in cluster.all():  # every fault ends with every block back in the pool
        inst.wait_all_free()


# ---------------------------------------------------------------------- helpers


def _pool_inst(router: RouterThread, inst: Instance) -> Any:
    return next(i for i in router.router.pool.instances if i.url == inst.url)


def _free_blocks(router: RouterThread, inst: Instance) -> int | None:
    """The free blocks of ``inst`` as the router sees them: its core's latest snapshot,
    over the router's link to it."""
    stats = router.router.pool.core_stats(_pool_inst(router, inst))
    return stats.num_free_blocks if stats is not None else None


def _index(router: RouterThread, inst: Instance) -> InstanceIndex:
    idx = router.router.placement.index.index(_pool_inst(router, inst))
    assert idx is not None, f"no KV index for {inst.name}"
    return idx


def _cached_blocks(router: RouterThread, inst: Instance, ids: list[int]) -> int:
    """Leading full blocks of ``ids`` the router believes ``inst`` caches (the router's
    own lookup: the instances' events are keyed with the cluster secret, issue 40)."""
    _index(router, inst)
    return router.router.placement.index.longest_prefix(_pool_inst(router, inst),
                                                    lambda bs: hash_prefix_blocks(ids, bs))


def _decisions(router: RouterThread, decision: str) -> float:
    return metric_value(router.metrics(), "kvpush_router_route_decisions_total",
                        f'decision="{decision}"')


def _requests(router: RouterThread, inst: Instance) -> int:
    return _pool_inst(router, inst).requests


def _complete(url: str, ids: list[int], max_tokens: int = 6) -> str:
    r = httpx.post(url + "/v1/completions", timeout=60,
                   json={"prompt": ids, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _check(router: RouterThread, c: Cluster, ids: list[int]) -> None:
    """``ids`` through the router: the colocated instance's greedy text."""
    assert _complete(router.url, ids) == _complete(c.ref.url, ids)


def _synced_with(router: RouterThread, inst: Instance) -> bool:
    """The router's index of ``inst`` is its /kv/cache_blocks (same engine, same seq)."""
    snap = inst.get("/kv/cache_blocks")
    idx = _index(router, inst)
    return (idx.synced and idx.engine_id == snap["engine_id"] and idx.seq == snap["seq"]
            and idx.hashes == {bytes.fromhex(h) for h in snap["hashes"]})


def _hold(d: Instance, p: Instance, prompt: list[int]) -> socket.socket:
    """A push decode leg for ``prompt`` sent straight to ``d``, signed as the router
    signs it, whose prefill leg never comes: ``d`` allocates the prompt's blocks and
    holds them while it waits for the KV (until its lease). Closing the returned socket
    is the client going away: ``d`` aborts the request and frees its blocks."""
    pi, di = p.get("/kv/info"), d.get("/kv/info")
    tid = uuid.uuid4().hex
    kv = {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": tid,
          "remote_engine_id": pi["engine_id"], "remote_host": pi["side_channel_host"],
          "remote_port": pi["side_channel_port"], "remote_request_id": tid}
    # the secret the instances got (server_helpers: the session's, unless set outside)
    secret = os.environ.get("KVPUSH_KV_SECRET", server_helpers.TEST_KV_SECRET)
    signed = ParamsSigner(secret.encode()).sign(kv, role="decode", engine_id=di["engine_id"],
                                                 peer_engine_id=pi["engine_id"])
    body = json.dumps({"prompt": prompt, "max_tokens": 4, "stream": True,
                       "kv_transfer_params": signed}).encode()
    s = socket.create_connection(("127.0.0.1", d.port), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
              b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
              + body)
    return s


def _prompt(start: int, n: int = 40) -> list[int]:
    """``n`` token ids no other test of the module sends (distinct ``start``s)."""
    return [3 + (start + i) % 1000 for i in range(n)]


# ---------------------------------------------------------------------- the faults


def test_full_decode_is_passed_over_for_one_with_room(cluster, router):
    """D1 caches the prompt's prefix, but push legs waiting for their KV hold all but 2
    of its blocks (and pin the prefix), sent to D1's own API, not through the router. A
    real decode queues a request it has no blocks for until running requests end; the
    router, seeing D1's free blocks in the snapshots its core link brings, sends the
    request to D2 with a prefill leg instead, and it is answered while D1 is still full.
    Once D1 has room again, the next turn is local to D1."""
    c = cluster
    prefix = _prompt(0)
    _complete(c.d1.url, prefix, max_tokens=1)  # D1 caches the prefix (10 blocks)
    wait_until(lambda: _cached_blocks(router, c.d1, prefix) == 10, 10, "D1 holds it")
    assert _cached_blocks(router, c.d2, prefix) == 0
    # two legs of prefix + 56 tokens: 10 shared + 2 x 14 blocks = 38 of 40 held
    holds = [_hold(c.d1, c.p, prefix + _prompt(100 + 60 * k, 56)) for k in range(2)]
    try:
        wait_until(lambda: c.d1.get("/kv/info")["num_free_blocks"] == 2, 10, "D1 full")
        wait_until(lambda: _free_blocks(router, c.d1) == 2, 10,
                   "the router's core link saw D1 full")
        turn = prefix + _prompt(300, 12)  # 13 blocks: 3 more than the prefix, 2 free
        d1_before, d2_before = _requests(router, c.d1), _requests(router, c.d2)
        _check(router, c, turn)  # answered while the holds stand
        assert _requests(router, c.d1) == d1_before
        assert _requests(router, c.d2) == d2_before + 1
        assert _decisions(router, "remote") == 1 and _decisions(router, "local") == 0
        assert c.d1.get("/kv/info")["num_free_blocks"] == 2  # still full
    finally:
        for s in holds:
            s.close()
    c.d1.wait_all_free()
    wait_until(lambda: _free_blocks(router, c.d1) == D_BLOCKS, 10,
               "the router saw D1 free again")
    # D1 has room and still caches the prefix: the next turn is local to it
    d1_before = _requests(router, c.d1)
    _check(router, c, prefix + _prompt(400, 4))
    assert _requests(router, c.d1) == d1_before + 1 and _decisions(router, "local") == 1


def test_lost_event_batch_is_repaired_by_a_snapshot(cluster, router):
    """The router's SUB socket misses one batch of D1's (a real publisher; the batch is
    dropped where the router receives it, as a slow subscriber's are): the router does
    not know D1 caches the prompt, until D1's next batch shows the gap in seq and the
    snapshot brings the index back to D1's cache. The next turn is then local to D1."""
    c = cluster
    idx = _index(router, c.d1)
    dropped: list[int] = []
    receive = idx.on_batch

    def lossy(batch: Any) -> BatchResult:
        if not dropped and batch.events:
            dropped.append(batch.seq)
            return BatchResult.DUPLICATE  # never seen
        return receive(batch)

    idx.on_batch = lossy  # type: ignore[method-assign]
    def snapshots() -> int:
        return router.router.placement.index.state(_pool_inst(router, c.d1))["snapshots"]

    gaps, snaps = idx.gaps, snapshots()
    ids = _prompt(500)
    _complete(c.d1.url, ids, max_tokens=1)
    wait_until(lambda: bool(dropped), 10, "D1's batch reached the router")
    assert _cached_blocks(router, c.d1, ids) == 0  # lost on the way
    _complete(c.d1.url, _prompt(600), max_tokens=1)  # the next batch: a gap
    wait_until(lambda: _synced_with(router, c.d1), 10, "index repaired from the snapshot")
    assert idx.gaps == gaps + 1
    assert snapshots() > snaps
    assert _cached_blocks(router, c.d1, ids) == 10
    d1_before = _requests(router, c.d1)
    _check(router, c, ids + _prompt(700, 4))
    assert _requests(router, c.d1) == d1_before + 1 and _decisions(router, "local") == 1


def test_eviction_shrinks_the_routers_index(cluster, router):
    """D2 caches a prompt (its next turn goes to D2 alone); longer prompts then fill
    D2's 40 blocks and its prefix cache evicts the prompt: the router's index loses it
    (and matches D2's cache), so the next turn is no longer local."""
    c = cluster
    ids = _prompt(800)
    _complete(c.d2.url, ids, max_tokens=1)
    wait_until(lambda: _cached_blocks(router, c.d2, ids) == 10, 10, "D2 holds it")
    _check(router, c, ids + _prompt(850, 4))
    assert _decisions(router, "local") == 1
    for k in range(3):  # 3 x 25 blocks through a 40-block cache, one after the other
        _complete(c.d2.url, [1000 + k] * 100, max_tokens=1)
    wait_until(lambda: _synced_with(router, c.d2), 10, "index follows D2's evictions")
    idx = _index(router, c.d2)
    assert _cached_blocks(router, c.d2, ids) == 0
    assert len(idx.hashes) <= D_BLOCKS
    _check(router, c, ids + _prompt(850, 4))  # the same turn again: remote now
    assert _decisions(router, "remote") == 1 and _decisions(router, "local") == 1


def test_restarted_decode_index_is_dropped(cluster, router):
    """D1 caches a prompt, then is SIGKILLed and started again on its port: a new engine
    id with an empty cache. The router drops D1's index (it follows the new engine from
    a fresh snapshot), so the next turn is not sent to D1 alone, and it is answered
    right."""
    c = cluster
    ids = _prompt(200)
    _complete(c.d1.url, ids, max_tokens=1)
    wait_until(lambda: _cached_blocks(router, c.d1, ids) == 10, 10, "D1 holds it")
    old = _index(router, c.d1).engine_id
    c.d1.kill()
    c.d1.restart()
    new = c.d1.get("/kv/info")["engine_id"]
    assert new != old
    wait_until(lambda: _pool_inst(router, c.d1).healthy
               and _index(router, c.d1).engine_id == new and _synced_with(router, c.d1),
               20, "the router follows D1's new engine")
    assert _cached_blocks(router, c.d1, ids) == 0 and not _index(router, c.d1).hashes
    _check(router, c, ids + _prompt(250, 4))
    assert _decisions(router, "remote") == 1 and _decisions(router, "local") == 0
