"""Step-time noise: how far a served step's time scatters around its step model.

Two steps of one shape do not take one time on a real host: in the served probe and in
the validation runs of benchmarks/SIMULATION.md a 1-thread prefill step scattered 3-10%
(standard deviation of log measured / modelled) around the step model, with no memory
from one step to the next (lag-1 autocorrelation -0.3..0.5, around 0), decode steps
7-15%. A deterministic simulation runs every step at the model's median time, and that
misses two things a measured percentile contains:

* queueing: a queue's mean wait grows with the variance of its service time
  (Pollaczek-Khinchine: an M/G/1 queue waits ``lambda E[S^2] / (2 (1 - rho))``, which
  is ``lambda Var[S] / (2 (1 - rho))`` more than the M/D/1 queue with the same mean);
* knife edges: whether a request that arrives a few milliseconds around the end of a
  step joins the next step with another prompt or goes alone is decided by the
  milliseconds; a 700 ms step that scatters 5% scatters 35 ms (SIMULATION.md 1-v10a:
  the prefix-hit push p90 at 1 req/s, set by one request that measured runs prefilled
  beside the next one and the simulation prefilled alone).

With ``host.step_noise`` (step model -> {"prefill": sigma, "decode": sigma}, measured by
calibrate's served probe: :func:`measure_noise`) the simulator multiplies every step's
modelled time by a log-normal draw of median 1 (the served factors are medians) and
that sigma, from a generator seeded by ``ClusterConfig.seed``; and
:func:`kvpush.sim.cluster.simulate_pooled` runs several seeds and pools their
requests, as ``kvpush bench compare`` pools its repeats. A profile with neither it nor
``host.step_noise_quantiles`` (below; the GPU profiles written from public figures)
simulates deterministically, as before.

Measured effect on the recorded validation runs: neutral (SIMULATION.md 1-v12). The
probe's robust sigma is 2-5%; the knife edge of 1-v10a was set, in v12, by one step at
1.4x its neighbours, a tail the probe's few dozen prefill steps do not contain.

A log-normal of median 1 and the robust sigma keeps the probe's middle but not its upper
tail, and a time per output token is a mean of steps, which the tail moves: in the
v18-v21 calibrations the 2-thread probe's decode steps averaged 1.02-1.04x their median
(1-thread 1.01-1.02x; the validation runs' decodes 1.02-1.05x), where that log-normal
averages about 1.002x, so simulated decodes ran 2-4% (1 thread: 1-2%) short on average.
Calibrations also keep the distribution itself, ``host.step_noise_quantiles`` (step
model -> {kind: the percentiles 0-100 of log measured / served-modelled}:
:func:`measure_noise_quantiles`; only for kinds with :data:`MIN_QUANTILE_STEPS` probe
steps, in practice decode); where a profile has them, a step's factor is drawn
from them (inverse transform, linear between the points) instead, so the simulated steps
have the probe's median, scatter and tail, and its mean to within the interpolation
(the v18-v21 tables' mean factors are within 0.2% of their probes' mean ratios). The
probe's decode steps during which a request arrived are in the table too, and the
simulator also charges each arrival (``host.arrival_step_s``): about 2% of the 2-thread
decode steps, so the overlap adds about 0.3% to their mean.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvpush.sim.step_models import StepModel, decode_only

NOISE_KINDS = ("prefill", "decode")
#: steps of a kind the probe needs before its noise is measured (else: none for it)
MIN_NOISE_STEPS = 8
#: the standard deviation of a normal distribution over its median absolute deviation
MAD_TO_SIGMA = 1.4826
#: points of the quantile table per noise kind (host.step_noise_quantiles): the
#: percentiles 0, 1, ..., 100, the smallest and largest step included
NOISE_QUANTILES = 101
#: steps of a kind the probe needs before its table is kept: a tail needs a couple of
#: steps per top percentile. One calibration's probe runs ~270-280 decode steps on 1
#: thread and ~450-500 on 2, but only ~45 prefill ones (a pooled pair of calibrations,
#: twice that), whose top percent is under one step: pooled, v22's 2-thread prefill
#: table averaged 3% over its median, two steps at 1.4x among them (v18-v21: within 1%),
#: a tail the next calibration need not repeat. Prefill keeps its log-normal.
MIN_QUANTILE_STEPS = 200


def noise_kind(chunks: Sequence[Sequence[Any]]) -> str:
    """"decode" for a step of one-token rows only, else "prefill"."""
    return "decode" if decode_only(chunks) else "prefill"


def robust_sigma(logs: Sequence[float]) -> float:
    """The spread of ``logs`` as a normal's sigma, from their median absolute deviation
    (a stray step -- a page fault, a garbage collection -- does not set it)."""
    mid = statistics.median(logs)
    return MAD_TO_SIGMA * statistics.median(abs(x - mid) for x in logs)


def measure_noise(steps: Iterable[Mapping[str, Any]], model: StepModel
                  ) -> dict[str, float]:
    """Per noise kind, the robust sigma of log(measured / modelled) over traced steps
    (``{"chunks": ..., "dur": seconds}``) priced by ``model`` (the served step model:
    what is left is scatter, not level); kinds with fewer than
    :data:`MIN_NOISE_STEPS` steps are left out."""
    return sigmas_of(log_ratios(steps, model))


def sigmas_of(logs: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """:func:`measure_noise` from :func:`log_ratios` already taken."""
    return {k: round(robust_sigma(v), 4) for k in NOISE_KINDS
            if len(v := logs.get(k, [])) >= MIN_NOISE_STEPS}


def log_ratios(steps: Iterable[Mapping[str, Any]], model: StepModel
               ) -> dict[str, list[float]]:
    """Per noise kind, log(measured / modelled) of each traced step (``{"chunks": ...,
    "dur": seconds}``) that ``model`` prices above zero."""
    logs: dict[str, list[float]] = {}
    for st in steps:
        chunks = [tuple(c) for c in st["chunks"]]
        predicted = model.step_time(chunks)
        if predicted > 0 and st["dur"] > 0:
            logs.setdefault(noise_kind(chunks), []).append(math.log(st["dur"] / predicted))
    return logs


def even_quantiles(values: Sequence[float], n: int = NOISE_QUANTILES) -> tuple[float, ...]:
    """``values`` at probabilities i / (n - 1), i = 0 .. n-1: from the smallest to the
    largest, linear between order statistics (:func:`kvpush.bench.metrics.percentile`)."""
    from kvpush.bench.metrics import percentile

    if n < 2:
        raise ValueError(f"a quantile table needs at least 2 points, got {n}")
    return tuple(round(percentile(values, 100.0 * i / (n - 1)), 5) for i in range(n))


def measure_noise_quantiles(steps: Iterable[Mapping[str, Any]], model: StepModel,
                            n: int = NOISE_QUANTILES) -> dict[str, tuple[float, ...]]:
    """Per noise kind, the distribution of log(measured / modelled) over traced steps
    priced by ``model`` (the served step model), as ``n`` even quantiles
    (:func:`even_quantiles`); kinds with fewer than :data:`MIN_QUANTILE_STEPS` steps
    are left out (they keep :func:`measure_noise`'s log-normal). Unlike
    :func:`measure_noise` it keeps the tail: stray slow steps are part of what a mean
    over many steps (a TPOT) pays."""
    return quantiles_of(log_ratios(steps, model), n)


def quantiles_of(logs: Mapping[str, Sequence[float]], n: int = NOISE_QUANTILES
                 ) -> dict[str, tuple[float, ...]]:
    """:func:`measure_noise_quantiles` from :func:`log_ratios` already taken."""
    return {k: even_quantiles(v, n) for k in NOISE_KINDS
            if len(v := logs.get(k, [])) >= MIN_QUANTILE_STEPS}


def table_mean(table: Sequence[float], points: int = 2000) -> float:
    """The mean factor the draws from ``table`` give (exp of :func:`quantile_draw`,
    averaged over ``points`` even probabilities)."""
    return statistics.mean(math.exp(quantile_draw(table, (i + 0.5) / points))
                           for i in range(points))


def quantile_draw(table: Sequence[float], u: float) -> float:
    """The value at probability ``u`` (0..1) of a table of even quantiles (probabilities
    i / (n - 1), :func:`even_quantiles`): linear between neighbouring points."""
    x = min(max(u, 0.0), 1.0) * (len(table) - 1)
    i = min(int(x), len(table) - 2)
    return table[i] + (table[i + 1] - table[i]) * (x - i)


class StepNoise:
    """Multipliers for step times per noise kind: drawn from the kind's quantile table
    where there is one (``quantiles``: log factors, :func:`quantile_draw`), else
    log-normal of median 1 and the kind's sigma, else 1."""

    def __init__(self, sigmas: Mapping[str, float], rng: random.Random,
                 quantiles: Mapping[str, Sequence[float]] | None = None) -> None:
        self.sigmas = {k: float(sigmas.get(k, 0.0)) for k in NOISE_KINDS}
        self.quantiles = {k: tuple(v) for k, v in (quantiles or {}).items() if v}
        self.rng = rng

    def factor(self, decode: bool) -> float:
        kind = "decode" if decode else "prefill"
        if table := self.quantiles.get(kind):
            return math.exp(quantile_draw(table, self.rng.random()))
        sigma = self.sigmas[kind]
        return self.rng.lognormvariate(0.0, sigma) if sigma > 0 else 1.0
