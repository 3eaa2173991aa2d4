"""How steady this host's CPU speed is: a fixed matmul timed over and over.

The simulator's validation (benchmarks/SIMULATION.md) compares runs with a profile
calibrated minutes apart; this script shows how far the host's own speed moves on that
time scale, with no kvpush code in the loop. Each job multiplies a 32 x 576 matrix by a
576 x 4096 one (the shape of a batch-32 decode step's projections for smollm2-135m) 200
times per sample and reports the median sample time per second. Per round, three
segments of ``--seconds`` each:

* ``2t``: one process, 2 torch threads (how a colocated instance steps on 2 cores);
* ``2t-bound``: the same with its OpenMP threads bound to cores (OMP_PROC_BIND=true,
  OMP_PLACES=cores), as vLLM's CPU backend pins its threads;
* ``1t+1t``: two 1-thread processes at once, pinned to core 0 and core 1 (how a 1P1D
  pair steps), reported per core.

    .venv/bin/python benchmarks/host_speed.py --rounds 6 --seconds 20 --json OUT.json

Run it on a quiet host: anything else running moves the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

JOB = r"""
import statistics, sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
end = time.time() + float(sys.argv[2])
a, w = torch.randn(32, 576), torch.randn(576, 4096)
for _ in range(20):
    a @ w
second, samples = int(time.time()), []
while time.time() < end:
    t = time.perf_counter()
    for _ in range(200):
        a @ w
    samples.append(time.perf_counter() - t)
    if int(time.time()) != second:
        print(second, statistics.median(samples), flush=True)
        second, samples = int(time.time()), []
"""


def run_jobs(jobs: list[tuple[int, dict[str, str], list[str]]], seconds: float
             ) -> list[list[tuple[int, float]]]:
    """Start every (threads, extra env, command prefix) job at once; their
    (second, median sample seconds) lines."""
    procs = []
    for threads, env, prefix in jobs:
        procs.append(subprocess.Popen(
            [*prefix, sys.executable, "-c", JOB, str(threads),
             str(seconds)], env={**os.environ, **env}, stdout=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        text, _ = p.communicate(timeout=seconds + 60)
        out.append([(int(s), float(v)) for s, v in (line.split() for line in text.split("\n")
                                                     if line.strip())])
    return out


def spread(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=10, method="inclusive") if len(values) >= 2 else values * 9
    return {"n": len(values), "fastest_ms": 1e3 * min(values), "p10_ms": 1e3 * q[0],
            "median_ms": 1e3 * statistics.median(values), "p90_ms": 1e3 * q[-1],
            "slowest_ms": 1e3 * max(values)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=20.0, help="per segment")
    ap.add_argument("--json", type=Path, help="also write every second's figure here")
    args = ap.parse_args(argv)
    if len(os.sched_getaffinity(0)) < 2:
        print("host_speed.py needs 2 usable cores", file=sys.stderr)
        return 2
    bound = {"OMP_PROC_BIND": "true", "OMP_PLACES": "cores"}
    segments = {"2t": [(2, {}, [])], "2t-bound": [(2, bound, [])],
                "1t+1t": [(1, {}, ["taskset", "-c", "0"]), (1, {}, ["taskset", "-c", "1"])]}
    seen: dict[str, list[float]] = {}
    lines: list[dict] = []
    print("| time (UTC) | round | segment | median sample (ms) per second |")
    print("|---|---:|---|---|")
    for r in range(args.rounds):
        for name, jobs in segments.items():
            results = run_jobs(jobs, args.seconds)
            for i, res in enumerate(results):
                key = name if len(results) == 1 else f"{name} core {i}"
                seen.setdefault(key, []).extend(v for _, v in res)
                lines += [{"round": r, "segment": key, "t": s, "s": v} for s, v in res]
                if res:
                    stamp = time.strftime("%H:%M:%S", time.gmtime(res[0][0]))
                    print(f"| {stamp} | {r} | {key} | "
                          + " ".join(f"{1e3 * v:.0f}" for _, v in res) + " |", flush=True)
    print("\n| segment | seconds | fastest | p10 | median | p90 | slowest | slowest / fastest |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    summary = {}
    for key, values in seen.items():
        s = summary[key] = spread(values)
        print(f"| {key} | {s['n']} | {s['fastest_ms']:.0f} | {s['p10_ms']:.0f} | "
              f"{s['median_ms']:.0f} | {s['p90_ms']:.0f} | {s['slowest_ms']:.0f} | "
              f"{s['slowest_ms'] / s['fastest_ms']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "seconds": lines}, indent=1)
                             + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
