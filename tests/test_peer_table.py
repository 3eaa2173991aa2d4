"""The transfer thread's peer table (transfer_thread/peers.py): bounded whatever addresses
requests name, refusals matched to their sender and expiring, connection errors
reported at once, dropped sends counted in /metrics, idle peers evicted and met again.

Real side channels on 127.0.0.1 (free ports), the in-process transport for engines;
every wait is bounded in time, every instance stopped, free blocks checked."""

from __future__ import annotations

import os
import queue
import time
import uuid

from engine_helpers import greedy, make_engine, random_prompts, run_to_completion
from kvpush.cluster.launcher import free_port
from kvpush.config import EngineConfig, KVTransferConfig
from kvpush.engine.llm_engine import LLMEngine
from kvpush.engine.outputs import FinishReason
from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.transfer_thread.peers import MAX_PEERS
from kvpush.kv_transfer.transfer_thread.worker import TransferWorker
from kvpush.kv_transfer.wire import messages as m
from kvpush.kv_transfer.wire.side_channel import SideChannel
from kvpush.server.metrics import ServerMetrics
from pd_helpers import PDDriver, make_instance
from router_helpers import metric_value
from test_worker_fences import FakeChannel, FakeTransport, hello

HOST = "127.0.0.1"
D, P, X = "10.0.0.2:5700", "10.0.0.1:5600", "10.0.0.3:5601"
LEASE = 2.0


class PeerTransport(FakeTransport):
    """FakeTransport that also adds and removes peers (by their metadata)."""

    def __init__(self) -> None:
        super().__init__()
        self.removed: list[str] = []

    def add_peer(self, metadata: bytes) -> str:
        return metadata.decode() or "agent"

    def remove_peer(self, peer: str) -> None:
        self.removed.append(peer)


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def closed_ports(n: int) -> list[int]:
    """``n`` distinct ports on 127.0.0.1 that nothing listens on (bounded tries)."""
    ports: set[int] = set()
    for _ in range(20 * n):
        ports.add(free_port(HOST))
        if len(ports) == n:
            return sorted(ports)
    raise AssertionError(f"found only {len(ports)} free ports")


