"""A transfer thread that dies (issue 30, finding 9): the instance's /health fails with
the reason, every request that depended on the thread ends with an error, every block
it held comes back (those a peer may still reach one-sidedly after a hold: pull's lent
blocks a lease, push's fenced ones the fence timeout), and a new P/D request gets a 503.

The thread is killed the way a bug would kill it: its transport raises from inside the
thread's loop (``state``/``progress``, called there only). Both engines are stepped by
the test (PDDriver), so each case sits exactly where it should when the thread dies;
the HTTP checks then run the dead instance behind its real app and step loop.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from engine_helpers import greedy, random_prompts
from kvpush.engine.async_engine import AsyncEngine
from kvpush.engine.llm_engine import LLMEngine
from kvpush.engine.outputs import FinishReason, RequestError
from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.step_loop.state import RecvState, SendState
from kvpush.kv_transfer.transfer_thread.worker import TransferWorker
from kvpush.server.app import build_app
from kvpush_testing.faults import FaultPlan
from pd_helpers import PDDriver, make_instance, writes_posted
from test_worker_fences import D, FakeChannel, FakeTransport, hello

CRASH = "injected transport crash"
DIED = "KV transfer thread died"
HOLD_S = 2.0  # prefill's lease and decode's fence timeout: how long held blocks wait


def kill_transfer_thread(eng: LLMEngine) -> None:
    """Make the transport raise the next time the transfer thread's loop uses it (it
    polls it at least every 20 ms while peers exist), and wait until the thread is gone."""
    def crash(*_a, **_k):
        raise RuntimeError(CRASH)

    worker = eng.connector.worker
    worker.transport.state = crash
    worker.transport.progress = crash
    worker._thread.join(10)
    assert not worker._thread.is_alive(), "the transfer thread did not die"


def free(eng: LLMEngine) -> int:
    return eng.stats().num_free_blocks


def all_free(eng: LLMEngine) -> bool:
    s = eng.stats()
    return s.num_free_blocks == s.num_total_blocks and not eng.scheduler.requests


def assert_failed(leg, *words: str) -> None:
    assert leg.finished and leg.finish_reason is FinishReason.ERROR, leg
    for word in words:
        assert word in leg.error, leg


def refuses_new_pd_request(drv: PDDriver, dead: LLMEngine) -> dict:
    """A P/D request reaching the dead instance's engine (queued before the death was
    known) is refused with a 503; returns the params such a request carries."""
    if dead is drv.p:
        kv = {"do_remote_decode": True, "transfer_id": "new"}
    else:  # valid params of either mode (pull: prefill's blocks for the 20 tokens)
        kv = {**drv.d_params("new"), "remote_block_ids": [0, 1], "remote_request_id": "new"}
    with pytest.raises(RequestError) as e:
        dead.add_request("x-new", random_prompts([20], seed=5)[0], greedy(2), kv)
    assert e.value.status_code == 503 and DIED in str(e.value)
    assert "x-new" not in dead.scheduler.requests
    return kv


def check_http(dead: LLMEngine, kv: dict) -> None:
    """The dead instance behind its app: /health is a 503 with a JSON body saying why,
    and a new P/D request a 503 in OpenAI's error shape."""
    async def main() -> None:
        app = build_app(AsyncEngine(dead.config, engine=dead))
        async with app.router.lifespan_context(app):  # starts and stops the step loop
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                         timeout=10) as client:
                r = await client.get("/health")
                assert r.status_code == 503, r.text
                err = r.json()["error"]
                assert DIED in err["message"] and CRASH in err["message"], err
                assert err["type"] == "server_error"
                body = {"prompt": random_prompts([20], seed=6)[0], "max_tokens": 2,
                        "kv_transfer_params": kv}
                r = await asyncio.wait_for(client.post("/v1/completions", json=body), 10)
                assert r.status_code == 503, r.text
                err = r.json()["error"]
                assert DIED in err["message"] and set(err) == {"message", "type", "param",
                                                               "code"}

    asyncio.run(main())


@pytest.fixture
def pair(tiny_qwen3):
    made: list[PDDriver] = []

    def make(mode: str) -> tuple[PDDriver, FaultPlan, FaultPlan]:
        pf, df = FaultPlan(), FaultPlan()
        p = make_instance(tiny_qwen3, "prefill", mode, faults=pf, lease=HOLD_S,
                          max_num_batched_tokens=16)
        d = make_instance(tiny_qwen3, "decode", mode, faults=df, lease=HOLD_S,
                          fence_timeout=HOLD_S, max_num_batched_tokens=16)
        drv = PDDriver(p, d)
        made.append(drv)
        return drv, pf, df

    yield make
    for drv in made:
        drv.close()


