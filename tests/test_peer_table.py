"""The transfer thread's peer table (transfer_thread/peers.py): bounded whatever addresses
requests name, refusals matched to their sender and expiring, connection errors
reported at once, dropped sends counted in /metrics, idle peers evicted and met again.

Real side channels on 127.0.0.1 (free ports), the in-process transport for engines; a
worker without its thread runs on an injected clock; every wait is bounded in time,
every instance stopped, free blocks checked."""

from __future__ import annotations

import logging
import os
import time
import uuid

from contract_fakes import (
    CHAIN,
    LEASE,
    PROMPT_TOKENS,
    Clock,
    D,
    FakeChannel,
    FakeTransport,
    P,
    closed_ports,
    hello,
    step,
    worker,
)
from engine_helpers import greedy, make_engine, random_prompts, run_to_completion
from kvpush.cluster.launcher import free_port
from kvpush.config import EngineConfig, KVTransferConfig
from kvpush.engine.llm_engine import LLMEngine
from kvpush.engine.outputs import FinishReason
from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.transfer_thread.peers import MAX_PEERS, PeerTable
from kvpush.kv_transfer.wire import messages as m
from kvpush.kv_transfer.wire.side_channel import SideChannel
from kvpush.server.metrics import ServerMetrics
from kvpush_testing.links import InProcLinks
from pd_helpers import PDDriver, make_instance
from router_helpers import metric_value

