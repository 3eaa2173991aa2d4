"""Engine steps inside the serving stack against the engine alone.

`kvpush simulate calibrate` times :class:`~kvpush.engine.llm_engine.LLMEngine` steps in a
process of its own. A serving instance steps the same engine, but beside its HTTP front
end and, on a small host, beside the router and the load generator, which stream every
token, and its steps get somewhat longer or shorter (2 vCPUs: 0.95-1.15x by kind and
length, and from one calibration to the next; before the server's one-OpenMP-pool fix,
1.2-1.6x for 2-thread steps, see kvpush.engine.async_engine). The served probe measures it:
it serves a short workload through a real instance and the router with the per-step
trace on (kvpush.engine.step_trace), prices every traced step with the engine-alone step
model, and relates measured to modelled per kind of step:

* ``prefill_burst``: a step with the prefill of :data:`BURST_MIN_PROMPTS` or more short
  prompts (chunks of :data:`BATCHED_MIN_TOKENS` to :data:`BURST_MAX_TOKENS` tokens): a
  burst of short prompts prefilled together, eight 128-token prompts to a 1024-token step;
* ``prefill_batched``: any other step with the prefill of two or more prompts (chunks of
  at least :data:`BATCHED_MIN_TOKENS` tokens): longer prompts prefilled together (two
  384-token prompts and the ends of their neighbours to a step);
* ``prefill``: any other step with a chunk of more than one token (with or without
  decodes): one prompt's chunk, perhaps with a few tokens of the next;
* ``decode``: a step of one-token decode rows only.

Batched prefills are their own kind because the engine-alone fit prices them worse than
lone ones: on one thread, the probe's and the benchmarks' batched prefill steps ran
1.10-1.12x the model where lone prompts ran 0.98-1.06x (the 2-thread fit has no such
gap); one factor for both, measured mostly on the probe's batched steps, made every lone
1024-token prefill 9% too slow. A profile without ``prefill_batched`` uses its
``prefill`` factor for them. Bursts of short prompts are a kind again: on two threads the
benchmarks' eight-prompt steps ran a median 0.95x (0.83-1.11 per run; v18-v25 at 16
req/s and all at once, SIMULATION.md 1-v25) of the served model that the probe's two-
and three-prompt steps set at 1.01-1.14x the engine alone, which made the 2-thread
colocated instance's short-prompt bursts ~16% slow; on one thread the pull and push
prefill instances' eight-prompt steps ran 0.94-1.05x (v21, v23, v25). The probe serves
such a burst of its own (:class:`ServedProbe`); a profile without ``prefill_burst`` uses
``prefill_batched``'s factor (else prefill's).

Decode steps get the median of measured / modelled. Prefill steps get a factor that
depends on the step's length where the probe saw two lengths (:func:`served_curve`):
in the v5/v6 runs, served 384-token prefills took 1.07-1.08x the engine alone and
1024-token ones 0.95-1.0x, so one factor measured on short prompts made every long
prompt ~9% slow and, queued near saturation, their time to first token 15-40% high. (A
line, scale x t + offset, fitted the two lengths as well but gave a 60 ms chunk over a
cached prefix 100 ms more: the extra is not a fixed cost per step.)

The profile keeps them as ``host.served_factors[step model][kind]`` (the median over
all steps of the kind) and ``host.served_factor_curves[step model][kind]`` (``[[modelled
seconds, factor], ...]``: linear between the points, the end points' factors beyond),
and the simulator multiplies its step times by them (:class:`ServedStepModel`). What
scatter is left around the served model is ``host.step_noise`` and, tail included,
``host.step_noise_quantiles`` (:mod:`kvpush.sim.noise`).

The same probe times the front end: in its all-at-once phase, the instance notes when
each request reached its engine (the trace's arrival lines); the mean gap between them
is ``handoff.front_end_s`` (:func:`front_end_gap`). In its light-rate runs it times a
lone request's way in and its first token's way out (:func:`lone_paths`): client send
to the engine's arrival line (``handoff.request_path_s``), and the end of the step that
sampled token #1 to the client reading it (``handoff.token_return_s``: the post to the
HTTP loop, the SSE frame, the router, the client). On 2 vCPUs both took 4-5 ms where
the profile's estimated hops said 2 (kvpush bench compare with step traces, 512-token
prompts at 0.5 req/s).
"""

