"""Elastic membership against a real etcd (tests/etcd_helpers.py, no mock): instances
register with `kvpush serve --register`, in-process routers follow with --discover.

Join, leave by drain (SIGTERM), leave by crash (SIGKILL: the lease expires), etcd
stopped and restarted under a running router, two routers on one prefix, a card that
does not match its instance. Each keeps traffic going through the router and checks
that requests succeed and that every instance's free blocks return to their start.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from etcd_helpers import EtcdServer, require_etcd
from kvpush.discovery.target import parse_target
from router_helpers import Instance, RouterThread, signed, start_instances, wait_until
from stand_in import make_kv_info, stand_in

require_etcd()  # skips the module, saying why, where no etcd binary can be had

pytestmark = pytest.mark.timeout(180)

KV = ("--block-size", "16", "--num-blocks", "128", "--kv-transfer", "push",
      "--lease-timeout", "2", "--heartbeat-interval", "0.2")
TTL = "2"
BODY = {"prompt": "the quick brown fox jumps over the lazy dog", "max_tokens": 6,
        "temperature": 0}


def reg(etcd: EtcdServer, role: str, prefix: str = "kvpush", ttl: str = TTL) -> tuple:
    return ("--role", role, *KV, "--register", etcd.url(prefix), "--register-ttl", ttl,
            "--drain-grace", "0.5")


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("membership-logs")


@pytest.fixture(scope="module")
def etcd(tmp_path_factory, logs) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path_factory.mktemp("etcd-data") / "data", logs)
    yield server
    server.stop()


@dataclass
class Members:
    """The instances registered under /kvpush/ now (tests run in file order and hand
    the cluster on: the drain test replaces D0 by D1)."""

    prefill: Instance
    decode: Instance
    #: a second decode, joined with the first and crashed by the crash test
    spare: Instance | None = None


@pytest.fixture(scope="module")
def base(tiny_llama, etcd, logs) -> Iterator[Members]:
    """A prefill and a decode registered under /kvpush/ for the whole module."""
    p0, d0 = start_instances(tiny_llama, [("P0", reg(etcd, "prefill")),
                                          ("D0", reg(etcd, "decode"))], logs)
    m = Members(p0, d0)
    started = [p0, d0]
    m.started = started  # type: ignore[attr-defined]
    yield m
    for i in started + [m.decode]:
        i.stop()


def router(etcd: EtcdServer, prefix: str = "kvpush", **kw) -> RouterThread:
    return RouterThread("push", [], [], discover=parse_target(etcd.url(prefix)), **kw)


def pool(rt: RouterThread) -> set[str]:
    return {i["url"] for i in rt.instances()}


def running(inst: Instance) -> float:
    """Requests in the instance's running batch now (from its /metrics)."""
    from router_helpers import metric_value

    text = httpx.get(inst.url + "/metrics", timeout=5).text
    return metric_value(text, "kvpush_num_requests_running")


def kv_index(rt: RouterThread, url: str) -> dict | None:
    return next((i.get("kv_index") for i in rt.instances() if i["url"] == url), None)


def healthy(rt: RouterThread) -> dict[str, str]:
    return {i["url"]: i["role"] for i in rt.instances() if i["healthy"]}


class Traffic:
    """Requests through the router from two threads, each pausing PAUSE_S between two,
    until stopped (bounded: 3000 requests or 120 s); records each status."""

    PAUSE_S = 0.05

    def __init__(self, url: str) -> None:
        self.url, self.results = url, []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(2)]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        deadline = time.monotonic() + 120
        with httpx.Client(timeout=60) as c:
            while not self._stop.is_set() and len(self.results) < 3000 \
                    and time.monotonic() < deadline:
                try:
                    r = c.post(self.url + "/v1/completions", json=BODY)
                    self.results.append((time.monotonic(), r.status_code, r.text[:200]))
                except Exception as e:  # noqa: BLE001 - recorded, the test fails on it
                    self.results.append((time.monotonic(), 0, repr(e)))
                self._stop.wait(self.PAUSE_S)

    def wait_count(self, n: int, timeout: float = 30.0) -> None:
        start = len(self.results)
        wait_until(lambda: len(self.results) >= start + n, timeout,
                   f"{n} more requests (alive: {[t.is_alive() for t in self._threads]}, "
                   f"last: {self.results[-3:]})")

    def stop(self) -> list[tuple[float, int, str]]:
        self._stop.set()
        for t in self._threads:
            t.join(60)
        return self.results


