"""`kvpush up`: a 1P1D cluster (tiny random Llama) as a subprocess starts, serves through
its router, and stops with no process left behind, also when a child fails to start,
when a child dies while serving, and when `kvpush up` itself is SIGKILLed (PDEATHSIG).

The processes below `kvpush up` are collected from /proc while it runs; each test checks
that none of them is alive at the end. Every wait is bounded; teardown SIGKILLs
everything a test started.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from kvpush.cli_types import Parser
from kvpush.cluster import cli as up_cli
from kvpush.cluster.launcher import (
    ChildSpec,
    StopSignals,
    Supervisor,
    alive,
    descendant_pids,
    pid_alive,
)
from server_helpers import free_port
from waits import wait_until

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc")]

ENGINE = ("--block-size", "16", "--kv-cache-memory", "4MiB", "--max-model-len", "256",
          "--dtype", "float32")  # serve's auto would be bf16 on a bf16 CPU
READY_S = 90.0  # two instances and a router on two busy cores
STOP_S = 30.0


class Up:
    """`kvpush up` as a subprocess in its own session; remembers every process it had
    below it (``pids``) and kills them all in ``kill_all``."""

    def __init__(self, tmp: Path, *args: str, model: Path | str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_dir = tmp / "logs"
        tmp.mkdir(parents=True, exist_ok=True)
        self.out_path, self.err_path = tmp / "up.out", tmp / "up.err"
        cmd = [sys.executable, "-m", "kvpush", "up", "--port", str(self.port),
               "--log-dir", str(self.log_dir), "--startup-timeout", "80",
               "--stop-timeout", "15", *args]
        if model is not None:
            cmd += ["--model", str(model)]
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                         start_new_session=True)
        self.pids: set[int] = set()

    @property
    def out(self) -> str:
        return self.out_path.read_text()

    @property
    def err(self) -> str:
        return self.err_path.read_text()

    def snapshot(self) -> None:
        if self.proc.poll() is None:
            self.pids.update(descendant_pids(self.proc.pid))

    def wait_ready(self, timeout: float = READY_S) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.snapshot()
            if self.proc.poll() is not None:
                raise AssertionError(f"kvpush up exited {self.proc.returncode}:\n"
                                     f"{self.out}\n{self.err}")
            if "stops the cluster" in self.out:  # printed once the router is healthy
                assert httpx.get(f"{self.url}/health", timeout=5).status_code == 200
                self.snapshot()
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"not ready in {timeout} s:\n{self.out}\n{self.err}")
            time.sleep(0.2)

    def wait_exit(self, timeout: float) -> int:
        """Exit status, collecting child pids meanwhile."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            self.snapshot()
            if time.monotonic() > deadline:
                raise AssertionError(f"kvpush up still running after {timeout} s:\n"
                                     f"{self.out}\n{self.err}")
            time.sleep(0.05)
        return self.proc.returncode

    def child_pid(self, marker: str) -> int:
        for pid in descendant_pids(self.proc.pid):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if marker.encode() in cmdline:
                return pid
        raise AssertionError(f"no child with {marker!r} below kvpush up")

    def kill_all(self) -> None:
        self.snapshot()
        for pid in [self.proc.pid, *self.pids]:
            if pid_alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def up_factory(tmp_path) -> Iterator[Callable[..., Up]]:
    started: list[Up] = []

    def make(*args: str, model: Path | str | None = None) -> Up:
        up = Up(tmp_path / f"up{len(started)}", *args, model=model)
        started.append(up)
        return up

    yield make
    for up in started:
        up.kill_all()


def _children_gone(up: Up, timeout: float = 0.0) -> None:
    assert len(up.pids) >= 1
    if timeout:
        wait_until(lambda: not alive(up.pids), timeout, f"children {alive(up.pids)} exit")
    assert alive(up.pids) == [], f"left behind: {alive(up.pids)}"


