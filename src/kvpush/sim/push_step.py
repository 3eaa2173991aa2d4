"""What push costs a prefill instance's steps on a shared CPU host (CPU profiles).

Push hands each prefill step's new KV to P's transfer thread layer group by layer group
while the forward pass runs, and the transfer thread WRITEs it into D's blocks; pull's
READ runs on D's side after P's step. On the 2-vCPU host push's P steps ran longer than
pull's, most where several prompts shared a step beside a decoding D. Why is not settled
(benchmarks/SIMULATION.md 1-v19: P's transfer and side-channel threads used the same CPU
time in both modes, and P's step loop was 99.8% in the forward pass); the model takes the
copies' share of the cores and memory bandwidth as the likely cause and prices it per
KV block written.

:func:`probe_push_step` serves the same short prompts through a 1P1D pull pair and a
push pair side by side (``kvpush.sim.corun.serve_side_by_side``), at one or more loads,
and :func:`pooled_push_step_cost` prices push's extra time per P step from the traces,
apart for steps that started with D idle and mid-step:

    extra = per_step + per_block x (KV blocks the step completes)

The light load (2 req/s: mostly one prompt per step, up to 3-4) spreads the blocks per
step little; the loaded one (4 req/s: up to 7 prompts per step, mostly beside a decoding
D) spreads them, and the two terms are fitted together (Theil-Sen lines, robust to the
odd slow step), each load's push steps over its own pull steps, as the loads run minutes
apart. Where the blocks do not span :data:`MIN_BLOCK_SPREAD`, one figure per step. In
the v18 / v19 runs push's steps at 4 req/s ran ~2% longer than pull's, while the 2 req/s
probe measured 0-1.6 ms a step (SIMULATION.md 1-v19, 1-v20).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from kvpush.sim.step_models import StepModel, completed_blocks, decode_only

#: fewer steps than this on either side (pull, push) of a D state: no figure (0)
MIN_STEPS = 3
#: the blocks per step must span at least this ratio (largest over smallest) for a
#: per-block term to be fitted; below it, one figure per step
MIN_BLOCK_SPREAD = 1.5


class ProbeLoad(NamedTuple):
    """One load of the pull / push pair probe: ``prompts_per_turn`` prompts at ``rate``
    per turn, ``turns`` turns per pair, ``output_len`` tokens out."""

    rate: float
    prompts_per_turn: int
    turns: int
    output_len: int = 8


#: mostly one prompt per P step (the calibrations' probe until session 13; ~4 min)
LIGHT = ProbeLoad(2.0, 8, 24, 8)
#: up to 7 prompts per P step, mostly beside a decoding D (short_high_rate's 4 req/s
#: cell; ~4-5 min)
LOADED = ProbeLoad(4.0, 16, 8, 16)


def step_blocks(chunks: Sequence[Sequence[Any]], block_size: int) -> int:
    """KV blocks a prefill step completes, what push WRITEs to D for it (no prefix hit):
    per chunk ``(tokens, context, ends_prompt, ...)``, the whole blocks it fills and,
    when it ends the prompt, the last partial one. A chunk given without its flag
    counts as ending the prompt."""
    total = 0
    for ch in chunks:
        first, end = completed_blocks(int(ch[1]), int(ch[0]),
                                      bool(ch[2]) if len(ch) > 2 else True, block_size)
        total += max(0, end - first)
    return total


def theil_sen(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the median line through ``(x, y)`` points: the median of
    the slopes between every two points with different x, then the median of
    ``y - slope x``; a flat line at the median y where every x is the same."""
    slopes = [(b[1] - a[1]) / (b[0] - a[0]) for i, a in enumerate(points)
              for b in points[i + 1:] if b[0] != a[0]]
    k = statistics.median(slopes) if slopes else 0.0
    return statistics.median(y - k * x for x, y in points), k