def assert_all_ok(results: list, since: float = 0.0) -> None:
    bad = [r for r in results if r[0] >= since and r[1] != 200]
    assert not bad, bad[:3]
    assert [r for r in results if r[0] >= since], "no request was sent"


def free_blocks_back(insts: list[Instance]) -> None:
    for inst in insts:
        inst.wait_all_free()


def test_join_then_leave_by_drain(tiny_llama, etcd, base, logs):
    p0, d0 = base.prefill, base.decode
    rt = router(etcd, policy="cache-aware")
    try:
        wait_until(lambda: set(healthy(rt)) == {p0.url, d0.url}, 20, "P0 and D0 in rotation")
        traffic = Traffic(rt.url)
        traffic.wait_count(3)
        # join: two more decodes register; the router takes them in while requests flow
        d1, d2 = start_instances(tiny_llama, [("D1", reg(etcd, "decode")),
                                              ("D2", reg(etcd, "decode"))], logs)
        base.decode, base.spare = d1, d2
        base.started.append(d2)
        wait_until(lambda: {d1.url, d2.url} <= pool(rt), 1.5,
                   "D1 and D2 in the router's pool within a second of being ready")
        wait_until(lambda: {d1.url, d2.url} <= set(healthy(rt)), 10, "D1, D2 in rotation")
        # its KV-event index started when it joined
        wait_until(lambda: kv_index(rt, d1.url) is not None, 5, "D1's KV index")
        traffic.wait_count(6)
        # leave by drain: SIGTERM D0 while it runs a long request; its key goes first
        # (the router drops it within a second), that request finishes, then it exits
        long_answer: list = []
        long_req = threading.Thread(target=lambda: long_answer.append(httpx.post(
            d0.url + "/v1/completions", timeout=60,
            json={**BODY, "max_tokens": 1200, "ignore_eos": True})))
        long_req.start()
        wait_until(lambda: running(d0) > 0 or not long_req.is_alive(), 10, "D0 busy")
        assert long_req.is_alive(), "the long request ended before the SIGTERM"
        d0.proc.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        wait_until(lambda: d0.url not in pool(rt), 1.5, "D0 dropped within a second")
        long_req.join(60)
        print(f"the long request ended {time.monotonic() - signalled:.2f} s after SIGTERM")
        d0.proc.proc.wait(20)
        assert long_answer and long_answer[0].status_code == 200, long_answer
        assert long_answer[0].json()["usage"]["completion_tokens"] == 1200
        traffic.wait_count(6)
        assert_all_ok(traffic.stop())
        assert len([k for k in etcd.registered() if "/decode/" in k]) == 2  # D1's, D2's
        # D0's KV index went with it: the router follows the others' events only
        followed = {i.url for i in rt.router.placement.index._followers}
        assert followed == {p0.url, d1.url, d2.url}
        free_blocks_back([p0, d1, d2])
    finally:
        rt.stop()


def test_leave_by_crash_lease_expires(etcd, base):
    p0, d1, d2 = base.prefill, base.decode, base.spare
    assert d2 is not None, "the drain test starts D2"
    rt = router(etcd, health_interval_s=30)  # only the lease expiry can drop it
    try:
        wait_until(lambda: set(healthy(rt)) == {p0.url, d1.url, d2.url}, 20, "all in rotation")
        traffic = Traffic(rt.url)
        traffic.wait_count(4)
        d2.kill()  # no drain: its key stays until its 2 s lease expires
        killed = time.monotonic()
        wait_until(lambda: d2.url not in pool(rt), 6, "D2 dropped when its lease expired")
        assert time.monotonic() - killed > 0.5, "dropped before the lease could expire?"
        assert len([k for k in etcd.registered() if "/decode/" in k]) == 1
        since = time.monotonic()
        traffic.wait_count(6)
        results = traffic.stop()
        # legs in flight on D2 when it was killed may fail; every request after its
        # lease expired succeeds, on D1
        assert_all_ok(results, since)
        free_blocks_back([p0, d1])
    finally:
        rt.stop()