def wait_for(cond, timeout: float, what: str, step=None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        if step is None or not step():
            time.sleep(0.01)


def assert_clean(*engines: LLMEngine) -> None:
    for eng in engines:
        s = eng.stats()
        assert s.num_free_blocks == s.num_total_blocks


# ---- finding 3: the table is bounded -------------------------------------------------
def test_many_bogus_peer_addresses_are_capped_and_their_sockets_closed():
    """Issue 30, finding 3: every address a request named kept a DEALER and its monitor
    (3 fds) for ever. Now at most MAX_PEERS are open at once; an address beyond the cap
    is refused at once with the reason; a handshake nobody answers is given up after
    the lease and its sockets closed, so the fd count returns to its start."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    ch = SideChannel(HOST, 0)
    w = TransferWorker(hello("decode", ch.address), ch, PeerTransport(), events.put,
                       0.6, 0.1)
    w.receives.on_notice = events.put  # the table's notices, as the worker routes them
    n = MAX_PEERS + 40
    addresses = [f"{HOST}:{port}" for port in closed_ports(n)]
    fd0 = fd_count()
    peak: list[tuple[int, int]] = []
    w.start()
    try:
        for address in addresses:
            w.submit(c.Call(lambda a=address: w.peers.ensure(a)))
        w.submit(c.Call(lambda: peak.append((len(w.peers), fd_count()))))
        refused: dict[str, str] = {}
        deadline = time.monotonic() + 8
        while len(refused) < n:
            ev = events.get(timeout=max(0.01, deadline - time.monotonic()))
            if isinstance(ev, c.PeerRefused):
                refused[ev.address] = ev.reason
        [(open_peers, fds)] = peak
        assert open_peers == MAX_PEERS
        assert fds - fd0 <= 4 * MAX_PEERS + 16  # 3 ZMQ sockets (+ a TCP attempt) each
        capped = [a for a, why in refused.items() if "peers (the limit)" in why]
        unanswered = [a for a, why in refused.items()
                      if "no answer to the side-channel handshake" in why]
        assert capped == addresses[MAX_PEERS:]  # the requests beyond the cap, at once
        assert sorted(unanswered) == sorted(addresses[:MAX_PEERS])
        wait_for(lambda: fd_count() <= fd0 + 4, 10, f"fds back near {fd0}: {fd_count()}")
        assert len(w.peers) == 0 and ch.num_destinations == 0
        assert not ch._links.links  # nothing remembered of links that never came up
        assert w.counters["side_channel_peers_evicted_handshake_timeout"] == MAX_PEERS
    finally:
        w.stop()
    assert fd_count() <= fd0 + 4


def test_idle_peers_are_evicted_and_met_again(tiny_qwen3):
    """A ready peer that no transfer uses is evicted once idle (sockets closed); the next
    request handshakes again. When only prefill evicted decode, decode's
    registration waits on prefill for the new handshake instead of being refused."""
    p = make_instance(tiny_qwen3, "prefill", "push", lease=2.0)
    d = make_instance(tiny_qwen3, "decode", "push", lease=2.0)
    drv = PDDriver(p, d)
    prompts = random_prompts([40, 60, 50], seed=31)
    ref = run_to_completion(make_engine(tiny_qwen3), {f"r{i}": q for i, q in
                                                      enumerate(prompts)}, greedy(4))
    try:
        drv.submit("r0", prompts[0], greedy(4))
        drv.run(timeout=20)
        drv.settle()
        assert p.connector.worker.peers.is_ready(d.connector.address)
        # both evict (the step loops keep no peers: the transfer threads' tables)
        for eng in (p, d):
            eng.connector.worker.peers.idle_timeout_s = 0.2
        wait_for(lambda: not p.connector.worker.peers.is_ready(d.connector.address)
                 and not d.connector.worker.peers.is_ready(p.connector.address), 10,
                 "both peers evicted", step=drv.pump)
        assert len(p.connector.worker.peers) == len(d.connector.worker.peers) == 0
        drv.submit("r1", prompts[1], greedy(4))
        drv.run(timeout=20)
        drv.settle()
        # only prefill evicts: decode registers at once over its old handshake
        d.connector.worker.peers.idle_timeout_s = 1e9
        wait_for(lambda: not p.connector.worker.peers.is_ready(d.connector.address), 10,
                 "prefill evicts decode", step=drv.pump)
        assert d.connector.worker.peers.is_ready(p.connector.address)
        drv.submit("r2", prompts[2], greedy(4))
        drv.run(timeout=20)
        for i in range(3):
            leg = drv.d_legs[f"r{i}"]
            assert leg.finish_reason is FinishReason.LENGTH, leg
            assert leg.tokens == ref[f"r{i}"]
        drv.settle()
        assert p.connector.stats()["worker_side_channel_peers_evicted_idle"] >= 2
        assert d.connector.stats()["worker_side_channel_peers_evicted_idle"] >= 1
        assert_clean(p, d)
    finally:
        drv.close()


def test_failed_connect_fails_the_request_at_once(tiny_qwen3):
    """Issue 30, finding 3: when the side channel could not open a connection, the ZMQ
    error was swallowed and the request failed only at its lease. ``-bogus`` passes
    kv_transfer_params' host check but ZMQ refuses it (EINVAL), like a process out of
    sockets: the request fails at once, with ZMQ's reason."""
    p = make_instance(tiny_qwen3, "prefill", "push")
    d = make_instance(tiny_qwen3, "decode", "push", lease=5.0)
    drv = PDDriver(p, d)
    try:
        kv = {"do_remote_prefill": True, "transfer_id": "r", "remote_host": "-bogus",
              "remote_port": 5000}
        t0 = time.monotonic()
        drv.send_decode("r", random_prompts([40])[0], greedy(3), kv)
        drv.run(timeout=15)
        elapsed = time.monotonic() - t0
        leg = drv.d_legs["r"]
        assert leg.finish_reason is FinishReason.ERROR
        assert "cannot open a side-channel connection to -bogus:5000" in leg.error, leg
        assert "Invalid argument" in leg.error
        assert elapsed < 2.5, f"failed after {elapsed:.1f} s, not at once (lease: 5 s)"
        drv.settle()
        assert_clean(p, d)
    finally:
        drv.close()


# ---- finding 4: refusals are matched to their sender and expire ---------------------
def test_a_refusal_applies_to_its_sender_only_and_expires():
    """Issue 30, finding 4: one HelloRefused refused every peer in handshake, for ever.
    Now it refuses only the peer that sent it (and only while we are in handshake with
    it); our own side channel is refused here without a word on the wire; a refusal
    fails requests at once while it lasts, then expires and the handshake is retried."""
    ch, events = FakeChannel(), []
    w = TransferWorker(hello("decode", D), ch, PeerTransport(), [].append, LEASE, 0.5)
    w.receives.on_notice = events.append  # the table's notices, as the worker routes them

    def hellos_to(address: str) -> int:
        return sum(1 for a, msg in ch.sent if a == address and isinstance(msg, m.Hello))

    w.peers.ensure(P)
    w.peers.ensure(X)
    assert hellos_to(P) == hellos_to(X) == 1
    why = "peer decode at 10.0.0.2:5700 is incompatible: block_size: peer has 16, this 32"
    w.receive(m.encode(m.HelloRefused("x", why)), X)
    assert events == [c.PeerRefused(X, why)]
    assert w.peers[P].refused is None  # P's handshake goes on
    # a refusal from nobody we said Hello to changes nothing
    w.receive(m.encode(m.HelloRefused("y", "go away")), "10.0.0.7:1")
    w.receive(m.encode(m.HelloRefused("y", "go away")), "")
    assert len(events) == 1 and w.peers.refusals_ignored == 2
    theirs = hello("prefill", P)
    w.receive(m.encode(m.Hello(**{**{f: getattr(theirs, f) for f in theirs.__struct_fields__},
                                  "reply": True})), P)
    assert isinstance(events[-1], c.PeerReady) and w.peers.is_ready(P)
    w.receive(m.encode(m.HelloRefused("p", "late")), P)  # ready: ignored
    assert w.peers.is_ready(P)
    # a request naming our own side channel: refused here, nothing sent, P untouched
    w.peers.ensure(D)
    assert events[-1].address == D and "own side channel" in events[-1].reason
    assert hellos_to(D) == 0 and D not in w.peers and w.peers.is_ready(P)
    # while X's refusal lasts a request for it fails at once, no new Hello
    w.peers.ensure(X)
    assert events[-1] == c.PeerRefused(X, why) and hellos_to(X) == 1
    # it expires: the entry (and its socket) goes, the next request says Hello again
    w.peers.sweep(time.monotonic() + LEASE + 0.1)
    assert X not in w.peers and X in ch.forgotten and w.peers.is_ready(P)
    w.peers.ensure(X)
    assert hellos_to(X) == 2
    fixed = hello("prefill", X)
    w.receive(m.encode(fixed), X)  # X, fixed, answers
    assert events[-1] == c.PeerReady(X, fixed) and w.peers.is_ready(X)
    assert not any(isinstance(ev, c.PeerRefused) and ev.address == P for ev in events)


def _instance(model_dir, role: str, port: int = 0, block_size: int = 16) -> LLMEngine:
    kvt = KVTransferConfig(role=role, mode="push", engine_id=f"{role}-{uuid.uuid4().hex[:6]}",
                           transport="inproc", lease_timeout_s=0.5, heartbeat_interval_s=0.1,
                           side_channel_port=port)
    return LLMEngine(EngineConfig.build(model_dir, kv_transfer=kvt, block_size=block_size,
                                        num_blocks=256, max_model_len=1024))


def test_a_refused_prefill_is_used_once_fixed(tiny_qwen3):
    """Issue 30, finding 4, end to end: decode is refused by an incompatible prefill;
    that prefill is replaced on the same address by a compatible one; once the refusal
    has expired (a lease), decode's next request handshakes again and succeeds."""
    port = free_port(HOST)
    d = _instance(tiny_qwen3, "decode")
    bad = _instance(tiny_qwen3, "prefill", port, block_size=32)
    prompt = random_prompts([40], seed=9)[0]
    drv = PDDriver(bad, d)
    good = None
    try:
        drv.send_decode("r0", prompt, greedy(3))
        drv.run(timeout=15)
        leg = drv.d_legs["r0"]
        assert leg.finish_reason is FinishReason.ERROR and "block_size" in leg.error, leg
        bad.shutdown()
        good = _instance(tiny_qwen3, "prefill", port)
        assert good.connector.address == bad.connector.address
        drv = PDDriver(good, d)
        address = good.connector.address
        wait_for(lambda: address not in d.connector.worker.peers, 10,
                 "the refusal to expire", step=drv.pump)
        drv.submit("r1", prompt, greedy(3))
        drv.run(timeout=15)
        leg = drv.d_legs["r1"]
        assert leg.finish_reason is FinishReason.LENGTH, leg
        assert leg.tokens == run_to_completion(make_engine(tiny_qwen3), {"r": prompt},
                                               greedy(3))["r"]
        drv.settle()
        assert_clean(good, d)
    finally:
        for eng in (good, bad, d):
            if eng is not None:
                eng.shutdown()  # (idempotent)


# ---- dropped sends in /metrics ---------------------------------------------------------
def test_dropped_sends_are_counted_in_metrics(tiny_qwen3):
    """A message the side channel could not send or discarded is counted by reason in
    /metrics: here decode's Abort for a request to a prefill that never answers,
    discarded when the handshake is given up (and that peer's eviction)."""
    p = make_instance(tiny_qwen3, "prefill", "push")
    d = make_instance(tiny_qwen3, "decode", "push", lease=0.5)
    metrics = ServerMetrics(d.stats, lambda: True)
    metrics.register_kv_stats(d.connector.stats)
    drv = PDDriver(p, d)
    try:
        text = metrics.render().decode()
        name = "kvpush_kv_side_channel_send_dropped_total"
        for reason in ("queue_full", "connect_failed", "handshake_timeout", "peer_refused"):
            assert f'{name}{{reason="{reason}"}} 0.0' in text
        kv = {"do_remote_prefill": True, "transfer_id": "r", "remote_host": HOST,
              "remote_port": closed_ports(1)[0]}
        drv.send_decode("r", random_prompts([40])[0], greedy(3), kv)
        drv.pump()
        d.abort_request("d-r")  # the client left: the Abort waits for the handshake
        wait_for(lambda: metric_value(metrics.render().decode(), name,
                                      'reason="handshake_timeout"') == 1,
                 10, "the dropped Abort in /metrics", step=drv.pump)
        text = metrics.render().decode()
        assert metric_value(text, "kvpush_kv_side_channel_peers_evicted_total",
                            'reason="handshake_timeout"') == 1
        assert metric_value(text, "kvpush_kv_side_channel_peers", 'state="handshake"') == 0
        drv.settle()
        assert_clean(p, d)
    finally:
        drv.close()
