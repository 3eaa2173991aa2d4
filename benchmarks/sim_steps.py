"""Compare a benchmark's real engine steps with the simulator's step model.

`kvpush bench compare --step-trace` makes every kvpush instance write one JSON line per
engine step (kvpush.engine.step_trace) under OUT/steps/<mode>_rep<N>/. This script
takes each run of OUT/runs/, the steps its instances took during it, and sets each
step's measured time beside the profile's prediction for the same step shape (same
chunks, positions, sampling and decode-cache fills), grouped by role and step kind:

    .venv/bin/python benchmarks/sim_steps.py OUT --profile PROFILE.json [--min-rows N]

(``--min-rows``: only steps of at least N rows, e.g. 30 for the batch-32 decodes of a
busy colocated instance.)

A ratio near 1 means the step model (as the simulator uses it: the engine-alone fit
times the profile's host.served_factors) holds inside the serving stack, so any
TTFT/TPOT error of `benchmarks/sim_validate.py` comes from elsewhere (queueing,
hand-off, HTTP); a ratio away from 1 is how much slower (or faster) the engine stepped
in this run than the profile says.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from kvpush.sim.profile import load_profile  # noqa: E402
from kvpush.sim.served import step_kind as served_kind  # noqa: E402
from kvpush.sim.served import traced_steps  # noqa: E402

#: a pause between two steps shorter than this is the step loop's own time between them
#: (inbox, outputs to the front end); a longer one is the instance waiting for work
GAP_S = 0.02
ROLE_OF_FILE = {"both": "colocated", "prefill": "prefill", "decode": "decode"}


def step_kind(chunks: list[list[Any]]) -> str:
    """The simulator's kinds (prefill, decode), with prefill steps that also decode
    told apart ("mixed")."""
    kind = served_kind(chunks)
    return "mixed" if kind == "prefill" and any(c[0] == 1 for c in chunks) else kind


def compare_run(out: Path, run: dict[str, Any], profile: Any,
                min_rows: int = 0) -> list[dict[str, Any]]:
    folder = out / "steps" / f"{run['mode_label']}_rep{run['repeat']}"
    model = profile.step_models[f"threads={run['threads_per_instance']}"]
    groups: dict[tuple[str, str], list[tuple[float, float]]] = {}
    busy: dict[str, float] = {}
    gaps: dict[str, list[float]] = {}
    for path in sorted(folder.glob("*.jsonl")):
        role = ROLE_OF_FILE.get(path.stem.split("-")[0], path.stem)
        end = None
        for st in traced_steps([path], run["wall_start"], run["wall_end"]):
            if end is not None and st["t"] - end < GAP_S:
                gaps.setdefault(role, []).append(st["t"] - end)
            end = st["t"] + st["dur"]
            if len(st["chunks"]) < min_rows:
                continue
            chunks = [tuple(c) for c in st["chunks"]]
            groups.setdefault((role, step_kind(st["chunks"])), []).append(
                (st["dur"], model.step_time(chunks)))
            busy[role] = busy.get(role, 0.0) + st["dur"]
    span = run["wall_end"] - run["wall_start"]
    rows = []
    for (role, kind), pairs in sorted(groups.items()):
        ratios = [m / p for m, p in pairs if p > 0]
        rows.append({"mode": run["mode_label"], "rate": run["request_rate"], "role": role,
                     "kind": kind, "steps": len(pairs),
                     "measured_ms": 1e3 * statistics.median(m for m, _ in pairs),
                     "model_ms": 1e3 * statistics.median(p for _, p in pairs),
                     "ratio_median": statistics.median(ratios),
                     "ratio_total": sum(m for m, _ in pairs) / sum(p for _, p in pairs),
                     "busy_share": busy[role] / span if span > 0 else 0.0,
                     "gap_ms": 1e3 * statistics.median(gaps[role]) if gaps.get(role) else 0.0})
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| mode | rate | role | steps | n | measured med (ms) | model med (ms) "
             "| measured/model (median) | (sum) | instance busy | gap med (ms) |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['rate']} | {r['role']} | {r['kind']} | "
                     f"{r['steps']} | {r['measured_ms']:.1f} | {r['model_ms']:.1f} | "
                     f"{r['ratio_median']:.2f} | {r['ratio_total']:.2f} | "
                     f"{100 * r['busy_share']:.0f}% | {r['gap_ms']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="a `kvpush bench compare --step-trace` folder")
    ap.add_argument("--profile", default=str(ROOT / "benchmarks/results/sim/cpu-local.json"))
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--min-rows", type=int, default=0,
                    help="only steps with at least this many rows (chunks)")
    args = ap.parse_args(argv)
    profile = load_profile(args.profile)
    rows: list[dict[str, Any]] = []
    for path in sorted((args.out / "runs").glob("*.json")):
        run = json.loads(path.read_text())
        if "wall_start" not in run or not (args.out / "steps").is_dir():
            print(f"{path.name}: no step trace (run bench compare with --step-trace)",
                  file=sys.stderr)
            continue
        rows += compare_run(args.out, run, profile, args.min_rows)
    if not rows:
        print("no traced steps found", file=sys.stderr)
        return 1
    print(f"Profile `{args.profile}`; {args.out}\n")
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
