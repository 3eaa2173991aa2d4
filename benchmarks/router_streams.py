"""Many streams through the router against the same instance direct (issue 51.4).

Starts one `kvpush serve` instance (role both, tiny random Qwen3 unless --model) and a
router in front of it with one cluster secret (``router``: over the instance's engine
core, its request plane). Then runs `kvpush bench` (--max-concurrency streams at once,
all sent at once) against each path in turn, the order rotating per repeat, and prints
per path the output tok/s
and TPOT, and per router the CPU it spent per request and per output token (its
process's user + system time over the run, from /proc).

    PYTHONPATH=src python benchmarks/router_streams.py                 # 64 streams
    PYTHONPATH=src python benchmarks/router_streams.py --repeats 3 --json out.json

Not part of the test suite. Everything it starts it stops.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from router_overhead import (  # noqa: E402
    child,
    free_port,
    listener_pid,
    model_or_tiny,
    wait_for_cores,
)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (and its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench(url: str, args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "-m", "kvpush", "bench", "--url", url, "--input-len",
           str(args.input_len), "--output-len", str(args.output_len), "--num-prompts",
           str(args.num_prompts), "--max-concurrency", str(args.streams),
           "--request-rate", "inf", "--no-progress", "--out", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model folder or installed name (default: a tiny "
                                    "random Qwen3)")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="the instance's torch threads")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    kvpush = [sys.executable, "-m", "kvpush"]
    os.environ.setdefault("KVPUSH_KV_SECRET", os.urandom(16).hex())
    with tempfile.TemporaryDirectory(prefix="kvpush-router-streams-") as tmp:
        tmpdir = Path(tmp)
        model = model_or_tiny(args.model, tmpdir)
        sp = free_port()
        serve = [*kvpush, "serve", model, "--port", str(sp), "--threads",
                 str(args.threads), "--log-level", "warning", "--max-num-seqs",
                 str(args.streams)]
        results: dict[str, list[dict]] = {}
        with contextlib.ExitStack() as stack:
            paths = {"direct": stack.enter_context(
                child(serve, tmpdir / "serve.log", f"http://127.0.0.1:{sp}"))}
            pids = {}
            for name, env in [("router", {})]:
                rp = free_port()
                router = [*kvpush, "router", "--mode", "colocated", "--decode",
                          f"http://127.0.0.1:{sp}", "--port", str(rp), "--log-level",
                          "warning"]
                paths[name] = stack.enter_context(
                    child(router, tmpdir / f"{name}.log", f"http://127.0.0.1:{rp}", env=env))
                pids[name] = listener_pid(rp)
            wait_for_cores(paths["router"])
            names = list(paths)
            bench(paths["direct"], args, tmpdir / "warm.json")  # warm up the instance
            for rep in range(args.repeats):
                k = rep % len(names)
                for name in names[k:] + names[:k]:
                    cpu0 = cpu_seconds(pids[name]) if name in pids else 0.0
                    res = bench(paths[name], args, tmpdir / f"{name}-{rep}.json")
                    cpu = cpu_seconds(pids[name]) - cpu0 if name in pids else None
                    results.setdefault(name, []).append({
                        "output_throughput": res["output_throughput"],
                        "mean_tpot_ms": res["mean_tpot_ms"],
                        "median_ttft_ms": res["median_ttft_ms"],
                        "completed": res["completed"],
                        "total_output_tokens": res["total_output_tokens"],
                        "router_cpu_s": cpu})
    print(f"{args.streams} streams, {args.num_prompts} requests of {args.input_len} in / "
          f"{args.output_len} out per run, {args.repeats} repeats (order rotating)")
    direct = max(r["output_throughput"] for r in results["direct"])
    for name, runs in results.items():
        best = max(r["output_throughput"] for r in runs)
        tps = ", ".join(f"{r['output_throughput']:.0f}" for r in runs)
        tpot = ", ".join(f"{r['mean_tpot_ms']:.1f}" for r in runs)
        line = (f"  {name:<10} output tok/s {tps}  (best {best:.0f}, {best / direct:.2f}x "
                f"direct)  TPOT ms {tpot}")
        cpus = [r for r in runs if r["router_cpu_s"] is not None]
        if cpus:
            per_req = sum(r["router_cpu_s"] for r in cpus) / sum(r["completed"] for r in cpus)
            per_tok = (sum(r["router_cpu_s"] for r in cpus)
                       / sum(r["total_output_tokens"] for r in cpus))
            line += f"  router CPU {per_req * 1e3:.2f} ms/request, {per_tok * 1e6:.0f} us/token"
        print(line)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
