"""The serving path on the tiny `bench` model (compute ~nil): what HTTP, SSE, the step
loop and detokenizing cost per token (issue 39).

Starts one `kvpush serve` (role both, fp32, --threads 1) on the random Qwen3 `bench`
preset (3 layers, hidden 128) and measures, in this order:

1. first streamed chunk, one request at a time, 8- and 128-token prompts (median, p90);
2. first chunk at 128 tokens with max_tokens=64 against max_tokens=1 (interleaved);
3. 64 concurrent streams, 64 in / 128 out (`kvpush bench`): mean TPOT, output tok/s;
4. the server's processes' RSS (the API process and, split, the engine core).

    PYTHONPATH=src .venv/bin/python benchmarks/serving_path.py --out /tmp/sp.json
    ... --py-spy /tmp/prof   # also record py-spy (every process) during step 3

With ``--url`` it measures a server already running instead (e.g. `vllm serve`).
Not part of the test suite; everything it starts it stops.
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
from collections.abc import Iterator
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(model: Path, log: Path, extra: list[str]) -> Iterator[tuple[str, int]]:
    port = free_port()
    argv = [sys.executable, "-m", "kvpush", "serve", str(model), "--host",
            "127.0.0.1", "--port", str(port), "--dtype", "float32", "--threads", "1",
            "--log-level", "warning", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "UCX_NET_DEVICES": "lo",
           "NIXL_LOG_LEVEL": "WARN", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + 180
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"serve exited {proc.returncode}; see {log}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"serve not healthy; see {log}")
                time.sleep(0.2)
            yield url, proc.pid
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def first_chunk_ms(client: httpx.Client, url: str, model: str, prompt: list[int],
                   max_tokens: int) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    first = None
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                first = (time.perf_counter() - t0) * 1e3
    assert first is not None
    return first


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median_ms": round(statistics.median(xs), 3),
            "p90_ms": round(xs[int(0.9 * (len(xs) - 1))], 3), "n": len(xs)}


def rss_mib(pid: int) -> dict[str, float]:
    """RSS of ``pid`` and each of its descendants (MiB), by command line."""
    out: dict[str, float] = {}
    todo = [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError):
            status = Path(f"/proc/{p}/status").read_text()
            rss = next(int(x.split()[1]) for x in status.splitlines() if x.startswith("VmRSS"))
            name = Path(f"/proc/{p}/comm").read_text().strip()
            out[f"{p}:{name}"] = round(rss / 1024, 1)
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
            todo += [int(k) for k in kids]
    return out


def measure(url: str, pid: int | None, args, tmp: Path) -> dict:
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    res: dict = {}
    with httpx.Client(timeout=60) as c:
        for n in (8, 128):  # warm-up
            first_chunk_ms(c, url, model, list(range(10, 10 + n)), 8)
        for n in (8, 128):
            xs = [first_chunk_ms(c, url, model, [10 + (i + j) % 900 for j in range(n)], 8)
                  for i in range(args.requests)]
            res[f"first_chunk_{n}"] = _stats(xs)
        a, b = [], []
        for i in range(args.requests):
            prompt = [10 + (i + j) % 900 for j in range(128)]
            a.append(first_chunk_ms(c, url, model, prompt, 64))
            b.append(first_chunk_ms(c, url, model, prompt, 1))
        res["first_chunk_128_max64"] = _stats(a)
        res["first_chunk_128_max1"] = _stats(b)
        res["max64_minus_max1_ms"] = round(statistics.median(a) - statistics.median(b), 3)
    spies: list[subprocess.Popen] = []
    if args.py_spy and pid is not None:
        for p in [int(k.split(":")[0]) for k in rss_mib(pid)]:
            spies.append(subprocess.Popen(
                ["py-spy", "record", "--pid", str(p), "--rate", "200", "--format", "raw",
                 "--threads", "--nonblocking", "-o", f"{args.py_spy}.{p}.txt"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    out = tmp / "bench.json"
    subprocess.run([sys.executable, "-m", "kvpush", "bench", "--url", url,
                    "--tokenizer", str(args.model), "--input-len", "64", "--output-len",
                    "128", "--num-prompts", str(args.prompts or args.streams), "--max-concurrency",
                    str(args.streams), "--request-rate", "inf", "--no-progress",
                    "--out", str(out)], check=True, stdout=subprocess.DEVNULL)
    for s in spies:
        s.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            s.wait(30)
    b = json.loads(out.read_text())
    res["streams"] = {"n": args.streams, "mean_tpot_ms": round(b["mean_tpot_ms"], 3),
                      "output_tok_s": round(b["output_throughput"], 1),
                      "mean_ttft_ms": round(b["mean_ttft_ms"], 2),
                      "completed": b["completed"]}
    if pid is not None:
        res["rss_mib"] = rss_mib(pid)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None,
                    help="model folder (default: a fresh random Qwen3 `bench` preset)")
    ap.add_argument("--url", default=None, help="measure this running server instead")
    ap.add_argument("--requests", type=int, default=40, help="per one-at-a-time figure")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=0,
                    help="requests in the streams run (default: --streams)")
    ap.add_argument("--py-spy", default=None, metavar="PREFIX")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="extra `kvpush serve` argument (repeatable)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if args.model is None:
            from kvpush.models.random_model import make_random_model

            args.model = make_random_model(tmp / "model", "qwen3", "bench")
        if args.url:
            res = measure(args.url, None, args, tmp)
        else:
            with server(args.model, tmp / "serve.log", args.serve_arg) as (url, pid):
                res = measure(url, pid, args, tmp)
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
