"""How much longer an engine step runs per request arriving during it, from run sets'
step traces (benchmarks/SIMULATION.md 1-arrivals; the simulator's host.arrival_step_s).

For each workload, mode and instance of the given run sets (`kvpush bench compare
--step-trace` folders, as benchmarks/sim_runs.sh makes them), every traced step of one
kind (steps with a prefill chunk, or decode-only steps) is fitted by least squares as

    measured = k_run x modelled + c x arrivals

with one speed factor ``k_run`` per run (so the host's drift from run to run cancels)
and one cost ``c`` per arrival, where ``modelled`` is the set's profile and
``arrivals`` the requests that reached the host during the step (for a P/D pair, the
arrivals at P: push sends each request to D at the same time, pull relays it later).

    .venv/bin/python benchmarks/arrival_steps.py sim/v14 sim/v15 sim/v16 sim/v17

(folders under benchmarks/results; each set's profile: its cpu-local-pooled.json).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Hashable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks/results"
sys.path.insert(0, str(ROOT / "src"))

#: (instance label, the trace files of its steps, the trace files of the host arrivals)
ROLES = {"colocated": [("colocated", "both", "both")],
         "pull": [("P", "prefill", "prefill"), ("D", "decode", "prefill")],
         "push": [("P", "prefill", "prefill"), ("D", "decode", "prefill")]}


def fit(rows: list[tuple[Hashable, float, float, int]]) -> tuple[float, float] | None:
    """(c, its standard error) from (run, modelled, measured, arrivals) rows, with a speed
    factor per run (any key that tells the runs apart); None when no step saw an
    arrival."""
    import numpy as np

    runs = sorted({r for r, *_ in rows})
    if not any(n for *_, n in rows) or len(rows) <= len(runs) + 1:
        return None
    col = {r: i for i, r in enumerate(runs)}
    a = np.zeros((len(rows), len(runs) + 1))
    y = np.array([d for _, _, d, _ in rows])
    for i, (r, m, _, n) in enumerate(rows):
        a[i, col[r]], a[i, -1] = m, n
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    res = y - a @ coef
    cov = np.linalg.pinv(a.T @ a) * float(res @ res) / (len(rows) - len(runs) - 1)
    return float(coef[-1]), float(np.sqrt(cov[-1, -1]))


def collect(run_set: str) -> dict[tuple[str, ...], list]:
    from kvpush.engine.step_trace import read_arrivals
    from kvpush.sim.arrival_cost import arrivals_during
    from kvpush.sim.profile import load_profile
    from kvpush.sim.served import traced_steps
    from kvpush.sim.step_models import decode_only

    prof = load_profile(RESULTS / run_set / "cpu-local-pooled.json")
    groups: dict[tuple[str, ...], list] = {}
    for wl in sorted(p for p in (RESULTS / run_set).iterdir() if (p / "runs").is_dir()):
        for path in sorted((wl / "runs").glob("*.json")):
            run = json.loads(path.read_text())
            mode = run["mode_label"].split("-")[0]
            folder = wl / "steps" / f"{run['mode_label']}_rep{run['repeat']}"
            if mode not in ROLES or not folder.is_dir():
                continue
            model = prof.step_models[f"threads={run['threads_per_instance']}"]
            key_run = f"{run_set}/{path.stem}"
            span = (run["wall_start"], run["wall_end"])
            rate = str(run["request_rate"]).removesuffix(".0")
            for inst, role, arrival_role in ROLES[mode]:
                arrivals = sorted(t for f in folder.glob(f"{arrival_role}-*.jsonl")
                                  for t in read_arrivals(f) if span[0] <= t <= span[1])
                for st in traced_steps(sorted(folder.glob(f"{role}-*.jsonl")), *span):
                    chunks = [tuple(c) for c in st["chunks"]]
                    kind = "decode" if decode_only(chunks) else "prefill"
                    n = arrivals_during(st, arrivals)
                    groups.setdefault((wl.name, run["mode_label"], rate, inst, kind),
                                      []).append(
                        (key_run, model.step_time(chunks), st["dur"], n))
    return groups


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sets", nargs="+", help="run set folders under benchmarks/results")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    groups: dict[tuple[str, ...], list[Any]] = {}
    for s in args.sets:
        for key, rows in collect(s).items():
            groups.setdefault(key, []).extend(rows)
    out = []
    print(f"Run sets: {', '.join(args.sets)}. Per arrival during a step: c (ms) +- its "
          "standard error, one speed factor per run.\n")
    print("| workload | mode | rate | instance | steps | n | arrivals in them | c (ms) |")
    print("|---|---|---:|---|---|---:|---:|---:|")
    for (wl, mode, rate, inst, kind), rows in sorted(groups.items()):
        got = fit(rows)
        if got is None:
            continue
        c, se = got
        out.append({"workload": wl, "mode": mode, "rate": rate, "instance": inst,
                    "steps": kind,
                    "n": len(rows), "arrivals": sum(n for *_, n in rows),
                    "c_s": round(c, 6), "se_s": round(se, 6)})
        print(f"| {wl} | {mode} | {rate} | {inst} | {kind} | {len(rows)} | "
              f"{out[-1]['arrivals']} | {1e3 * c:.1f} +- {1e3 * se:.1f} |")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