from __future__ import annotations

import math
import statistics
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvpush.sim.profile import ProfileError, require_field, row_table
from kvpush.sim.step_models import Chunk, RowTable, StepModel, decode_only, interp

KINDS = ("prefill", "prefill_batched", "prefill_burst", "decode")
#: where a profile has no factor for a kind: the kind whose factor it uses instead
FALLBACK = {"prefill_burst": "prefill_batched", "prefill_batched": "prefill"}
#: the size from which a prefill chunk counts as a prompt's prefill in a batched step
#: (smaller ones: the tail of a token budget that a step's main prompt left over)
BATCHED_MIN_TOKENS = 64
#: short prompts' chunks in a step from which it is a burst (the engine's 1024-token
#: budget holds eight 128-token prompts)
BURST_MIN_PROMPTS = 4
#: the largest chunk that counts as a short prompt's in a burst: a step of two full
#: 384-token prompts and the ends of two more (130 + 384 + 384 + 122) is not a burst
BURST_MAX_TOKENS = 256


def step_kind(chunks: Sequence[Sequence[Any]]) -> str:
    if decode_only(chunks):
        return "decode"
    big = [c[0] for c in chunks if c[0] >= BATCHED_MIN_TOKENS]
    if sum(n <= BURST_MAX_TOKENS for n in big) >= BURST_MIN_PROMPTS:
        return "prefill_burst"
    return "prefill_batched" if len(big) >= 2 else "prefill"


def factor_key(kind: str, present: Iterable[str]) -> str:
    """The kind whose figure prices ``kind``'s steps: itself if ``present``, else along
    :data:`FALLBACK` (burst -> batched -> prefill)."""
    present = set(present)
    while kind not in present and kind in FALLBACK:
        kind = FALLBACK[kind]
    return kind


@dataclass(frozen=True)
class ServedStepModel:
    """A step model scaled per kind of step: by ``curves[kind]`` at the step's modelled
    time where there is one, else by ``factors[kind]``."""

    inner: StepModel
    factors: Mapping[str, float]
    curves: Mapping[str, RowTable] = field(default_factory=dict)

    def factor(self, kind: str, t: float | None = None) -> float:
        key = factor_key(kind, self.factors)
        curve = self.curves.get(key)
        if curve and t is not None:
            return curve_factor(curve, t)
        return self.factors.get(key, 1.0)

    def step_time(self, chunks: Sequence[Chunk]) -> float:
        t = self.inner.step_time(chunks)
        return t * self.factor(step_kind(chunks), t)


def without_kind(model: StepModel, kind: str) -> StepModel:
    """``model`` with ``kind``'s own served factor and curve dropped, so that its steps
    take their :data:`FALLBACK`'s (a what-if); inside a wrapper (a scaled model) too; a
    model without served factors as is."""
    if kind not in FALLBACK:
        raise ValueError(f"{kind!r} has no fallback kind (one of {', '.join(FALLBACK)})")
    if not isinstance(model, ServedStepModel):
        inner = getattr(model, "inner", None)
        return replace(model, inner=without_kind(inner, kind)) if inner else model
    return replace(model, factors={k: v for k, v in model.factors.items() if k != kind},
                   curves={k: v for k, v in model.curves.items() if k != kind})


def curve_factor(curve: RowTable, t: float) -> float:
    """The factor at modelled time ``t``: linear between the points, flat beyond."""
    return interp(curve, min(max(t, curve[0][0]), curve[-1][0]))


def _per_kind(table: Any, where: str, kind: Any = (int, float)) -> dict[str, Any]:
    if not isinstance(table, Mapping) or set(table) - set(KINDS):
        raise ProfileError(f"{where}: expected an object with keys among {', '.join(KINDS)}")
    return {str(k): require_field(table, k, where, kind) for k in table}


