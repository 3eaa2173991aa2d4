"""Project push vs pull to the announcement's set-up with `kvpush simulate`.

Qwen3-32B, 1 prefill + 1 decode instance on the built-in H200 profile (TP8 per instance
by default, as on two P5en nodes), 2048 input / 128 output tokens at 1, 2 and 4
requests/s, for these KV situations: contiguous blocks, fragmented blocks (one descriptor
per layer per block), decode holding the whole prompt in its prefix cache (under both
of push's tail policies: D computes the tail, or P computes the prompt and pushes the
block D lacks), and decode holding the first half (in these, prefill keeps no prefix
cache: the hits are decode's alone, as when decode served the previous turn of a
conversation). Prints the tables and writes them between the ``sim_project`` markers of
``benchmarks/SIMULATION.md`` (and JSON into
``benchmarks/results/sim/projection_<profile>.json``).

    .venv/bin/python benchmarks/sim_project.py
    .venv/bin/python benchmarks/sim_project.py --profile h200-tp1-qwen3-32b --no-write
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from sim_validate import write_section  # noqa: E402

DOC = HERE / "SIMULATION.md"
SCENARIOS = (
    # name, fragmentation, prefix_len (fraction of the prompt), cached on, push's
    # prefix-hit tail policy (kvpush --prefix-hit-tail; prefill is its default)
    ("contiguous KV", 0.0, 0.0, (), "prefill"),
    ("fragmented KV", 1.0, 0.0, (), "prefill"),
    ("decode-side full prefix hit, tail on decode", 0.0, 1.0, ("decode",), "decode"),
    ("decode-side full prefix hit, tail on prefill", 0.0, 1.0, ("decode",), "prefill"),
    ("decode-side half prefix hit", 0.0, 0.5, ("decode",), "prefill"),
)
STAGES = ("prefill_started", "prefill_done", "relayed", "decode_received", "registered",
          "transfer_posted", "transfer_done", "notified", "first_token", "client_first_token")


def project(profile_name: str, rates: list[float], num_prompts: int, input_len: int,
            output_len: int, seed: int) -> tuple[list[dict], dict]:
    from kvpush.sim.cluster import ClusterConfig, simulate
    from kvpush.sim.profile import load_profile
    from kvpush.sim.workload import Workload

    prof = load_profile(profile_name)
    rows, stages = [], {}
    for name, frag, prefix_frac, cached, tail in SCENARIOS:
        prefix = min(input_len - 1, int(input_len * prefix_frac))
        for rate in rates:
            w = Workload(num_prompts, rate, input_len, output_len, seed, prefix, cached)
            out = {}
            for mode in ("pull", "push"):
                res = simulate(prof, w, ClusterConfig(mode, 1, 1, frag,
                                                      prefill_prefix_cache=not cached,
                                                      prefix_hit_tail=tail))
                out[mode] = res.summary()
            row = {"scenario": name, "rate": rate}
            for mode in ("pull", "push"):
                s = out[mode]
                for k in ("median_ttft_ms", "p90_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
                          "mean_descs", "unfinished"):
                    row[f"{mode}_{k}"] = s[k]
                if rate == rates[0]:
                    stages[f"{name} / {mode}"] = s["stages_ms"]
            row["ttft_ratio"] = row["pull_median_ttft_ms"] / row["push_median_ttft_ms"]
            row["ttft_p90_ratio"] = row["pull_p90_ttft_ms"] / row["push_p90_ttft_ms"]
            row["tpot_gain"] = 1 - row["push_mean_tpot_ms"] / row["pull_mean_tpot_ms"]
            rows.append(row)
    return rows, stages


def tables(rows: list[dict], stages: dict) -> str:
    head = ("| scenario | req/s | pull TTFT med | push TTFT med | pull/push med | pull/push "
            "p90 | pull TPOT mean | push TPOT mean | push TPOT gain | descs pull / push |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['scenario']} | {r['rate']:g} | {r['pull_median_ttft_ms']:.1f} | "
            f"{r['push_median_ttft_ms']:.1f} | **{r['ttft_ratio']:.2f}x** | "
            f"{r['ttft_p90_ratio']:.2f}x | {r['pull_mean_tpot_ms']:.2f} | "
            f"{r['push_mean_tpot_ms']:.2f} | **{r['tpot_gain']:+.1%}** | "
            f"{r['pull_mean_descs']:.0f} / {r['push_mean_descs']:.0f} |")
    used = [s for s in STAGES if any(s in v for v in stages.values())]
    st = ["| run (lowest rate) | " + " | ".join(used) + " |",
          "|---|" + "---:|" * len(used)]
    for name, v in stages.items():
        st.append(f"| {name} | " + " | ".join(f"{v[s]:.1f}" if s in v else "" for s in used)
                  + " |")
    return ("\n".join(lines) + "\n\nMean time from arrival to each stage (ms), lowest rate "
            "(announced: up to 3x TTFT and up to 30% TPOT, push over pull):\n\n" + "\n".join(st))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="h200-tp8-qwen3-32b")
    ap.add_argument("--rates", default="1,2,4")
    ap.add_argument("--num-prompts", type=int, default=400)
    ap.add_argument("--input-len", type=int, default=2048)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--marker", default="sim_project",
                    help="section of SIMULATION.md to (re)write")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    rows, stages = project(args.profile, rates, args.num_prompts, args.input_len,
                           args.output_len, args.seed)
    body = (f"Profile `{args.profile}`, 1 prefill + 1 decode, {args.input_len} in / "
            f"{args.output_len} out, {args.num_prompts} Poisson requests per run (seed "
            f"{args.seed}). Command: `.venv/bin/python benchmarks/sim_project.py"
            + (f" --profile {args.profile} --marker {args.marker}"
               if args.marker != "sim_project" else "") + "`.\n\n" + tables(rows, stages))
    print(body)
    if not args.no_write:
        write_section(DOC, args.marker, body)
        out = HERE / "results" / "sim" / f"projection_{args.profile}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"rows": rows, "stages": stages}, indent=1) + "\n")
        print(f"\nwrote {DOC} and {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