def test_prefill_push_death_fails_its_legs_and_frees_sends_at_once(pair):
    """Prefill dies with one push draining (prefilled, WRITEs in flight, blocks kept past
    its finish) and one still prefilling (WRITEs in flight): the running leg fails,
    every block of both is free at once, decode's legs fail (prefill went silent) and
    its blocks come back; new P/D requests get a 503."""
    drv, pf, _ = pair("push")
    p, d = drv.p, drv.d
    pf.arm(transfer_delay_s=60.0)  # no WRITE lands before the death
    drv.submit_registered("q", random_prompts([40], seed=1)[0], greedy(3))
    drv.run(until=lambda: "q" in p.connector.sender.sends
            and p.connector.sender.sends["q"].state is SendState.HELD, timeout=10)
    drv.submit_registered("r", random_prompts([300], seed=2)[0], greedy(3))
    drv.run(until=lambda: writes_posted(p, "r", 2), timeout=10)
    assert "p-r" in p.scheduler.requests and "p-q" not in p.scheduler.requests
    assert free(p) < p.stats().num_total_blocks

    kill_transfer_thread(p)
    drv.run(until=lambda: drv.p_legs["r"].finished, timeout=5)
    assert_failed(drv.p_legs["r"], DIED, CRASH)
    assert all_free(p) and not p.connector.sender.sends  # nothing waits for a hold
    drv.run(timeout=10)  # decode's legs end at their lease: prefill is silent
    assert_failed(drv.d_legs["q"])
    assert_failed(drv.d_legs["r"])
    drv.run(until=lambda: all_free(d) and not d.connector.fenced_blocks, timeout=10)
    check_http(p, refuses_new_pd_request(drv, p))


def test_decode_push_death_fails_its_receive_and_frees_fenced_blocks_after_the_hold(pair):
    """Decode dies while prefill WRITEs into its blocks: decode's request fails at once;
    its blocks stay fenced (prefill may still WRITE) until the fence timeout, then come
    back; prefill, no longer heartbeaten, ends its send at its lease and frees."""
    drv, pf, _ = pair("push")
    p, d = drv.p, drv.d
    pf.arm(transfer_delay_s=HOLD_S)
    drv.submit_registered("r", random_prompts([300], seed=3)[0], greedy(3))
    drv.run(until=lambda: writes_posted(p, "r", 2), timeout=10)
    assert d.connector.receiver.recvs["r"].state is RecvState.AWAITING_KV

    kill_transfer_thread(d)
    t0 = time.monotonic()
    drv.run(until=lambda: drv.d_legs["r"].finished, timeout=5)
    assert_failed(drv.d_legs["r"], DIED, CRASH)  # at once: not "lease expired"
    held = d.connector.fenced_blocks
    assert held > 0 and free(d) == d.stats().num_total_blocks - held
    assert "d-r" not in d.scheduler.requests
    drv.run(until=lambda: all_free(p) and not p.connector.sender.sends, timeout=10)
    drv.run(until=lambda: all_free(d) and not d.connector.fenced_blocks, timeout=10)
    assert time.monotonic() - t0 >= HOLD_S * 0.9  # held for the fence timeout
    check_http(d, refuses_new_pd_request(drv, d))


