"""Engine steps inside the serving stack against the engine alone.

`kvpush simulate calibrate` times :class:`~kvpush.engine.llm_engine.LLMEngine` steps in a
process of its own. A serving instance steps the same engine, but beside its HTTP front
end and, on a small host, beside the router and the load generator, which stream every
token, and its steps get somewhat longer (2 vCPUs: 1.06-1.09x for prefill steps,
0.97-0.99x for decodes; before the server's one-OpenMP-pool fix, 1.2-1.6x for 2-thread
steps, see kvpush.engine.async_engine). The served probe measures it:
it serves a short workload through a real instance and the router with the per-step
trace on (kvpush.engine.step_trace), prices every traced step with the engine-alone step
model, and records measured / modelled per kind of step (median over the steps):

* ``prefill_batched``: a step with the prefill of two or more prompts (two chunks of at
  least :data:`BATCHED_MIN_TOKENS` tokens each): a burst's prompts prefilled together;
* ``prefill``: any other step with a chunk of more than one token (with or without
  decodes): one prompt's chunk, perhaps with a few tokens of the next;
* ``decode``: a step of one-token decode rows only.

Batched prefills are their own kind because the engine-alone fit prices them worse than
lone ones: on one thread, the probe's and the benchmarks' batched prefill steps ran
1.10-1.12x the model where lone prompts ran 0.98-1.06x (the 2-thread fit has no such
gap); one factor for both, measured mostly on the probe's batched steps, made every lone
1024-token prefill 9% too slow. A profile without ``prefill_batched`` uses its
``prefill`` factor for them.

The profile keeps them as ``host.served_factors[step model][kind]`` and the simulator
multiplies its step times by them (:class:`ServedStepModel`).

The same probe times the front end: in its all-at-once phase, the instance notes when
each request reached its engine (the trace's arrival lines); the mean gap between them
is ``handoff.front_end_s`` (:func:`front_end_gap`).
"""

from __future__ import annotations

import math
import statistics
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpush.sim.profile import Chunk, StepModel

KINDS = ("prefill", "prefill_batched", "decode")
#: the size from which a prefill chunk counts as a prompt's prefill in a batched step
#: (smaller ones: the tail of a token budget that a step's main prompt left over)
BATCHED_MIN_TOKENS = 64


def step_kind(chunks: Sequence[Sequence[Any]]) -> str:
    if all(c[0] == 1 for c in chunks):
        return "decode"
    big = sum(1 for c in chunks if c[0] >= BATCHED_MIN_TOKENS)
    return "prefill_batched" if big >= 2 else "prefill"


@dataclass(frozen=True)
class ServedStepModel:
    """A step model scaled per kind of step (``factors``: kind -> factor)."""

    inner: StepModel
    factors: Mapping[str, float]

    def factor(self, kind: str) -> float:
        if kind == "prefill_batched" and kind not in self.factors:
            kind = "prefill"
        return self.factors.get(kind, 1.0)

    def step_time(self, chunks: Sequence[Chunk]) -> float:
        return self.inner.step_time(chunks) * self.factor(step_kind(chunks))


def traced_steps(paths: Iterable[Path], start: float = -math.inf,
                 end: float = math.inf) -> list[dict[str, Any]]:
    """The traced steps of these files that started in [start, end]."""
    from kvpush.engine.step_trace import read_trace

    return [st for p in paths for st in read_trace(p) if start <= st["t"] <= end]


def step_ratios(steps: Iterable[Mapping[str, Any]], model: StepModel
                ) -> dict[str, list[float]]:
    """kind -> measured / modelled time of each step of that kind."""
    out: dict[str, list[float]] = {}
    for st in steps:
        chunks = [tuple(c) for c in st["chunks"]]
        predicted = model.step_time(chunks)
        if predicted > 0:
            out.setdefault(step_kind(chunks), []).append(st["dur"] / predicted)
    return out


