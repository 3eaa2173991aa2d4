"""`kvpush router` over real `kvpush serve` processes (tiny random Llama, greedy).

The instances are the session's shared ``router_cluster`` (router_helpers.RouterCluster,
shared with test_router_cores.py): a single role=both instance (the reference, and the
colocated mode's instance), a push 2P2D cluster with short leases (the fault tests kill
and restart its members), and a pull 1P1D pair; each test leaves every free-block count
as it found it. Routers run in-process (uvicorn in a thread) but for the CLI tests.
Every wait is bounded; every process and thread started here is stopped here.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec
import pytest

from kvpush.discovery.instance_spec import InstanceSpecError, parse_instance
from kvpush.router.config import RouterConfig, RouterConfigError
from kvpush.router.pool import Pool
from router_helpers import (
    CHATS,
    PROMPTS,
    Instance,
    RouterCluster,
    RouterThread,
    answer_text,
    body,
    chat_body,
    cluster_secret,
    metric_value,
    reference_answers,
    sse_text,
    stream,
    wait_until,
)
from server_helpers import free_port
from stand_in import make_kv_info
from waits import settled

pytestmark = pytest.mark.timeout(120)

@pytest.fixture
def cluster(router_cluster: RouterCluster) -> Iterator[RouterCluster]:
    """The shared instances; each test leaves every free-block count as it found it."""
    yield router_cluster
    router_cluster.wait_all_free()


@pytest.fixture(scope="module")
def refs(router_cluster: RouterCluster) -> dict:
    """Greedy answers of the single instance: refs[("completion"|"chat", i)] -> text."""
    return reference_answers(router_cluster.single.url)


_body, _chat = body, chat_body


def _run_all(url: str) -> list[tuple[tuple[str, int], str]]:
    """Every prompt and chat through ``url``, streaming and not, all at once."""

    def one(kind: str, i: int, stream: bool) -> tuple[tuple[str, int], str]:
        with httpx.Client(timeout=60) as c:
            chat = kind == "chat"
            body = _chat(CHATS[i]) if chat else _body(PROMPTS[i])
            if stream:
                text, reason, frames = sse_text(c, url, body, chat=chat)
                assert reason == "length" and not any("error" in f for f in frames)
                return (kind, i), text
            path = "/v1/chat/completions" if chat else "/v1/completions"
            r = c.post(url + path, json=body)
            assert r.status_code == 200, r.text
            assert r.json()["id"] == r.headers["x-request-id"]  # decode got the router's id
            return (kind, i), answer_text(r.json(), chat=chat)

    jobs = [("completion", i) for i in range(len(PROMPTS))] + [
        ("chat", i) for i in range(len(CHATS))]
    with ThreadPoolExecutor(8) as ex:
        futs = [ex.submit(one, k, i, s) for k, i in jobs for s in (False, True)]
        return [f.result(timeout=90) for f in futs]


# ------------------------------------------------------------------ outputs and modes


@pytest.mark.parametrize("mode", ["push", "pull", "colocated"])
def test_outputs_equal_single_instance(cluster, refs, mode):
    if mode == "push":
        ps, ds = cluster.push_p[:1], cluster.push_d[:1]
    elif mode == "pull":
        ps, ds = [cluster.pull_p], [cluster.pull_d]
    else:
        ps, ds = [], [cluster.single]
    def transfers() -> float:  # decode's KV transfers that completed
        return metric_value(httpx.get(ds[0].url + "/metrics", timeout=10).text,
                            "kvpush_kv_transfers_ok_total")

    rt = RouterThread(mode, [p.url for p in ps], [d.url for d in ds])
    try:
        results = _run_all(rt.url)
        for key, text in results:
            assert text == refs[key], key
        n = len(results)
        # a prompt decode has never seen: its KV comes over (decode got the router's
        # kv_transfer_params and did not silently recompute)
        # (read once the counter has settled: an instance publishes its transfer
        # counters with its next snapshot, a little after the answers they count)
        before = settled(transfers)
        r = httpx.post(rt.url + "/v1/completions", timeout=60,
                       json=_body(f"{mode} fresh prompt {time.time()} " * 4))
        assert r.status_code == 200, r.text
        want = 0 if mode == "colocated" else 1
        wait_until(lambda: transfers() - before >= want, 10, "the fresh prompt's transfer")
        assert settled(transfers) - before == want
        n += 1
        if mode != "colocated":  # push: prefill legs may still be draining
            # a repeated prompt is a full prefix hit on decode: its prefill leg ends "ok"
            # (aborted after it began) or "skipped" (refused before), as the race goes
            def legs_done() -> float:
                m = rt.metrics()
                return sum(metric_value(m, "kvpush_router_prefill_leg_seconds_count",
                                        f'outcome="{o}"') for o in ("ok", "skipped"))
            wait_until(lambda: legs_done() == n, 10, "P legs")
            assert metric_value(rt.metrics(), "kvpush_router_prefill_leg_seconds_count",
                                'outcome="http_error"') == 0
        m = rt.metrics()
        assert metric_value(m, "kvpush_router_requests_total",
                            f'mode="{mode}",outcome="ok"') == n
        assert metric_value(m, "kvpush_router_time_to_first_token_seconds_count",
                            f'mode="{mode}"') == len(results) // 2
        assert metric_value(m, "kvpush_router_instance_in_flight") == 0
        assert metric_value(m, "kvpush_router_instance_healthy") == len(ps) + len(ds)
        models = httpx.get(rt.url + "/v1/models", timeout=10).json()
        assert models["data"][0]["id"] == cluster.single.get("/v1/models")["data"][0]["id"]
        assert httpx.get(rt.url + "/health", timeout=10).json()["status"] == "ok"
        # an instance's 4xx comes back as it is (OpenAI body and status)
        r = httpx.post(rt.url + "/v1/completions", json=_body("x", max_tokens=0), timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        # malformed bodies: a 400 that says what is wrong (NaN: the HTTP legs' JSON
        # check, or the front's check of the field over the engine cores)
        for bad, says in ((b"{nope", ("JSON",)), (b"[1]", ("JSON",)),
                          (b'{"prompt": "x", "temperature": NaN}', ("JSON", "temperature"))):
            r = httpx.post(rt.url + "/v1/completions", content=bad, timeout=30)
            message = r.json()["error"]["message"]
            assert r.status_code == 400 and any(w in message for w in says), r.text
        for inst in ps + ds:
            inst.wait_all_free()
    finally:
        rt.stop()


def test_round_robin_spreads_over_both_prefills(cluster):
    """2P2D round robin: every P and every D gets half the requests."""

    insts = cluster.push_p + cluster.push_d
    rt = RouterThread("push", [p.url for p in cluster.push_p],
                      [d.url for d in cluster.push_d])
    try:
        wait_until(lambda: httpx.get(rt.url + "/health", timeout=5).json().get("legs")
                   == "engine cores", 20, "the router serves over the engine cores")
        with httpx.Client(timeout=60) as c:
            for k in range(8):
                r = c.post(rt.url + "/v1/completions", json=_body(PROMPTS[k % 3]))
                assert r.status_code == 200, r.text
        states = rt.instances()
        assert [s["requests"] for s in states] == [4, 4, 4, 4]
        assert {s["engine_id"] for s in states} == {i.get("/kv/info")["engine_id"]
                                                    for i in insts}
        for inst in insts:
            inst.wait_all_free()
    finally:
        rt.stop()


def _fake_pool(policy: str, n: int = 3) -> Pool:
    cfg = RouterConfig(mode="push", policy=policy,  # type: ignore[arg-type]
                       prefill=tuple(parse_instance(f"127.0.0.1:{9000 + i}") for i in range(n)),
                       decode=(parse_instance("127.0.0.1:9100"),))
    pool = Pool(cfg)
    for inst in pool.instances:
        inst.healthy = True
    return pool


def test_instance_specs():
    s = parse_instance("127.0.0.1:8100")
    assert s.url == "http://127.0.0.1:8100" and s.explicit is None
    s = parse_instance("http://h:1/@vllm-p@10.0.0.1:5600")
    assert s.url == "http://h:1" and s.explicit is not None
    assert (s.explicit.engine_id, s.explicit.side_channel_host,
            s.explicit.side_channel_port) == ("vllm-p", "10.0.0.1", 5600)
    for bad in ("h", "http://h:1/v1", "h:1@only-engine", "h:1@e@h:99999", "ftp://h:1"):
        with pytest.raises(InstanceSpecError):
            parse_instance(bad)
    with pytest.raises(RouterConfigError, match="listed twice"):
        RouterConfig(mode="pull", prefill=(parse_instance("h:1"),),
                     decode=(parse_instance("http://h:1"),))


def test_kvpush_and_vllm_instances_are_not_paired():
    """A kvpush prefill (it answers /kv/info) next to healthy vLLM decodes, or a vLLM
    prefill next to kvpush decodes, stays out of the rotation with the reason (their KV
    layouts differ: a transfer between them would give wrong tokens); instances of one
    kind pair as before, and a colocated router mixes kinds freely."""
    kvpush = make_kv_info(engine_id="p-1", role="prefill", kv_transfer="pull",
                          request_plane="127.0.0.1:9", request_plane_members=False,
                          side_channel_host="127.0.0.1", side_channel_port=5600)
    cfg = RouterConfig(mode="pull", prefill=(parse_instance("127.0.0.1:9000"),),
                       decode=(parse_instance("127.0.0.1:9100"),))
    pool = Pool(cfg)
    (p,), (d,) = pool.by_role["prefill"], pool.by_role["decode"]
    d.healthy, d.info = True, None  # a vLLM decode
    why = pool.verify(p, kvpush)
    assert why is not None and "a kvpush instance" in why and "layouts differ" in why
    assert pool.verify(p, None) is None  # a vLLM prefill pairs with it
    d.info = msgspec.structs.replace(kvpush, role="decode")  # now a kvpush decode
    why = pool.verify(p, None)
    assert why is not None and "a vLLM instance" in why
    assert pool.verify(p, kvpush) is None
    col = Pool(RouterConfig(mode="colocated", prefill=(),
                            decode=(parse_instance("h:1"), parse_instance("h:2"))))
    a, b = col.by_role["decode"]
    a.healthy, a.info = True, None
    assert col.verify(b, msgspec.structs.replace(kvpush, role="both")) is None


def test_policies_pick_order():
    pool = _fake_pool("round-robin")
    ps = pool.by_role["prefill"]
    assert [pool.pick("prefill").index for _ in range(4)] == [0, 1, 2, 0]
    ps[1].healthy = False
    assert [pool.pick("prefill").index for _ in range(3)] == [2, 0, 2]
    assert pool.pick("prefill", exclude=[ps[0], ps[2]]) is None
    pool = _fake_pool("least-outstanding")
    ps = pool.by_role["prefill"]
    a, b = pool.pick("prefill"), pool.pick("prefill")  # 0 then 1 (tie -> round robin)
    assert (a.index, b.index) == (0, 1)
    assert pool.pick("prefill").index == 2  # the only one with nothing in flight
    pool.release(ps[1])
    assert pool.pick("prefill").index == 1
    pool.release(ps[0])
    pool.release(ps[2])
    assert [pool.pick("prefill").index for _ in range(2)] == [2, 0]  # ties: rotation on
    assert [i.in_flight for i in ps] == [1, 1, 1]


# ------------------------------------------------------------------ no prefill, fallback


def test_no_healthy_prefill_503_then_fallback(cluster, refs):
    dead = f"http://127.0.0.1:{free_port()}"
    d = cluster.push_d[0]
    rt = RouterThread("push", [dead], [d.url], wait=False)
    try:
        r = httpx.get(rt.url + "/health", timeout=10)
        assert r.status_code == 503 and "error" in r.json()
        r = httpx.post(rt.url + "/v1/completions", json=_body(PROMPTS[0]), timeout=30)
        assert r.status_code == 503
        err = r.json()["error"]
        # the instance is named in the router's log, not to the client
        assert "no healthy prefill instance" in err["message"]
        assert dead.removeprefix("http://") not in err["message"]
        assert err["type"] == "server_error"
        assert metric_value(rt.metrics(), "kvpush_router_requests_total",
                            'mode="push",outcome="unavailable"') == 1
    finally:
        rt.stop()
    rt = RouterThread("push", [dead], [d.url], fallback_local_prefill=True)
    try:
        assert httpx.get(rt.url + "/health", timeout=10).status_code == 200
        with httpx.Client(timeout=60) as c:
            r = c.post(rt.url + "/v1/completions", json=_body(PROMPTS[0]))
            assert r.status_code == 200 and answer_text(r.json()) == refs[("completion", 0)]
            text, _, _ = sse_text(c, rt.url, _chat(CHATS[0]), chat=True)
            assert text == refs[("chat", 0)]
        assert metric_value(rt.metrics(), "kvpush_router_requests_total",
                            'mode="fallback",outcome="ok"') == 2
        d.wait_all_free()
    finally:
        rt.stop()


# ------------------------------------------------------------------ client disconnects


def test_client_disconnect_aborts_both_legs(cluster):
    p, d = cluster.push_p[0], cluster.push_d[0]

    rt = RouterThread("push", [p.url], [d.url])
    try:
        long = _body(PROMPTS[2], max_tokens=1900, ignore_eos=True)
        with httpx.Client(timeout=30) as c, c.stream(
                "POST", rt.url + "/v1/completions", json={**long, "stream": True}) as r:
            assert r.status_code == 200
            next(r.iter_raw())  # the first chunk, then hang up
        # non-streaming: the client gives up while decode generates
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(rt.url + "/v1/completions", json=long, timeout=0.3)
        p.wait_all_free(timeout=15)
        d.wait_all_free(timeout=15)
        wait_until(lambda: metric_value(rt.metrics(), "kvpush_router_requests_total",
                                        'outcome="abort"') == 2, 10, "two aborts counted")
        assert metric_value(rt.metrics(), "kvpush_router_instance_in_flight") == 0
    finally:
        rt.stop()


# ------------------------------------------------------------------ instances killed


class Traffic:
    """Workers sending requests (completions and chat, streaming and not) in a loop until
    stopped; every outcome is recorded as (start, end, verdict, detail)."""

    def __init__(self, url: str, refs: dict, workers: int = 3) -> None:
        self.url, self.refs = url, refs
        self.stop_event = threading.Event()
        self.results: list[tuple[float, float, str, str]] = []
        self.threads = [threading.Thread(target=self._run, args=(w,), daemon=True)
                        for w in range(workers)]
        for t in self.threads:
            t.start()

    def _one(self, c: httpx.Client, k: int) -> tuple[str, str]:
        chat, streaming = k % 2 == 1, k % 3 == 0
        i = k % (len(CHATS) if chat else len(PROMPTS))
        body = _chat(CHATS[i]) if chat else _body(PROMPTS[i])
        want = self.refs[("chat" if chat else "completion", i)]
        if streaming:
            status, text, _, frames, err = stream(c, self.url, body, chat=chat, timeout=30)
            errors = [f["error"]["message"] for f in frames if "error" in f]
        else:
            path = "/v1/chat/completions" if chat else "/v1/completions"
            r = c.post(self.url + path, json=body)
            status, err, errors = r.status_code, None, []
            text = answer_text(r.json(), chat=chat) if status == 200 else ""
            if status != 200:
                err = r.json()
        if status != 200:
            # a failed request is a 5xx with an OpenAI-style body and a message
            assert status >= 500 and err["error"]["message"], (status, err)
            return "error", f"{status} {err['error']['message']}"
        if errors:  # the stream had started: the error came in-band
            assert all(errors), frames
            return "error", errors[0]
        return ("ok" if text == want else "wrong"), text

    def _run(self, w: int) -> None:
        k = w
        with httpx.Client(timeout=30) as c:
            while not self.stop_event.is_set():
                t0 = time.monotonic()
                try:
                    verdict, detail = self._one(c, k)
                except Exception as e:  # noqa: BLE001 - recorded; the test fails on it
                    verdict, detail = "exception", repr(e)
                self.results.append((t0, time.monotonic(), verdict, detail))
                k += 1

    def count(self, verdict: str = "ok", since: float = 0.0) -> int:
        return sum(1 for r in list(self.results) if r[2] == verdict and r[0] >= since)

    def stop(self) -> list[tuple[float, float, str, str]]:
        self.stop_event.set()
        for t in self.threads:
            t.join(40)
            assert not t.is_alive(), "a request hung"
        return self.results


def _state(rt: RouterThread, url: str) -> dict:
    return next(s for s in rt.instances() if s["url"] == url)


def _served(rt: RouterThread, inst: Instance) -> float:
    """Legs the router has sent the instance (over its engine core or its HTTP API)."""
    return _state(rt, inst.url)["requests"]


def _kill_during_traffic(cluster: RouterCluster, refs: dict, victim: Instance,
                         noticed_by: str) -> None:
    """SIGKILL ``victim`` (a member of the push 2P2D cluster) under traffic: in-flight
    requests end (answer or clear 5xx) within bounds, later ones go to the others, blocks
    come free on the survivors; restarted on its port (new engine id, new side channel),
    it is back in rotation and gets requests again.

    noticed_by="request": health checks are too rare to matter, so the router learns of
    the death from a leg's connection error (and sends that leg elsewhere);
    "health": the periodic checks notice it."""
    ps, ds = cluster.push_p, cluster.push_d
    interval = 60.0 if noticed_by == "request" else 0.3
    rt = RouterThread("push", [p.url for p in ps], [d.url for d in ds],
                      health_interval_s=interval)
    traffic = Traffic(rt.url, refs)
    try:
        wait_until(lambda: traffic.count() >= 6, 30, "traffic flowing")
        old_engine = victim.get("/kv/info")["engine_id"]
        victim.kill()
        wait_until(lambda: not _state(rt, victim.url)["healthy"], 10, "victim out of rotation")
        t_down = time.monotonic()
        wait_until(lambda: traffic.count(since=t_down) >= 6, 30, "traffic after the kill")
        results = traffic.stop()
        bad = [r for r in results if r[2] in ("exception", "wrong")]
        assert not bad, bad
        assert max(end - start for start, end, _, _ in results) < 25  # nothing hung
        after = [r for r in results if r[0] >= t_down]
        assert all(r[2] == "ok" for r in after), [r for r in after if r[2] != "ok"]
        if noticed_by == "request":
            assert _state(rt, victim.url)["failures"] >= 1
            # As between a death and the next check: the router still thinks it is up.
            # The leg that hits it cannot connect, and goes to the other instance.
            inst = next(i for i in rt.router.pool.instances if i.url == victim.url)
            inst.healthy = True
            role = "prefill" if victim in ps else "decode"
            with httpx.Client(timeout=60) as c:
                for k in range(2):
                    r = c.post(rt.url + "/v1/completions", json=_body(PROMPTS[k]))
                    assert r.status_code == 200 and answer_text(r.json()) == \
                        refs[("completion", k)]
            assert metric_value(rt.metrics(), "kvpush_router_retries_total",
                                f'role="{role}"') >= 1
            assert not _state(rt, victim.url)["healthy"]
        survivors = [i for i in ps + ds if i is not victim]
        for inst in survivors:
            inst.wait_all_free(timeout=20)
        if noticed_by == "request":  # a router that checks often enough for what follows
            rt.stop()
            rt = RouterThread("push", [p.url for p in ps], [d.url for d in ds])
            assert not _state(rt, victim.url)["healthy"]
        # the same port again: a new engine id and side channel, back in rotation
        victim.restart()
        wait_until(lambda: _state(rt, victim.url)["healthy"], 20, "victim back in rotation")
        new_engine = victim.get("/kv/info")["engine_id"]
        assert new_engine != old_engine and _state(rt, victim.url)["engine_id"] == new_engine
        before = _served(rt, victim)
        with httpx.Client(timeout=60) as c:
            for k in range(4):
                r = c.post(rt.url + "/v1/completions", json=_body(PROMPTS[k % 3]))
                assert r.status_code == 200 and answer_text(r.json()) == \
                    refs[("completion", k % 3)]
        wait_until(lambda: _served(rt, victim) - before == 2, 10, "victim served its share")
        for inst in ps + ds:
            inst.wait_all_free(timeout=20)
        m = rt.metrics()
        assert metric_value(m, "kvpush_router_instance_healthy") == 4
        assert metric_value(m, "kvpush_router_instance_in_flight") == 0
    finally:
        traffic.stop()
        rt.stop()


def test_prefill_killed_during_traffic(cluster, refs):
    _kill_during_traffic(cluster, refs, cluster.push_p[0], noticed_by="request")


def test_decode_killed_during_traffic(cluster, refs):
    _kill_during_traffic(cluster, refs, cluster.push_d[1], noticed_by="health")


# ------------------------------------------------------------------ the command line


def _router_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpush", "router", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_cli_help_and_bad_flags():
    r = _router_cli("--help")
    assert r.returncode == 0 and "--fallback-local-prefill" in r.stdout
    r = _router_cli("--prefill", "127.0.0.1:1")
    assert r.returncode == 2 and "at least one decode instance" in r.stderr
    r = _router_cli("--mode", "colocated", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2")
    assert r.returncode == 2 and "takes no --prefill" in r.stderr
    r = _router_cli("--decode", "http://127.0.0.1:x")
    assert r.returncode == 2 and "invalid port" in r.stderr
    # a port in use: refused at once, not after waiting --startup-timeout for instances
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        busy = blocker.getsockname()[1]
        t0 = time.monotonic()
        r = _router_cli("--mode", "colocated", "--decode", f"http://127.0.0.1:{free_port()}",
                        "--port", str(busy), "--startup-timeout", "60")
    assert r.returncode == 2 and time.monotonic() - t0 < 30, r.stderr
    assert f"cannot listen on 127.0.0.1:{busy}" in r.stderr
    assert "address already in use" in r.stderr.lower() and "Traceback" not in r.stderr


def test_cli_refuses_misconfigured_or_missing_instances(cluster):
    r = _router_cli("--mode", "push", "--prefill", cluster.pull_p.url,
                    "--decode", cluster.push_d[0].url)
    assert r.returncode == 2, r.stderr
    assert "kv_transfer='pull'" in r.stderr and cluster.pull_p.url in r.stderr
    r = _router_cli("--mode", "pull", "--prefill", cluster.pull_d.url,
                    "--decode", cluster.pull_p.url)
    assert r.returncode == 2 and "role='decode'" in r.stderr and "role='prefill'" in r.stderr
    dead = f"http://127.0.0.1:{free_port()}"
    r = _router_cli("--mode", "colocated", "--decode", dead, "--startup-timeout", "1")
    assert r.returncode == 1 and "none was usable within 1 s" in r.stderr and dead in r.stderr


def test_cli_serves_colocated(cluster, refs, tmp_path):
    port = free_port()
    log = open(tmp_path / "router.log", "w")  # noqa: SIM115 - closed below
    # the router holds the cluster's secret: it joins the instance's request plane
    env = {**os.environ, "KVPUSH_KV_SECRET": cluster_secret().decode()}
    proc = subprocess.Popen([sys.executable, "-m", "kvpush", "router", "--mode", "colocated",
                             "--decode", cluster.single.url, "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            assert proc.poll() is None, (tmp_path / "router.log").read_text()
            try:
                return httpx.get(url + "/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, 30, "the router CLI up")
        r = httpx.post(url + "/v1/completions", json=_body(PROMPTS[1]), timeout=60)
        assert r.status_code == 200 and answer_text(r.json()) == refs[("completion", 1)]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        log.close()
    text = (tmp_path / "router.log").read_text()
    rid = r.headers["x-request-id"]
    assert f"request {rid} completion mode=colocated" in text, text
    assert "outcome=ok" in text and "HTTP Request" not in text  # no httpx line per check


def test_load_weight_must_be_finite(capsys):
    """--load-weight inf passed the check (inf >= 0) and made an idle instance's cost
    inf * 0 = nan, which no comparison orders (failed before: no error)."""
    from kvpush.cli import build_parser

    argv = ["router", "--mode", "colocated", "--decode", "h:1", "--load-weight"]
    for bad in ("inf", "nan", "-1"):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args([*argv, bad])
        assert e.value.code == 2 and "--load-weight" in capsys.readouterr().err
    assert build_parser().parse_args([*argv, "0"]).load_weight == 0.0
