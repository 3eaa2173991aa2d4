"""Push fencing on decode, end to end: a request that ends while prefill's WRITEs may
still land (prefill frozen past the lease, the client gone, registrations lost) keeps
its blocks out of the pool until prefill answers (AbortAck / PushDone), its connection
drops, or the fence times out; every path ends with every block free again.

Prefill is "frozen" from outside: its side channel (injected through the links) blocks
the transfer thread where it waits for messages, so it neither heartbeats, nor reads,
nor checks a WRITE's completion (like a SIGSTOPped process, whose sockets stay open),
and it resumes where it stopped when the gate opens. The same paths on one transfer
thread with an injected clock: test_worker_fences.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from engine_helpers import greedy, make_engine, random_prompts, run_to_completion
from kvpush.engine.outputs import FinishReason
from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.wire import messages as m
from kvpush_testing.faults import FaultPlan
from kvpush_testing.links import InProcLinks
from pd_helpers import PDDriver, make_instance, writes_posted

pytestmark = pytest.mark.timeout(120)

WRITE_S = 1.0  # each WRITE lands this long after its post (while prefill runs)


class FreezableChannel:
    """A transfer thread's side channel that a test can freeze (``recv`` waits on a
    gate) and that records the messages the thread receives. Everything else is the
    wrapped channel's."""

    def __init__(self, channel) -> None:
        self._channel = channel
        self.received: list[m.Message] = []
        self._open, self._blocked = threading.Event(), threading.Event()
        self._open.set()
        self._thaw_on_wake = False

    def recv(self, timeout_ms: int) -> list[tuple[str, bytes]]:
        if not self._open.is_set():
            self._blocked.set()
            self._open.wait(60)
        out = self._channel.recv(timeout_ms)
        self.received += [m.decode(payload) for _, payload in out
                          if m.type_name(payload) != "?"]
        return out

    def wake(self) -> None:
        self._channel.wake()
        if self._thaw_on_wake:
            self._open.set()

    def freeze(self) -> None:
        """Returns once the thread is blocked."""
        self._blocked.clear()
        self._open.clear()
        assert self._blocked.wait(10), "the transfer thread did not come to its channel"

    def thaw(self, on_wake: bool = False) -> None:
        """Open the gate (``on_wake``: once the thread is next woken, not now)."""
        self._thaw_on_wake = on_wake
        if not on_wake:
            self._open.set()

    def __getattr__(self, name: str):
        return getattr(self._channel, name)


@dataclass(frozen=True, eq=False)
class FreezableLinks(InProcLinks):
    def channel(self, host: str, port: int, secret: bytes | None):
        return FreezableChannel(super().channel(host, port, secret))


class Pair(PDDriver):
    """A push prefill/decode pair whose prefill's transfer thread can be frozen."""

    faults: FaultPlan

    @property
    def p_channel(self) -> FreezableChannel:
        return self.p.connector.worker.channel

    def freeze_prefill(self) -> None:
        self.p_channel.freeze()

    def thaw_prefill(self) -> None:
        self.p_channel.thaw()

    def kill_prefill_transfer_thread(self) -> None:
        """Its thread ends, as its process would: its sockets close and the WRITEs it
        posted never land. It stops where it was frozen: the stop's wake opens the
        gate, after the stop is queued, so it handles nothing of decode's first."""
        self.p_channel.thaw(on_wake=True)
        self.p.connector.worker.stop()

    def pump_until(self, seconds: float) -> None:
        """Both engines stepped for ``seconds`` (real time: the leases are)."""
        end = time.monotonic() + seconds
        self.run(until=lambda: time.monotonic() >= end, timeout=seconds + 5)

    def d_clean(self) -> bool:
        s = self.d.stats()
        return s.num_free_blocks == s.num_total_blocks and not self.d.connector.holds.by_tid

    def answers(self, kind: type) -> list[str]:
        """Transfer ids of each of prefill's answers of ``kind`` (``m.AbortAck``,
        ``m.PushDone``) that decode's transfer thread received."""
        return [msg.transfer_id for msg in self.d.connector.worker.channel.received
                if isinstance(msg, kind)]

    def counts(self) -> tuple[int, int, int]:
        """Decode's (fences, fences_peer_gone, fence_timeouts), as its step loop has them."""
        k = self.d.connector.stats()
        return k.fences, k.fences_peer_gone, k.fence_timeouts