def _spread(xs: Sequence[float]) -> bool:
    """Whether the blocks per step span :data:`MIN_BLOCK_SPREAD` (steps that complete
    no block, a chunk inside one, count as one)."""
    return max(xs) >= MIN_BLOCK_SPREAD * max(min(xs), 1.0)


def excess_points(pull: Sequence[tuple[float, float]], push: Sequence[tuple[float, float]]
                  ) -> list[tuple[float, float]]:
    """Push's ``(blocks, residual)`` steps as ``(blocks, excess)`` over pull's residual
    line, what the model misses in both modes: a Theil-Sen line over blocks where pull's
    steps span :data:`MIN_BLOCK_SPREAD`, else their median."""
    a, k = theil_sen(pull) if _spread([x for x, _ in pull]) else (
        statistics.median(r for _, r in pull), 0.0)
    return [(x, r - a - k * x) for x, r in push]


def fit_excess(excess: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(per step, per block) seconds from push's ``(blocks, excess)`` points, both never
    below 0: ``per_step + per_block x blocks`` (Theil-Sen) where the blocks span
    :data:`MIN_BLOCK_SPREAD`, else the median excess per step; through the origin where
    the line's intercept is negative."""
    if not _spread([x for x, _ in excess]):
        return max(0.0, statistics.median(e for _, e in excess)), 0.0
    s, b = theil_sen(excess)
    if b <= 0:
        return max(0.0, statistics.median(e for _, e in excess)), 0.0
    if s < 0:  # through the origin: the median of excess / blocks
        return 0.0, max(0.0, statistics.median(e / x for x, e in excess if x > 0))
    return s, b


def excess_fit(pull: Sequence[tuple[float, float]], push: Sequence[tuple[float, float]]
               ) -> tuple[float, float]:
    """(per step, per block) seconds push's ``(blocks, residual)`` steps run over pull's
    (:func:`excess_points`, :func:`fit_excess`); where neither side's blocks spread,
    the difference of the medians per step."""
    return fit_excess(excess_points(pull, push))


#: one side-by-side run: P's steps in the pull pair and the push pair, then D's in each
PairTraces = tuple[Sequence[Mapping[str, Any]], Sequence[Mapping[str, Any]],
                   Sequence[Mapping[str, Any]], Sequence[Mapping[str, Any]]]


def push_step_cost(pull_steps: Sequence[Mapping[str, Any]],
                   push_steps: Sequence[Mapping[str, Any]],
                   model: StepModel,
                   pull_decode: Sequence[Mapping[str, Any]],
                   push_decode: Sequence[Mapping[str, Any]],
                   block_size: int | None = None) -> dict[str, Any]:
    """How much longer a prefill instance's prefill steps take in push than in pull, from
    a push pair's and a pull pair's traces over the same prompts (what the pair shares,
    the served overhead, cancels); :func:`pooled_push_step_cost` of one run."""
    return pooled_push_step_cost([(pull_steps, push_steps, pull_decode, push_decode)],
                                 model, block_size)


def pooled_push_step_cost(runs: Sequence[PairTraces], model: StepModel,
                          block_size: int | None = None) -> dict[str, Any]:
    """Push's extra time per P step over several side-by-side runs (one per load). Each
    step's residual is measured minus modelled; each pair's D steps split P's steps as
    the simulator applies the figures: started with D idle -> ``push_prefill_step_s`` /
    ``push_prefill_block_s``, started while D was mid-step ->
    ``push_prefill_corun_step_s`` / ``push_prefill_corun_block_s``. Push's steps are
    taken over pull's of the same run (:func:`excess_points`: the host's drift from one
    run to the next cancels, which pooling the raw residuals would fit as a slope), then
    all runs' points are fitted together (:func:`fit_excess`; without ``block_size``
    one figure per step). Seconds; a run adds nothing to a D state where a side has
    fewer than :data:`MIN_STEPS` steps, and a state no run adds to gets 0. ``steps``
    counts every run's steps (``fitted``: push's steps of the runs that added), and
    ``residual_s`` holds each run's median residuals (None where it added nothing)."""
    from kvpush.sim.corun import BusySpans

    def residuals(steps: Sequence[Mapping[str, Any]], decode: Sequence[Mapping[str, Any]]
                  ) -> dict[bool, list[tuple[float, float]]]:
        """(blocks, measured - modelled) of each prefill step, by whether D was
        mid-step when it started."""
        out: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        busy = BusySpans(decode)
        for st in steps:
            chunks = [tuple(c) for c in st["chunks"]]
            if decode_only(chunks) or (predicted := model.step_time(chunks)) <= 0:
                continue
            blocks = step_blocks(chunks, block_size) if block_size else 1
            out[busy.at(st["t"])].append((float(blocks), st["dur"] - predicted))
        return out

    split = [(residuals(pull_steps, pull_decode), residuals(push_steps, push_decode))
             for pull_steps, push_steps, pull_decode, push_decode in runs]
    out: dict[str, Any] = {"steps": {}}
    for suffix, beside in (("", False), ("corun_", True)):
        where = "beside D" if beside else "D idle"
        counts = {"pull": 0, "push": 0, "fitted": 0}
        excess: list[tuple[float, float]] = []
        medians: list[dict[str, float] | None] = []  # per run; None: it added nothing
        for pull_sides, push_sides in split:
            pull, push = pull_sides[beside], push_sides[beside]
            counts["pull"] += len(pull)
            counts["push"] += len(push)
            if min(len(pull), len(push)) < MIN_STEPS:
                medians.append(None)
                continue
            excess += excess_points(pull, push)
            counts["fitted"] += len(push)
            medians.append({"pull": round(statistics.median(r for _, r in pull), 6),
                            "push": round(statistics.median(r for _, r in push), 6)})
        out["steps"][where] = counts
        out.setdefault("residual_s", {})[where] = medians
        step_key, block_key = f"push_prefill_{suffix}step_s", f"push_prefill_{suffix}block_s"
        if not excess:
            out[step_key] = out[block_key] = 0.0
            continue
        if block_size:
            out.setdefault("blocks", {})[where] = [min(x for x, _ in excess),
                                                   max(x for x, _ in excess)]
        per_step, per_block = fit_excess(excess)  # blocks all 1: one per-step figure
        out[step_key], out[block_key] = round(per_step, 6), round(per_block, 7)
    return out


def probe_push_step(model: str, engine_model: StepModel, block_size: int = 32,
                    loads: Sequence[ProbeLoad] = (LIGHT, LOADED), input_len: int = 128,
                    seed: int = 11, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Serve ``kvpush bench compare``'s 1P1D pull pair and its push pair side by side at
    each of ``loads`` in turn (``kvpush.sim.corun.serve_side_by_side``: the same short
    prompts to both, the order alternating, so the host's drift falls on both alike),
    then price push's extra time per P step over all of their steps together, each
    load's push steps over its own pull steps (:func:`pooled_push_step_cost`), and each
    load's on its own for the record (``loads``).
    Short prompts: on the v14 runs the difference was roughly 7-12 ms per step, within
    the scatter of a 485 ms step but 5-10% of a 100-150 ms one."""
    from kvpush.sim.corun import PairSpec, serve_side_by_side

    if not loads or any(ld.turns < 1 for ld in loads):
        raise ValueError(f"need at least one load, each of turns >= 1, got {list(loads)}")
    pairs = [PairSpec("pull", "pull"), PairSpec("push", "push")]
    runs: list[PairTraces] = []
    per_load = []
    for ld in loads:
        run = serve_side_by_side(model, pairs, input_len, ld.output_len,
                                 ld.prompts_per_turn, ld.turns, ld.rate, seed)
        runs.append((run.steps["pull", "prefill"], run.steps["push", "prefill"],
                     run.steps["pull", "decode"], run.steps["push", "decode"]))
        alone = pooled_push_step_cost(runs[-1:], engine_model, block_size)
        per_load.append({**ld._asdict(), "started_utc": run.started_utc, **alone,
                         "traces": pack_traces(runs[-1])})
        log(f"[calibrate] push's prefill steps over pull's ({input_len}-token prompts, "
            f"{ld.prompts_per_turn} per turn at {ld.rate:g} req/s, {ld.turns} turns each, "
            f"alternating): {describe(alone)} ({alone['steps']})")
    out = pooled_push_step_cost(runs, engine_model, block_size)
    out["loads"] = per_load
    if len(loads) > 1:
        log(f"[calibrate] push's prefill step cost, all loads: {describe(out)}")
    return out


def describe(cost: Mapping[str, Any]) -> str:
    """One line of a :func:`push_step_cost` result, in milliseconds."""
    def part(suffix: str) -> str:
        step = 1e3 * cost[f"push_prefill_{suffix}step_s"]
        block = 1e3 * cost.get(f"push_prefill_{suffix}block_s", 0.0)
        return f"+{step:.1f} ms" + (f" + {block:.2f} ms/block" if block else "")
    return f"{part('')} per step with D idle, {part('corun_')} beside a D step"


#: the four step lists of a side-by-side run, as :func:`pack_traces` stores them
TRACE_KEYS = ("pull_prefill", "push_prefill", "pull_decode", "push_decode")


def pack_traces(run: PairTraces) -> dict[str, Any]:
    """A run's traced steps for a profile's record, compact: times from the run's first
    step (``t0``, wall clock), P's steps as ``[t, dur, chunks]``, D's as ``[t, dur]``
    (only when D was mid-step matters), to 1 us (coarser, a P step starting at a D
    step's edge could change sides on a refit)."""
    t0 = min((st["t"] for steps in run for st in steps), default=0.0)
    out: dict[str, Any] = {"t0": t0}
    for key, steps in zip(TRACE_KEYS, run, strict=True):
        out[key] = [[round(st["t"] - t0, 6), round(st["dur"], 6)]
                    + ([[list(c) for c in st["chunks"]]] if key.endswith("prefill") else [])
                    for st in steps]
    return out


def unpack_traces(packed: Mapping[str, Any]) -> PairTraces:
    """The step lists :func:`pack_traces` stored, as :func:`pooled_push_step_cost` takes
    them (D's steps carry no chunks: they only mark when D was mid-step)."""
    t0 = float(packed["t0"])
    steps = [[{"t": t0 + row[0], "dur": row[1], "chunks": row[2] if len(row) > 2 else []}
              for row in packed[key]] for key in TRACE_KEYS]
    return steps[0], steps[1], steps[2], steps[3]


def reprice(record: Mapping[str, Any], engine_model: StepModel,
            block_size: int) -> dict[str, Any]:
    """:func:`pooled_push_step_cost` over the runs a profile's ``measured.push_step``
    stored (:func:`probe_push_step`'s ``loads``, each with its ``traces``), e.g. after
    the fit changed; each load's own figures again too. ValueError if it stored none."""
    loads = [ld for ld in record.get("loads", []) if ld.get("traces")]
    if not loads:
        raise ValueError("this record stores no probe traces (calibrations before "
                         "commit 9900d06 did not keep them)")
    runs = [unpack_traces(ld["traces"]) for ld in loads]
    out = pooled_push_step_cost(runs, engine_model, block_size)
    out["loads"] = [{**without_fit(ld), **pooled_push_step_cost([run], engine_model,
                                                                 block_size)}
                    for ld, run in zip(loads, runs, strict=True)]
    return out


#: what :func:`pooled_push_step_cost` writes into a record (a refit replaces them all)
FIT_KEYS = ("steps", "residual_s", "blocks", "push_prefill_step_s",
            "push_prefill_corun_step_s", "push_prefill_block_s", "push_prefill_corun_block_s")


def without_fit(record: Mapping[str, Any]) -> dict[str, Any]:
    """A record without the figures of an earlier fit (the load, its traces and when it
    ran stay)."""
    return {k: v for k, v in record.items() if k not in FIT_KEYS}