def test_etcd_restart_keeps_view_and_catches_up(etcd, base):
    from kvpush.discovery.card import card_from_info, encode

    p0, d1 = base.prefill, base.decode
    rt = router(etcd)
    try:
        wait_until(lambda: set(healthy(rt)) == {p0.url, d1.url}, 20, "P0 and D1 in rotation")
        traffic = Traffic(rt.url)
        traffic.wait_count(2)
        etcd.stop()

        def membership() -> dict:
            return httpx.get(rt.url + "/health", timeout=5).json()["membership"]

        wait_until(lambda: membership()["state"] == "unreachable", 5, "/health says so")
        assert membership()["error"]
        traffic.wait_count(4)  # the last view serves
        etcd.start()
        wait_until(lambda: membership()["state"] == "watching", 10, "back to watching")
        # the instances' leases survived (same data dir): they are still registered;
        # and a change made after the restart reaches the router
        wait_until(lambda: len(etcd.registered()) == 2, 10, "both keys still there")
        ghost = card_from_info("http://127.0.0.1:9", make_kv_info(**{**d1.get("/kv/info"),
                                                                   "engine_id": "ghost"}))
        etcd.put("/kvpush/instances/decode/ghost", encode(signed(ghost)))
        wait_until(lambda: ghost.url in pool(rt), 2, "a card written after the restart")
        assert ghost.url not in healthy(rt)  # it does not answer: no traffic
        etcd.delete("/kvpush/instances/decode/ghost")
        wait_until(lambda: ghost.url not in pool(rt), 2, "and deleted")
        traffic.wait_count(4)
        assert_all_ok(traffic.stop())
        free_blocks_back([p0, d1])
    finally:
        rt.stop()


def test_two_routers_one_prefix_and_static_beside(etcd, base):
    p0, d1 = base.prefill, base.decode
    r1 = router(etcd)
    # the second router has D1 on its command line too: that static entry stays, and
    # D1's card is ignored rather than listed twice
    r2 = RouterThread("push", [], [d1.url], discover=parse_target(etcd.url()))
    try:
        wait_until(lambda: set(healthy(r1)) == {p0.url, d1.url}, 20, "router 1")
        wait_until(lambda: set(healthy(r2)) == {p0.url, d1.url}, 20, "router 2")
        assert len(r2.instances()) == 2
        t1, t2 = Traffic(r1.url), Traffic(r2.url)
        t1.wait_count(4)
        t2.wait_count(4)
        assert_all_ok(t1.stop())
        assert_all_ok(t2.stop())
        free_blocks_back([p0, d1])
    finally:
        r1.stop()
        r2.stop()


def test_card_that_does_not_match_is_refused(etcd, base):
    from kvpush.discovery.card import card_from_info, encode

    p0, d1 = base.prefill, base.decode
    info = d1.get("/kv/info")
    stale = card_from_info(d1.url, make_kv_info(**{**info, "engine_id": "not-d1"}))

    # signed (a stale card of the cluster's own), but the instance is not what it says
    etcd.put("/forged/instances/decode/not-d1", encode(signed(stale)))
    etcd.put("/forged/instances/decode/junk", b"{not a card")
    # unsigned: dropped before anything connects to the URL it names
    etcd.put("/forged/instances/decode/unsigned",
             encode(card_from_info("http://127.0.0.1:9",
                                   make_kv_info(**{**info, "engine_id": "u"}))))
    rt = RouterThread("push", [p0.url], [], discover=parse_target(etcd.url("forged")))
    try:
        def state() -> dict:
            return next((i for i in rt.instances() if i["url"] == d1.url), {})

        wait_until(lambda: bool(state().get("misconfigured")), 10, "the forged card refused")
        assert "does not match its /kv/info" in state()["misconfigured"]
        assert "engine_id" in state()["misconfigured"]
        assert not state()["healthy"]
        assert "http://127.0.0.1:9" not in {i["url"] for i in rt.instances()}
        r = httpx.post(rt.url + "/v1/completions", json=BODY, timeout=30)
        assert r.status_code == 503  # no usable decode: the forged one gets nothing
        h = httpx.get(rt.url + "/health", timeout=5)
        assert h.status_code == 503 and h.json()["membership"]["state"] == "watching"
        assert "error" in h.json()  # still an OpenAI-style error body
    finally:
        rt.stop()


def test_router_started_before_its_instances(etcd, base):
    """A cache-aware router watching an empty prefix serves /health 503, then takes the
    instances in when their cards appear, and loads the tokenizer from the decode that
    joined (it had none to ask at start)."""
    from kvpush.discovery.card import card_from_info, encode

    p0, d1 = base.prefill, base.decode
    rt = router(etcd, prefix="late", policy="cache-aware")
    try:
        assert httpx.get(rt.url + "/health", timeout=5).status_code == 503

        for inst in (p0, d1):
            info = inst.get("/kv/info")
            etcd.put(f"/late/instances/{info['role']}/{info['engine_id']}",
                     encode(signed(card_from_info(inst.url, make_kv_info(**info)))))
        wait_until(lambda: set(healthy(rt)) == {p0.url, d1.url}, 10, "both joined")
        tok = rt.router.tokenizer
        wait_until(lambda: tok.state.value == "ready", 20, f"tokenizer loaded ({tok.why})")
        # ready means ready: 200 only once the tokenizer it routes with has loaded
        assert httpx.get(rt.url + "/health", timeout=5).status_code == 200
        r = httpx.post(rt.url + "/v1/completions", json=BODY, timeout=60)
        assert r.status_code == 200, r.text
        free_blocks_back([p0, d1])
    finally:
        rt.stop()


