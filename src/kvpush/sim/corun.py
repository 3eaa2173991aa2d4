"""How much slower an instance steps beside another on the same host (CPU profiles).

Two instances of a 1P1D pair on one small host share its cores, caches and memory
bandwidth. Two probes:

* ``kvpush simulate calibrate --corun`` (:func:`measure_corun`): a few step shapes of
  the calibration re-measured with a second engine process serving 512-in / 16-out
  requests beside it, against alone before and after -> ``host.corun_slowdown``. On the
  2-vCPU development VM it measured 1.0, 2.1 and 1.7 within two minutes, so it is off by
  default.
* the served pair (:func:`probe_served_pair`, part of the served probe): a light load
  through a real 1P1D push pair with the step trace on; per kind of step, measured /
  modelled for steps that started beside the other instance's step over those that
  started alone -> ``host.corun_by_kind`` (prefill, decode), which replaces
  ``corun_slowdown``. The v8 and v9 benchmark traces gave 1.02-1.03 (prefill) and
  1.07-1.10 (decode) this way.

The simulator applies the factor to a step that starts while another instance of the run
is mid-step (:meth:`kvpush.sim.profile.Profile.corun_factor`).
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpush.sim.calibrate import CalibrationPlan, measure_steps
from kvpush.sim.step_fit import Sample
from kvpush.sim.step_models import StepModel, decode_only

_CORUNNER = """
import sys, torch
from kvpush.config import EngineConfig
from kvpush.engine.llm_engine import LLMEngine
from kvpush.sampling_params import SamplingParams
cfg = EngineConfig.build(sys.argv[1], threads=1, block_size=32, max_model_len=1100,
                         enable_prefix_caching=False, max_num_seqs=64,
                         kv_cache_memory=256 << 20)
eng = LLMEngine(cfg)
p = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
g = torch.Generator().manual_seed(1)
n = 0
while True:
    while eng.scheduler.num_running + eng.scheduler.num_waiting < 2:
        ids = torch.randint(0, cfg.model.vocab_size, (512,), generator=g).tolist()
        eng.add_request(f"co{n}", ids, p)
        n += 1
    eng.step()
    if n == 4:
        print("ready", flush=True)
