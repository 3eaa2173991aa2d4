"""Where local prefill on decode stops paying: the measurement behind the default of
`kvpush router --local-prefill-max-tokens` (docs/ROUTER.md, "The threshold").

One 1P1D push cluster, and two cache-aware routers in front of the same two instances:

* ``local``: ``--local-prefill-max-tokens 1000000``: every request goes to decode alone,
  which computes the whole prompt itself;
* ``remote``: ``--local-prefill-max-tokens 0``: every uncached request also gets a
  prefill leg (push).

``--background S`` streams keep decode busy decoding (short prompts through the local
router, long outputs, restarted as they end), as running conversations would. Probes of
N uncached tokens (fresh random token ids, so no prefix hit) and 4 output tokens go
alternately through each router, one at a time, for every N. For each probe it records
the time to the first token (TTFT), and the longest gap between two tokens of any
background stream while the probe was being prefilled (the stall that prefill costs the
running decodes).

    .venv/bin/python benchmarks/local_prefill_threshold.py --model smollm2-135m \\
        --sizes 32,64,128,256,512,1024 --background 0,4 --repeats 3 \\
        --out benchmarks/results/local_prefill_threshold

Writes summary.json and summary.md to --out. Not part of the test suite; everything it
starts it stops.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvpush.bench.machine import cpu_flags
from kvpush.cluster.cli import child_env, plan_instances, router_argv
from kvpush.cluster.launcher import ChildSpec, Supervisor, free_port

MODES = ("local", "remote")
THRESHOLD = {"local": 1_000_000, "remote": 0}


@dataclass
class Stream:
    """One background stream's token arrival times (monotonic seconds)."""

    times: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, t: float) -> None:
        with self.lock:
            self.times.append(t)

    def gaps_in(self, t0: float, t1: float) -> list[float]:
        """Gaps between consecutive tokens whose later token falls in [t0, t1 + one gap]:
        a stall that began inside the window ends with the first token after it."""
        with self.lock:
            ts = list(self.times)
        out = []
        for a, b in zip(ts, ts[1:], strict=False):
            if b >= t0 and a <= t1:
                out.append(b - a)
        return out


def stream_tokens(c: httpx.Client, url: str, body: dict, on_token) -> float | None:
    """Send a streaming completion; call on_token(t) per chunk with text; return TTFT."""
    t0 = time.perf_counter()
    first = None
    with c.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            if first is None:
                first = now - t0
            on_token(now)
    return first


def background(url: str, stream: Stream, stop: threading.Event, seed: int,
               vocab: int, output_len: int) -> None:
    rng = random.Random(seed)
    with httpx.Client(timeout=600) as c:
        while not stop.is_set():
            prompt = [rng.randrange(17, vocab) for _ in range(16)]
            body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0,
                    "ignore_eos": True}
            try:
                stream_tokens(c, url, body, stream.add)
            except (httpx.HTTPError, RuntimeError) as e:
                if not stop.is_set():
                    print(f"background stream: {e}", file=sys.stderr)
                    stop.wait(1.0)