def served_step_models(models: dict[str, StepModel], host: Mapping[str, Any],
                       path: str) -> dict[str, StepModel]:
    """``host.served_factors``: step model -> {kind: factor} and, optionally,
    ``host.served_factor_curves``: step model -> {kind: [[modelled seconds, factor], ...]}
    (kvpush.sim.served): how much longer that model's steps take inside the serving
    stack than in the engine alone, per kind of step."""
    factors = host.get("served_factors", {})
    curves = host.get("served_factor_curves", {})
    for key, table in (("served_factors", factors), ("served_factor_curves", curves)):
        if not isinstance(table, Mapping):
            raise ProfileError(f"{path}: host.{key} must be an object")
        for name in table:
            if name not in models:
                raise ProfileError(f"{path}: host.{key}.{name}: no such step model")
    out = dict(models)
    for name in set(factors) | set(curves):
        where = f"{path}: host.served_factors.{name}"
        f = {k: float(v) for k, v in _per_kind(factors.get(name, {}), where).items()}
        if any(not v > 0 for v in f.values()):
            raise ProfileError(f"{where}: factors must be > 0")
        where = f"{path}: host.served_factor_curves.{name}"
        c = {k: row_table(v, f"{where}.{k}")
             for k, v in _per_kind(curves.get(name, {}), where, list).items()}
        if any(not v or any(fac <= 0 for _, fac in v) for v in c.values()):
            raise ProfileError(f"{where}: a curve needs points with factors > 0")
        out[name] = ServedStepModel(models[name], f, c)
    return out


def traced_steps(paths: Iterable[Path], start: float = -math.inf,
                 end: float = math.inf) -> list[dict[str, Any]]:
    """The traced steps of these files that started in [start, end]."""
    from kvpush.engine.step_trace import read_trace

    return [st for p in paths for st in read_trace(p) if start <= st["t"] <= end]


def step_pairs(steps: Iterable[Mapping[str, Any]], model: StepModel
               ) -> dict[str, list[tuple[float, float]]]:
    """kind -> (modelled, measured) time of each step of that kind."""
    out: dict[str, list[tuple[float, float]]] = {}
    for st in steps:
        chunks = [tuple(c) for c in st["chunks"]]
        predicted = model.step_time(chunks)
        if predicted > 0:
            out.setdefault(step_kind(chunks), []).append((predicted, st["dur"]))
    return out


#: a kind's steps get a curve rather than one factor when the longest modelled step is
#: at least this many times the shortest (the probe's two prompt lengths)
CURVE_MIN_SPREAD = 1.8
#: steps a length bin needs to give a point of the curve
CURVE_MIN_STEPS = 3


def served_curve(pairs: Sequence[tuple[float, float]]) -> RowTable:
    """From (modelled, measured) steps: a point (median modelled time, median measured
    / modelled) per length bin (powers of 2 of the modelled time) with at least
    :data:`CURVE_MIN_STEPS` steps; none where the steps do not span
    :data:`CURVE_MIN_SPREAD`, fewer than two bins have enough steps, or the points'
    factors are within 2% of each other (one factor says it)."""
    ps = [p for p, _ in pairs]
    if len(pairs) < 2 * CURVE_MIN_STEPS or max(ps) < CURVE_MIN_SPREAD * min(ps):
        return ()
    bins: dict[int, list[tuple[float, float]]] = {}
    for p, m in pairs:
        bins.setdefault(round(math.log2(p)), []).append((p, m))
    points = tuple((round(statistics.median(p for p, _ in side), 6),
                    round(statistics.median(m / p for p, m in side), 4))
                   for _, side in sorted(bins.items()) if len(side) >= CURVE_MIN_STEPS)
    factors = [f for _, f in points]
    if len(points) < 2 or max(factors) - min(factors) < 0.02 * min(factors):
        return ()
    return points


def served_model_from(pairs: Mapping[str, Sequence[tuple[float, float]]]
                      ) -> tuple[dict[str, float], dict[str, RowTable]]:
    """(factors, curves) per kind from the probe's (modelled, measured) steps: every
    kind the median ratio, prefill kinds also a curve where their steps span two
    lengths (:func:`served_curve`); a kind without steps takes its fallback's
    (:data:`FALLBACK`: burst -> batched -> prefill), else 1."""
    factors: dict[str, float] = {}
    curves: dict[str, RowTable] = {}
    for k in KINDS:
        if not pairs.get(k):
            continue
        factors[k] = round(statistics.median(m / p for p, m in pairs[k]), 4)
        if k != "decode" and (curve := served_curve(pairs[k])):
            curves[k] = curve
    factors.setdefault("prefill", 1.0)
    for kind in (k for k in KINDS if k in FALLBACK):  # KINDS lists a fallback first
        if kind not in factors:
            factors[kind] = factors[FALLBACK[kind]]
            if FALLBACK[kind] in curves:
                curves[kind] = curves[FALLBACK[kind]]
    factors.setdefault("decode", 1.0)
    return {k: factors[k] for k in KINDS}, curves


