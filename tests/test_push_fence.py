"""Push fencing on decode: a request that ends while prefill's WRITEs may still land
(prefill frozen past the lease, the client gone, registrations lost) keeps its blocks out
of the pool until prefill answers (AbortAck / PushDone), its connection drops, or the
fence times out; every path ends with every block free again.

Prefill is "frozen" by blocking its transfer thread on a gate (a command that waits):
it then neither heartbeats, nor reads, nor completes a WRITE — like a SIGSTOPped
process, whose sockets stay open — and resumes where it stopped when the gate opens.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from engine_helpers import greedy, make_engine, random_prompts, run_to_completion
from kvpush.engine.outputs import FinishReason
from kvpush.kv_transfer import commands as cmd
from kvpush.kv_transfer.step_loop.state import RecvState
from kvpush.kv_transfer.wire import messages as m
from kvpush_testing.faults import FaultPlan
from pd_helpers import PDDriver, make_instance, writes_posted

WRITE_S = 1.0  # each WRITE lands this long after its post (while prefill runs)


class Pair(PDDriver):
    """A push prefill/decode pair whose prefill's transfer thread can be frozen."""

    faults: FaultPlan
    gate: threading.Event

    def freeze_prefill(self) -> None:
        """Block prefill's transfer thread (returns once it is blocked)."""
        entered = threading.Event()

        def freeze() -> None:
            entered.set()
            self.gate.wait(60)

        self.p.connector.worker.submit(cmd.Call(freeze))
        assert entered.wait(10), "prefill's transfer thread did not take the command"

    def thaw_prefill(self) -> None:
        self.gate.set()

    def kill_prefill_transfer_thread(self) -> None:
        """Its thread ends when it next reads its queue; its sockets close, and the
        WRITEs it has posted never land (the transport is closed with it). As a process
        that ends, it tells no one first (a thread that dies on its own does since issue
        40, test_death_notice.py): marked as a requested stop."""
        self.p.connector.worker._stop_requested = True
        self.p.connector.worker.submit(cmd.Stop())
        self.thaw_prefill()
        self.p.connector.worker._thread.join(10)

    def pump_for(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if not self.pump():
                time.sleep(0.002)

    def d_clean(self) -> bool:
        s, c = self.d.stats(), self.d.connector
        return (s.num_free_blocks == s.num_total_blocks and not c.receiver.recvs
                and not c.fenced_blocks)

    def watch(self, kind: type) -> list[str]:
        """Transfer ids of each answer of prefill's (``m.AbortAck``, ``m.PushDone``)
        that decode's transfer thread hands its receives."""
        seen: list[str] = []
        receives = self.d.connector.worker.receives
        name = {m.AbortAck: "on_abort_ack", m.PushDone: "on_push_done"}[kind]
        orig = getattr(receives, name)

        def spy(msg, sender: str) -> None:
            seen.append(msg.transfer_id)
            orig(msg, sender)

        setattr(receives, name, spy)
        return seen


@pytest.fixture
def make_pair(tiny_qwen3) -> Iterator:
    made: list[Pair] = []

    def make(p_lease: float = 30.0, d_lease: float = 0.5, fence_timeout: float = 300.0,
             policy: str = "fail") -> Pair:
        faults = FaultPlan()
        p = make_instance(tiny_qwen3, "prefill", "push", faults=faults, lease=p_lease,
                          max_num_batched_tokens=16)
        d = make_instance(tiny_qwen3, "decode", "push", faults=faults, lease=d_lease,
                          fence_timeout=fence_timeout, policy=policy,
                          max_num_batched_tokens=16)
        pair = Pair(p, d)
        pair.faults, pair.gate = faults, threading.Event()
        made.append(pair)
        return pair

    yield make
    for pair in made:
        pair.thaw_prefill()
        pair.close()


def writes_in_flight(pair: Pair, rid: str = "r", prompt_len: int = 300) -> None:
    """Decode registered first, prefill writing each block as it computes it (one block
    per 16-token step), every WRITE landing WRITE_S after its post: returns once two
    blocks' WRITEs are posted and prefill is still computing."""
    pair.submit_registered(rid, random_prompts([prompt_len], seed=21)[0], greedy(5))
    pair.faults.arm(transfer_delay_s=WRITE_S)
    pair.run(until=lambda: writes_posted(pair.p, rid, 2), timeout=10)
    assert f"p-{rid}" in pair.p.scheduler.requests


def assert_fenced(pair: Pair, rid: str = "r") -> list[int]:
    """Decode's request has ended but its blocks are held out of the pool."""
    recv = pair.d.connector.receiver.recvs[rid]
    assert recv.state is RecvState.QUARANTINED and recv.held
    held = recv.held
    s = pair.d.stats()
    assert s.num_free_blocks == s.num_total_blocks - len(held)
    assert all(pair.d.scheduler.pool.ref_counts[b] > 0 for b in held)  # not free
    assert pair.d.connector.fenced_blocks == len(held)
    assert pair.d.connector.stats()["blocks_fenced"] == len(held)
    assert pair.d.kv_info()["num_fenced_blocks"] == len(held)
    assert f"d-{rid}" not in pair.d.scheduler.requests
    return held


def lease_failed(pair: Pair, rid: str = "r") -> None:
    pair.run(until=lambda: pair.d_legs[rid].finished, timeout=10)
    leg = pair.d_legs[rid]
    assert leg.finish_reason is FinishReason.ERROR and "lease expired" in leg.error, leg


def test_lease_expiry_fences_until_prefill_acks_the_abort(make_pair):
    """Prefill frozen past decode's lease with WRITEs in flight and queued: the request
    fails at the lease, its blocks stay fenced past the lease, prefill resumes, finishes
    its WRITEs into them, answers decode's Abort with AbortAck: then they are freed."""
    pair = make_pair()
    acks = pair.watch(m.AbortAck)
    writes_in_flight(pair)
    pair.freeze_prefill()
    lease_failed(pair)  # the client hears at the lease, as before
    assert_fenced(pair)
    pair.pump_for(1.0)  # twice the lease: the fence does not end with it
    assert_fenced(pair)
    landed = pair.p.connector.transport.stats.done
    pair.thaw_prefill()
    pair.settle()
    assert set(acks) == {"r"}  # (the fence repeats its Abort: acks may repeat too)
    assert pair.p.connector.transport.stats.done > landed  # late WRITEs landed, fenced
    c = pair.d.connector.worker.counters
    assert (c["fences"], c["fences_peer_gone"], c["fence_timeouts"]) == (1, 0, 0)


def test_lease_expiry_fence_ends_on_push_done(make_pair):
    """The same, decode's Aborts all lost: prefill's own lease on the transfer ends
    after it resumes, it drains its WRITEs and sends PushDone: the blocks are freed."""
    pair = make_pair(p_lease=1.0)
    dones = pair.watch(m.PushDone)
    acks = pair.watch(m.AbortAck)
    writes_in_flight(pair)
    pair.faults.arm(drop_messages={"Abort": 10**6})
    pair.freeze_prefill()
    lease_failed(pair)
    assert_fenced(pair)
    pair.thaw_prefill()
    pair.settle()
    assert "r" in dones and not acks
    assert pair.faults.count("message_drops:Abort") >= 1


def test_fence_ends_when_prefill_connection_drops(make_pair):
    """Fenced, then prefill's process ends (its transfer thread closes its sockets, the
    WRITEs it posted never land): decode sees the connection drop and frees."""
    pair = make_pair()
    writes_in_flight(pair)
    pair.freeze_prefill()
    lease_failed(pair)
    assert_fenced(pair)
    pair.kill_prefill_transfer_thread()
    pair.run(until=pair.d_clean, timeout=10)
    c = pair.d.connector.worker.counters
    assert (c["fences"], c["fences_peer_gone"], c["fence_timeouts"]) == (1, 1, 0)


def test_fence_ends_at_once_when_prefill_died_before_the_lease(make_pair):
    """Prefill's process ends while its WRITEs are in flight; decode's lease expires
    later: the connection is already down, so nothing is fenced for long."""
    pair = make_pair()
    writes_in_flight(pair)
    pair.p.connector.worker.stop()
    lease_failed(pair)
    pair.run(until=pair.d_clean, timeout=5)
    c = pair.d.connector.worker.counters
    assert (c["fences"], c["fences_peer_gone"], c["fence_timeouts"]) == (1, 1, 0)


def test_fence_times_out_when_prefill_stays_frozen(make_pair):
    """Prefill frozen for good (connection up, never answering): the blocks come back
    at the fence timeout, which is counted."""
    pair = make_pair(fence_timeout=0.5)
    writes_in_flight(pair)
    pair.freeze_prefill()
    lease_failed(pair)
    assert_fenced(pair)
    pair.run(until=pair.d_clean, timeout=5)
    c = pair.d.connector.worker.counters
    assert (c["fences"], c["fences_peer_gone"], c["fence_timeouts"]) == (1, 0, 1)
    pair.kill_prefill_transfer_thread()  # nothing of it lands now


def test_client_abort_quarantine_outlives_the_lease(make_pair):
    """Decode's client goes away while prefill (frozen) has WRITEs in flight: the
    blocks stay fenced past the lease, until prefill resumes and acks the Abort."""
    pair = make_pair()
    acks = pair.watch(m.AbortAck)
    writes_in_flight(pair)
    pair.freeze_prefill()
    out = pair.d.abort_request("d-r")
    assert out.finish_reason is FinishReason.ABORT
    pair.d_legs["r"].finish_reason = FinishReason.ABORT
    assert_fenced(pair)
    pair.pump_for(1.5)  # three leases
    assert_fenced(pair)
    assert pair.d.connector.worker.counters["aborts_sent"] == 1
    pair.thaw_prefill()
    pair.settle()
    assert set(acks) == {"r"}


def test_recompute_policy_recomputes_in_fresh_blocks_while_fenced(make_pair, tiny_qwen3):
    """With --kv-load-failure-policy recompute the request goes on at the lease in
    other blocks (the right answer), while the fenced ones wait for prefill."""
    pair = make_pair(policy="recompute")
    writes_in_flight(pair)
    pair.freeze_prefill()
    pair.run(until=lambda: pair.d.connector.fenced_blocks > 0, timeout=10)
    held = set(pair.d.connector.receiver.recvs["r"].held)
    pair.run(until=lambda: pair.d_legs["r"].finished, timeout=30)
    prompt = random_prompts([300], seed=21)[0]
    ref = run_to_completion(make_engine(tiny_qwen3), {"r0": prompt}, greedy(5))["r0"]
    assert pair.d_legs["r"].tokens == ref
    assert set(pair.d.connector.receiver.recvs["r"].held) == held  # still fenced
    pair.thaw_prefill()
    pair.settle()


def test_lost_registrations_fence_until_prefill_acks(make_pair):
    """Every registration lost: decode gives up and fails the request, but a late one
    could still reach prefill, so the blocks wait for its AbortAck."""
    pair = make_pair(d_lease=0.6)
    acks = pair.watch(m.AbortAck)
    pair.faults.arm(drop_messages={"PushRegister": 1000})
    pair.submit("r", random_prompts([60])[0], greedy(5))
    pair.run(timeout=15)
    leg = pair.d_legs["r"]
    assert leg.finish_reason is FinishReason.ERROR and "registration lost" in leg.error
    pair.settle()
    assert set(acks) == {"r"}
    assert pair.d.connector.worker.counters["fences"] == 1


def test_prefill_acks_an_abort_for_an_unknown_or_finished_transfer(make_pair):
    """Prefill answers an Abort for any id — one it never had, one long finished — so
    that decode, fencing until it hears, never waits for ever."""
    pair = make_pair()
    acks = pair.watch(m.AbortAck)
    pair.submit("done", random_prompts([40])[0], greedy(3))
    pair.run(timeout=15)
    assert pair.d_legs["done"].finish_reason is FinishReason.LENGTH
    pair.settle()
    worker, prefill = pair.d.connector.worker, pair.p.connector.address
    for tid in ("never-was", "done"):
        worker.submit(cmd.Call(lambda t=tid: worker.peers.send(prefill, m.Abort(t, "test"))))
    pair.run(until=lambda: set(acks) == {"done", "never-was"}, timeout=5)
    pair.settle()


def test_prefill_refuses_writes_for_an_id_decode_aborted(make_pair):
    """Decode aborts a push mid-prefill: prefill acks once its in-flight WRITEs drain,
    and no WRITE for that id is posted afterwards, though its prefill step loop may
    still queue some (the layer hook of the step that was running)."""
    pair = make_pair()
    acks = pair.watch(m.AbortAck)
    writes_in_flight(pair)
    worker = pair.p.connector.worker
    pair.d.abort_request("d-r")
    pair.d_legs["r"].finish_reason = FinishReason.ABORT
    pair.run(until=lambda: "r" in acks, timeout=10)
    posts = pair.p.connector.transport.stats.posts
    assert "r" in worker.aborted and "r" not in worker.writes
    # blocks the layer hook stated computed before the step loop heard of the abort
    refused = worker.counters["writes_refused"]
    worker.submit(cmd.BlocksComputed("r", 0, [0], range(1)))
    handled = threading.Event()
    worker.submit(cmd.Call(handled.set))  # commands run in order: the WRITE is handled then
    assert handled.wait(5)
    assert worker.counters["writes_refused"] > refused
    assert pair.p.connector.transport.stats.posts == posts
    assert "r" not in worker.writes
    pair.settle()