@pytest.fixture
def make_pair(tiny_qwen3) -> Iterator:
    made: list[Pair] = []

    def make(p_lease: float = 30.0, d_lease: float = 0.5, fence_timeout: float = 300.0,
             policy: str = "fail") -> Pair:
        faults = FaultPlan()
        links = FreezableLinks(faults)
        p = make_instance(tiny_qwen3, "prefill", "push", links=links, lease=p_lease,
                          max_num_batched_tokens=16)
        d = make_instance(tiny_qwen3, "decode", "push", links=links, lease=d_lease,
                          fence_timeout=fence_timeout, policy=policy,
                          max_num_batched_tokens=16)
        pair = Pair(p, d)
        pair.faults = faults
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
    hold = pair.d.connector.holds.by_tid[rid]
    assert hold.request_id is None and hold.blocks  # no request waits: fenced
    held = hold.blocks
    s = pair.d.stats()
    assert s.num_free_blocks == s.num_total_blocks - len(held)
    assert all(pair.d.scheduler.pool.ref_counts[b] > 0 for b in held)  # not free
    assert pair.d.connector.fenced_blocks == len(held)
    assert pair.d.connector.stats().blocks_fenced == len(held)
    assert pair.d.kv_info().num_fenced_blocks == len(held)
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
    writes_in_flight(pair)
    pair.freeze_prefill()
    lease_failed(pair)  # the client hears at the lease
    assert_fenced(pair)
    pair.pump_until(1.0)  # twice the lease: the fence does not end with it
    assert_fenced(pair)
    landed = pair.p.connector.worker.transport.stats.done
    pair.thaw_prefill()
    pair.settle()
    assert set(pair.answers(m.AbortAck)) == {"r"}  # (the fence repeats its Abort)
    assert pair.p.connector.worker.transport.stats.done > landed  # late WRITEs landed
    assert pair.counts() == (1, 0, 0)


def test_lease_expiry_fence_ends_on_push_done(make_pair):
    """The same, decode's Aborts all lost: prefill's own lease on the transfer ends
    after it resumes, it drains its WRITEs and sends PushDone: the blocks are freed."""
    pair = make_pair(p_lease=1.0)
    writes_in_flight(pair)
    pair.faults.arm(drop_messages={"Abort": 10**6})
    pair.freeze_prefill()
    lease_failed(pair)
    assert_fenced(pair)
    pair.thaw_prefill()
    pair.settle()
    assert "r" in pair.answers(m.PushDone) and not pair.answers(m.AbortAck)
    assert pair.faults.count("message_drops:Abort") >= 1
    assert pair.counts() == (1, 0, 0)


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
    assert pair.counts() == (1, 1, 0)
    assert not pair.answers(m.AbortAck) and not pair.answers(m.PushDone)


def test_fence_ends_at_once_when_prefill_died_before_the_lease(make_pair):
    """Prefill's process ends while its WRITEs are in flight; decode's lease expires
    later: the connection is already down, so nothing is fenced for long."""
    pair = make_pair()
    writes_in_flight(pair)
    pair.p.connector.worker.stop()
    lease_failed(pair)
    pair.run(until=pair.d_clean, timeout=5)
    assert pair.counts() == (1, 1, 0)


