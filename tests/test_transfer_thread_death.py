"""A transfer thread that dies ends its engine core (issue 50, point 3): the thread logs
one line that says why, closes its transport and then its side channel, and tells the
engine (``TransferThreadDied`` in the inbox); the step loop raises it and CoreLoop ends,
failing every request it held with the reason. Nothing is held for the dead instance:
its peers' leases, fences and the connection's drop cover it, as for a killed process.

Two engines in one process (PDDriver, in-process transport, real ZMQ side channels),
stepped by the test so that each case sits where it should when the thread dies. The
thread is killed as a bug would kill it: its side channel's ``recv`` raises
(``kvpush_testing.serve.DyingLinks``, a trigger file), or the handling of a fact
raises (the role object wrapped). Nothing in ``kvpush`` knows about either. The same
death in a real ``kvpush serve`` pair: test_death_notice.py.
"""

from __future__ import annotations

import logging
import threading

import pytest

from contract_fakes import FakeChannel, FakeTransport, hello
from engine_helpers import greedy, random_prompts
from kvpush.engine.core_loop import CoreLoop
from kvpush.engine.inputs import AbortRequests, TransferThreadDied
from kvpush.engine.llm_engine import LLMEngine
from kvpush.engine.outputs import FinishReason
from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.transfer_thread.context import Settings
from kvpush.kv_transfer.transfer_thread.worker import TransferWorker
from kvpush_testing.faults import FaultPlan
from kvpush_testing.links import InProcLinks
from kvpush_testing.serve import CRASH, DyingLinks
from pd_helpers import PDDriver, make_instance, writes_posted

LEASE = 1.0  # both instances' lease: how long a peer's silence is borne
DIED = "the KV transfer thread died"
FACTS = ("begin", "blocks", "prefilled", "end")
WORKER_LOG = "kvpush.kv_transfer.transfer_thread.worker"


class FactCrash:
    """A role object whose handling of the step loop's facts raises (a bug there)."""

    def __init__(self, role) -> None:
        self._role = role

    def __getattr__(self, name: str):
        if name in FACTS:
            def crash(*_a, **_k):
                raise RuntimeError(f"{CRASH} (handling {name})")
            return crash
        return getattr(self._role, name)


class Driver(PDDriver):
    """PDDriver that stops stepping an engine once its transfer thread died (its core
    process would be gone) and steps the other alone."""

    dead: LLMEngine | None = None

    def pump(self) -> bool:
        if self.dead is None:
            return super().pump()
        live, legs = (self.d, self.d_legs) if self.dead is self.p else (self.p, self.p_legs)
        self._absorb(live.process_inbox(), legs)
        busy = live.has_work()
        if busy:
            self._absorb(live.step(), legs)
        return busy


def watch_death(eng: LLMEngine) -> tuple[threading.Event, list[str]]:
    """An event set once ``eng``'s transfer thread has told the engine it died, and why."""
    died, why = threading.Event(), []
    worker = eng.connector.worker
    tell = worker.on_death

    def told(reason: str) -> None:
        why.append(reason)
        tell(reason)
        died.set()

    worker.on_death = told
    return died, why


def kill(drv: Driver, eng: LLMEngine, trigger=None) -> str:
    """Kill ``eng``'s transfer thread: through its side channel (``trigger``: the
    DyingLinks file), or the next fact it handles; returns why it died."""
    died, why = watch_death(eng)
    worker = eng.connector.worker
    if trigger is not None:
        trigger.touch()
    else:  # a new leg: its Begin is the next fact
        worker.role = FactCrash(worker.role)
        send = drv.send_prefill if eng is drv.p else drv.send_decode
        send("x", random_prompts([20], seed=8)[0], greedy(2))
        eng.connector.flush()  # (as the step loop does at the end of the turn)
    assert died.wait(10), "the transfer thread did not die"
    drv.dead = eng
    [reason] = why
    assert CRASH in reason and reason.startswith("RuntimeError: ")
    return reason


def end_core(eng: LLMEngine, why: str, caplog) -> dict:
    """The dead instance's step loop, as its engine core runs it: it ends at once with
    TransferThreadDied, failing every request it held with the reason (one batch, which
    says the reason for the front end: a request it has not yet handed the core fails
    with it too), and logs nothing more than the thread's one line. Returns the outputs
    by request."""
    running = set(eng.scheduler.requests)
    core = CoreLoop(eng.config, engine=eng)
    batches = []
    try:
        core.run(batches.append)
    finally:
        if core.kv_events is not None:
            core.kv_events.close()
    assert isinstance(core.fatal, TransferThreadDied) and core.fatal.why == why
    outs = {o.request_id: o for b in batches for o in b.outputs}
    assert set(outs) == running and running
    assert [b.fatal for b in batches if b.fatal is not None] == [str(core.fatal)]
    assert batches[-1].fatal is not None and DIED in batches[-1].fatal
    for out in outs.values():
        assert out.finish_reason is FinishReason.ERROR, out
        assert DIED in out.failure.message and CRASH in out.failure.message, out
        assert not out.failure.rejected
    assert not eng.scheduler.requests
    lines = [r for r in caplog.records if r.levelno >= logging.ERROR
             and r.name.startswith("kvpush.engine")]
    assert lines == [], [r.getMessage() for r in lines]  # no "step loop died"
    [line] = [r for r in caplog.records if r.levelno == logging.CRITICAL]
    assert line.name == WORKER_LOG and DIED in line.getMessage() and why in line.getMessage()
    return outs


