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
requests, as ``kvpush bench compare`` pools its repeats. A profile without it (the GPU
profiles written from public figures) simulates deterministically, as before.

Measured effect on the recorded validation runs: neutral (SIMULATION.md 1-v12). The
probe's robust sigma is 2-5%; the knife edge of 1-v10a was set, in v12, by one step at
1.4x its neighbours, a tail the probe's few dozen prefill steps do not contain.
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
    logs: dict[str, list[float]] = {}
    for st in steps:
        chunks = [tuple(c) for c in st["chunks"]]
        predicted = model.step_time(chunks)
        if predicted > 0 and st["dur"] > 0:
            logs.setdefault(noise_kind(chunks), []).append(math.log(st["dur"] / predicted))
    return {k: round(robust_sigma(v), 4) for k in NOISE_KINDS
            if len(v := logs.get(k, [])) >= MIN_NOISE_STEPS}


class StepNoise:
    """Multipliers for step times: log-normal, median 1, sigma per noise kind."""

    def __init__(self, sigmas: Mapping[str, float], rng: random.Random) -> None:
        self.sigmas = {k: float(sigmas.get(k, 0.0)) for k in NOISE_KINDS}
        self.rng = rng

    def factor(self, decode: bool) -> float:
        sigma = self.sigmas["decode" if decode else "prefill"]
        return self.rng.lognormvariate(0.0, sigma) if sigma > 0 else 1.0
