"""How a burst sent all at once starts: measured against simulated.

With 32 short prompts sent at once, the 2-thread colocated instance prefills them in
steps of eight, so their times to first token climb in a staircase (one prompt alone,
then 7-8 per step). The median of 32 falls between the 16th and 17th: when the first
step takes one prompt, 16 prompts are done after three steps and the median is the mean
of the third and fourth step's group (~3.8 s in v26); when it takes two, it sits inside
the third group (~3.0 s). Which one happens depends on the gap between the first two
arrivals at the engine, against how soon the engine starts its first step. This script
prints, per run set, for the colocated cell of ``--workload`` at ``--rate`` (default:
short_high_rate, inf): per measured repeat the prompts in the first prefill step, the
gap between the first two arrivals (the trace's arrival lines) and the first step's
start after the first arrival; and how many prompts the simulator's first step takes
on the set's profile over ``--seeds`` noise seeds per repeat (SIMULATION.md 1-v26;
since 1-v27 the profile may draw the first gap from the measured ones):

    .venv/bin/python benchmarks/burst_start.py sim/v18 ... sim/v26 \
        --profile cpu-local-pooled-quantiles.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

import sim_validate as sv  # noqa: E402
from sim_validate_sets import lender_arg, load_lender, with_burst_start  # noqa: E402


def prompts(chunks: list[Any]) -> int:
    """Prompts' chunks (more than one token) in a step."""
    return sum(1 for c in chunks if c[0] > 1)


def first_step_prompts(result: Any) -> int:
    """Prompts the simulated run's first prefill step took: the requests whose first
    chunk was scheduled at the earliest time any was."""
    from kvpush.sim.workload import Stage

    starts = [r.stages[Stage.PREFILL_STARTED] for r in result.requests
              if Stage.PREFILL_STARTED in r.stages]
    return starts.count(min(starts))


def burst_starts(folder: str, profile: str, workload: str = "short_high_rate",
                 rate: str = "inf", seeds: int = 8,
                 burst_start_from: Path | None = None) -> dict[str, Any]:
    """``measured``: per repeat (first-step prompts, first arrival gap s, wake s);
    ``simulated``: first-step prompts of every simulated run (``seeds`` per repeat, as
    sim_validate.simulated_measurements replays them), on the set's profile, or where
    it measured no burst start, with ``burst_start_from``'s (sim_validate_sets)."""
    from kvpush.engine.step_trace import read_arrivals
    from kvpush.sim.profile import load_profile
    from kvpush.sim.served import first_gap, traced_steps

    prof = load_profile(sv.RESULTS / folder / profile)
    if burst_start_from is not None:
        prof = with_burst_start(prof, load_lender(burst_start_from))
    measured, simulated = [], []
    for r, label, w, cluster, _cell, reps in sv.cells(f"{folder}/{workload}"):
        if label != "colocated" or r != rate:
            continue
        for run in reps:
            steps_dir = (sv.RESULTS / folder / workload / "steps"
                         / f"{run['mode_label']}_rep{run['repeat']}")
            files = sorted(steps_dir.glob("*.jsonl"))
            window = run["wall_start"], run["wall_end"]
            steps = traced_steps(files, *window)
            arrivals = sorted(t for f in files for t in read_arrivals(f)
                              if window[0] <= t <= window[1])
            measured.append((prompts(steps[0]["chunks"]), first_gap(arrivals),
                             steps[0]["t"] - arrivals[0]))
        simulated += [first_step_prompts(res) for group in
                      sv.simulated_measurements(prof, w, cluster, reps, seeds)
                      for res in group]
    return {"measured": measured, "simulated": simulated}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sets", nargs="+", metavar="FOLDER", help="run sets under benchmarks/results")
    ap.add_argument("--profile", default="cpu-local-pooled-quantiles.json",
                    help="each set's profile, by its file name in the set")
    ap.add_argument("--workload", default="short_high_rate")
    ap.add_argument("--rate", default="inf")
    ap.add_argument("--seeds", type=int, default=8, help="noise seeds per measured repeat")
    ap.add_argument("--burst-start-from", metavar="PROFILE",
                    help="sets whose profile measured no burst start take this one's "
                         "(under benchmarks/results; as sim_validate_sets.py)")
    args = ap.parse_args(argv)
    lender = lender_arg(ap, args.burst_start_from)
    print("| set | measured: first-step prompts (first arrival gap, wake; ms) | "
          "simulated: first-step prompts (runs) |\n|---|---|---|")
    for folder in args.sets:
        out = burst_starts(folder, args.profile, args.workload, args.rate, args.seeds,
                           lender)
        meas = "; ".join(f"{n} ({1e3 * gap:.1f}, {1e3 * wake:.1f})"
                         for n, gap, wake in out["measured"])
        sim = out["simulated"]
        print(f"| {folder} | {meas} | " + ", ".join(
            f"{n}: {sim.count(n)}" for n in sorted(set(sim))) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