def test_prefill_pull_death_fails_its_legs_and_frees_lent_blocks_after_a_lease(pair):
    """Prefill dies with blocks lent (decode's READ in flight) and a pull leg still
    prefilling: that leg fails, the lent blocks stay lent for a lease (decode may still
    READ them), then come back; decode's READ fails and frees."""
    drv, _, df = pair("pull")
    p, d = drv.p, drv.d
    df.arm(transfer_delay_s=3.0)  # decode's READ is still in flight at the death
    drv.submit("r", random_prompts([40], seed=4)[0], greedy(3))
    drv.run(until=lambda: "r" in d.connector.receiver.recvs
            and d.connector.receiver.recvs["r"].state is RecvState.AWAITING_KV, timeout=10)
    drv.send_prefill("q", random_prompts([300], seed=5)[0], greedy(1))
    drv.run(until=lambda: p.scheduler.requests["p-q"].num_computed_tokens >= 32,
            timeout=10)
    lent = sum(len(b) for b in p.connector.sender.lent.values())
    assert lent > 0

    kill_transfer_thread(p)
    t0 = time.monotonic()
    drv.run(until=lambda: drv.p_legs["q"].finished, timeout=5)
    assert_failed(drv.p_legs["q"], DIED, CRASH)
    assert "p-q" not in p.scheduler.requests
    assert free(p) == p.stats().num_total_blocks - lent  # only the lent blocks wait
    drv.run(until=lambda: all_free(p) and not p.connector.sender.lent, timeout=10)
    assert time.monotonic() - t0 >= HOLD_S * 0.9
    drv.run(timeout=10)  # decode's lease or its READ ends it: prefill is gone
    assert_failed(drv.d_legs["r"])
    drv.run(until=lambda: all_free(d) and not d.connector.receiver.recvs, timeout=10)
    check_http(p, refuses_new_pd_request(drv, p))


def test_decode_pull_death_fails_its_read_and_frees_its_blocks_at_once(pair):
    """Decode dies with its READ in flight: its request fails at once and its blocks
    are free at once (its READ ended with its transport); prefill's lent blocks come
    back at prefill's lease, which decode no longer renews."""
    drv, _, df = pair("pull")
    p, d = drv.p, drv.d
    df.arm(transfer_delay_s=30.0)
    drv.submit("r", random_prompts([40], seed=7)[0], greedy(3))
    drv.run(until=lambda: "r" in d.connector.receiver.recvs
            and d.connector.receiver.recvs["r"].state is RecvState.AWAITING_KV, timeout=10)

    kill_transfer_thread(d)
    drv.run(until=lambda: drv.d_legs["r"].finished, timeout=5)
    assert_failed(drv.d_legs["r"], DIED, CRASH)
    assert all_free(d) and not d.connector.receiver.recvs and not d.connector.fenced_blocks
    drv.run(until=lambda: all_free(p) and not p.connector.sender.lent, timeout=10)
    check_http(d, refuses_new_pd_request(drv, d))


class WaitingChannel(FakeChannel):
    """FakeChannel whose ``recv`` blocks until woken or timed out (the real thread runs)."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log
        self._wake = threading.Event()

    def recv(self, timeout_ms: int) -> list:
        self._wake.wait(timeout_ms / 1000)
        self._wake.clear()
        return []

    def wake(self) -> None:
        self._wake.set()

    def close(self) -> None:
        self.log.append("channel closed")


class LoggingTransport(FakeTransport):
    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log

    def close(self) -> None:
        self.log.append("transport closed")


def running_worker(role: str = "decode") -> tuple[TransferWorker, list, threading.Event]:
    log: list = []
    posted = threading.Event()

    def post(ev) -> None:
        log.append(ev)
        posted.set()

    w = TransferWorker(hello(role, D), WaitingChannel(log), LoggingTransport(log), post,
                       2.0, 0.5)
    w.start()
    return w, log, posted


def test_any_end_of_the_thread_but_stop_is_a_death_told_after_the_transport_closed():
    """An exception of any kind escaping the loop (SystemExit too), or a Stop the engine
    did not send, ends the thread as a death: ``death`` says why (what /health shows)
    and WorkerDied is its last event, posted once the transport is closed (the step
    loop frees blocks on it). ``stop()`` is no death."""
    w, log, posted = running_worker()

    def exit_now(now: float) -> None:
        raise SystemExit("interpreter going down")

    w._heartbeat = exit_now
    w._next_heartbeat = 0.0
    w.channel.wake()
    assert posted.wait(5)
    w._thread.join(5)
    # (issue 40: on a death the transport closes first, so that the dying thread tells
    # its peers over the side channel only once nothing of its own can land)
    assert log == ["transport closed", "channel closed",
                   c.WorkerDied("SystemExit: interpreter going down", True)]
    assert w.death == "SystemExit: interpreter going down"

    w, log, posted = running_worker()
    w.submit(c.Stop())  # not through stop()
    assert posted.wait(5)
    assert isinstance(log[-1], c.WorkerDied) and "without being asked" in log[-1].why
    assert w.death is not None

    w, log, posted = running_worker()
    assert w.death is None
    w.stop()
    assert log == ["channel closed", "transport closed"] and w.death is None