def all_free(eng: LLMEngine) -> bool:
    s = eng.stats()
    k = eng.connector
    return (s.num_free_blocks == s.num_total_blocks and not eng.scheduler.requests
            and not k.holds.by_tid and not len(k.worker.table))


def assert_failed(leg, *words: str) -> None:
    assert leg.finished and leg.finish_reason is FinishReason.ERROR, leg
    for word in words:
        assert word in leg.error, leg


@pytest.fixture
def pair(tiny_qwen3, tmp_path):
    made: list[Driver] = []

    def make(mode: str, dies: str | None = None, p_faults: FaultPlan | None = None,
             d_faults: FaultPlan | None = None):
        """A prefill and a decode instance; the one that ``dies`` gets DyingLinks on
        the returned trigger file."""
        trigger = tmp_path / f"die-{len(made)}"

        def links(role: str, faults: FaultPlan | None):
            inner = InProcLinks(faults)
            return DyingLinks(str(trigger), inner) if role == dies else inner

        p = make_instance(tiny_qwen3, "prefill", mode, links=links("prefill", p_faults),
                          lease=LEASE, max_num_batched_tokens=16)
        d = make_instance(tiny_qwen3, "decode", mode, links=links("decode", d_faults),
                          lease=LEASE, max_num_batched_tokens=16)
        drv = Driver(p, d)
        made.append(drv)
        return drv, trigger

    yield make
    for drv in made:
        drv.close()


# ---- the thread itself -----------------------------------------------------------------
class WaitingChannel(FakeChannel):
    """FakeChannel whose ``recv`` blocks until woken or timed out (the real thread runs)."""

    def __init__(self, log: list) -> None:
        super().__init__()
        self.log = log
        self._wake = threading.Event()

    def recv(self, timeout_ms: int) -> list:
        self._wake.wait(timeout_ms / 1000)
        self._wake.clear()
        return []

    def wake(self) -> None:
        self._wake.set()


def running_worker() -> tuple[TransferWorker, list, threading.Event]:
    log: list = []
    transport = FakeTransport()
    transport.log = log
    dead = threading.Event()

    def on_death(why: str) -> None:
        log.append(("died", why))
        dead.set()

    w = TransferWorker(hello("decode", "10.0.0.2:5700"), Settings(2.0, 0.5), WaitingChannel(log),
                       transport, log.append, on_death)
    w.start()
    return w, log, dead


@pytest.mark.parametrize("exc", [RuntimeError("a bug"), SystemExit("interpreter going down")])
def test_anything_escaping_the_loop_is_a_death_told_once_the_transport_closed(exc, caplog):
    """An exception of any kind escaping the loop (SystemExit too) ends the thread: one
    critical line says why, the transport closes, then the side channel (a peer that
    sees the connection drop frees what it fenced: nothing of ours may land after it),
    then ``on_death`` is told, once; no update is posted for it. ``stop()`` is no death."""
    w, log, dead = running_worker()

    class Raises:
        def __getattr__(self, name):
            def boom(*_a, **_k):
                raise exc
            return boom

    w.role = Raises()
    with caplog.at_level(logging.INFO, WORKER_LOG):
        w.submit(c.StepMessage((c.End("t", "client gone"),)))
        assert dead.wait(5)
        w.stop()  # after a death: nothing more
    why = f"{type(exc).__name__}: {exc}"
    closed = log.index("transport closed")
    assert all(isinstance(x, c.TransferUpdate) for x in log[:closed])  # (its heartbeat's)
    assert log[closed:] == ["transport closed", "channel closed", ("died", why)]
    [line] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert line.levelno == logging.CRITICAL and why in line.getMessage()

    w, log, dead = running_worker()
    w.stop()
    assert [x for x in log if not isinstance(x, c.TransferUpdate)] == [
        "transport closed", "channel closed"] and not dead.is_set()


