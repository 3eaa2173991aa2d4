"""Cells whose requests' TPOTs fall in two groups, measured against simulated.

At a low rate on a colocated instance, a request that is decoding when the next prompt
arrives waits one or more mixed (prefill + decode) steps between two of its tokens; its
TPOT is then twice or more that of a request that did not. Where about half the requests waited,
the median TPOT of a cell is the mean of two values either side of the gap and moves by
the width of the gap with one request more or less on either side (SIMULATION.md
1-v20). This script prints, per run set and colocated cell of one workload and rate, how
many requests waited ("hit": a gap over ``--gap`` seconds between two of its tokens), the
middle of the sorted measured TPOTs, and the same for the simulation on the set's own
profile (``--profile``: its file name in each set), each measured repeat replayed at
its own arrivals on ``--groups`` noise seeds; and request by request how many the
simulation classes as measured ("alike": hit in more than half of its seeds where the
measured request was hit, and not where it was not):

    .venv/bin/python benchmarks/bimodal_cells.py sim/v18 sim/v19 sim/v20 sim/v21 sim/v22 \
        sim/v23 --profile cpu-local-pooled-quantiles.json --pooled

``--pooled`` adds one row per instance over all the sets' requests, with how far the
measured median itself moves: the 90% interval of the pooled median when the arrival
draws are drawn again with replacement (``--resamples`` times), and the share of those
resamples whose median the simulated one is within the validation's tolerance
(``sim_validate.TOLERANCE``, 15%) of, relative to the measured, as ``err``. A draw is
every measured repeat that replayed the same arrival seed, in whichever set (at an
infinite rate all repeats are one draw: the same burst): which requests wait follows
the arrivals, so the repeats of one draw are not independent (at 0.5 req/s v18-v20
replayed seed 0 in all their repeats, v21 and v22 seeds 0-2, v23 seeds 23-25).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

import sim_validate as sv  # noqa: E402

from kvpush.bench.metrics import percentile  # noqa: E402


def tpot(token_gaps: list[float]) -> float:
    """A request's TPOT from the gaps between its output tokens."""
    return sum(token_gaps) / len(token_gaps)


def waited(token_times: list[float], gap: float) -> bool:
    """Whether a request waited a mixed step: a gap over ``gap`` s between two tokens."""
    return any(b - a > gap for a, b in zip(token_times, token_times[1:]))


def cell_rows(run_set: str, workload: str, rate: str, gap: float, groups: int,
              profile: str = "cpu-local-pooled.json") -> list[dict]:
    """Per colocated cell: the measured and simulated shares of requests that waited, the
    middle of the measured TPOTs, both medians, and request by request (each repeat at its
    own arrivals) how many the simulation classes as measured: waited in more than half
    of its ``groups`` noise seeds exactly where the request measured waited. For
    :func:`pooled_rows`: ``repeat_tpots``, (arrival draw, its requests' TPOTs in s) per
    measured repeat, and ``sim_tpots``, every simulated request's TPOT."""
    from kvpush.sim.profile import load_profile

    prof = load_profile(sv.RESULTS / run_set / profile)
    rows = []
    for rate_text, label, w, cluster, _cell, reps in sv.cells(f"{run_set}/{workload}"):
        if rate_text != rate or not label.startswith("colocated"):
            continue
        sims = sv.simulated_measurements(prof, w, cluster, reps, groups)
        measured, agree, repeat_tpots = [], 0, []
        for k, run in enumerate(reps):
            draw = "burst" if math.isinf(w.rate) else sv.run_arrival_seed(w, run)
            repeat_tpots.append((draw, [tpot(i) for i in run["itls"] if i]))
            for i, itl in enumerate(run["itls"]):
                if not itl:
                    continue
                measured.append(itl)
                votes = sum(waited(m[k].requests[i].token_times, gap) for m in sims)
                agree += (votes * 2 > groups) == (max(itl) > gap)
        sim_reqs = [q for m in sims for res in m for q in res.requests
                    if len(q.token_times) > 1]
        sim_times = [q.token_times for q in sim_reqs]
        ordered = sorted(v for _draw, tpots in repeat_tpots for v in tpots)
        mid = len(ordered) // 2
        sim_tpots = [q.tpot for q in sim_reqs]
        rows.append({
            "set": run_set, "instance": label,
            "meas_hit": sum(max(i) > gap for i in measured), "meas_n": len(measured),
            "meas_middle": [round(1e3 * v) for v in ordered[max(0, mid - 2):mid + 2]],
            "meas_median": round(1e3 * statistics.median(ordered)),
            "sim_hit": sum(waited(t, gap) for t in sim_times), "sim_n": len(sim_times),
            "sim_median": round(1e3 * statistics.median(sim_tpots)),
            "agree": agree,
            "repeat_tpots": repeat_tpots, "sim_tpots": sim_tpots})
    return rows


def resampled_medians(draws: list[list[float]], resamples: int, seed: int = 0) -> list[float]:
    """The median of the pooled values when ``len(draws)`` draws (lists of values) are
    drawn again with replacement, ``resamples`` times (a cluster bootstrap: the values of
    one draw are not drawn one by one)."""
    rng = random.Random(seed)
    return [statistics.median(v for d in rng.choices(draws, k=len(draws)) for v in d)
            for _ in range(resamples)]


