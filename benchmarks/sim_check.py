"""The simulator against one measured `kvpush bench compare` set, cell by cell.

One command: ``kvpush simulate calibrate`` on this host (the engine alone, per thread
count, and the NIXL transfer probe), then one ``kvpush bench compare`` set (every mode
at every rate on the same prompts), then the same workload simulated on the calibrated
profile for each mode and rate. It prints, per cell, median and p90 TTFT and mean and
median TPOT, measured against simulated, with the simulation's error in percent, and
writes the table (``sim_check.md``) and the figures (``sim_check.json``) into ``--out``
beside the profile (``profile.json``) and the compare set (``compare/``).

    .venv/bin/python benchmarks/sim_check.py --out /tmp/sim_check

Run it on a quiet host (the default set takes about 12 minutes on 2 cores). The
simulator's instances run as `bench compare` starts them: P/D with one share of the
cores each, colocated with all; the calibration fits a step model for each thread count.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

#: (summary field, heading): what is compared per cell, all in ms
METRICS: tuple[tuple[str, str], ...] = (
    ("median_ttft_ms", "TTFT med"), ("p90_ttft_ms", "TTFT p90"),
    ("mean_tpot_ms", "TPOT mean"), ("median_tpot_ms", "TPOT med"),
)


def error_pct(simulated: float, measured: float) -> float:
    """(simulated - measured) / measured in percent; nan where nothing was measured."""
    if not measured or math.isnan(measured) or math.isnan(simulated):
        return math.nan
    return 100.0 * (simulated - measured) / measured


def check_rows(measured: dict[str, dict[str, Any]], simulated: dict[str, dict[str, Any]]
               ) -> list[dict[str, Any]]:
    """One row per cell ("mode@rate") measured and simulated: each metric's measured and
    simulated value and the error in percent; ``worst``: the largest error's size."""
    rows = []
    for cell, m in measured.items():
        s = simulated.get(cell)
        if s is None:
            continue
        row: dict[str, Any] = {"cell": cell}
        for key, _ in METRICS:
            row[key] = {"measured": m[key], "simulated": s[key],
                        "error_pct": error_pct(s[key], m[key])}
        errs = [abs(row[k]["error_pct"]) for k, _ in METRICS
                if not math.isnan(row[k]["error_pct"])]
        row["worst"] = max(errs, default=math.nan)
        rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]], limit: float = 15.0) -> str:
    """The rows as markdown: per metric "measured / simulated (error)"; a cell whose
    worst error is beyond ``limit`` percent is marked."""
    def ms(x: float) -> str:
        return f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}"

    def part(v: dict[str, float]) -> str:
        e = v["error_pct"]
        err = "-" if math.isnan(e) else f"{e:+.0f}%"
        return f"{ms(v['measured'])} / {ms(v['simulated'])} ({err})"

    head = "| cell | " + " | ".join(f"{h} (ms)" for _, h in METRICS) + " | within |"
    lines = [head, "|---|" + "---:|" * len(METRICS) + "---|"]
    for r in rows:
        ok = "-" if math.isnan(r["worst"]) else ("yes" if r["worst"] <= limit else "no")
        lines.append(f"| {r['cell']} | " + " | ".join(part(r[k]) for k, _ in METRICS)
                     + f" | {ok} |")
    within = sum(1 for r in rows if r["worst"] <= limit)
    lines.append(f"\nmeasured / simulated (simulation's error); {within} of {len(rows)} "
                 f"cells within {limit:g}% on every metric")
    return "\n".join(lines)


def simulate_cells(profile: Any, cfg: Any) -> dict[str, dict[str, Any]]:
    """Every mode x rate of the compare config ``cfg`` simulated on ``profile``: the
    prompts' lengths and the arrival draw (seed) each rate's runs used, colocated as
    one instance, P/D as ``cfg.prefill`` + ``cfg.decode``."""
    from kvpush.bench.compare import arrival_seed
    from kvpush.bench.compare_report import rate_text
    from kvpush.sim.cluster import ClusterConfig, simulate
    from kvpush.sim.workload import Workload

    if cfg.arrivals_per_repeat:
        raise ValueError("one arrival draw per rate only (no --arrivals-per-repeat)")
    out = {}
    for i, rate in enumerate(cfg.rates):
        w = Workload(cfg.num_prompts, rate, cfg.input_len, cfg.output_len,
                     seed=arrival_seed(cfg, i, 0))
        for spec in cfg.modes:
            if spec.mode == "colocated":
                cc = ClusterConfig("colocated", 0, 1)
            else:
                cc = ClusterConfig(spec.mode, cfg.prefill, cfg.decode)
            out[f"{spec.label}@{rate_text(rate)}"] = simulate(profile, w, cc).summary()
    return out


def thread_counts(cfg: Any) -> tuple[int, ...]:
    """The torch threads `bench compare` gives P/D and colocated instances here."""
    from kvpush.bench.compare_report import usable_cores

    cores = usable_cores()
    return tuple(sorted({max(1, cores // (cfg.prefill + cfg.decode)), cores}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, metavar="DIR")
    ap.add_argument("--model", default="smollm2-135m", metavar="NAME_OR_DIR")
    ap.add_argument("--modes", default="colocated,push,pull")
    ap.add_argument("--rates", default="0.25,inf")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", type=Path,
                    help="simulate on this profile instead of calibrating one")
    ap.add_argument("--quick", action="store_true",
                    help="a very short calibration (a check that the script runs)")
    args = ap.parse_args(argv)

    from kvpush.bench.compare import CompareConfig, ModeSpec, run_compare
    from kvpush.sim.calibrate import CalibrationPlan, calibrate
    from kvpush.sim.profile import load_profile

    cfg = CompareConfig(modes=[ModeSpec.parse(m) for m in args.modes.split(",")],
                        rates=[float(r) for r in args.rates.split(",")],
                        out_dir=args.out / "compare", model=args.model,
                        input_len=args.input_len, output_len=args.output_len,
                        num_prompts=args.num_prompts, repeats=args.repeats, seed=args.seed,
                        label="sim_check")
    cfg.validate()
    profile_path = args.profile
    if profile_path is None:
        plan = CalibrationPlan.quick() if args.quick else CalibrationPlan()
        profile_path = args.out / "profile.json"
        plan = dataclasses.replace(plan, threads=thread_counts(cfg))
        calibrate(args.model, profile_path, plan, note="benchmarks/sim_check.py")
    profile = load_profile(profile_path)
    summary = run_compare(cfg)
    rows = check_rows(summary["cells"], simulate_cells(profile, cfg))
    table = format_table(rows)
    command = "`.venv/bin/python benchmarks/sim_check.py " + " ".join(
        sys.argv[1:] if argv is None else argv) + "`"
    text = (f"Profile `{profile_path}` ({profile.name}); measured: {summary['machine']}; "
            f"{args.input_len} in / {args.output_len} out, {args.num_prompts} prompts, "
            f"{args.repeats} repeat(s). Command: {command}\n\n{table}\n")
    print(text)
    (args.out / "sim_check.md").write_text(text)
    (args.out / "sim_check.json").write_text(json.dumps(
        {"profile": str(profile_path), "config": summary["config"], "rows": rows},
        indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