def front_end_gap(arrivals: Sequence[float]) -> float | None:
    """Mean gap between consecutive arrivals of a burst sent all at once (None for
    fewer than two)."""
    if len(arrivals) < 2:
        return None
    a = sorted(arrivals)
    return (a[-1] - a[0]) / (len(a) - 1)


def factors_from(ratios: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """The median ratio of each kind with steps; a kind without: its fallback's
    (prefill_batched -> prefill), else 1.0."""
    out = {k: round(statistics.median(ratios[k]), 4) for k in KINDS if ratios.get(k)}
    out.setdefault("prefill", 1.0)
    out.setdefault("prefill_batched", out["prefill"])
    out.setdefault("decode", 1.0)
    return {k: out[k] for k in KINDS}


@dataclass(frozen=True)
class ServedProbe:
    """The workload the probe serves through ``kvpush bench compare``'s colocated
    cluster (one instance behind the router, the load generator streaming every token):
    random prompts at a light rate (lone decodes, a prompt arriving now and then into
    them) and all at once (batched decodes, back-to-back prefills), because the two
    load levels slow the engine differently (a 1.0 req/s probe alone measured 1.21-1.25
    on 2-thread decodes that stepped 0.8-0.9x of that in a busy server)."""

    input_len: int = 384
    output_len: int = 24
    num_prompts: int = 12
    rates: tuple[float, ...] = (1.0, math.inf)
    seed: int = 7


def probe_served(model: str, threads: int, engine_model: StepModel,
                 probe: ServedProbe = ServedProbe(),
                 log: Callable[[str], None] = print) -> dict[str, Any]:
    """Serve ``probe`` with ``threads`` torch threads; measured / modelled step times per
    kind (``factors``) and the number of steps behind each, the front end's gap
    between the arrivals of the all-at-once burst (``front_end_s``, None without one)
    and the traced steps themselves (``trace``)."""
    import json

    from kvpush.bench.compare import CompareConfig, ModeSpec, run_compare
    from kvpush.engine.step_trace import read_arrivals

    with tempfile.TemporaryDirectory(prefix="kvpush-served-probe-") as tmp:
        cfg = CompareConfig(modes=[ModeSpec("colocated", threads)], rates=list(probe.rates),
                            out_dir=Path(tmp), model=model, input_len=probe.input_len,
                            output_len=probe.output_len, num_prompts=probe.num_prompts,
                            seed=probe.seed, step_trace=True, time_limit=600.0,
                            run_timeout=300.0)
        run_compare(cfg, log=lambda m: None)
        files = sorted((Path(tmp) / "steps").rglob("*.jsonl"))
        steps = traced_steps(files)
        ratios = step_ratios(steps, engine_model)
        gaps = []
        for path in sorted((Path(tmp) / "runs").glob("*.json")):
            run = json.loads(path.read_text())
            if math.isinf(float(run["request_rate"])):
                gap = front_end_gap([t for f in files for t in read_arrivals(f)
                                     if run["wall_start"] <= t <= run["wall_end"]])
                if gap is not None:
                    gaps.append(gap)
    factors = factors_from(ratios)
    front_end = statistics.median(gaps) if gaps else None
    log(f"[calibrate] served probe, threads={threads}: steps in the server / engine alone "
        + ", ".join(f"{k} {factors[k]:.2f} ({len(ratios.get(k, []))} steps)" for k in KINDS)
        + (f"; front end {1e3 * front_end:.2f} ms per request" if front_end else ""))
    return {"factors": factors, "steps": {k: len(ratios.get(k, [])) for k in KINDS},
            "front_end_s": front_end,
            # every traced step ([chunks, seconds]): a refit prices them again
            # (kvpush.sim.refit) without serving the probe again
            "trace": [[st["chunks"], round(st["dur"], 6)] for st in steps],
            "probe": {**probe.__dict__, "rates": [str(r) for r in probe.rates]}}