def test_fence_times_out_when_prefill_stays_frozen(make_pair):
    """Prefill frozen for good (connection up, never answering): the blocks come back
    at the fence timeout, which is counted."""
    pair = make_pair(fence_timeout=0.5)
    writes_in_flight(pair)
    pair.freeze_prefill()
    lease_failed(pair)
    assert_fenced(pair)
    pair.run(until=pair.d_clean, timeout=5)
    assert pair.counts() == (1, 0, 1)
    pair.kill_prefill_transfer_thread()  # nothing of it lands now


def test_client_abort_fence_outlives_the_lease(make_pair):
    """Decode's client goes away while prefill (frozen) has WRITEs in flight: the
    blocks stay fenced past the lease, until prefill resumes and acks the Abort."""
    pair = make_pair()
    writes_in_flight(pair)
    pair.freeze_prefill()
    out = pair.d.abort_request("d-r")
    assert out.finish_reason is FinishReason.ABORT
    pair.d_legs["r"].finish_reason = FinishReason.ABORT
    assert_fenced(pair)
    pair.pump_until(1.5)  # three leases
    assert_fenced(pair)
    assert pair.d.connector.stats().aborts_sent == 1  # (the fence's repeats not counted)
    pair.thaw_prefill()
    pair.settle()
    assert set(pair.answers(m.AbortAck)) == {"r"}
    assert pair.counts() == (1, 0, 0)


def test_recompute_policy_recomputes_in_fresh_blocks_while_fenced(make_pair, tiny_qwen3):
    """With --kv-load-failure-policy recompute the request goes on at the lease in
    other blocks (the right answer), while the fenced ones wait for prefill."""
    pair = make_pair(policy="recompute")
    writes_in_flight(pair)
    pair.freeze_prefill()
    pair.run(until=lambda: pair.d.connector.fenced_blocks > 0, timeout=10)
    held = set(pair.d.connector.holds.by_tid["r"].blocks)
    pair.run(until=lambda: pair.d_legs["r"].finished, timeout=30)
    prompt = random_prompts([300], seed=21)[0]
    ref = run_to_completion(make_engine(tiny_qwen3), {"r0": prompt}, greedy(5))["r0"]
    assert pair.d_legs["r"].tokens == ref
    assert set(pair.d.connector.holds.by_tid["r"].blocks) == held  # still fenced
    pair.thaw_prefill()
    pair.settle()


def test_lost_registrations_fence_until_prefill_acks(make_pair):
    """Every registration lost: decode gives up and fails the request, but a late one
    could still reach prefill, so the blocks wait for its AbortAck."""
    pair = make_pair(d_lease=0.6)
    pair.faults.arm(drop_messages={"PushRegister": 1000})
    pair.submit("r", random_prompts([60])[0], greedy(5))
    pair.run(timeout=15)
    leg = pair.d_legs["r"]
    assert leg.finish_reason is FinishReason.ERROR and "registration lost" in leg.error
    pair.settle()
    assert set(pair.answers(m.AbortAck)) == {"r"}
    assert pair.counts() == (1, 0, 0)


def test_prefill_refuses_writes_for_an_id_decode_aborted(make_pair):
    """Decode aborts a push mid-prefill: prefill acks once its in-flight WRITEs drain,
    and no WRITE for that id is posted afterwards, though its prefill step loop may
    still state blocks ready (the layer hook of the step that was running)."""
    pair = make_pair()
    writes_in_flight(pair)
    worker = pair.p.connector.worker
    pair.d.abort_request("d-r")
    pair.d_legs["r"].finish_reason = FinishReason.ABORT
    pair.run(until=lambda: "r" in pair.answers(m.AbortAck), timeout=10)
    posts = worker.transport.stats.posts
    refused = pair.p.connector.counters.writes_refused
    # blocks the layer hook stated ready before the step loop heard of the abort
    worker.submit(c.StepMessage((c.BlocksReady("r", 0, [0], range(1)),)))
    pair.run(until=lambda: pair.p.connector.counters.writes_refused > refused, timeout=5)
    assert worker.transport.stats.posts == posts
    pair.settle()
    assert worker.transport.stats.posts == posts
