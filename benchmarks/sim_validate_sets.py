"""Validate `kvpush simulate` against several run sets at once, each on its own profile.

`benchmarks/sim_runs.sh` made the same five workloads more than once (sim/v14, v15,
v16), each set bracketed by its own calibrations. On this VM a cell's repeats move by up
to 30% with the host (SIMULATION.md 1-host), so one set's three repeats still carry that
noise. This script pools the sets: for every cell it simulates each set's workload on
that set's own profile and compares the percentiles of all simulated requests with those
of all measured requests of all the sets' repeats. Each set's simulation has as many
runs per measured repeat as every other's (``--replicas`` noise seeds over all the
cell's repeats, rounded up; each run at its repeat's arrivals), so the sets weigh in
the pooled simulation as they do in the pooled measurement. Each set is still predicted
only from its own calibration; what pooling adds is repeats, as `kvpush bench compare`
pools its repeats within a set.

    .venv/bin/python benchmarks/sim_validate_sets.py \\
        --set sim/v14=sim/v14/cpu-local-pooled-push-step.json \\
        --set sim/v15=sim/v15/cpu-local-pooled.json \\
        --set sim/v16=sim/v16/cpu-local-pooled.json

(paths under benchmarks/results/). The table goes between the ``sim_validate_sets``
markers of SIMULATION.md (``--no-write``: print only). ``--resamples N`` adds how far
each cell's verdict rests on which repeats were measured: the share of N draws of its
repeats, with replacement, whose pooled value the simulation is within 15% of.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

import sim_validate as sv  # noqa: E402

from kvpush.sim.served import FALLBACK  # noqa: E402

NAMES = ("quiet_512", "long_prompts", "short_high_rate", "prefix_hit",
         "prefix_hit_tail_on_decode")


def with_burst_start(profile, source=None):
    """``profile`` with the burst start of ``source`` (handoff.burst_first_gaps_s and
    engine_wake_s) if it measured none itself, or with none at all (``source`` None)."""
    ho = profile.handoff
    if source is None:
        ho = dataclasses.replace(ho, burst_first_gaps_s=(), engine_wake_s=0.0)
    elif not ho.burst_first_gaps_s:
        ho = dataclasses.replace(ho, burst_first_gaps_s=source.handoff.burst_first_gaps_s,
                                 engine_wake_s=source.handoff.engine_wake_s)
    return dataclasses.replace(profile, handoff=ho)


def load_lender(path: Path):
    """The profile at ``path``, to lend its burst start (:func:`with_burst_start`); a
    ValueError if it measured none."""
    from kvpush.sim.profile import load_profile

    lender = load_profile(path)
    if not lender.handoff.burst_first_gaps_s:
        raise ValueError(f"{path}: the profile has no handoff.burst_first_gaps_s to lend")
    return lender


def lender_arg(ap: argparse.ArgumentParser, text: str | None) -> Path | None:
    """``--burst-start-from``'s profile under benchmarks/results (None without the
    option); a usage error if it is no file or measured no burst start."""
    if not text:
        return None
    path = sv.RESULTS / text
    if not path.is_file():
        ap.error(f"--burst-start-from: no file {path}")
    try:
        load_lender(path)
    except ValueError as e:
        ap.error(f"--burst-start-from: {e}")
    return path


def validate_sets(sets: list[tuple[str, Path]], replicas: int = sv.REPLICAS,
                  arrival_step_s: float | None = None,
                  without_kind: str | None = None,
                  burst_start_from: Path | None = None,
                  without_burst_start: bool = False, resamples: int = 0) -> list[dict]:
    """One row per cell present in every set: measured (all sets' repeats pooled) and
    simulated (each set on its profile, requests pooled) metrics. What-ifs:
    ``arrival_step_s``, every profile's host.arrival_step_s set to it for all its step
    models; ``without_kind``, that kind of step's own served factor dropped from every
    step model, so its steps take their fallback kind's (kvpush.sim.served);
    ``without_burst_start``, no profile's bursts start with a drawn first gap or its
    engines wake at once. ``burst_start_from``: the profiles that measured no burst
    start (calibrated before the probe did) take that profile's. ``resamples``: also
    each metric's ``share_`` of that many draws of the cell's measured repeats that the
    simulation is within the tolerance of (resampled_shares)."""
    from kvpush.bench.compare_report import pooled
    from kvpush.sim.cluster import summarize
    from kvpush.sim.profile import load_profile
    from kvpush.sim.served import without_kind as drop

    profiles = [load_profile(p) for _, p in sets]
    if burst_start_from is not None:
        source = load_lender(burst_start_from)
        profiles = [with_burst_start(p, source) for p in profiles]
    if without_burst_start:
        profiles = [with_burst_start(p) for p in profiles]
    if arrival_step_s is not None:
        profiles = [dataclasses.replace(p, arrival_step_s=dict.fromkeys(
            p.step_models, arrival_step_s)) for p in profiles]
    if without_kind is not None:
        profiles = [dataclasses.replace(p, step_models={
            n: drop(m, without_kind) for n, m in p.step_models.items()}) for p in profiles]
    rows = []
    for name in NAMES:
        per_set = [{(rate, label): (w, cluster, reps)
                    for rate, label, w, cluster, _cell, reps in sv.cells(f"{folder}/{name}")}
                   for folder, _ in sets]
        for key in [k for k in per_set[0] if all(k in s for s in per_set)]:
            # every set simulated as `groups` measurements of its own (one run per
            # measured repeat, at the repeat's arrivals), so that each set weighs in the
            # pooled simulation as its repeats weigh in the pooled measurement
            groups = -(-replicas // sum(len(cells[key][2]) for cells in per_set))
            results, runs = [], []
            for prof, cells in zip(profiles, per_set):
                w, cluster, reps = cells[key]
                # each set's noise seeds follow the ones the sets before it used
                results += [r for m in sv.simulated_measurements(
                    prof, w, dataclasses.replace(cluster, seed=cluster.seed + len(results)), reps,
                    groups)
                    for r in m]
                runs += reps
            meas, sim = pooled(runs), summarize(results)
            row = {"workload": name, "mode": key[1], "rate": key[0],
                   "n": meas["completed"], "repeats": len(runs), "sim_runs": len(results)}
            for metric, _ in sv.METRICS:
                row[f"meas_{metric}"], row[f"sim_{metric}"] = meas[metric], sim[metric]
                row[f"err_{metric}"] = ((sim[metric] - meas[metric]) / meas[metric]
                                        if meas[metric] else 0.0)
            if resamples:
                rng = random.Random(f"resample/{name}/{key[1]}/{key[0]}")
                row.update({f"share_{metric}": share for metric, share in
                            resampled_shares(runs, sim, resamples, rng).items()})
            rows.append(row)
    return rows


def resampled_shares(runs: list[dict], sim: dict, resamples: int,
                     rng: random.Random) -> dict[str, float]:
    """How far a cell's verdict rests on which repeats were measured: per metric, the
    share of ``resamples`` draws of its measured repeats (as many as it has, with
    replacement) whose pooled value ``sim`` is within the tolerance of. The repeat is
    the unit drawn: its requests share one host state and one arrival draw. Repeats are
    drawn from all the sets alike, while ``sim`` keeps the measured mix of sets, so
    where a cell has one repeat per set the share also carries how the sets differ."""
    from kvpush.bench.compare_report import request_tpots, request_ttfts
    from kvpush.bench.metrics import percentile

    values = [(request_ttfts(r), request_tpots(r)) for r in runs]
    quantile = {"median_ttft_ms": (0, 50), "p90_ttft_ms": (0, 90), "median_tpot_ms": (1, 50)}
    hits = dict.fromkeys(quantile, 0)
    for _ in range(resamples):
        drawn = [values[rng.randrange(len(values))] for _ in values]
        for metric, (which, q) in quantile.items():
            meas = percentile([x for d in drawn for x in d[which]], q) * 1e3
            # as the table's err: 0 where nothing was measured
            hits[metric] += abs(sim[metric] - meas) <= sv.TOLERANCE * meas if meas else 1
    return {metric: n / resamples for metric, n in hits.items()}


def resample_table(rows: list[dict], resamples: int, floor: float = 0.9) -> str:
    """The cells whose verdict on some metric holds in fewer than ``floor`` of the
    draws, and per metric how many cells hold it in at least ``floor``."""
    shares = [[r[f"share_{m}"] for m, _ in sv.METRICS] for r in rows]
    lines = [f"Resampled ({resamples} draws of each cell's measured repeats, with "
             "replacement, as many as it has): the share of draws whose pooled value the "
             f"simulation is within {sv.TOLERANCE:.0%} of. Cells below {floor:.0%} on "
             "any metric:", "",
             "| workload | mode | rate | repeats | " + " | ".join(h for _, h in sv.METRICS)
             + " |", "|---|---|---:|---:|" + "---:|" * len(sv.METRICS)]
    for r, s in zip(rows, shares):
        if min(s) < floor:
            lines.append(f"| {r['workload']} | {r['mode']} | {r['rate']} | {r['repeats']} | "
                         + " | ".join(f"{math.floor(1000 * x) / 10:.1f}%" for x in s) + " |")
    lines += ["", f"- within {sv.TOLERANCE:.0%} in at least {floor:.0%} of the draws: "
              + " / ".join(str(sum(s[i] >= floor for s in shares))
                           for i in range(len(sv.METRICS)))
              + f" of {len(rows)} cells (" + " / ".join(h for _, h in sv.METRICS) + ")"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", action="append", required=True, metavar="FOLDER=PROFILE",
                    help="a run set's folder and its profile, both under benchmarks/results")
    ap.add_argument("--replicas", type=int, default=sv.REPLICAS,
                    help="noise seeds per cell, shared out among all the sets' repeats "
                         "(rounded up to a whole number per repeat)")
    ap.add_argument("--arrival-step-s", type=float, metavar="SECONDS",
                    help="a what-if, not a prediction: every profile's host.arrival_step_s "
                         "set to this for all step models")
    ap.add_argument("--without-served-kind", choices=sorted(FALLBACK), metavar="KIND",
                    help="a what-if, not a prediction: every profile's served factor of "
                         "this kind of step dropped, its steps priced by the kind it "
                         "falls back to (prefill_burst -> prefill_batched -> prefill)")
    ap.add_argument("--burst-start-from", metavar="PROFILE",
                    help="profiles calibrated before the served probe measured how a "
                         "burst starts take this profile's (handoff.burst_first_gaps_s "
                         "and engine_wake_s; a file under benchmarks/results)")
    ap.add_argument("--without-burst-start", action="store_true",
                    help="a what-if, not a prediction: no profile's bursts draw their "
                         "first gap, and engines start a step as soon as work arrives")
    ap.add_argument("--resamples", type=int, default=0, metavar="N",
                    help="also how often each cell's verdict holds over N draws of its "
                         "measured repeats (with replacement; 0: not shown)")
    ap.add_argument("--marker", default="sim_validate_sets",
                    help="the SIMULATION.md markers to write between")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--results", action="store_true",
                    help="also write the section into RESULTS.md, between its markers "
                         "there (which must exist; the validation of record, issue 7)")
    args = ap.parse_args(argv)
    if args.arrival_step_s is not None and args.arrival_step_s < 0:
        ap.error("--arrival-step-s must be >= 0")
    if args.results and not args.no_write and (why := check_results_markers(args.marker)):
        ap.error(why)
    if args.resamples < 0:
        ap.error("--resamples must be >= 0")
    if args.burst_start_from and args.without_burst_start:
        ap.error("--burst-start-from and --without-burst-start exclude each other")
    sets = parse_sets(ap, args.set)
    lender = lender_arg(ap, args.burst_start_from)
    rows = validate_sets(sets, args.replicas, args.arrival_step_s,
                         args.without_served_kind, lender, args.without_burst_start,
                         args.resamples)
    what_if = ("" if args.arrival_step_s is None else
               f"**What-if, not a prediction:** every profile's host.arrival_step_s set to "
               f"{1e3 * args.arrival_step_s:g} ms for all step models. ")
    if args.without_served_kind:
        what_if += (f"**What-if, not a prediction:** every profile's served factor for "
                    f"{args.without_served_kind} steps dropped (priced by "
                    f"{FALLBACK[args.without_served_kind]}'s). ")
    if args.without_burst_start:
        what_if += ("**What-if, not a prediction:** no profile's bursts draw their first "
                    "gap (every gap is handoff.front_end_s) and engines start a step as "
                    "soon as work arrives. ")
    lent = ("" if lender is None else
            f"Profiles without a measured burst start take `{args.burst_start_from}`'s "
            "(handoff.burst_first_gaps_s and engine_wake_s). ")
    body = (what_if + lent + "Each cell pools the repeats of the sets "
            + ", ".join(f"`{f}` (profile `{p.relative_to(sv.RESULTS)}`)" for f, p in sets)
            + f"; simulated: each set on its own profile, {args.replicas} noise seeds "
            "shared out among all the sets' repeats (rounded up to a whole number per "
            "repeat, each at its repeat's arrivals), every request pooled. Latencies in ms; "
            "err = (sim - "
            f"measured) / measured; **x** = outside {sv.TOLERANCE:.0%}. Command: `.venv/bin/"
            "python benchmarks/sim_validate_sets.py "
            + " ".join(f"--set {t}" for t in args.set)
            + (f" --arrival-step-s {args.arrival_step_s:g}"
               if args.arrival_step_s is not None else "")
            + (f" --without-served-kind {args.without_served_kind}"
               if args.without_served_kind else "")
            + (f" --burst-start-from {args.burst_start_from}" if lender else "")
            + (" --without-burst-start" if args.without_burst_start else "")
            + (f" --replicas {args.replicas}" if args.replicas != sv.REPLICAS else "")
            + (f" --resamples {args.resamples}" if args.resamples else "")
            + (f" --marker {args.marker}" if args.marker != "sim_validate_sets" else "")
            + (" --results" if args.results else "")
            + "`.\n\n"
            + sv.table(rows) + "\n\n"
            + sv.scorecard(rows)
            + ("\n\n" + resample_table(rows, args.resamples) if args.resamples else ""))
    print(body)
    if not args.no_write:
        sv.write_section(sv.DOC, args.marker, body)
        if args.results:
            sv.write_section(sv.RESULTS_DOC, args.marker, body)
    return 0


def parse_sets(ap: argparse.ArgumentParser, texts: list[str]) -> list[tuple[str, Path]]:
    """The ``--set FOLDER=PROFILE`` arguments as (folder, profile path); a usage error
    (exit 2) for one that does not name a folder and a file under benchmarks/results."""
    sets = []
    for text in texts:
        folder, sep, profile = text.partition("=")
        if not sep or not (sv.RESULTS / folder).is_dir() or not (sv.RESULTS / profile).is_file():
            ap.error(f"--set {text}: expected FOLDER=PROFILE, both under benchmarks/results")
        sets.append((folder, sv.RESULTS / profile))
    return sets


def check_results_markers(marker: str) -> str | None:
    """Why RESULTS.md cannot take the section (None: it can): --results only replaces a
    section whose markers a person has placed there, never appends one at the end."""
    text = sv.RESULTS_DOC.read_text() if sv.RESULTS_DOC.exists() else ""
    if f"<!-- {marker}:begin -->" in text and f"<!-- {marker}:end -->" in text:
        return None
    return (f"--results: {sv.RESULTS_DOC.name} has no <!-- {marker}:begin/end --> markers; "
            "place them where the table belongs first")


if __name__ == "__main__":
    raise SystemExit(main())