@dataclass(frozen=True)
class ServedFit:
    """What the probe's traced steps say against an engine-alone step model."""

    factors: dict[str, float]
    curves: dict[str, RowTable]
    noise: dict[str, float]  # kvpush.sim.noise: the scatter left around the served model
    steps: dict[str, int]  # how many steps of each kind the figures rest on
    #: the same scatter as even quantiles of log measured / served-modelled, tail kept
    noise_quantiles: dict[str, tuple[float, ...]] = field(default_factory=dict)


def fit_served(steps: Sequence[Mapping[str, Any]], engine_model: StepModel) -> ServedFit:
    """Served factors and curves (:func:`served_model_from`), then the step noise around
    the served model they make, from traced steps (``{"chunks": ..., "dur": ...}``);
    the served probe and `kvpush simulate refit` both fit this way."""
    from kvpush.sim.noise import log_ratios, quantiles_of, sigmas_of

    steps = list(steps)
    pairs = step_pairs(steps, engine_model)
    factors, curves = served_model_from(pairs)
    # every step priced once by the served model, for both forms of its scatter
    logs = log_ratios(steps, ServedStepModel(engine_model, factors, curves))
    return ServedFit(factors, curves, sigmas_of(logs),
                     {k: len(pairs.get(k, [])) for k in KINDS}, quantiles_of(logs))


def curves_json(curves: Mapping[str, RowTable]) -> dict[str, list[list[float]]]:
    """Curves as the profile stores them (``host.served_factor_curves[model]``)."""
    return {k: [list(p) for p in v] for k, v in curves.items()}


def front_end_gap(arrivals: Sequence[float]) -> float | None:
    """Mean gap between consecutive arrivals of a burst sent all at once (None for
    fewer than two)."""
    if len(arrivals) < 2:
        return None
    a = sorted(arrivals)
    return (a[-1] - a[0]) / (len(a) - 1)


def first_gap(arrivals: Sequence[float]) -> float | None:
    """How far apart the first two arrivals of a burst sent all at once were (None for
    fewer than two)."""
    if len(arrivals) < 2:
        return None
    a = sorted(arrivals)
    return a[1] - a[0]


def idle_wakes(arrivals: Sequence[float], steps: Sequence[Mapping[str, Any]]
               ) -> list[float]:
    """For each arrival that found the engine idle (no traced step in flight), the time
    to the start of the next step: the step loop waking up and scheduling it."""
    from bisect import bisect_left

    steps = sorted(steps, key=lambda st: st["t"])
    starts = [st["t"] for st in steps]
    out = []
    for a in sorted(arrivals):
        j = bisect_left(starts, a)
        if j == len(steps) or (j and steps[j - 1]["t"] + steps[j - 1]["dur"] > a):
            continue
        out.append(starts[j] - a)
    return out


def lone_paths(run: Mapping[str, Any], arrivals: Sequence[float],
               step_ends: Sequence[float]) -> tuple[list[float], list[float]]:
    """(way in, first token's way out) of each request of a ``kvpush bench`` run, in
    seconds, from its wall-clock origin (``start_wall``) and the instance's trace: send
    -> the first arrival line after it; the end of the last step before the client read
    token #1 -> that read. At a light rate nothing else steps in that gap (a step takes
    tens of ms), so that step sampled the token. Empty lists for a run without
    ``start_wall`` (recorded before it existed)."""
    origin = run.get("start_wall")
    if not origin:
        return [], []
    from bisect import bisect_left, bisect_right

    arrivals, step_ends = sorted(arrivals), sorted(step_ends)
    ins, outs = [], []
    for start, ttft, err in zip(run["start_times"], run["ttfts"], run["errors"]):
        if err or start < 0:
            continue
        sent, first = origin + start, origin + start + ttft
        i = bisect_left(arrivals, sent)
        if i == len(arrivals):
            continue
        arrived = arrivals[i]
        if arrived < first:
            ins.append(arrived - sent)
        j = bisect_right(step_ends, first)
        if j and step_ends[j - 1] > arrived:
            outs.append(first - step_ends[j - 1])
    return ins, outs


