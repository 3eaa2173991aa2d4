"""How far a cell's simulated metrics move from one simulated measurement to the next.

A measured cell of `kvpush bench compare` pools its R repeats. One *simulated
measurement* is built the same way: R runs, one per repeat (each at that repeat's arrival
seed where the repeats drew their own, `bench compare --arrivals-per-repeat`), each on
its own noise seed, their requests pooled. This script simulates ``--groups`` G of them
per cell (G x R noise seeds) and prints, for every cell metric whose prediction over all
G x R runs pooled misses the tolerance or whose spread is wider than it, the measured
value, that prediction, and the 10th-90th percentile and min-max of the G simulated
measurements; then the largest and the median spread over all cell metrics.

Where that spread is wider than the 15% tolerance, the statistic itself moves that much
between two simulated measurements of the same cell at the bench's sample size. The
profile's step noise is drawn independently per step, so the spread it makes can be far
narrower than the host's own between repeats (table D of sim_validate.py), which comes
from speed levels that hold for seconds to minutes (SIMULATION.md 1-host, 1-v21). The
pooled prediction here rests on G x R runs, not on table A's noise seeds, so a cell near
the tolerance can miss here and not there. This is a diagnostic beside table A; the
validation's criterion stays table A's pooled prediction within 15% of the measured
value.

    P=benchmarks/results/sim/v21/cpu-local-pooled.json
    .venv/bin/python benchmarks/sim_band.py --profile $P \\
        --workloads sim/v21/quiet_512,sim/v21/short_high_rate [--groups 16] [--marker NAME]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

import sim_validate as sv  # noqa: E402

GROUPS = 16


def band_rows(profile: Path, workloads: tuple[str, ...], groups: int = GROUPS) -> list[dict]:
    """One row per cell metric: measured, pooled prediction, and the simulated
    measurements' values."""
    from kvpush.bench.compare_report import pooled
    from kvpush.sim.cluster import summarize
    from kvpush.sim.profile import load_profile

    prof = load_profile(profile)
    rows = []
    for name in workloads:
        for rate, label, w, cluster, _cell, reps in sv.cells(name):
            sims = sv.simulated_measurements(prof, w, cluster, reps, groups)
            per = [summarize(m) for m in sims]
            every = summarize([r for m in sims for r in m])
            meas = pooled(reps)
            for key, title in sv.METRICS:
                rows.append({"workload": name, "mode": label, "rate": rate,
                             "metric": title, "measured": meas[key], "sim": every[key],
                             "values": [p[key] for p in per]})
    return rows


def describe(row: dict) -> dict:
    """The row's band: p10 / p90 / min / max of the simulated measurements, the band's
    half-width over the pooled prediction, whether the pooled prediction is within the
    tolerance and whether the measured value lies inside p10-p90."""
    from kvpush.bench.metrics import percentile

    v, m, s = row["values"], row["measured"], row["sim"]
    lo, hi = percentile(v, 10), percentile(v, 90)
    return {"p10": lo, "p90": hi, "min": min(v), "max": max(v),
            "half_width": (hi - lo) / 2 / s if s else 0.0,
            "err": (s - m) / m if m else 0.0,
            "within": abs(s - m) <= sv.TOLERANCE * m, "inside": lo <= m <= hi}


def table(rows: list[dict]) -> str:
    out = ["| workload | mode | rate | metric | measured | sim pooled | err | sim p10-p90 "
           "| sim min-max | band half-width | measured inside p10-p90? |",
           "|---|---|---:|---|---:|---:|---:|---|---|---:|---|"]
    misses = inside = wide = 0
    for r in rows:
        d = describe(r)
        wide += d["half_width"] > sv.TOLERANCE
        misses += not d["within"]
        inside += not d["within"] and d["inside"]
        if d["within"] and d["half_width"] <= sv.TOLERANCE:
            continue
        mark = "" if d["within"] else " **x**"
        out.append(f"| {r['workload']} | {r['mode']} | {r['rate']} | {r['metric']} | "
                   f"{r['measured']:.0f} | {r['sim']:.0f} | {d['err']:+.0%}{mark} | "
                   f"{d['p10']:.0f}-{d['p90']:.0f} | {d['min']:.0f}-{d['max']:.0f} | "
                   f"{d['half_width']:.0%} | {'yes' if d['inside'] else 'no'} |")
    widths = sorted(describe(r)["half_width"] for r in rows)
    return "\n".join(out) + (
        f"\n\n- {len(rows)} cell metrics; {wide} with a band (p10-p90) wider than "
        f"±{sv.TOLERANCE:.0%} of the pooled prediction; {misses} pooled predictions outside "
        f"{sv.TOLERANCE:.0%}, {inside} of them with the measured value inside the band; "
        f"band half-width median ±{widths[len(widths) // 2]:.0%}, largest "
        f"±{widths[-1]:.0%}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", type=Path, required=True)
    ap.add_argument("--workloads", required=True,
                    help="result folders under benchmarks/results/, comma-separated")
    ap.add_argument("--groups", type=int, default=GROUPS,
                    help=f"simulated measurements per cell (default {GROUPS})")
    ap.add_argument("--marker", help="also write the table between these markers of "
                                     "SIMULATION.md")
    args = ap.parse_args(argv)
    if args.groups < 2:
        ap.error("--groups must be at least 2")
    workloads = tuple(w for w in args.workloads.split(",") if w)
    rows = band_rows(args.profile, workloads, args.groups)
    shown = (args.profile.resolve().relative_to(HERE.parent)
             if HERE.parent in args.profile.resolve().parents else args.profile)
    body = (f"Profile `{shown}`; {args.groups} simulated measurements per cell, each one "
            "run per measured repeat on its own noise seed, pooled as the repeats are. "
            f"Rows: metrics that miss {sv.TOLERANCE:.0%} pooled or whose band is wider "
            f"than ±{sv.TOLERANCE:.0%}. "
            "Command: `.venv/bin/python benchmarks/sim_band.py --profile "
            f"{shown} --workloads {args.workloads}"
            f"{'' if args.groups == GROUPS else f' --groups {args.groups}'}"
            f"{' --marker ' + args.marker if args.marker else ''}`.\n\n" + table(rows))
    print(body)
    if args.marker:
        sv.write_section(sv.DOC, args.marker, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