HOST = "127.0.0.1"
X = "10.0.0.3:5601"


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def wait_for(cond, timeout: float, what: str, step=None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        if step is None or not step():
            time.sleep(0.01)


def ready(eng: LLMEngine, address: str) -> bool:
    """Whether ``eng``'s transfer thread has ``address`` as a ready peer (read across
    threads: a polling condition)."""
    return eng.connector.worker.peers.ready_peer(address) is not None


def assert_clean(*engines: LLMEngine) -> None:
    for eng in engines:
        s = eng.stats()
        assert s.num_free_blocks == s.num_total_blocks


# ---- finding 3: the table is bounded -------------------------------------------------
def test_many_bogus_peer_addresses_are_capped_and_their_sockets_closed(caplog):
    """Issue 30, finding 3: every address a request named kept a DEALER and its monitor
    (3 fds) for ever. Now at most MAX_PEERS are open at once; a transfer naming an
    address beyond the cap fails at once with the reason; a handshake nobody answers
    fails its transfer at the lease and is given up (its sockets closed, what was queued
    for it counted) once no transfer uses it, so the fd count returns to its start."""
    ch = SideChannel(HOST, 0)
    w, _, _, updates, clock = worker("decode", channel=ch, ready=False)
    n = MAX_PEERS + 40
    addresses = [f"{HOST}:{port}" for port in closed_ports(n)]
    fd0 = fd_count()
    try:
        step(w, *[c.Begin(f"t{i}", PROMPT_TOKENS, CHAIN, c.PeerRef(a))
                  for i, a in enumerate(addresses)])
        assert len(w.peers) == MAX_PEERS
        assert fd_count() - fd0 <= 4 * MAX_PEERS + 16  # 3 ZMQ sockets (+ a TCP attempt) each
        capped = {ev.tid: ev.why for ev in updates.events()}
        assert list(capped) == [f"t{i}" for i in range(MAX_PEERS, n)]  # at once
        assert all("peers (the limit)" in why for why in capped.values()), capped
        with caplog.at_level(logging.ERROR):
            clock.advance(LEASE)  # nobody answered: the transfers end at their lease
            w.tick()
            w.flush()
        assert "no answer to the side-channel handshake" in caplog.text
        over = {ev.tid: ev for ev in updates.events()}
        assert len(over) == n and len(w.table) == 0
        assert all(over[f"t{i}"].why == "lease expired: prefill stopped answering"
                   for i in range(MAX_PEERS))
        clock.advance(1.0)  # the next heartbeat's sweep: no transfer uses them any more
        w.tick()
        w.flush()
        assert len(w.peers) == 0 and ch.num_destinations == 0
        assert not ch._links.links  # nothing remembered of links that never came up
        k = updates.counters()
        assert k.side_channel_peers_evicted["handshake_timeout"] == MAX_PEERS
        # each transfer's Abort waited for its handshake: dropped with it, counted
        assert k.side_channel_send_dropped["handshake_timeout"] == MAX_PEERS
        assert k.side_channel_peers == {"handshake": 0, "ready": 0, "refused": 0}
        wait_for(lambda: fd_count() <= fd0 + 4, 10, f"fds back near {fd0}: {fd_count()}")
    finally:
        w.stop()  # (never started: closes the channel)
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
    pa, da = p.connector.address, d.connector.address
    try:
        drv.submit("r0", prompts[0], greedy(4))
        drv.run(timeout=20)
        drv.settle()
        assert ready(p, da)
        # both evict (the tables are the transfer threads'; a float read each sweep)
        for eng in (p, d):
            eng.connector.worker.peers.idle_timeout_s = 0.2
        wait_for(lambda: not ready(p, da) and not ready(d, pa), 10, "both peers evicted",
                 step=drv.pump)
        assert len(p.connector.worker.peers) == len(d.connector.worker.peers) == 0
        drv.submit("r1", prompts[1], greedy(4))
        drv.run(timeout=20)
        drv.settle()
        # only prefill evicts: decode registers at once over its old handshake
        d.connector.worker.peers.idle_timeout_s = 1e9
        wait_for(lambda: not ready(p, da), 10, "prefill evicts decode", step=drv.pump)
        assert ready(d, pa)
        drv.submit("r2", prompts[2], greedy(4))
        drv.run(timeout=20)
        for i in range(3):
            leg = drv.d_legs[f"r{i}"]
            assert leg.finish_reason is FinishReason.LENGTH, leg
            assert leg.tokens == ref[f"r{i}"]
        drv.settle()
        wait_for(lambda: p.connector.stats().side_channel_peers_evicted.get("idle", 0) >= 2
                 and d.connector.stats().side_channel_peers_evicted.get("idle", 0) >= 1,
                 10, "the evictions in the counters", step=drv.pump)
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
    ch, clock, told = FakeChannel(D), Clock(), []
    peers = PeerTable(hello("decode", D), ch, FakeTransport(),
                      on_ready=lambda a, h: told.append(("ready", a)),
                      on_refused=lambda a, why: told.append(("refused", a, why)),
                      deliver=lambda msg, sender: None, busy=set,
                      handshake_timeout_s=LEASE, idle_timeout_s=4 * LEASE,
                      refusal_ttl_s=LEASE, clock=clock)

    def hellos_to(address: str) -> int:
        return sum(1 for a, msg in ch.sent if a == address and isinstance(msg, m.Hello))

    peers.ensure(P)
    peers.ensure(X)
    assert hellos_to(P) == hellos_to(X) == 1
    why = "peer decode at 10.0.0.2:5700 is incompatible: block_size: peer has 16, this 32"
    peers.on_refused_hello(m.HelloRefused("x", why), X)
    assert told == [("refused", X, why)]
    assert peers[P].refused is None  # P's handshake goes on
    # a refusal from nobody we said Hello to changes nothing
    peers.on_refused_hello(m.HelloRefused("y", "go away"), "10.0.0.7:1")
    peers.on_refused_hello(m.HelloRefused("y", "go away"), "")
    assert len(told) == 1 and "10.0.0.7:1" not in peers
    assert peers.on_hello(hello("prefill", P, reply=True), P)
    assert told[-1] == ("ready", P) and peers.ready_peer(P) is not None
    peers.on_refused_hello(m.HelloRefused("p", "late"), P)  # ready: ignored
    assert peers.ready_peer(P) is not None
    # a request naming our own side channel: refused here, nothing sent, P untouched
    assert peers.ensure(D) is None
    assert told[-1][:2] == ("refused", D) and "own side channel" in told[-1][2]
    assert hellos_to(D) == 0 and D not in peers and peers.ready_peer(P) is not None
    # while X's refusal lasts a request for it fails at once, no new Hello
    assert peers.ensure(X) is None
    assert told[-1] == ("refused", X, why) and hellos_to(X) == 1
    # it expires: the entry (and its socket) goes, the next request says Hello again
    clock.advance(LEASE + 0.1)
    peers.sweep(clock())
    assert X not in peers and X in ch.forgotten and peers.ready_peer(P) is not None
    assert peers.evicted["refusal_expired"] == 1
    peers.ensure(X)
    assert hellos_to(X) == 2
    assert peers.on_hello(hello("prefill", X), X)  # X, fixed, answers
    assert told[-1] == ("ready", X) and peers.ready_peer(X) is not None
    assert not any(t[0] == "refused" and t[1] == P for t in told)


def _instance(model_dir, role: str, port: int = 0, block_size: int = 16) -> LLMEngine:
    kvt = KVTransferConfig(role=role, mode="push", engine_id=f"{role}-{uuid.uuid4().hex[:6]}",
                           lease_timeout_s=0.5, heartbeat_interval_s=0.1,
                           side_channel_port=port)
    return LLMEngine(EngineConfig.build(model_dir, kv_transfer=kvt, block_size=block_size,
                                        num_blocks=256, max_model_len=1024),
                     links=InProcLinks())


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
    name = "kvpush_kv_side_channel_send_dropped_total"
    try:
        # the transfer thread's first heartbeat brings its figures, every reason at 0
        wait_for(lambda: f'{name}{{reason="handshake_timeout"}}' in metrics.render().decode(),
                 10, "the side channel's figures", step=drv.pump)
        text = metrics.render().decode()
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
