"""What the router adds to a request: direct vs through `kvpush router --mode colocated`.

Starts one `kvpush serve` instance (role both, one torch thread) and routers in front
of it (child processes on 127.0.0.1, free ports, one cluster secret): ``router`` serves
over the instance's engine core (its request plane, issue 51), and each --variant
NAME:ENV=VALUE runs beside it with that environment. It sends the same
greedy completion to each path in rotating order, and prints the median / p90 of each
and its difference from direct, the router's overhead:

* ``whole_answer``: a non-streaming answer of --max-tokens tokens;
* ``first_chunk_P``: time to the first streamed chunk, prompt of P token ids (--prompts,
  default 8 and 128);
* ``per_chunk``: a streamed answer of --stream-tokens (256) tokens: (last chunk - first
  chunk) / (chunks - 1), the time per relayed chunk (TPOT as the client sees it).

    .venv/bin/python benchmarks/router_overhead.py                      # tiny random Qwen3
    .venv/bin/python benchmarks/router_overhead.py --model smollm2-135m --requests 100
    .venv/bin/python benchmarks/router_overhead.py --profile /tmp/router.svg  # py-spy
    .venv/bin/python benchmarks/router_overhead.py \
        --variant main:PYTHONPATH=../main/src

Not part of the test suite. Everything it starts it stops.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def child(argv: list[str], log: Path, url: str, timeout: float = 120,
          env: dict[str, str] | None = None) -> Iterator[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "UCX_NET_DEVICES": "lo",
           "NIXL_LOG_LEVEL": "WARN", **(env or {})}
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{argv[3]} exited {proc.returncode}; see {log}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{argv[3]} not healthy in {timeout} s; see {log}")
                time.sleep(0.2)
            yield url
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(5)


def timed_post(c: httpx.Client, url: str, body: dict) -> float:
    t0 = time.perf_counter()
    r = c.post(url + "/v1/completions", json=body)
    r.raise_for_status()
    return time.perf_counter() - t0


def timed_first_chunk(c: httpx.Client, url: str, body: dict) -> float:
    t0 = time.perf_counter()
    with c.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        first = None
        for _ in r.iter_raw():
            if first is None:
                first = time.perf_counter() - t0
    assert first is not None
    return first


def timed_per_chunk(c: httpx.Client, url: str, body: dict) -> float:
    """(last chunk - first chunk) / (token chunks - 1) of one streamed answer."""
    stamps: list[float] = []
    with c.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
    assert len(stamps) >= 2, len(stamps)
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"median_ms": statistics.median(xs) * 1e3,
            "p90_ms": xs[min(len(xs) - 1, int(0.9 * len(xs)))] * 1e3}


def compare(c: httpx.Client, paths: dict[str, str], body: dict, n: int,
            fn: Callable[[httpx.Client, str, dict], float],
            warm: int = 5) -> dict[str, dict[str, float]]:
    """``fn`` on every path (name -> URL) in turn, ``n`` times, the order rotating so that
    drift hits every path alike."""
    for _ in range(warm):  # warm up every path (connections, caches)
        for url in paths.values():
            fn(c, url, body)
    acc: dict[str, list[float]] = {name: [] for name in paths}
    names = list(paths)
    for i in range(n):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            acc[name].append(fn(c, paths[name], body))
    return {name: stats(xs) for name, xs in acc.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model folder or installed name (default: a tiny "
                                    "random Qwen3 built in a temporary folder)")
    ap.add_argument("--requests", type=int, default=50, help="per path (default: 50)")
    ap.add_argument("--max-tokens", type=int, default=4,
                    help="tokens of the first-chunk and whole-answer requests (default: 4)")
    ap.add_argument("--prompts", type=int, nargs="+", default=[8, 128], metavar="TOKENS",
                    help="prompt lengths of the first-chunk figure (default: 8 128)")
    ap.add_argument("--stream-tokens", type=int, default=256,
                    help="answer length of the per-chunk figure (default: 256; 0: skip)")
    ap.add_argument("--stream-requests", type=int, default=10,
                    help="requests per path of the per-chunk figure (default: 10)")
    ap.add_argument("--profile", type=Path,
                    help="record the router with py-spy (on PATH) while it runs, to this "
                         "file: an SVG flame graph (.svg) or collapsed stacks (other)")
    ap.add_argument("--variant", type=variant, action="append", default=[],
                    metavar="NAME:KEY=VALUE,...",
                    help="one more router side by side, its environment changed (e.g. "
                         "main:PYTHONPATH=/path/to/main/src); repeatable")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    kvpush = [sys.executable, "-m", "kvpush"]
    with tempfile.TemporaryDirectory(prefix="kvpush-router-overhead-") as tmp:
        tmpdir = Path(tmp)
        model = model_or_tiny(args.model, tmpdir)
        sp = free_port()
        serve = [*kvpush, "serve", model, "--port", str(sp), "--threads", "1",
                 "--log-level", "warning"]
        os.environ.setdefault("KVPUSH_KV_SECRET", os.urandom(16).hex())  # every child's
        with contextlib.ExitStack() as stack:
            paths = {"direct": stack.enter_context(
                child(serve, tmpdir / "serve.log", f"http://127.0.0.1:{sp}"))}
            ports = {}
            routers = [("router", {}), *args.variant]
            for name, env in routers:
                ports[name] = rp = free_port()
                router = [*kvpush, "router", "--mode", "colocated", "--decode",
                          f"http://127.0.0.1:{sp}", "--port", str(rp), "--log-level",
                          "warning"]
                paths[name] = stack.enter_context(
                    child(router, tmpdir / f"{name}.log", f"http://127.0.0.1:{rp}", env=env))
            wait_for_cores(paths["router"])
            stack.enter_context(profiled(args.profile, ports["router"]))
            c = stack.enter_context(httpx.Client(timeout=120, trust_env=False))
            base = {"max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
            out = {"whole_answer": compare(c, paths, {**base, "prompt": ids(8)},
                                           args.requests, timed_post)}
            for n in args.prompts:
                out[f"first_chunk_{n}"] = compare(c, paths, {**base, "prompt": ids(n)},
                                                  args.requests, timed_first_chunk)
            if args.stream_tokens:
                body = {**base, "prompt": ids(8), "max_tokens": args.stream_tokens}
                out["per_chunk"] = compare(c, paths, body, args.stream_requests,
                                           timed_per_chunk, warm=1)
    print(f"model {args.model or 'tiny random qwen3'}, {args.requests} requests per path "
          f"({args.stream_requests} for per_chunk), router --mode colocated, one client "
          "at a time; medians (p90) in ms, overhead = path - direct")
    for name, res in out.items():
        d = res["direct"]
        line = f"  {name:<15} direct {d['median_ms']:7.3f} ({d['p90_ms']:7.3f})"
        for path, r in res.items():
            if path == "direct":
                continue
            r["overhead_median_ms"] = r["median_ms"] - d["median_ms"]
            line += (f"   {path} {r['median_ms']:7.3f} ({r['p90_ms']:7.3f}) "
                     f"{r['overhead_median_ms']:+.3f}")
        print(line)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


def model_or_tiny(model: str | None, tmpdir: Path) -> str:
    """``model``, or a tiny random Qwen3 built in ``tmpdir`` (compute close to nothing)."""
    if model is not None:
        return model
    from kvpush.models.random_model import make_random_model

    return str(make_random_model(tmpdir / "tiny", "qwen3", "tiny", seed=0))


def wait_for_cores(url: str, timeout: float = 30.0) -> None:
    """Until the router serves over the engine core (its /health says so)."""
    deadline = time.monotonic() + timeout
    while httpx.get(url + "/health", timeout=5).json().get("legs") != "engine cores":
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} does not serve over the engine core")
        time.sleep(0.2)


def variant(text: str) -> tuple[str, dict[str, str]]:
    """NAME:KEY=VALUE[,KEY=VALUE...] -> (NAME, environment)."""
    name, _, assigns = text.partition(":")
    env = dict(a.split("=", 1) for a in assigns.split(",") if "=" in a)
    if not name or not env:
        raise argparse.ArgumentTypeError("expected NAME:KEY=VALUE[,KEY=VALUE...]")
    return name, env


def ids(n: int) -> list[int]:
    """A prompt of ``n`` token ids (no tokenizing on either path)."""
    return [(7 * i) % 1000 + 10 for i in range(n)]


@contextlib.contextmanager
def profiled(svg: Path | None, port: int) -> Iterator[None]:
    """py-spy record of the process listening on ``port`` while the block runs."""
    if svg is None:
        yield
        return
    pid = listener_pid(port)
    fmt = "flamegraph" if svg.suffix == ".svg" else "raw"  # raw: collapsed stacks
    proc = subprocess.Popen(["py-spy", "record", "-p", str(pid), "-o", str(svg), "-r", "500",
                             "--nonblocking", "-f", fmt], stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)
    try:
        time.sleep(1)
        yield
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)


def listener_pid(port: int) -> int:
    out = subprocess.run(["ss", "-ltnpH", f"sport = :{port}"], capture_output=True,
                         text=True, check=True).stdout
    return int(out.split("pid=")[1].split(",")[0])


if __name__ == "__main__":
    sys.exit(main())