# ---- a P/D pair: the dead instance's core ends, its peer gets every block back ----------
def test_prefill_push_death_ends_its_core_and_decode_frees_by_fence_and_lease(pair, caplog):
    """Prefill dies with WRITEs in flight for two pushes: one whose decode leg the
    client left (decode's blocks fenced: prefill may still WRITE), one still
    prefilling. Prefill's core ends, failing its running leg with the reason. Decode
    frees the fenced blocks when prefill's connection drops, and the other receive's
    at its lease (prefill went silent): every block back, both legs ended."""
    pf = FaultPlan()
    drv, trigger = pair("push", dies="prefill", p_faults=pf)
    p, d = drv.p, drv.d
    pf.arm(transfer_delay_s=60.0)  # no WRITE lands: prefill answers no Abort
    drv.submit_registered("q", random_prompts([40], seed=1)[0], greedy(3))
    drv.run(until=lambda: writes_posted(p, "q", 2), timeout=10)
    d.inbox.put(AbortRequests(["d-q"]))  # the client left: its blocks are fenced
    drv.run(until=lambda: drv.d_legs["q"].finished and d.connector.fenced_blocks, timeout=10)
    drv.submit_registered("r", random_prompts([300], seed=2)[0], greedy(3))
    drv.run(until=lambda: writes_posted(p, "r", 2), timeout=10)
    assert "p-r" in p.scheduler.requests

    with caplog.at_level(logging.INFO):
        why = kill(drv, p, trigger)
        end_core(p, why, caplog)
    drv.run(timeout=10)  # the other receive ends at its lease
    assert_failed(drv.d_legs["r"], "lease expired")
    drv.run(until=lambda: all_free(d), timeout=10)
    k = d.connector.counters
    # the fence of the left leg (no lease: --fence-timeout) ended by the drop, the
    # other's at its lease, both freed at once for a peer whose connection is down
    assert k.fences_peer_gone == 2 and k.fence_timeouts == 0 and k.leases_expired == 1


def test_decode_push_death_ends_its_core_and_prefill_frees_at_its_lease(pair, caplog):
    """Decode dies (handling a fact) while prefill WRITEs into its blocks: decode's core
    ends, failing both its requests. Prefill's leg ends (with token #1, or aborted at
    the lease), its WRITEs fail (decode's region is gone): every block back."""
    pf = FaultPlan()
    drv, _ = pair("push", p_faults=pf)
    p, d = drv.p, drv.d
    pf.arm(transfer_delay_s=LEASE)
    drv.submit_registered("r", random_prompts([300], seed=3)[0], greedy(3))
    drv.run(until=lambda: writes_posted(p, "r", 2), timeout=10)

    with caplog.at_level(logging.INFO):
        why = kill(drv, d)
        outs = end_core(d, why, caplog)
    assert set(outs) == {"d-r", "d-x"}
    drv.run(until=lambda: drv.p_legs["r"].finished and all_free(p), timeout=10)
    assert p.connector.counters.transfers_failed == 1


def test_prefill_pull_death_ends_its_core_and_decode_frees_when_its_read_fails(pair, caplog):
    """Prefill dies with blocks lent (decode's READ in flight) and a leg prefilling:
    prefill's core ends, failing the leg. Decode's READ fails (prefill's region is
    gone): its request fails and its blocks come back."""
    df = FaultPlan()
    drv, trigger = pair("pull", dies="prefill", d_faults=df)
    p, d = drv.p, drv.d
    df.arm(transfer_delay_s=2 * LEASE)  # decode's READ is in flight at the death
    drv.submit("r", random_prompts([40], seed=4)[0], greedy(3))
    reads = d.connector.worker.transport.stats
    drv.run(until=lambda: reads.posts == 1, timeout=10)
    drv.send_prefill("q", random_prompts([300], seed=5)[0], greedy(1))
    drv.run(until=lambda: p.scheduler.requests["p-q"].num_computed_tokens >= 32, timeout=10)

    with caplog.at_level(logging.INFO):
        why = kill(drv, p, trigger)
        assert set(end_core(p, why, caplog)) == {"p-q"}
    drv.run(timeout=10)  # at its lease: prefill is silent; its blocks wait for the READ
    assert_failed(drv.d_legs["r"], "lease expired")
    drv.run(until=lambda: all_free(d), timeout=10)  # the READ failed: nothing to read
    k = d.connector.counters
    assert k.transfers_failed == 1 and k.leases_expired == 1


def test_decode_pull_death_ends_its_core_and_prefill_frees_its_lend_at_its_lease(pair,
                                                                              caplog):
    """Decode dies with its READ of prefill's lend in flight: decode's core ends,
    failing its request; prefill's lend, no longer renewed by decode's heartbeats, ends
    at its lease and its blocks come back."""
    df = FaultPlan()
    drv, trigger = pair("pull", dies="decode", d_faults=df)
    p, d = drv.p, drv.d
    df.arm(transfer_delay_s=60.0)
    drv.submit("r", random_prompts([40], seed=7)[0], greedy(3))
    reads = d.connector.worker.transport.stats
    drv.run(until=lambda: reads.posts == 1, timeout=10)
    lent = p.connector.stats().blocks_lent

    with caplog.at_level(logging.INFO):
        why = kill(drv, d, trigger)
        assert set(end_core(d, why, caplog)) == {"d-r"}
    assert p.stats().num_free_blocks == p.stats().num_total_blocks - lent
    drv.run(until=lambda: all_free(p), timeout=10)
    assert p.connector.counters.leases_expired == 1
