"""Validate `kvpush simulate` against the recorded `kvpush bench compare` runs.

For each workload (default: the runs of ``benchmarks/results/sim/v14/``, made by
``benchmarks/sim_runs.sh`` with per-step traces) the configuration is read from
``summary.json`` (model, lengths, prompts, rates, modes, threads, seed) and replayed
through the simulator with the same Poisson arrivals (`kvpush bench`'s own generator
and seeds: ``seed + 1000 x rate index``; runs made with ``--arrivals-per-repeat`` are
replayed repeat by repeat at each run's recorded seed), on a profile calibrated on this
machine.
Predicted median / p90 TTFT and median TPOT are printed next to the measured (all
repeats pooled) and written between the ``sim_validate`` markers of
``benchmarks/SIMULATION.md``.

    # calibrate this machine, then validate (the one command to re-run on a quiet host):
    .venv/bin/python benchmarks/sim_validate.py --calibrate --profile /tmp/cpu-now.json
    # validate against an existing profile:
    .venv/bin/python benchmarks/sim_validate.py --profile benchmarks/results/sim/v14/cpu-local.json
    # the older runs of benchmarks/RESULTS.md, with table B's one-number host factor:
    .venv/bin/python benchmarks/sim_validate.py --idle-factor --marker sim_validate_legacy \
        --workloads long_prompts,prefix_hit,short_high_rate
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
WORKLOADS = tuple(f"sim/v14/{w}" for w in ("quiet_512", "long_prompts", "short_high_rate",
                                           "prefix_hit", "prefix_hit_tail_on_decode"))
DEFAULT_PROFILE = RESULTS / "sim" / "v14" / "cpu-local-pooled-push-step.json"
DOC = HERE / "SIMULATION.md"
#: the default validation's tables also go into RESULTS.md (issue 7 asks for them there)
RESULTS_DOC = HERE / "RESULTS.md"
TOLERANCE = 0.15
#: noise seeds per cell for profiles with host.step_noise or step_noise_quantiles (their
#: requests pooled)
REPLICAS = 16
METRICS = (("median_ttft_ms", "TTFT med"), ("p90_ttft_ms", "TTFT p90"),
           ("median_tpot_ms", "TPOT med"))


def _rate(text: str) -> float:
    return math.inf if text == "inf" else float(text)


def idle_factor(prof, workload: str) -> tuple[float, str]:
    """Measured / simulated TTFT of the one request that found the cluster idle in the
    workload's run on one thread (colocated-1t, first request of the lowest rate): how
    much slower the host ran during the benchmark than the profile says."""
    from kvpush.sim.cluster import ClusterConfig, simulate
    from kvpush.sim.workload import Workload

    summary = json.loads((RESULTS / workload / "summary.json").read_text())
    cfg, label = summary["config"], "colocated-1t"
    rate = summary["rates"][0]
    run = json.loads((RESULTS / workload / "runs" / f"{label}_r{rate}_rep0.json")
                     .read_text())
    w = Workload(1, _rate(rate), cfg["input_len"], cfg["output_len"], seed=cfg["seed"])
    sim = simulate(prof, w, ClusterConfig("colocated", 0, 1, step_models=(
        ("colocated", f"threads={cfg['threads'][label]}"),))).requests[0]
    measured = run["ttfts"][0]
    return measured / sim.ttft, (f"{workload} {label} @ {rate} req/s, request 0: measured "
                                 f"{measured * 1e3:.0f} ms, simulated {sim.ttft * 1e3:.0f} ms")


def cells(name: str):
    """Each measured cell of one workload folder: (rate text, mode label, the Workload, the
    ClusterConfig that replays it, the summary's pooled cell, the repeats' run JSONs)."""
    from kvpush.sim.cluster import ClusterConfig
    from kvpush.sim.workload import Workload

    summary = json.loads((RESULTS / name / "summary.json").read_text())
    cfg = summary["config"]
    shared = cfg["dataset"] == "shared-prefix"
    prefix = (cfg["prefix_len"] or cfg["input_len"] // 2) if shared else 0
    # runs from before --prefix-hit-tail had the engine compute a full hit's tail on D
    tail = cfg.get("prefix_hit_tail") or ("prefill" if "prefix_hit_tail" in cfg
                                          else "decode")
    for i, rate_text in enumerate(summary["rates"]):
        # the warm-up requests ran the shared prefix through P and D (or colocated)
        w = Workload(cfg["num_prompts"], _rate(rate_text), cfg["input_len"],
                     cfg["output_len"], seed=cfg["seed"] + 1000 * i, prefix_len=prefix,
                     prefix_cached_on=("prefill", "decode") if shared and cfg["warmup"]
                     else ())
        for label in summary["modes"]:
            cell = summary["cells"].get(f"{label}@{rate_text}")
            if cell is None:
                continue
            mode = label.split(":")[0].split("-")[0]
            threads = cfg["threads"][label]
            role = "colocated" if mode == "colocated" else None
            over = (("colocated", f"threads={threads}"),) if role else (
                ("prefill", f"threads={threads}"), ("decode", f"threads={threads}"))
            # bench compare runs colocated as ONE `role both` instance (its runs say
            # "instances": "1 both"); P/D as cfg prefill + cfg decode instances
            size = (0, 1) if mode == "colocated" else (cfg["prefill"], cfg["decode"])
            cluster = ClusterConfig(mode, *size, step_models=over, prefix_hit_tail=tail)
            reps = [json.loads(f.read_text()) for f in sorted(
                (RESULTS / name / "runs").glob(f"{label}_r{rate_text}_rep*.json"))]
            yield rate_text, label, w, cluster, cell, reps


def run_arrival_seed(w, run: dict) -> int:
    """The seed of a run's Poisson arrivals: ``arrival_seed`` in its JSON (bench compare
    since 749f67c), else ``seed`` (the bench client's one seed, which bench compare sets
    to the arrival seed; the v21 runs, made at 97933e8, have only that)."""
    return run.get("arrival_seed", run.get("seed", w.seed))


def per_repeat_arrivals(w, reps: list[dict]) -> bool:
    """Whether the cell's repeats drew their own arrivals (`bench compare
    --arrivals-per-repeat`): a run records another seed than the workload's. At an
    infinite rate every draw sends all at once, so those repeats are one workload."""
    return not math.isinf(w.rate) and any(run_arrival_seed(w, r) != w.seed for r in reps)


def simulate_cell(prof, w, cluster, reps: list[dict], replicas: int,
                  levels: list[tuple[str | None, float]] | None = None) -> list:
    """The simulated runs of one measured cell, to pool as its repeats are pooled.

    Repeats that share one arrival draw (the default of `bench compare`) are one workload:
    ``replicas`` noise seeds from ``cluster.seed`` on (kvpush.sim.noise; one
    deterministic run without step noise). Where the repeats drew their own arrivals, or
    ``levels`` (per repeat: the step model and factor of kvpush.sim.host_level) scale
    each one, every repeat is replayed on its own, at its recorded arrival seed, with
    ``ceil(replicas / repeats)`` noise seeds each, consecutive from ``cluster.seed``.
    One result per noise seed used, so ``len()`` of the answer is how many were."""
    from kvpush.sim.cluster import simulate_pooled

    if levels is None and not per_repeat_arrivals(w, reps):
        return simulate_pooled(prof, w, cluster, replicas)
    share = -(-replicas // len(reps))
    results: list = []
    for k, run in enumerate(reps):
        p = prof if levels is None else prof.scaled(levels[k][1], levels[k][0])
        wk = dataclasses.replace(w, seed=run_arrival_seed(w, run))
        results += simulate_pooled(p, wk, dataclasses.replace(
            cluster, seed=cluster.seed + k * share), share)
    return results


def simulated_measurements(prof, w, cluster, reps: list[dict], groups: int) -> list[list]:
    """``groups`` simulated measurements of one cell, each built as the measured cell is:
    one simulated run per measured repeat (at the repeat's arrivals where the repeats drew
    their own), on noise seeds ``cluster.seed + g * R + k`` (g: the measurement, k: the
    repeat). Always ``groups`` x R runs, with or without step noise, so that callers can
    weigh cells by their repeats (sim_validate_sets.py)."""
    from kvpush.sim.cluster import simulate

    own = per_repeat_arrivals(w, reps)
    loads = [dataclasses.replace(w, seed=run_arrival_seed(w, run)) if own else w
             for run in reps]
    n = len(reps)
    return [[simulate(prof, wk, dataclasses.replace(cluster, seed=cluster.seed + g * n + k))
             for k, wk in enumerate(loads)] for g in range(groups)]


def validate(profile_path: Path, scale: float = 1.0,
             workloads: tuple[str, ...] = WORKLOADS,
             replicas: int = REPLICAS, scale_model: str | None = None,
             host_level: bool = False) -> tuple[list[dict], str]:
    """One row per measured cell: measured and simulated metrics. ``host_level``: each
    repeat simulated on its own, its run's step model scaled by the run's host probe over
    the calibration's (kvpush.sim.host_level), ``replicas`` noise seeds shared out among
    the repeats and all their requests pooled."""
    from kvpush.sim.cluster import summarize
    from kvpush.sim.host_level import level_scale
    from kvpush.sim.profile import load_profile

    prof = load_profile(profile_path)
    measured = json.loads(profile_path.read_text()).get("measured", {})
    if scale != 1.0:
        prof = prof.scaled(scale, scale_model)
    rows: list[dict] = []
    for name in workloads:
        for rate_text, label, w, cluster, cell, reps in cells(name):
            row = {"workload": name, "mode": label, "rate": rate_text,
                   "n": cell["completed"], "per_repeat": per_repeat_arrivals(w, reps)}
            if host_level:
                levels = [level_scale(measured, run) for run in reps]
                row["host_scales"] = [round(factor, 4) for _, factor in levels]
                sim = summarize(simulate_cell(prof, w, cluster, reps, replicas, levels))
            else:
                sim = summarize(simulate_cell(prof, w, cluster, reps, replicas))
            for key, _ in METRICS:
                row[f"meas_{key}"] = cell[key]
                row[f"reps_{key}"] = [r[key] for r in reps if r.get(key) is not None]
                row[f"sim_{key}"] = sim[key]
                row[f"err_{key}"] = (sim[key] - cell[key]) / cell[key] if cell[key] else 0.0
            rows.append(row)
    return rows, prof.name


def level_table(rows: list[dict]) -> str:
    """Table A's layout with each cell's per-repeat host levels."""
    lines = table(rows).split("\n")
    lines[0] += " levels |"
    lines[1] += "---|"
    for i, r in enumerate(rows):
        lines[i + 2] += " " + "/".join(f"{f:.2f}" for f in r["host_scales"]) + " |"
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    head = ["workload", "mode", "rate", "n"]
    for _, t in METRICS:
        head += [f"{t} meas", f"{t} sim", "err"]
    out = ["| " + " | ".join(head) + " |", "|---|---|---:|---:|" + "---:|" * 3 * len(METRICS)]
    for r in rows:
        cells = [r["workload"], r["mode"], r["rate"], str(r["n"])]
        for key, _ in METRICS:
            e = r[f"err_{key}"]
            mark = "" if abs(e) <= TOLERANCE else " **x**"
            cells += [f"{r[f'meas_{key}']:.0f}", f"{r[f'sim_{key}']:.0f}", f"{e:+.0%}{mark}"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


RATIOS = (("pull", "push", "median_ttft_ms", "pull/push TTFT med"),
          ("pull", "push", "median_tpot_ms", "pull/push TPOT med"),
          ("colocated", "push", "median_ttft_ms", "colocated/push TTFT med"),
          ("colocated", "push", "median_tpot_ms", "colocated/push TPOT med"))


def ratio_table(rows: list[dict]) -> str:
    """Ratios between modes of the same workload and rate, measured vs simulated: a
    slower or faster host scales both modes and cancels out."""
    cells = {(r["workload"], r["rate"], r["mode"]): r for r in rows}
    out = ["| workload | rate | ratio | measured | simulated | err |",
           "|---|---:|---|---:|---:|---:|"]
    errs = []
    for (wl, rate, mode), r in cells.items():
        for a, b, key, title in RATIOS:
            if mode != b or (wl, rate, a) not in cells:
                continue
            ra = cells[wl, rate, a]
            meas = ra[f"meas_{key}"] / r[f"meas_{key}"]
            sim = ra[f"sim_{key}"] / r[f"sim_{key}"]
            e = sim / meas - 1
            errs.append(abs(e))
            mark = "" if abs(e) <= TOLERANCE else " **x**"
            out.append(f"| {wl} | {rate} | {title} | {meas:.2f} | {sim:.2f} | {e:+.0%}{mark} |")
    errs.sort()
    ok = sum(e <= TOLERANCE for e in errs)
    return "\n".join(out) + (f"\n\n- ratios: {ok}/{len(errs)} within {TOLERANCE:.0%}; median "
                             f"|error| {errs[len(errs) // 2]:.0%}" if errs else "")


def spread(values: list[float]) -> float:
    """(max - min) / mean of one cell's per-repeat values (0 for fewer than two)."""
    if len(values) < 2 or not sum(values):
        return 0.0
    return (max(values) - min(values)) / (sum(values) / len(values))


def repeat_table(rows: list[dict]) -> str:
    """The measured side: cells whose repeats differ among themselves by more than the
    tolerance, with the simulation beside them."""
    out = ["| workload | mode | rate | metric | repeats | spread | pooled | sim | err |",
           "|---|---|---:|---|---|---:|---:|---:|---:|"]
    count = total = 0
    for r in rows:
        for key, title in METRICS:
            reps = r.get(f"reps_{key}", [])
            if len(reps) < 2:
                continue
            total += 1
            sp = spread(reps)
            if sp <= TOLERANCE:
                continue
            count += 1
            e = r[f"err_{key}"]
            out.append(f"| {r['workload']} | {r['mode']} | {r['rate']} | {title} | "
                       + " / ".join(f"{v:.0f}" for v in reps)
                       + f" | {sp:.0%} | {r[f'meas_{key}']:.0f} | {r[f'sim_{key}']:.0f} | "
                       f"{e:+.0%}{'' if abs(e) <= TOLERANCE else ' **x**'} |")
    return "\n".join(out) + (f"\n\n- {count} of {total} repeated cell metrics differ by more "
                             f"than {TOLERANCE:.0%} from one repeat to another")


#: the step-time change the sensitivity section tries: two calibrations of this host
#: 25 minutes apart differed by 4-11% on one-thread steps (SIMULATION.md 1-v12)
SENSITIVITY = 0.05


def sensitivity_table(rows: list[dict], lo: list[dict], hi: list[dict]) -> str:
    """Cells whose prediction moves by more than the tolerance either way when every
    step takes ``SENSITIVITY`` less or more time (``lo`` / ``hi``: the validation at
    those scales): near saturation a few percent of step time is tens of percent of
    latency, and no profile measured apart from the runs pins them to 15%."""
    out = [f"| workload | mode | rate | metric | measured | sim x{1 - SENSITIVITY:g} | sim | "
           f"sim x{1 + SENSITIVITY:g} | measured inside? |",
           "|---|---|---:|---|---:|---:|---:|---:|---|"]
    count = misses = inside = 0
    for r, a, b in zip(rows, lo, hi):
        for key, title in METRICS:
            s0, s1, s2 = a[f"sim_{key}"], r[f"sim_{key}"], b[f"sim_{key}"]
            if not s1 or max(abs(s0 - s1), abs(s2 - s1)) / s1 <= TOLERANCE:
                continue
            count += 1
            m = r[f"meas_{key}"]
            within = min(s0, s2) <= m <= max(s0, s2)
            if abs(r[f"err_{key}"]) > TOLERANCE:
                misses += 1
                inside += within
            out.append(f"| {r['workload']} | {r['mode']} | {r['rate']} | {title} | {m:.0f} | "
                       f"{s0:.0f} | {s1:.0f} | {s2:.0f} | {'yes' if within else 'no'} |")
    total = sum(abs(r[f"err_{k}"]) > TOLERANCE for r in rows for k, _ in METRICS)
    return "\n".join(out) + (
        f"\n\n- {count} cell metrics move more than {TOLERANCE:.0%} for "
        f"{SENSITIVITY:.0%} of step time; {misses} of table A's {total} misses are among "
        f"them, {inside} of those with the measured value inside the band")


def scorecard(rows: list[dict]) -> str:
    lines = []
    for key, t in METRICS:
        ok = sum(abs(r[f"err_{key}"]) <= TOLERANCE for r in rows)
        errs = sorted(abs(r[f"err_{key}"]) for r in rows)
        lines.append(f"- {t}: {ok}/{len(rows)} within {TOLERANCE:.0%}; median |error| "
                     f"{errs[len(errs) // 2]:.0%}, worst {errs[-1]:.0%}")
    return "\n".join(lines)


def noise_phrase(host: dict) -> str:
    """How the profile's steps scatter, for a table's header ("" for not at all)."""
    if tables := host.get("step_noise_quantiles"):
        from kvpush.sim.noise import table_mean

        sigmas = host.get("step_noise", {})

        def kind(m: str, k: str) -> str:
            if k in tables.get(m, {}):
                return f"{k} mean {table_mean(tables[m][k]):.3f}"
            return f"{k} sigma {sigmas[m][k]:.3f}"

        kinds = ", ".join(f"{m} " + "/".join(
            kind(m, k) for k in ("prefill", "decode")
            if k in tables.get(m, {}) or k in sigmas.get(m, {}))
            for m in sorted(set(sigmas) | set(tables)))
        return ("Step noise (per step model and kind: a mean factor where drawn from the "
                "probe's percentiles, host.step_noise_quantiles, else the sigma of the "
                f"log-normal, host.step_noise): {kinds}")
    sigmas = ", ".join(f"{m} " + "/".join(f"{k} {v:.3f}" for k, v in sig.items())
                       for m, sig in host.get("step_noise", {}).items())
    return f"Step noise (host.step_noise, sigma of log step time): {sigmas}" if sigmas else ""


def write_section(doc: Path, marker: str, body: str) -> None:
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    text = doc.read_text() if doc.exists() else "# kvpush simulator: validation and projection\n"
    block = f"{begin}\n{body}\n{end}"
    if begin in text and end in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    doc.write_text(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", type=Path, default=DEFAULT_PROFILE)
    ap.add_argument("--calibrate", action="store_true",
                    help="run `kvpush simulate calibrate` into --profile first")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--note", default="", help="note for the calibrated profile")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--workloads", default=",".join(WORKLOADS),
                    help="result folders under benchmarks/results/ (default: the runs of "
                         "sim/v14/)")
    ap.add_argument("--idle-factor", action="store_true",
                    help="also table B: step times scaled by measured / simulated TTFT of "
                         "the first workload's first colocated-1t request")
    ap.add_argument("--replicas", type=int, default=REPLICAS,
                    help="noise seeds per cell, pooled, for a profile with step noise "
                         "(host.step_noise or step_noise_quantiles; default "
                         f"{REPLICAS}; a profile without simulates once)")
    ap.add_argument("--marker", default="sim_validate",
                    help="section of SIMULATION.md to (re)write")
    ap.add_argument("--scale", type=float, default=1.0,
                    help="every step time x this in table A (a what-if: the host at another "
                         "speed level, SIMULATION.md 1-host); needs --no-write or a --marker "
                         "of its own")
    ap.add_argument("--scale-model", default=None,
                    help="--scale only this step model's steps (e.g. threads=2)")
    ap.add_argument("--host-level", action="store_true",
                    help="also table F: each run's steps scaled by its idle host probe over "
                         "the calibration's (runs made with bench compare --host-probe, a "
                         "profile calibrated with the probe; kvpush.sim.host_level)")
    args = ap.parse_args()
    if args.scale != 1.0 and not args.no_write and args.marker == "sim_validate":
        ap.error("--scale makes a what-if, not the validation: add --no-write or a --marker")
    if args.calibrate and args.profile == DEFAULT_PROFILE:
        ap.error(f"--calibrate writes a new profile: give it a --profile path (the default, "
                 f"{DEFAULT_PROFILE.relative_to(HERE.parent)}, is the one the recorded runs "
                 "were validated against)")
    if args.calibrate:
        kvpush = Path(sys.executable).with_name("kvpush")
        cmd = [str(kvpush), "simulate", "calibrate", "--model", args.model,
               "--out", str(args.profile)] + (["--note", args.note] if args.note else [])
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    from kvpush.sim.profile import load_profile

    workloads = tuple(w for w in args.workloads.split(",") if w)
    rows, name = validate(args.profile, args.scale, workloads, args.replicas, args.scale_model)
    lo, _ = validate(args.profile, args.scale * (1 - SENSITIVITY), workloads, args.replicas,
                     args.scale_model)
    hi, _ = validate(args.profile, args.scale * (1 + SENSITIVITY), workloads, args.replicas,
                     args.scale_model)
    from kvpush.sim.host_level import HostLevelError

    try:
        leveled = (validate(args.profile, args.scale, workloads, args.replicas,
                            args.scale_model, host_level=True)[0] if args.host_level else [])
    except HostLevelError as e:
        ap.error(f"--host-level: {e}")
    with_factor = args.idle_factor
    if with_factor:
        factor, basis = idle_factor(load_profile(args.profile), workloads[0])
        adjusted, _ = validate(args.profile, factor, workloads, args.replicas)
    else:
        factor, basis, adjusted = 1.0, "", []
    prof = json.loads(args.profile.read_text())
    meas = prof.get("measured", {})
    noise = noise_phrase(prof.get("host", {}))
    shown = (args.profile.resolve().relative_to(HERE.parent)
             if HERE.parent in args.profile.resolve().parents else args.profile)
    body = (f"Profile `{shown}`"
            f" ({name}; calibrated {meas.get('started_utc', '?')} with the "
            f"{meas.get('clock', '?')} clock, load average before/after "
            f"{meas.get('load_avg_before', '?')} / {meas.get('load_avg_after', '?')}). "
            + (f"{noise}; each cell pools {args.replicas} noise seeds"
               + (" (rounded up to a whole number per repeat where the repeats drew their "
                  "own arrivals)" if any(r["per_repeat"] for r in rows) else "")
               + ". " if noise else
               "No step noise: one deterministic run per cell. ") +
            "Latencies in ms; err = (sim - measured) / measured; **x** = outside "
            f"{TOLERANCE:.0%}. Command: `.venv/bin/python benchmarks/sim_validate.py"
            f"{' --calibrate' if args.calibrate else ''}"
            f"{'' if args.profile == DEFAULT_PROFILE else f' --profile {shown}'}"
            f"{'' if args.workloads == ','.join(WORKLOADS) else ' --workloads ' + args.workloads}"
            f"{' --idle-factor' if args.idle_factor else ''}"
            f"{'' if args.replicas == REPLICAS else f' --replicas {args.replicas}'}"
            f"{'' if args.marker == 'sim_validate' else ' --marker ' + args.marker}"
            f"{'' if args.scale == 1.0 else f' --scale {args.scale:g}'}"
            f"{' --scale-model ' + args.scale_model if args.scale_model else ''}"
            f"{' --host-level' if args.host_level else ''}`.\n\n"
            + ("#### A. The calibrated profile as it is (a pure prediction)\n\n"
               if args.scale == 1.0 else
               f"#### A. The calibrated profile with every "
               f"{args.scale_model + ' ' if args.scale_model else ''}step x{args.scale:g} "
               "(a what-if, not a prediction)\n\n")
            + table(rows) + "\n\n" + scorecard(rows)
            + ("\n\n#### B. Step times scaled by one contention factor\n\n"
               f"Factor **{factor:.2f}** = measured / simulated TTFT of a single request "
               f"that found the cluster idle ({basis}): how much slower the host ran during"
               " the benchmark than the profile (one number taken from the measured runs; "
               "everything else is still predicted).\n\n"
               + table(adjusted) + "\n\n" + scorecard(adjusted) if with_factor else "")
            + "\n\n#### C. Ratios between modes (table A's predictions; a uniformly slower host "
            "would cancel out here)\n\n"
            + ratio_table(rows)
            + "\n\n#### D. The measured side: cells whose repeats differ by more than "
            f"{TOLERANCE:.0%} (max - min over their mean)\n\n"
            + repeat_table(rows)
            + f"\n\n#### E. Sensitivity: cells that move more than {TOLERANCE:.0%} when every "
            f"step takes {SENSITIVITY:.0%} less or more time\n\n"
            + sensitivity_table(rows, lo, hi)
            + ("\n\n#### F. Each run at its host's measured speed level\n\n"
               "Each repeat simulated on its own with its step model's times x (the run's "
               "idle host probe, mean of before and after) / (the calibration's, mean over "
               "its passes); the repeats' requests pooled as measured. The probe is a fixed "
               "matmul job on an idle cluster (kvpush.bench.host_probe), measured apart "
               "from the runs' own latencies. levels: each repeat's factor.\n\n"
               + level_table(leveled) + "\n\n" + scorecard(leveled) if leveled else ""))
    print(body)
    if not args.no_write:
        write_section(DOC, args.marker, body)
        if args.marker == "sim_validate":
            write_section(RESULTS_DOC, args.marker, body)
        (RESULTS / "sim").mkdir(parents=True, exist_ok=True)
        (RESULTS / "sim" / f"{args.marker}.json").write_text(json.dumps(
            {"profile": str(shown), "raw": rows,
             # the sensitivity runs: only their predictions (the rest is in raw)
             **{f"step_scale_{side}": [{k: v for k, v in r.items()
                                        if k in ("workload", "mode", "rate")
                                        or k.startswith("sim_")} for r in rs]
                for side, rs in (("lo", lo), ("hi", hi))},
             "host_level": leveled, "contention_factor": factor,
             "factor_basis": basis, "adjusted": adjusted}, indent=1) + "\n")
        print(f"\nwrote {DOC}{' and RESULTS.md' if args.marker == 'sim_validate' else ''} "
              f"and {RESULTS / 'sim' / (args.marker + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