@dataclass(frozen=True)
class ServedProbe:
    """The workload the probe serves through ``kvpush bench compare``'s colocated
    cluster (one instance behind the router, the load generator streaming every token):
    random prompts at a light rate (lone decodes, a prompt arriving now and then into
    them) and all at once (batched decodes, back-to-back prefills), because the two
    load levels slow the engine differently (a 1.0 req/s probe alone measured 1.21-1.25
    on 2-thread decodes that stepped 0.8-0.9x of that in a busy server); then longer
    prompts at a light rate, and a burst of short prompts (``prefill_burst``)."""

    input_len: int = 384
    output_len: int = 24
    #: 24: with 12, the all-at-once phase gave 4-5 batched prefill steps, and the 2-thread
    #: ``prefill_batched`` factor they set ranged 0.96-1.19 over the v13-v16 calibrations
    #: (SIMULATION.md 1-sets)
    num_prompts: int = 24
    rates: tuple[float, ...] = (1.0, math.inf)
    seed: int = 7
    #: then longer prompts at a light rate (None: not), so that the prefill steps span
    #: two lengths and get a curve, not one factor (:func:`served_curve`): the served
    #: 1024-token prefills of the v5/v6 runs took 0.95-1.0x the engine alone where
    #: the probe's 384-token ones took 1.07-1.08x
    long_input_len: int | None = 1024
    long_num_prompts: int = 6
    long_rate: float = 0.5
    #: then a burst of short prompts all at once (None: not), eight to a step, for the
    #: ``prefill_burst`` factor (twelve such steps); few output tokens, so that its
    #: decodes barely add to the decode factor. Its runs give neither the front end's
    #: gap, the lone paths nor the arrival cost: those stay measured on the phases above.
    burst_input_len: int | None = 128
    burst_num_prompts: int = 96
    burst_output_len: int = 4


def describe(factor: float, curve: RowTable | None) -> str:
    """``1.07`` or ``1.07 (1.10 at 600 ms .. 0.97 at 1700 ms)``."""
    if not curve:
        return f"{factor:.2f}"
    return f"{factor:.2f} (" + " .. ".join(f"{f:.2f} at {1e3 * t:.0f} ms"
                                           for t, f in curve) + ")"


def serve_traced(out_dir: Path, model: str, mode: str, threads: int | None,
                 rates: list[float], input_len: int, output_len: int, num_prompts: int,
                 seed: int) -> None:
    """Serve a random-prompt workload through ``kvpush bench compare``'s cluster for
    ``mode`` with the per-step trace on; runs and traces land under ``out_dir``."""
    from kvpush.bench.compare import CompareConfig, ModeSpec, run_compare

    run_compare(CompareConfig(modes=[ModeSpec(mode, threads)], rates=rates,
                              out_dir=out_dir, model=model, input_len=input_len,
                              output_len=output_len, num_prompts=num_prompts, seed=seed,
                              step_trace=True, time_limit=600.0, run_timeout=300.0),
                log=lambda m: None)


