"""What the router adds to a request: direct vs through `kvpush router --mode colocated`.

Starts one `kvpush serve` instance (role both) and a router in front of it (both as
child processes on 127.0.0.1, free ports), sends the same short greedy completion
alternately to each, and prints the median / p90 latency of both, non-streaming (whole
answer) and streaming (time to the first chunk), and the difference: the router's
overhead (one extra HTTP hop, JSON parse and re-encode, instance pick, relay).

    .venv/bin/python benchmarks/router_overhead.py                 # tiny random model
    .venv/bin/python benchmarks/router_overhead.py --model smollm2-135m --requests 100

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
def child(argv: list[str], log: Path, url: str, timeout: float = 120) -> Iterator[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "UCX_NET_DEVICES": "lo",
           "NIXL_LOG_LEVEL": "WARN"}
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


def stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"median_ms": statistics.median(xs) * 1e3,
            "p90_ms": xs[min(len(xs) - 1, int(0.9 * len(xs)))] * 1e3}


def compare(c: httpx.Client, direct: str, routed: str, body: dict, n: int,
            fn: Callable[[httpx.Client, str, dict], float]) -> dict[str, dict[str, float]]:
    for _ in range(5):  # warm up both paths (connections, caches)
        fn(c, direct, body)
        fn(c, routed, body)
    d: list[float] = []
    r: list[float] = []
    for i in range(n):  # alternate the order, so drift hits both paths alike
        pairs = [(direct, d), (routed, r)]
        for url, acc in pairs if i % 2 == 0 else pairs[::-1]:
            acc.append(fn(c, url, body))
    return {"direct": stats(d), "router": stats(r)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model folder or installed name (default: a tiny "
                                    "random Llama built in a temporary folder)")
    ap.add_argument("--requests", type=int, default=50, help="per path (default: 50)")
    ap.add_argument("--max-tokens", type=int, default=4, help="per request (default: 4)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    kvpush = [sys.executable, "-m", "kvpush"]
    with tempfile.TemporaryDirectory(prefix="kvpush-router-overhead-") as tmp:
        tmpdir = Path(tmp)
        model = args.model
        if model is None:
            from kvpush.models.random_model import make_random_model

            model = str(make_random_model(tmpdir / "tiny", "llama", "tiny", seed=0))
        sp, rp = free_port(), free_port()
        serve = [*kvpush, "serve", model, "--port", str(sp), "--threads", "1",
                 "--log-level", "warning"]
        router = [*kvpush, "router", "--mode", "colocated", "--decode",
                  f"http://127.0.0.1:{sp}", "--port", str(rp), "--log-level", "warning"]
        with child(serve, tmpdir / "serve.log", f"http://127.0.0.1:{sp}") as direct, \
                child(router, tmpdir / "router.log", f"http://127.0.0.1:{rp}") as routed, \
                httpx.Client(timeout=120, trust_env=False) as c:
            body = {"prompt": "the quick brown fox jumps over the lazy dog",
                    "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
            out = {"whole_answer": compare(c, direct, routed, body, args.requests, timed_post),
                   "first_chunk": compare(c, direct, routed, body, args.requests,
                                          timed_first_chunk)}
    print(f"model {args.model or 'tiny random llama'}, {args.requests} requests per path, "
          f"max_tokens {args.max_tokens}, router --mode colocated, one client at a time")
    for name, res in out.items():
        d, r = res["direct"], res["router"]
        res["overhead_median_ms"] = r["median_ms"] - d["median_ms"]
        print(f"  {name:<13} direct median {d['median_ms']:7.2f} ms (p90 {d['p90_ms']:7.2f})"
              f"   router median {r['median_ms']:7.2f} ms (p90 {r['p90_ms']:7.2f})"
              f"   overhead {res['overhead_median_ms']:+.2f} ms")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