def pooled_rows(per_set: list[dict], resamples: int,
                tolerance: float = sv.TOLERANCE) -> list[dict]:
    """One row per instance over the sets' rows of :func:`cell_rows`: the pooled measured
    and simulated medians (ms), their ``err``, the requests that waited of all, the
    measured median's 90% interval over resampled arrival draws (the repeats grouped by
    arrival draw), and the share of resamples whose median the simulated one is within
    ``tolerance`` of."""
    out = []
    for label in dict.fromkeys(r["instance"] for r in per_set):
        rows = [r for r in per_set if r["instance"] == label]
        by_draw: dict[int | str, list[float]] = {}
        for r in rows:
            for draw, tpots in r["repeat_tpots"]:
                by_draw.setdefault(draw, []).extend(tpots)
        draws = [d for d in by_draw.values() if d]
        meas = statistics.median(v for d in draws for v in d)
        sim = statistics.median(t for r in rows for t in r["sim_tpots"])
        meds = resampled_medians(draws, resamples)
        out.append({
            "instance": label, "draws": len(draws),
            "repeats": sum(len(r["repeat_tpots"]) for r in rows),
            "meas_hit": sum(r["meas_hit"] for r in rows), "meas_n": sum(r["meas_n"] for r in rows),
            "sim_hit": sum(r["sim_hit"] for r in rows), "sim_n": sum(r["sim_n"] for r in rows),
            "meas_median": round(1e3 * meas), "sim_median": round(1e3 * sim),
            "err": (sim - meas) / meas,
            "interval": (round(1e3 * percentile(meds, 5)), round(1e3 * percentile(meds, 95))),
            "within": sum(abs(sim - m) <= tolerance * m for m in meds) / resamples})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sets", nargs="+", help="run set folders under benchmarks/results")
    ap.add_argument("--workload", default="quiet_512")
    ap.add_argument("--rate", default="0.5")
    ap.add_argument("--gap", type=float, default=0.6,
                    help="seconds between two tokens that count as a wait (default 0.6)")
    ap.add_argument("--groups", type=int, default=sv.REPLICAS,
                    help="noise seeds per measured repeat (default %(default)s)")
    ap.add_argument("--profile", default="cpu-local-pooled.json",
                    help="the profile's file name in each set (default %(default)s)")
    ap.add_argument("--pooled", action="store_true",
                    help="also one row per instance over all the sets, with the measured "
                         "median's interval over resampled arrival draws")
    ap.add_argument("--resamples", type=int, default=2000,
                    help="resamples of the arrival draws for --pooled (default %(default)s)")
    args = ap.parse_args(argv)
    if args.resamples < 1:
        ap.error("--resamples must be at least 1")
    print(f"{args.workload} at {args.rate} req/s, each set on its {args.profile}; hit: a "
          f"gap over {args.gap:g} s between two tokens; simulated: each repeat on "
          f"{args.groups} noise seeds; alike: "
          "requests whose hit the simulation gives in most of its seeds exactly where "
          "the measured request was hit\n")
    print("| set | instance | measured: requests hit | middle of the sorted TPOTs (ms) "
          "| median | simulated: hit | median | alike |")
    print("|---|---|---:|---|---:|---:|---:|---:|")
    per_set = []
    for s in args.sets:
        for r in cell_rows(s, args.workload, args.rate, args.gap, args.groups,
                           args.profile):
            per_set.append(r)
            print(f"| {r['set']} | {r['instance']} | {r['meas_hit']} / {r['meas_n']} | "
                  f"{', '.join(map(str, r['meas_middle']))} | {r['meas_median']} | "
                  f"{r['sim_hit']} / {r['sim_n']} ({r['sim_hit'] / r['sim_n']:.0%}) | "
                  f"{r['sim_median']} | {r['agree']} / {r['meas_n']} |")
    if args.pooled:
        tol = f"{sv.TOLERANCE:.0%}"
        print(f"\npooled over the {len(args.sets)} sets; draws: the distinct arrival draws the "
              f"repeats replayed; interval: the measured median's 5th-95th percentile over "
              f"{args.resamples} resamples of the draws; within {tol}: the share of those "
              f"resamples whose median the simulated one is within {tol} of\n")
        print("| instance | repeats | draws | measured: hit | median | 90% interval "
              f"| simulated: hit | median | err | within {tol} |")
        print("|---|---:|---:|---:|---:|---|---:|---:|---:|---:|")
        for r in pooled_rows(per_set, args.resamples):
            print(f"| {r['instance']} | {r['repeats']} | {r['draws']} | "
                  f"{r['meas_hit']} / {r['meas_n']} | "
                  f"{r['meas_median']} | {r['interval'][0]}-{r['interval'][1]} | "
                  f"{r['sim_hit']} / {r['sim_n']} ({r['sim_hit'] / r['sim_n']:.1%}) | "
                  f"{r['sim_median']} | {r['err']:+.0%} | {r['within']:.0%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