def probe_served(model: str, threads: int, engine_model: StepModel,
                 probe: ServedProbe = ServedProbe(),
                 log: Callable[[str], None] = print) -> dict[str, Any]:
    """Serve ``probe`` with ``threads`` torch threads; measured / modelled step times per
    kind (``factors``) and the number of steps behind each, the front end's gap
    between the arrivals of the all-at-once burst (``front_end_s``, None without one),
    the gap between the first two arrivals of each all-at-once run
    (``burst_first_gaps_s``), how soon an idle engine starts a step for a light-rate
    arrival (``engine_wake_s``, median; None without one) and the traced steps
    themselves (``trace``)."""
    import json

    from kvpush.engine.step_trace import read_arrivals

    phases = [(probe.input_len, probe.num_prompts, list(probe.rates))]
    if probe.long_input_len:
        phases.append((probe.long_input_len, probe.long_num_prompts, [probe.long_rate]))
    with tempfile.TemporaryDirectory(prefix="kvpush-served-probe-") as tmp:
        for i, (input_len, num_prompts, rates) in enumerate(phases):
            serve_traced(Path(tmp) / f"phase{i}", model, "colocated", threads, rates,
                         input_len, probe.output_len, num_prompts, probe.seed)
        def windows(pattern: str, arrivals: list[float]):
            """Each run of ``pattern`` with the arrivals its wall-clock window holds."""
            for path in sorted(Path(tmp).glob(pattern)):
                run = json.loads(path.read_text())
                yield run, [t for t in arrivals if run["wall_start"] <= t <= run["wall_end"]]

        # every all-at-once run's first gap, the burst phase's first
        burst_steps, first_gaps = [], []
        if probe.burst_input_len:
            serve_traced(Path(tmp) / "burst", model, "colocated", threads, [math.inf],
                         probe.burst_input_len, probe.burst_output_len,
                         probe.burst_num_prompts, probe.seed)
            burst_files = sorted(Path(tmp).glob("burst/steps/**/*.jsonl"))
            burst_steps = traced_steps(burst_files)
            for _run, window in windows("burst/runs/*.json",
                                        [t for f in burst_files for t in read_arrivals(f)]):
                if (first := first_gap(window)) is not None:
                    first_gaps.append(round(first, 6))
        files = sorted(Path(tmp).glob("phase*/steps/**/*.jsonl"))
        steps = traced_steps(files)
        arrivals = [t for f in files for t in read_arrivals(f)]
        step_ends = [st["t"] + st["dur"] for st in steps]
        gaps, ways_in, ways_out, wakes = [], [], [], []
        for run, window in windows("phase*/runs/*.json", arrivals):
            if math.isinf(float(run["request_rate"])):
                if (gap := front_end_gap(window)) is not None:
                    gaps.append(gap)
                if (first := first_gap(window)) is not None:
                    first_gaps.append(round(first, 6))
            else:
                ins, outs = lone_paths(run, arrivals, step_ends)
                ways_in += ins
                ways_out += outs
                wakes += idle_wakes(window, steps)
    fit = fit_served(steps + burst_steps, engine_model)
    factors, curves, noise = fit.factors, fit.curves, fit.noise
    from kvpush.sim.arrival_cost import arrival_step_cost

    arrival = arrival_step_cost(steps, arrivals, engine_model)
    front_end = statistics.median(gaps) if gaps else None
    wake = statistics.median(wakes) if wakes else None
    way_in = statistics.median(ways_in) if ways_in else None
    way_out = statistics.median(ways_out) if ways_out else None
    log(f"[calibrate] served probe, threads={threads}: steps in the server / engine alone "
        + ", ".join(f"{k} {describe(factors[k], curves.get(k))} ({fit.steps[k]} steps)"
                    for k in KINDS)
        + (f"; front end {1e3 * front_end:.2f} ms per request" if front_end else "")
        + (" (first gaps of its bursts: "
           + ", ".join(f"{1e3 * g:.2f}" for g in first_gaps) + " ms)" if first_gaps else "")
        + (f"; an idle engine starts a step {1e3 * wake:.2f} ms after a request"
           if wake is not None else "")
        + (f"; request in {1e3 * way_in:.1f} ms, token #1 out {1e3 * way_out:.1f} ms"
           if way_in is not None and way_out is not None else "")
        + ("; scatter " + ", ".join(f"{k} {v:.1%}" for k, v in noise.items()) if noise
           else "")
        + (f"; an arrival adds {1e3 * arrival['arrival_step_s']:.1f} ms to a step in flight"
           if arrival["arrival_step_s"] is not None else "")
        + f" (decode steps with / without arrivals: {arrival['steps']})")
    return {"factors": factors, "curves": curves_json(curves),
            "steps": fit.steps, "noise": noise,
            "noise_quantiles": {k: list(v) for k, v in fit.noise_quantiles.items()},
            "front_end_s": front_end,
            "burst_first_gaps_s": first_gaps, "engine_wake_s": wake,
            "request_path_s": way_in, "token_return_s": way_out,
            # kvpush.sim.arrival_cost: host.arrival_step_s for this thread count
            "arrival_step": arrival,
            # every traced step ([chunks, seconds]): a refit prices them again
            # (kvpush.sim.refit) without serving the probe again
            "trace": [[st["chunks"], round(st["dur"], 6)] for st in steps + burst_steps],
            "probe": {**probe.__dict__, "rates": [str(r) for r in probe.rates]}}