def test_a_card_cannot_evict_a_working_instance(etcd, base, caplog):
    """A card naming the working decode's URL as another engine (issue 53.2): ignored,
    one log line, and the decode keeps getting every request."""
    import logging

    from kvpush.discovery.card import card_from_info, encode

    caplog.set_level(logging.INFO, "kvpush.router")
    p0, d1 = base.prefill, base.decode
    rt = router(etcd)
    try:
        wait_until(lambda: {p0.url, d1.url} <= set(healthy(rt)), 15, "both in rotation")
        t = Traffic(rt.url)
        t.wait_count(4)
        info = d1.get("/kv/info")
        key = "/kvpush/instances/decode/impostor"
        impostor = card_from_info(d1.url, make_kv_info(**{**info, "engine_id": "impostor"}))
        etcd.put(key, encode(signed(impostor)))
        wait_until(lambda: "impostor" in caplog.text, 5, "the card seen")
        before = next(i["requests"] for i in rt.instances() if i["url"] == d1.url)
        t.wait_count(10)
        after = next(i for i in rt.instances() if i["url"] == d1.url)
        assert after["healthy"] and after["requests"] >= before + 5
        lines = [r.getMessage() for r in caplog.records if "impostor" in r.getMessage()]
        assert len(lines) == 1 and "ignored" in lines[0], lines
        etcd.delete(key)
        assert_all_ok(t.stop())
        free_blocks_back([p0, d1])
    finally:
        rt.stop()


def test_a_fake_copying_a_real_instance_is_never_admitted(etcd, base):
    """A fake decode whose /kv/info is the real decode's, and which relays the router's
    challenge to the real decode (issue 53.1): given on the router's command line or by
    a card (signed, naming the fake's URL with the real identity), it never gets into
    rotation, never sees the router's API key, never receives a prompt."""
    from fastapi import Request
    from fastapi.responses import Response

    from kvpush.discovery.card import card_from_info, encode
    from server_helpers import uvicorn_server

    p0, d1 = base.prefill, base.decode
    info = d1.get("/kv/info")
    seen: list[tuple[str, str | None]] = []
    app = stand_in(info)

    @app.middleware("http")
    async def record(request: Request, call_next):  # noqa: ANN001, ANN202
        seen.append((request.url.path, request.headers.get("authorization")))
        return await call_next(request)

    @app.post("/kv/prove")
    async def relay(request: Request) -> Response:  # the real decode refuses the URL
        async with httpx.AsyncClient() as c:
            r = await c.post(d1.url + "/kv/prove", content=await request.body())
        return Response(r.content, status_code=r.status_code,
                        media_type="application/json")

    with uvicorn_server(app) as fake_url:
        etcd.put("/fake/instances/decode/copy",
                 encode(signed(card_from_info(fake_url, make_kv_info(**info)))))
        static = RouterThread("push", [p0.url], [fake_url], wait=False, api_key="router-key")
        found = RouterThread("push", [p0.url], [], discover=parse_target(etcd.url("fake")),
                             api_key="router-key")
        try:
            for rt in (static, found):
                def refused(rt: RouterThread = rt) -> bool:  # (the operator view needs
                    inst = rt.router.pool.find(fake_url)   # an admin key: read it here)
                    return inst is not None and "secret" in (inst.misconfigured or "")

                wait_until(refused, 10, "the fake refused")
                r = httpx.post(rt.url + "/v1/completions", json=BODY, timeout=30,
                               headers={"Authorization": "Bearer router-key"})
                assert r.status_code == 503, r.text
            time.sleep(1.0)  # a few more health rounds
            assert not any(rt.router.pool.find(fake_url).healthy for rt in (static, found))
        finally:
            static.stop()
            found.stop()
    assert {path for path, _ in seen} <= {"/health", "/kv/prove"}, seen
    assert all(auth is None for _, auth in seen), seen