"""

#: what is re-measured with and without a busy neighbour: 512-token prefill steps and
#: decode steps of two requests at 512 tokens
CORUN_PLAN = CalibrationPlan(prefill=((512, 512), (512, 512)), decode=((2, 512),),
                             decode_steps=6, threads=(1,), mixed=())


def measure_corun(model_dir: str | Path, clock: str = "wall",
                  log: Callable[[str], None] = print) -> dict[str, float]:
    """How much slower a 1-thread engine steps while another 1-thread engine process on
    this host serves 512-in / 16-out requests two at a time (as the other instance of a
    1P1D pair does): the ratio of step times with and without it, for prefill and for
    decode steps, and their geometric mean (``corun_slowdown``)."""
    import math
    import subprocess
    import sys

    def split(samples: list[Sample]) -> tuple[float, float]:
        pre = sum(dt for ch, dt in samples if not decode_only(ch))
        dec = sum(dt for ch, dt in samples if decode_only(ch))
        return pre, dec

    def run() -> tuple[float, float]:
        return split(measure_steps(model_dir, 1, CORUN_PLAN, clock=clock, log=lambda _m: None))

    before = run()
    proc = subprocess.Popen([sys.executable, "-c", _CORUNNER, str(model_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        if proc.stdout is None or proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the co-running engine did not start")
        busy = run()
    finally:
        proc.kill()
        proc.wait()
    after = run()  # alone before and after: the mean cancels drift and warm-up
    pre = 2 * busy[0] / (before[0] + after[0])
    dec = 2 * busy[1] / (before[1] + after[1])
    f = max(1.0, math.sqrt(pre * dec))
    log(f"[calibrate] with a busy neighbour engine: prefill steps x{pre:.2f}, decode steps "
        f"x{dec:.2f} -> corun_slowdown {f:.2f}")
    return {"prefill_ratio": round(pre, 3), "decode_ratio": round(dec, 3),
            "corun_slowdown": round(f, 3)}


#: fewer steps than this on either side of a kind's ratio: no figure (1.0)
PAIR_MIN_STEPS = 3


class BusySpans:
    """Another instance's traced steps, asked when it was mid-step: a step that started
    before ``t`` and ended after it (``at``, a binary search over the starts with the
    latest end so far: steps of several instances may overlap)."""

    def __init__(self, steps: Sequence[Mapping[str, Any]]) -> None:
        spans = sorted((o["t"], o["t"] + o["dur"]) for o in steps)
        self.starts = [a for a, _ in spans]
        self.latest_end = list(itertools.accumulate((b for _, b in spans), max))

    def at(self, t: float) -> bool:
        i = bisect_left(self.starts, t)  # the steps that started strictly before t
        return i > 0 and self.latest_end[i - 1] > t


def pair_corun_ratios(p_steps: Sequence[Mapping[str, Any]],
                      d_steps: Sequence[Mapping[str, Any]],
                      model: StepModel) -> dict[str, Any]:
    """From the traced steps of a served prefill and decode instance on one host: per
    kind of step ("prefill": P's steps with a chunk over one token, "decode": D's
    decode-only steps), the median measured / modelled time of the steps that started
    while the other instance was mid-step (the simulator's rule) over that of the steps
    that started while it was idle; 1.0 (and no slowdown below 1) where either side has
    fewer than :data:`PAIR_MIN_STEPS` steps. ``alone``: per kind, the median measured /
    modelled of the steps that started alone (recorded, not used by the simulator: in
    the v14 runs D's lone decode steps ran ~0.99x the engine-alone fit in a pair, where
    a lone served instance's ran 0.96x)."""
    import statistics

    out: dict[str, Any] = {"steps": {}}
    for kind, mine, other in (("prefill", p_steps, d_steps), ("decode", d_steps, p_steps)):
        sides: dict[bool, list[float]] = {True: [], False: []}
        busy = BusySpans(other)
        for st in mine:
            chunks = [tuple(c) for c in st["chunks"]]
            if decode_only(chunks) != (kind == "decode"):
                continue
            predicted = model.step_time(chunks)
            if predicted > 0:
                sides[busy.at(st["t"])].append(st["dur"] / predicted)
        out["steps"][kind] = {"busy": len(sides[True]), "alone": len(sides[False])}
        if len(sides[False]) >= PAIR_MIN_STEPS:  # a record: served alone, in a pair
            out.setdefault("alone", {})[kind] = round(statistics.median(sides[False]), 4)
        if min(len(sides[True]), len(sides[False])) < PAIR_MIN_STEPS:
            out[kind] = 1.0
        else:
            ratio = statistics.median(sides[True]) / statistics.median(sides[False])
            out[kind] = round(max(1.0, ratio), 4)
    return out


def probe_served_pair(model: str, engine_model: StepModel, input_len: int = 384,
                      output_len: int = 24, num_prompts: int = 32, rate: float = 1.0,
                      seed: int = 7, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Serve a light load through ``kvpush bench compare``'s 1P1D push pair (1 torch
    thread each, the router and the streaming client on the same host) with the step
    trace on, and measure how much slower each instance's steps run while the other is
    mid-step (:func:`pair_corun_ratios`). The engine-alone ``--corun`` probe measured
    1.0-2.1x within minutes on 2 vCPUs; served pairs showed a steady 1.02-1.03x on
    prefill and 1.07-1.10x on decode steps (the v8 and v9 runs). 32 prompts: with 16,
    only 4-6 of P's steps started beside a decode step of D (P's figure moved 1.04-1.12
    between two calibrations an hour apart); 32 give about twice that (~20 s more)."""
    import tempfile

    from kvpush.engine.step_trace import read_arrivals
    from kvpush.sim.arrival_cost import arrival_step_cost
    from kvpush.sim.served import serve_traced, traced_steps

    with tempfile.TemporaryDirectory(prefix="kvpush-pair-probe-") as tmp:
        serve_traced(Path(tmp), model, "push", None, [rate], input_len, output_len,
                     num_prompts, seed)
        p_files = sorted(Path(tmp).rglob("steps/**/prefill-*.jsonl"))
        p_steps = traced_steps(p_files)
        d_steps = traced_steps(sorted(Path(tmp).rglob("steps/**/decode-*.jsonl")))
        # one arrival per request at the host: when it reached P (push sends it to D
        # at the same time)
        arrivals = [t for f in p_files for t in read_arrivals(f)]
    out = pair_corun_ratios(p_steps, d_steps, engine_model)
    out["arrival_step"] = arrival_step_cost(d_steps, arrivals, engine_model, p_steps)
    cost = out["arrival_step"]["arrival_step_s"]
    log(f"[calibrate] served 1P1D pair: steps beside the other instance's / alone: "
        f"prefill x{out['prefill']:.3f}, decode x{out['decode']:.3f} "
        f"({out['steps']})"
        + (f"; an arrival adds {1e3 * cost:.1f} ms to D's decode step in flight"
           if cost is not None else "")
        + f" (decode steps with / without arrivals: {out['arrival_step']['steps']})")
    return out


@dataclass(frozen=True)
class PairSpec:
    """One 1P1D pair of a side-by-side run: its label, transfer mode and, for push, how
    many layers one WRITE carries (``None``: the server's default)."""

    name: str
    mode: str
    push_layers_per_write: int | None = None


@dataclass
class SideBySide:
    """What a side-by-side run gave: per pair, the measured requests' times to first
    token (s), and per (pair, role) the traced steps from the first measured turn on."""

    started_utc: str
    ttfts: dict[str, list[float]] = field(default_factory=dict)
    steps: dict[tuple[str, str], list[dict[str, Any]]] = field(default_factory=dict)


def serve_side_by_side(model: str, pairs: Sequence[PairSpec], input_len: int = 128,
                       output_len: int = 8, prompts_per_turn: int = 8, turns: int = 8,
                       rate: float = 2.0, seed: int = 11) -> SideBySide:
    """Start one of ``kvpush bench compare``'s 1P1D pairs per spec side by side (1 torch
    thread per instance, traced; an idle pair does not step), then send
    ``prompts_per_turn`` prompts at ``rate`` to each pair in turn, the same prompts to
    each, for ``turns`` turns after a warm-up turn (connections, hand-shakes). The order
    rotates through every permutation of the pairs (two pairs: A B, B A, A B, ...), so
    that the host's drifting speed falls on every pair alike. Every process started is
    stopped before it returns."""
    import tempfile
    import time

    if turns < 1:
        raise ValueError(f"turns must be >= 1, got {turns}")
    names = [p.name for p in pairs]
    if len(set(names)) != len(names) or not names:
        raise ValueError(f"pair names must be distinct and at least one: {names}")
    from kvpush.bench.client import BenchConfig, prepare_requests, run_benchmark
    from kvpush.bench.compare import Cluster, CompareConfig, ModeSpec, resolve_served_model
    from kvpush.bench.datasets import load_tokenizer
    from kvpush.sim.served import traced_steps

    served, tok_dir = resolve_served_model(model)
    tokenizer = load_tokenizer(tok_dir)
    run = SideBySide(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     {n: [] for n in names})
    with tempfile.TemporaryDirectory(prefix="kvpush-side-by-side-") as tmp, ExitStack() as st:
        root = Path(tmp)
        urls = {}
        for i, spec in enumerate(pairs):
            cfg = CompareConfig(modes=[ModeSpec(spec.mode)], rates=[rate], out_dir=root,
                                model=model, input_len=input_len, output_len=output_len,
                                startup_timeout=300.0,
                                push_layers_per_write=spec.push_layers_per_write)
            urls[spec.name] = st.enter_context(Cluster(
                cfg, ModeSpec(spec.mode), served, root / f"logs{i}", tok_dir,
                root / f"steps{i}")).url
        orders = list(itertools.permutations(names))
        for turn in range(turns + 1):
            if turn == 1:
                start = time.time()
            for name in orders[turn % len(orders)]:
                bc = BenchConfig(url=urls[name], tokenizer=tok_dir, input_len=input_len,
                                 output_len=output_len,
                                 num_prompts=prompts_per_turn if turn else 2,
                                 request_rate=rate if turn else math.inf,
                                 seed=seed + turn, timeout=120.0)
                res = run_benchmark(bc, requests=prepare_requests(bc, tokenizer),
                                    tokenizer=tokenizer)
                if turn:
                    run.ttfts[name] += [o.ttft for o in res.outputs if o.success]
        st.close()  # the pairs are stopped before their traces are read
        run.steps = {(spec.name, role): traced_steps(
            sorted((root / f"steps{i}").rglob(f"{role}-*.jsonl")), start)
            for i, spec in enumerate(pairs) for role in ("prefill", "decode")}
    return run
