"""Each run set on its own: the simulator's prediction of it beside the other sets'
measurement of the same cells (leave one set out).

Issue 7 asks for predicted median and p90 TTFT and median TPOT within 15% of measured.
The table of record pools the run sets (`sim_validate_sets.py`); this script asks how
each set fares alone. For every set S it scores, per metric, the cells within 15% of
S's measurement for two predictions:

- ``sim``: the simulator on S's own profile (the calibrations made just before and
  after S's runs), at S's arrivals, as `sim_validate.py` does;
- ``others``: the repeats of the other sets that ran the cell alike (same workload but
  for the seed of its draws, same cluster), pooled: the same engine, workload and rate
  measured again on other hours and, where the seeds differ, other arrival draws.

``others`` is a reference, not a rival: it does not know S's calibration, so it misses
wherever the host's speed moved between the sets, which the simulator sees. What it
shows is how far the measurement itself moves from set to set; a cell it misses too is
one whose value the host's hour or the arrival draw decides as much as any model.

    .venv/bin/python benchmarks/sim_holdout.py \\
        --set sim/v18=sim/v18/cpu-local-pooled-quantiles.json ... --replicas 256

(paths under benchmarks/results). Writes between the ``sim_holdout`` markers of
SIMULATION.md (``--no-write``: print only).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

import sim_validate as sv  # noqa: E402
from sim_validate_sets import (  # noqa: E402
    NAMES,
    lender_arg,
    load_lender,
    parse_sets,
    with_burst_start,
)


def err(value: float, ref: float) -> float:
    return (value - ref) / ref if ref else 0.0


def same_cell(a: tuple, b: tuple) -> bool:
    """Whether two sets ran one cell alike: the same workload but for its seed (the
    arrival and prompt draws), on the same cluster."""
    return (dataclasses.replace(a[0], seed=0) == dataclasses.replace(b[0], seed=0)
            and a[1] == b[1])


def holdout(sets: list[tuple[str, Path]], replicas: int,
            burst_start_from: Path | None = None) -> list[dict]:
    """One row per (set, cell present in every set): the set's measured metrics, the
    simulation's on its own profile, and the pooled measurement of the other sets that
    ran the cell alike (``others``: 0 when none did, and no errors for it). Profiles that
    measured no burst start take ``burst_start_from``'s (sim_validate_sets)."""
    from kvpush.bench.compare_report import pooled
    from kvpush.sim.cluster import summarize
    from kvpush.sim.profile import load_profile

    profiles = [load_profile(p) for _, p in sets]
    if burst_start_from is not None:
        lender = load_lender(burst_start_from)
        profiles = [with_burst_start(p, lender) for p in profiles]
    per_set = [{(name, rate, label): (w, cluster, cell, reps)
                for name in NAMES
                for rate, label, w, cluster, cell, reps in sv.cells(f"{folder}/{name}")}
               for folder, _ in sets]
    keys = [k for k in per_set[0] if all(k in s for s in per_set)]
    rows = []
    for i, ((folder, _), prof) in enumerate(zip(sets, profiles)):
        for key in keys:
            w, cluster, cell, reps = per_set[i][key]
            sim = summarize(sv.simulate_cell(prof, w, cluster, reps, replicas))
            alike = [s[key] for j, s in enumerate(per_set)
                     if j != i and same_cell(s[key], per_set[i][key])]
            others = pooled([r for a in alike for r in a[3]]) if alike else None
            row = {"set": folder, "workload": key[0], "rate": key[1], "mode": key[2],
                   "others": len(alike)}
            for metric, _ in sv.METRICS:
                row[f"meas_{metric}"] = cell[metric]
                row[f"err_sim_{metric}"] = err(sim[metric], cell[metric])
                if others is not None:
                    row[f"err_others_{metric}"] = err(others[metric], cell[metric])
            rows.append(row)
    return rows


def misses(row: dict, what: str, metric: str) -> bool:
    return abs(row[f"err_{what}_{metric}"]) > sv.TOLERANCE


