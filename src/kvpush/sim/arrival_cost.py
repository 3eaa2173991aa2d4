"""What a request arriving at the host costs the engine steps in flight (CPU profiles).

On a CPU host the load generator, the router and the instance's HTTP front end take each
request in (HTTP, JSON, tokenization, opening the stream) on the same cores the engine
steps on. In the v14-v17 run sets, a step during which requests reached the engine ran
longer by a few milliseconds per request, fitted within each run so that the host's
drifting speed cancels (benchmarks/arrival_steps.py, SIMULATION.md 1-arrivals): 4.7 +-
0.9 ms for the 2-thread colocated instance's steps at 16 req/s, 6.3-6.6 +- 1.1 ms for
P's prefill steps at 16 req/s, 2.9-4.9 ms for D's decode steps at 4 and 16 req/s, ~0-1
ms where the requests were sent all at once. The served factors come from probes whose
steps rarely see an arrival, so where 700 ms steps each saw ~10 arrivals (128-token
prompts at 16 req/s) the model ran 5-10% short and the queue behind it longer still.

:func:`arrival_step_cost` measures the cost from a served probe's step trace. Decode
steps are short and steady, so they carry it: per arrival, the median of
``(measured - r0 x modelled) / n`` over the decode-only steps during which ``n >= 1``
requests arrived, where ``r0`` is the median measured / modelled of the decode-only
steps during which none did (split by whether the other instance was mid-step, for a
pair). The simulator adds the figure (``host.arrival_step_s``, per step model) to every
step in flight on the host when a request arrives
(:meth:`kvpush.sim.engine.EngineSim.host_arrival`).
"""

from __future__ import annotations

import statistics
from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence
from typing import Any

from kvpush.sim.step_models import StepModel, decode_only

#: fewer decode steps than this on either side (with arrivals / without): no figure
MIN_STEPS = 3


def arrivals_during(step: Mapping[str, Any], arrivals: Sequence[float]) -> int:
    """How many of the (sorted) ``arrivals`` fall strictly inside ``step``."""
    return (bisect_left(arrivals, step["t"] + step["dur"])
            - bisect_right(arrivals, step["t"]))


def arrival_step_cost(steps: Sequence[Mapping[str, Any]], arrivals: Sequence[float],
                      model: StepModel,
                      neighbour: Sequence[Mapping[str, Any]] | None = None
                      ) -> dict[str, Any]:
    """Seconds each request arriving during a step adds to it, from traced steps
    (``{"t", "dur", "chunks"}``) and the times requests reached the engine: see the
    module docstring. ``neighbour``: the other instance's steps on the host; ``r0`` is
    then taken apart for steps that started while it was mid-step and while it was
    idle. ``arrival_step_s`` is None where a side has fewer than :data:`MIN_STEPS`
    steps, and never below 0."""
    from kvpush.sim.corun import BusySpans

    arrivals = sorted(arrivals)
    sides: dict[bool, dict[str, list[tuple[float, float, int]]]] = {}
    busy = BusySpans(neighbour or [])
    for st in steps:
        chunks = [tuple(c) for c in st["chunks"]]
        if not decode_only(chunks) or (predicted := model.step_time(chunks)) <= 0:
            continue
        n = arrivals_during(st, arrivals)
        beside = busy.at(st["t"])
        side = sides.setdefault(beside, {"with": [], "without": []})
        side["with" if n else "without"].append((st["dur"], predicted, n))
    excess: list[float] = []
    counts = {"with": 0, "without": 0}
    for side in sides.values():
        counts["with"] += len(side["with"])
        counts["without"] += len(side["without"])
        if len(side["without"]) < MIN_STEPS or not side["with"]:
            continue
        r0 = statistics.median(d / p for d, p, _ in side["without"])
        excess += [(d - r0 * p) / n for d, p, n in side["with"]]
    out: dict[str, Any] = {"steps": counts, "arrivals": len(arrivals), "arrival_step_s": None}
    if len(excess) >= MIN_STEPS:
        out["arrival_step_s"] = round(max(0.0, statistics.median(excess)), 6)
    return out