def run(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    log_dir = out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    up = argparse.Namespace(
        mode="push", prefill=1, decode=1, threads=1, max_model_len=args.max_model_len,
        kv_cache_memory=None, decode_cache_memory=None, block_size=None, dtype=None,
        policy="cache-aware", health_interval=None, shuffle_free_blocks=None,
        prefix_hit_tail=None, push_layers_per_write=None)
    cfg = json.loads((Path(args.model_dir) / "config.json").read_text())
    vocab = int(cfg["vocab_size"])
    results: dict = {"cpu_flags": cpu_flags(),
                     "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     "command": " ".join(sys.argv),
                     "model": args.model, "cells": []}
    with Supervisor(log_dir, child_env()) as sup:
        instances = [sup.spawn(s) for s in plan_instances(up, args.model)]
        sup.wait_healthy(instances, args.startup_timeout)
        urls = {r: [c.url for c in instances if c.spec.role == r]
                for r in ("prefill", "decode")}
        routers = {}
        for mode in MODES:
            port = free_port()
            argv = router_argv(up, port, urls["prefill"], urls["decode"]) + [
                "--local-prefill-max-tokens", str(THRESHOLD[mode])]
            routers[mode] = sup.spawn(ChildSpec(f"router-{mode}", "router", argv, port))
        sup.wait_healthy(list(routers.values()), args.startup_timeout)
        rng = random.Random(args.seed)
        with httpx.Client(timeout=600) as c:
            for mode in MODES:  # warm both paths (first push sets up the NIXL peer)
                for n in (32, max(args.sizes)):
                    prompt = [rng.randrange(17, vocab) for _ in range(n)]
                    stream_tokens(c, routers[mode].url, {"prompt": prompt, "max_tokens": 4,
                                                         "temperature": 0}, lambda t: None)
            for nbg in args.background:
                stop = threading.Event()
                streams = [Stream() for _ in range(nbg)]
                threads = [threading.Thread(
                    target=background, daemon=True,
                    args=(routers["local"].url, s, stop, args.seed + 100 + i, vocab,
                          args.background_output_len)) for i, s in enumerate(streams)]
                for t in threads:
                    t.start()
                if nbg:  # every stream past its own prefill, decoding
                    deadline = time.monotonic() + 120
                    while (any(len(s.times) < 3 for s in streams)
                           and time.monotonic() < deadline):
                        time.sleep(0.2)
                    base_t0 = time.perf_counter()
                    time.sleep(args.baseline_s)
                    base_gaps = [g for s in streams
                                 for g in s.gaps_in(base_t0, time.perf_counter())]
                else:
                    base_gaps = []
                for n in args.sizes:
                    cell = {"background": nbg, "tokens": n,
                            "baseline_itl_ms": (statistics.median(base_gaps) * 1e3
                                                if base_gaps else None)}
                    for mode in MODES:
                        cell[mode] = {"ttft_ms": [], "stall_ms": []}
                    for rep in range(args.repeats):
                        order = MODES if rep % 2 == 0 else MODES[::-1]
                        for mode in order:
                            prompt = [rng.randrange(17, vocab) for _ in range(n)]
                            t0 = time.perf_counter()
                            ttft = stream_tokens(
                                c, routers[mode].url,
                                {"prompt": prompt, "max_tokens": 4, "temperature": 0,
                                 "ignore_eos": True}, lambda t: None)
                            t1 = t0 + (ttft or 0)
                            gaps = [g for s in streams for g in s.gaps_in(t0, t1)]
                            cell[mode]["ttft_ms"].append(ttft * 1e3)
                            cell[mode]["stall_ms"].append(max(gaps) * 1e3 if gaps else None)
                    for mode in MODES:
                        m = cell[mode]
                        m["ttft_median_ms"] = statistics.median(m["ttft_ms"])
                        stalls = [s for s in m["stall_ms"] if s is not None]
                        m["stall_median_ms"] = statistics.median(stalls) if stalls else None
                    results["cells"].append(cell)
                    print(_row(cell), flush=True)
                stop.set()
                for t in threads:
                    t.join(timeout=args.background_output_len * 2.0)
    return results


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def _row(cell: dict) -> str:
    lo, re_ = cell["local"], cell["remote"]
    return (f"| {cell['background']} | {cell['tokens']} | {_fmt(lo['ttft_median_ms'])} | "
            f"{_fmt(re_['ttft_median_ms'])} | "
            f"{re_['ttft_median_ms'] / lo['ttft_median_ms']:.2f}x | "
            f"{_fmt(cell['baseline_itl_ms'])} | {_fmt(lo['stall_median_ms'])} | "
            f"{_fmt(re_['stall_median_ms'])} |")


HEADER = ("| background streams | uncached tokens | local TTFT ms | remote (push) TTFT ms | "
          "remote/local | background ITL ms (no probe) | stall, local ms | "
          "stall, remote ms |\n|---:|---:|---:|---:|---:|---:|---:|---:|")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--model-dir", default=None,
                   help="the model's folder (default: the installed kvpush model)")
    p.add_argument("--sizes", default="32,64,128,256,512,1024",
                   type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--background", default="0,4",
                   type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--background-output-len", type=int, default=400)
    p.add_argument("--baseline-s", type=float, default=3.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=180)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.model_dir is None:
        from kvpush.models import resolve_model
        args.model_dir = str(resolve_model(args.model))
    print(HEADER, flush=True)
    res = run(args)
    out = Path(args.out)
    (out / "summary.json").write_text(json.dumps(res, indent=1))
    md = [f"# Local prefill on decode vs a push prefill leg ({args.model})", "",
          "```", res["command"], "```", "",
          f"{res['date']}; CPU: {res['cpu_flags']}", "",
          HEADER]
    md += [_row(c) for c in res["cells"]]
    (out / "summary.md").write_text("\n".join(md) + "\n")
    print(f"wrote {out}/summary.json and summary.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