def counts(rows: list[dict]) -> dict[str, str]:
    """Cells within the tolerance, per metric, for the simulation (of all rows) and for
    the other sets (of the rows that had some), and how the misses of the latter split."""
    paired = [r for r in rows if r["others"]]
    ok = {what: " / ".join(str(sum(not misses(r, what, m) for r in sel))
                           for m, _ in sv.METRICS)
          for what, sel in (("sim", rows), ("others", paired))}
    split = {"sim only": 0, "others only": 0, "both": 0}
    for r in paired:
        for m, _ in sv.METRICS:
            s, o = misses(r, "sim", m), misses(r, "others", m)
            split["sim only"] += s and not o
            split["others only"] += o and not s
            split["both"] += s and o
    return {"cells": str(len(rows)), "sim": ok["sim"], "paired": str(len(paired)),
            "others": ok["others"], **{k: str(v) for k, v in split.items()}}


def score_table(rows: list[dict]) -> str:
    """Per set, and all sets together: cells within the tolerance for the simulation
    and for the other sets' measurement, and who missed the cell metrics of the cells
    both predict."""
    short = " / ".join(t for _, t in sv.METRICS)
    out = [f"| set | cells | sim within: {short} | cells others ran alike | others "
           f"within: {short} | missed by sim only | by others only | by both |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    folders = list(dict.fromkeys(r["set"] for r in rows))
    for name, sel in [(f, [r for r in rows if r["set"] == f]) for f in folders] + [
            ("**all**", rows)]:
        c = counts(sel)
        out.append(f"| {name} | {c['cells']} | {c['sim']} | {c['paired']} | {c['others']} "
                   f"| {c['sim only']} | {c['others only']} | {c['both']} |")
    return "\n".join(out)


def miss_table(rows: list[dict]) -> str:
    """Every (set, cell, metric) that either predictor misses, with both errors."""
    out = ["| set | workload | mode | rate | metric | measured | sim err | others err |",
           "|---|---|---|---:|---|---:|---:|---:|"]
    for r in rows:
        for m, t in sv.METRICS:
            sides = ("sim", "others") if r["others"] else ("sim",)
            if not any(misses(r, what, m) for what in sides):
                continue
            shown = [f"{r[f'err_{what}_{m}']:+.0%}" + (" **x**" if misses(r, what, m) else "")
                     if what in sides else "-" for what in ("sim", "others")]
            out.append(f"| {r['set']} | {r['workload']} | {r['mode']} | {r['rate']} | {t} | "
                       f"{r[f'meas_{m}']:.0f} | {shown[0]} | {shown[1]} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", action="append", required=True, metavar="FOLDER=PROFILE",
                    help="a run set's folder and its profile, both under benchmarks/results "
                         "(at least two)")
    ap.add_argument("--replicas", type=int, default=sv.REPLICAS,
                    help="noise seeds per cell of each set, shared out among its repeats")
    ap.add_argument("--burst-start-from", metavar="PROFILE",
                    help="profiles that measured no burst start take this one's "
                         "(under benchmarks/results; as sim_validate_sets.py)")
    ap.add_argument("--marker", default="sim_holdout",
                    help="the SIMULATION.md markers to write between")
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args(argv)
    if args.replicas < 1:
        ap.error("--replicas must be >= 1")
    sets = parse_sets(ap, args.set)
    if len(sets) < 2:
        ap.error("give at least two --set: each is held out against the others")
    if len({folder for folder, _ in sets}) < len(sets):
        ap.error("a --set folder is named twice: a set would be its own reference")
    lender = lender_arg(ap, args.burst_start_from)
    rows = holdout(sets, args.replicas, lender)
    short = " / ".join(t for _, t in sv.METRICS)
    body = ("Each set held out in turn. **sim**: the simulator on the set's own profile, "
            f"{args.replicas} noise seeds per cell shared out among its repeats; "
            "**others**: the repeats of the other sets that ran the cell alike (same "
            "workload but for its seed, same cluster) pooled, as a reference. Counts "
            "are cells within "
            f"{sv.TOLERANCE:.0%} of the held-out set's measurement ({short}); err = "
            "(prediction - measured) / measured. Command: `.venv/bin/python "
            "benchmarks/sim_holdout.py " + " ".join(f"--set {t}" for t in args.set)
            + (f" --burst-start-from {args.burst_start_from}" if lender else "")
            + (f" --replicas {args.replicas}" if args.replicas != sv.REPLICAS else "")
            + (f" --marker {args.marker}" if args.marker != "sim_holdout" else "")
            + "`.\n\n" + score_table(rows) + "\n\nEvery miss, by either:\n\n"
            + miss_table(rows))
    print(body)
    if not args.no_write:
        sv.write_section(sv.DOC, args.marker, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
