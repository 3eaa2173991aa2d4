"""Push with per-layer WRITEs against grouped ones, beside pull, on this host.

`kvpush serve --push-layers-per-write N` sets how many layers' new KV one WRITE carries
while a prefill step's forward pass runs (0, the default: 1 on CUDA, a third of the
layers on CPU). This script starts a 1P1D pull pair and one 1P1D push pair per value of
``--groups`` side by side (1 torch thread per instance; an idle pair does not step), then
sends the same short prompts to each in turns, the order rotating, so that the host's
drifting speed falls on every configuration alike. It prints, per configuration, the
time to first token and how much longer P's prefill steps ran than pull's (the median
of measured minus modelled time over P's prefill steps, as
``kvpush.sim.push_step.push_step_cost`` takes it, split by whether D was mid-step):

    .venv/bin/python benchmarks/push_layer_groups.py --groups 1,0 --turns 12 \\
        --out benchmarks/results/push-layer-groups.json

Run it on a quiet host: ~3 minutes for 12 turns of 8 prompts at 2 req/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
PROFILE = ROOT / "benchmarks/results/sim/v14/cpu-local-pooled.json"


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", default="1,0",
                    help="comma-separated --push-layers-per-write values (0: the default)")
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--prompts-per-turn", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--profile", type=Path, default=PROFILE,
                    help="a calibrated profile: its engine-alone fit prices each step")
    ap.add_argument("--out", type=Path, help="also write the figures here (JSON)")
    args = ap.parse_args(argv)
    groups = [int(g) for g in args.groups.split(",")]
    if args.turns < 1 or any(g < 0 for g in groups):
        ap.error("--turns must be >= 1 and every group >= 0")

    from kvpush.sim.corun import PairSpec, serve_side_by_side
    from kvpush.sim.profile import engine_step_model
    from kvpush.sim.push_step import describe, push_step_cost

    data = json.loads(args.profile.read_text())
    engine = engine_step_model(data, data["roles"]["prefill"])
    pairs = [PairSpec("pull", "pull")] + [
        PairSpec(f"push, {g or 'default'} layers per WRITE", "push", g) for g in groups]
    run = serve_side_by_side(args.model, pairs, args.input_len, args.output_len,
                             args.prompts_per_turn, args.turns, args.rate)
    ttfts, steps, started = run.ttfts, run.steps, run.started_utc
    names = [p.name for p in pairs]
    rows = []
    for name in names:
        t = ttfts[name]
        row = {"config": name, "requests": len(t),
               "ttft_median_ms": round(1e3 * statistics.median(t), 1),
               "ttft_mean_ms": round(1e3 * statistics.mean(t), 1),
               "ttft_p90_ms": round(1e3 * percentile(t, 0.9), 1)}
        if name != "pull":
            cost = push_step_cost(steps["pull", "prefill"], steps[name, "prefill"], engine,
                                  steps["pull", "decode"], steps[name, "decode"])
            row["p_step_over_pull_ms"] = {
                "D idle": round(1e3 * cost["push_prefill_step_s"], 1),
                "beside D": round(1e3 * cost["push_prefill_corun_step_s"], 1)}
            row["p_steps"] = cost["steps"]
            # the same steps priced per step + per KV block, as calibrate fits them
            per_block = push_step_cost(steps["pull", "prefill"], steps[name, "prefill"],
                                       engine, steps["pull", "decode"],
                                       steps[name, "decode"],
                                       int(data["instance"]["block_size"]))
            row["p_step_fit"] = describe(per_block)
        rows.append(row)
    print(f"{args.input_len}-token prompts, {args.output_len} out, {args.rate:g} req/s, "
          f"{args.turns} turns of {args.prompts_per_turn} per configuration, rotating; "
          f"started {started}\n")
    print("| configuration | requests | TTFT med (ms) | TTFT mean | TTFT p90 "
          "| P's prefill step over pull's (D idle / beside D, ms) |")
    print("|---|---:|---:|---:|---:|---|")
    for r in rows:
        extra = r.get("p_step_over_pull_ms")
        print(f"| {r['config']} | {r['requests']} | {r['ttft_median_ms']} | "
              f"{r['ttft_mean_ms']} | {r['ttft_p90_ms']} | "
              + (f"+{extra['D idle']} / +{extra['beside D']}" if extra else "-") + " |")
    for r in rows:
        if "p_step_fit" in r:
            print(f"\n{r['config']}, per step + per KV block: {r['p_step_fit']}")
    if args.out:
        args.out.write_text(json.dumps({"started_utc": started, "args": {
            k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