def test_up_serves_and_stops_cleanly(tiny_llama, up_factory):
    up = up_factory("--prefill", "1", "--decode", "1", *ENGINE, model=tiny_llama)
    up.wait_ready()
    assert f"endpoint    {up.url}/v1" in up.out
    assert "role prefill" in up.out and "role decode" in up.out and "curl" in up.out
    # prefill and decode (each an API process and its engine core), and the router
    assert len(up.pids) == 5, up.pids
    assert sorted(p.name for p in up.log_dir.iterdir()) == [
        "decode-0.log", "prefill-0.log", "router.log"]
    with httpx.Client(base_url=up.url, timeout=60) as client:
        r = client.post("/v1/completions", json={"prompt": "hello world " * 5,
                                                 "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                "temperature": 0, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] is not None
    up.proc.send_signal(signal.SIGTERM)
    assert up.wait_exit(STOP_S) == 0, up.err
    assert "stopped in" in up.out
    # every child stopped on SIGTERM (the engine cores too, which get it from killpg)
    assert "SIGKILLed" not in up.out, up.out
    _children_gone(up)


@pytest.mark.slow
def test_up_prefill_tp2_decode_tp1_serves_like_one_instance(tiny_llama, up_factory):
    """Issue 52 (points 1 and 4): `kvpush up --prefill-tp 2` in push mode starts a
    prefill of two ranks beside a decode of one; its router routes to them unchanged
    (both healthy, the prefill leg served by the TP 2 prefill) and the greedy answer
    equals one TP 1 engine's: its tokens, detokenized as the server's front end does."""
    from engine_helpers import greedy, make_engine, random_prompts
    from kvpush.engine.output_processor import RequestStream

    prompt = random_prompts([3 * 16 + 5], seed=52)[0]  # 3 full blocks and a tail
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    engine = make_engine(tiny_llama)
    try:
        stream = RequestStream("r", engine.tokenizer, greedy(8))  # the front end's
        engine.add_request("r", prompt, greedy(8))
        want_text = ""
        while engine.has_work():
            want_text += "".join(stream.process(o).new_text for o in engine.step())
    finally:
        engine.shutdown()
    up = up_factory("--mode", "push", "--prefill-tp", "2", "--decode-tp", "1",
                    "--policy", "round-robin", *ENGINE, model=tiny_llama)
    up.wait_ready()
    assert "1 prefill (TP 2) + 1 decode (TP 1)" in up.out, up.out
    assert "role prefill, TP 2" in up.out and "role decode, TP 1" in up.out, up.out
    # prefill: API process, engine core, rank 1; decode: API process, engine core; router
    assert len(up.pids) == 6, up.pids
    with httpx.Client(base_url=up.url, timeout=60) as client:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        assert r.json()["choices"][0]["text"] == want_text
        health = client.get("/health").json()
        assert health["status"] == "ok" and health["healthy"] == {"prefill": 1, "decode": 1}
        pool = {i["role"]: i for i in client.get("/router/instances").json()["instances"]}
    assert pool["prefill"]["healthy"] and pool["decode"]["healthy"], pool
    assert pool["prefill"]["requests"] >= 1 and pool["decode"]["requests"] >= 1, pool
    up.proc.send_signal(signal.SIGTERM)
    assert up.wait_exit(STOP_S) == 0, up.err
    _children_gone(up)


def test_child_failing_to_start_stops_all_and_shows_its_log(tiny_llama, up_factory):
    up = up_factory("--block-size", "3", model=tiny_llama)
    assert up.wait_exit(READY_S) == 1
    assert "exited with code 2 while starting" in up.err
    assert "--block-size must be a power of two" in up.err  # the child's log tail
    _children_gone(up)
    assert "router.log" not in os.listdir(up.log_dir)


def test_missing_model_is_a_usage_error(tmp_path, up_factory):
    up = up_factory(model=tmp_path / "no-such-model")
    assert up.wait_exit(30) == 2
    assert "no-such-model" in up.err and "neither a model folder" in up.err
    assert up.pids == set()


def test_child_dying_while_serving_stops_the_cluster_without_restarts(tiny_llama,
                                                                     up_factory):
    up = up_factory("--restart-tries", "0", *ENGINE, model=tiny_llama)
    up.wait_ready()
    os.kill(up.child_pid("--role decode"), signal.SIGKILL)
    assert up.wait_exit(STOP_S) == 1
    assert "decode-0" in up.err and "was killed by SIGKILL while serving" in up.err
    assert "a child exited (--restart-tries 0): stopping" in up.out
    _children_gone(up)


def _instances(up: Up) -> dict[str, dict]:
    r = httpx.get(f"{up.url}/router/instances", timeout=10)
    return {i["url"]: i for i in r.json()["instances"]}


@pytest.mark.timeout(300)  # three instances and a restart on a shared 2-core host
def test_one_decode_of_two_killed_is_restarted_and_serves_again(tiny_llama, up_factory):
    """Issue 63, point 3: one decode of `up --decode 2` SIGKILLed: `up` says so and keeps
    serving, the router takes it out (requests meanwhile all succeed on the other),
    `up` restarts it on its port, the router takes it back (a new engine id) and sends
    it requests again (with --kv-digest: the KV it gets is checked); a SIGTERM then stops
    everything."""
    up = up_factory("--decode", "2", "--policy", "round-robin", "--health-interval", "0.5",
                    "--restart-backoff", "0.5", "--kv-digest", *ENGINE, model=tiny_llama)
    up.wait_ready()
    pid = up.child_pid("--role decode")
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    url = f"http://127.0.0.1:{int(argv[argv.index(b'--port') + 1])}"
    before = _instances(up)[url]
    assert before["healthy"] and before["role"] == "decode", before
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: "was killed by SIGKILL while serving" in up.out, 15, "up saw it")
    wait_until(lambda: not _instances(up)[url]["healthy"], 15, "the router took it out")
    body = {"prompt": "hello world " * 5, "max_tokens": 8, "temperature": 0}
    with httpx.Client(base_url=up.url, timeout=60) as client:
        for _ in range(4):  # the other decode serves them all
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
        wait_until(lambda: "serves again" in up.out, READY_S, f"a restart:\n{up.out}")
        wait_until(lambda: _instances(up)[url]["healthy"], 30, "the router took it back")
        after = _instances(up)[url]
        assert after["engine_id"] != before["engine_id"], (before, after)
        served = after["requests"]
        for _ in range(4):  # round-robin: some of them on the restarted decode
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 8
    assert _instances(up)[url]["requests"] > served
    # --kv-digest reached the instances: the restarted decode checked what it got
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert "kvpush_kv_digest_mismatches_total 0.0" in metrics, metrics[-2000:]
    assert "--kv-digest" in Path(f"/proc/{up.child_pid('--role decode')}/cmdline").read_text()
    assert up.proc.poll() is None
    assert "restart 1 of 3" in up.out, up.out
    up.snapshot()
    assert pid not in alive(up.pids)
    up.proc.send_signal(signal.SIGTERM)
    assert up.wait_exit(STOP_S) == 0, up.err
    _children_gone(up)


def test_sigkill_of_up_kills_its_children(tiny_llama, up_factory):
    up = up_factory(*ENGINE, model=tiny_llama)
    up.wait_ready()
    up.proc.kill()
    up.proc.wait(10)
    _children_gone(up, timeout=15)


# ---- without a cluster --------------------------------------------------------------
def _parse(*argv: str) -> argparse.Namespace:
    parser = Parser()  # kvpush's, as `kvpush up` builds it
    up_cli.add_up_parser(parser.add_subparsers())
    return parser.parse_args(["up", *argv])


def test_plan_roles_threads_and_pass_through():
    args = _parse("--prefill", "2", "--decode", "3", "--mode", "pull", "--block-size", "3",
                  "--dtype", "bfloat16", "--kv-cache-memory", "1GiB",
                  "--decode-cache-memory", "256MiB",
                  "--shuffle-free-blocks", "--prefix-hit-tail", "decode",
                  "--push-layers-per-write", "5")
    assert up_cli.instance_roles(args) == ["prefill"] * 2 + ["decode"] * 3
    assert up_cli.default_threads(5, cores=16) == 3
    assert up_cli.default_threads(5, cores=2) == 1
    argv = up_cli.serve_argv(args, "m", "decode", 1234, 3)
    assert argv[2:5] == ["kvpush", "serve", "m"]
    for pair in (["--role", "decode"], ["--kv-transfer", "pull"], ["--threads", "3"],
                 ["--block-size", "3"], ["--dtype", "bfloat16"], ["--kv-cache-memory", "1GiB"],
                 ["--decode-cache-memory", "256MiB"],
                 ["--port", "1234"], ["--host", "127.0.0.1"], ["--shuffle-free-blocks", "0"],
                 ["--prefix-hit-tail", "decode"], ["--push-layers-per-write", "5"]):
        i = argv.index(pair[0])
        assert argv[i:i + 2] == pair
    assert "--max-model-len" not in argv
    specs = up_cli.plan_instances(args, "m")
    assert [s.name for s in specs] == ["prefill-0", "prefill-1", "decode-0", "decode-1",
                                       "decode-2"]
    assert len({s.port for s in specs}) == 5


def test_plan_colocated_and_router_argv():
    args = _parse("--mode", "colocated", "--policy", "least-outstanding")
    assert up_cli.instance_roles(args) == ["both"]
    argv = up_cli.serve_argv(args, "m", "both", 1, 1)
    assert "--kv-transfer" not in argv and argv[argv.index("--role") + 1] == "both"
    assert "--prefix-hit-tail" not in argv and "--shuffle-free-blocks" not in argv
    assert "--push-layers-per-write" not in argv
    assert "--decode-cache-memory" not in argv
    argv = up_cli.router_argv(args, 8000, [], ["http://a"])
    assert argv[2:4] == ["kvpush", "router"] and "--prefill" not in argv
    assert argv[argv.index("--decode") + 1] == "http://a"
    assert argv[argv.index("--policy") + 1] == "least-outstanding"
    assert "--load-weight" not in argv  # the router's own default
    argv = up_cli.router_argv(_parse("--load-weight", "2.5"), 8000, ["http://p"], ["http://d"])
    assert argv[argv.index("--load-weight") + 1] == "2.5"
    with pytest.raises(SystemExit):
        _parse("--load-weight", "-1")
    assert up_cli.usage_problem(_parse("--mode", "colocated", "--prefill", "2"))


def test_plan_tensor_parallel_per_role_and_threads_per_rank(monkeypatch):
    """-tp N for every instance, --prefill-tp/--decode-tp per role; the default threads
    are one share of the cores per rank; --threads is per rank as given."""
    monkeypatch.setattr(up_cli, "usable_cores", lambda: 12)

    def tps(specs):
        return [(s.name, up_cli.spec_tp(s)) for s in specs]

    def threads(specs):
        return {s.argv[s.argv.index("--threads") + 1] for s in specs}

    args = _parse("--prefill-tp", "2")  # 1P (2 ranks) + 1D (1 rank): 12 // 3
    specs = up_cli.plan_instances(args, "m")
    assert tps(specs) == [("prefill-0", 2), ("decode-0", 1)] and threads(specs) == {"4"}
    assert "--tensor-parallel-size" not in specs[1].argv  # TP 1: serve's default
    args = _parse("-tp", "2", "--decode", "2", "--decode-tp", "1", "--threads", "3")
    specs = up_cli.plan_instances(args, "m")
    assert tps(specs) == [("prefill-0", 2), ("decode-0", 1), ("decode-1", 1)]
    assert threads(specs) == {"3"}
    assert specs[0].argv[specs[0].argv.index("--tensor-parallel-size") + 1] == "2"
    args = _parse("--mode", "colocated", "-tp", "4")  # one instance, 4 ranks: 12 // 4
    (spec,) = up_cli.plan_instances(args, "m")
    assert up_cli.spec_tp(spec) == 4 and threads([spec]) == {"3"}
    assert up_cli.usage_problem(args) is None
    assert "--prefill-tp/--decode-tp" in up_cli.usage_problem(
        _parse("--mode", "colocated", "--decode-tp", "2"))


def test_help_does_not_import_heavy_modules():
    code = ("import sys; from kvpush.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'httpx', 'kvpush.cluster.launcher') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == "[]"


def test_stop_escalates_to_sigkill_and_kills_the_group(tmp_path):
    """A child that ignores SIGTERM, with a grandchild in its process group: stop() waits
    the bound, SIGKILLs the group, reaps."""
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, "
            "signal.SIG_IGN); subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(60)']); print('up', flush=True); time.sleep(60)")
    sup = Supervisor(tmp_path, stop_signals=StopSignals(), stop_timeout=1.0)
    with sup:
        child = sup.spawn(ChildSpec("stubborn", "test", [sys.executable, "-c", code], 1))
        wait_until(lambda: "up" in child.log_path.read_text(), 30, "child started")
        pids = [child.pid, *descendant_pids(child.pid)]
        assert len(pids) == 2
        t0 = time.monotonic()
        codes = sup.stop()
        assert 1.0 <= time.monotonic() - t0 < 10
    assert codes == {"stubborn": -signal.SIGKILL} and sup.killed == ["stubborn"]
    wait_until(lambda: not alive(pids), 5, "grandchild killed")


def test_second_stop_signal_skips_the_wait(tmp_path):
    """A second Ctrl-C/SIGTERM while stopping: SIGKILL now instead of waiting the bound."""
    code = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('up', flush=True); time.sleep(60)")
    signals = StopSignals().install()
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    try:
        with Supervisor(tmp_path, stop_signals=signals, stop_timeout=60.0) as sup:
            child = sup.spawn(ChildSpec("stubborn", "test", [sys.executable, "-c", code], 1))
            wait_until(lambda: "up" in child.log_path.read_text(), 30, "child started")
            t0 = time.monotonic()
            timer.start()
            codes = sup.stop()
            assert time.monotonic() - t0 < 10
    finally:
        timer.cancel()
        signals.restore()
    assert signals.count == 1 and signals.last == "SIGINT"
    assert codes == {"stubborn": -signal.SIGKILL}


def test_default_log_folders_are_pruned_to_the_newest_except_recent(tmp_path):
    """The oldest `up-*` folders beyond the newest N go; one still written to stays,
    and nothing else in the folder is touched."""
    old = time.time() - 3 * 24 * 3600
    made = []
    for i in range(6):
        d = tmp_path / f"up-20260101-00000{i}-x{i}"
        d.mkdir()
        (d / "router.log").write_text("log")
        os.utime(d / "router.log", (old, old))
        made.append(d)
    os.utime(made[1] / "router.log")  # a cluster from then is still logging
    (tmp_path / "keep-me").mkdir()
    removed = up_cli.prune_log_dirs(tmp_path, keep=3)
    assert removed == [made[0], made[2]]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([made[1].name, *(d.name for d in made[3:]), "keep-me"])
    assert up_cli.prune_log_dirs(tmp_path, keep=3) == []


@pytest.mark.slow
def test_a_child_whose_port_was_taken_starts_again_on_a_new_one(tiny_llama, tmp_path,
                                                                  capsys):
    """The port kvpush up probed can be taken before the instance binds it (a new
    process starts in between): the instance, refused, is started again on a new free
    port and the cluster goes on; without retries the failure is reported."""
    import socket

    from kvpush.cluster.launcher import ChildFailed, ChildSpec, Supervisor

    def spec(port: int) -> ChildSpec:
        argv = [sys.executable, "-m", "kvpush", "serve", str(tiny_llama), "--host",
                "127.0.0.1", "--port", str(port), "--threads", "1", *ENGINE]
        return ChildSpec("instance-0", "both", argv, port)

    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        busy = blocker.getsockname()[1]
        with Supervisor(tmp_path, up_cli.child_env(), stop_timeout=15) as sup:
            (child,) = up_cli.start_healthy(sup, [spec(busy)], timeout=60)
            assert child.spec.port != busy and child.healthy
            assert f"--port {child.spec.port}" in " ".join(child.spec.argv)
            assert httpx.get(f"{child.url}/health", timeout=5).status_code == 200
            assert f"port {busy} was taken" in capsys.readouterr().out
            first = sup.children[0]
            assert first.poll() is not None and up_cli.port_clash(first)
            assert first.log_path.name == f"instance-0.port-{busy}.log"
        (tmp_path / "again").mkdir()
        with Supervisor(tmp_path / "again", up_cli.child_env(), stop_timeout=15) as sup:
            with pytest.raises(ChildFailed) as e:
                up_cli.start_healthy(sup, [spec(busy)], timeout=60, retry_ports=False)
            assert up_cli.port_clash(e.value.child) and len(sup.children) == 1
