"""`kvpush simulate calibrate`: measure this machine's profile from kvpush's own engine.

Step times come from :class:`kvpush.engine.llm_engine.LLMEngine` itself: a few prompts
are run through ``step()`` with the scheduler's plan captured, so every step is one
sample (its chunks and its wall time, scheduling, sampling and detokenization included).
Prefill samples use a set token budget (chunks of n tokens at contexts 0, n, 2n...);
decode samples run B requests of C prompt tokens each. A ``linear`` step model is fitted
per torch thread count by non-negative least squares on relative error. The transfer
link comes from :mod:`kvpush.sim.transfer_probe` (real NIXL between two processes).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpush.sim.profile import Chunk, LinearStepModel, step_features

#: The features fitted (see :func:`kvpush.sim.profile.step_features`); per_sample is not
#: separable from per_seq (every chunk here samples) and stays 0.
FIT_FIELDS = ("base_s", "per_token_s", "per_attn_s", "per_seq_s", "per_ctx_s")


@dataclass(frozen=True)
class CalibrationPlan:
    #: (chunk tokens, prompt tokens): the prompt is prefilled in chunks of that size.
    prefill: tuple[tuple[int, int], ...] = ((1024, 1024), (512, 1024), (128, 512), (32, 128))
    #: (batch, prompt tokens): decode steps of that many requests.
    decode: tuple[tuple[int, int], ...] = ((1, 128), (4, 128), (16, 128), (1, 1024), (2, 512))
    decode_steps: int = 8
    threads: tuple[int, ...] = (1, 2)
    #: (batch, prompt tokens, new prompt tokens): decode steps of a batch into which a new
    #: prompt arrives (mixed prefill + decode steps, as colocated instances run them).
    mixed: tuple[tuple[int, int, int], ...] = ((2, 128, 512), (4, 256, 1024))

    @classmethod
    def quick(cls) -> CalibrationPlan:
        return cls(prefill=((32, 64), (8, 16)), decode=((1, 16), (4, 16)), decode_steps=3,
                   threads=(1,), mixed=((2, 16, 32),))


Sample = tuple[list[Chunk], float]
CLOCKS = ("auto", "wall", "cpu")


def choose_clock(clock: str) -> str:
    """``auto``: wall time on a quiet machine, CPU time when the load average exceeds
    the core count (then wall time mostly measures waiting for a core)."""
    if clock != "auto":
        return clock
    try:
        busy = os.getloadavg()[0] > 0.75 * (os.cpu_count() or 1)
    except OSError:
        busy = False
    return "cpu" if busy else "wall"


def measure_steps(model_dir: str | Path, threads: int, plan: CalibrationPlan,
                  block_size: int = 32, clock: str = "wall",
                  log: Callable[[str], None] = print) -> list[Sample]:
    """Run ``plan`` through a fresh LLMEngine with ``threads`` torch threads. ``clock``:
    ``wall`` (time.perf_counter) or ``cpu`` (CPU time of the thread that steps: what the
    step would take on dedicated cores, as that thread is busy, or spinning at the
    parallel regions' barriers, for the whole step)."""
    import torch

    from kvpush.config import EngineConfig
    from kvpush.engine.llm_engine import LLMEngine
    from kvpush.sampling_params import SamplingParams

    longest = max([p for _, p in plan.prefill] + [p for _, p in plan.decode]
                  + [m[2] for m in plan.mixed])
    max_len = longest + plan.decode_steps + 8
    cfg = EngineConfig.build(model_dir, threads=threads, block_size=block_size,
                             max_model_len=max_len, enable_prefix_caching=False,
                             max_num_batched_tokens=max(1024, longest), max_num_seqs=64,
                             kv_cache_memory=256 << 20)
    eng = LLMEngine(cfg)
    vocab = cfg.model.vocab_size
    gen = torch.Generator().manual_seed(0)
    samples: list[Sample] = []
    captured: list[Any] = []
    orig = eng.scheduler.schedule

    def schedule():
        plan_ = orig()
        captured.append(plan_)
        return plan_

    eng.scheduler.schedule = schedule  # type: ignore[method-assign]
    sched_cfg = eng.scheduler.config
    n_req = 0

    def run(prompts: Sequence[int], max_tokens: int, budget: int, record: bool,
            later: list[tuple[int, int]] | None = None) -> None:
        """``later``: (after this many steps, prompt tokens) to add mid-run."""
        eng.scheduler.config = dataclasses.replace(sched_cfg, max_num_batched_tokens=budget)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        later = list(later or [])

        def add(n: int) -> None:
            nonlocal n_req
            ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
            eng.add_request(f"cal{n_req}", ids, params)
            n_req += 1

        for n in prompts:
            add(n)
        steps_done = 0
        while eng.has_work():
            captured.clear()
            t0, c0 = time.perf_counter(), time.thread_time()
            eng.step()
            dt = time.perf_counter() - t0
            if clock == "cpu":
                dt = time.thread_time() - c0
            steps_done += 1
            if later and steps_done == later[0][0]:
                add(later.pop(0)[1])
            if record and captured and captured[-1].chunks:
                chunks = [(len(c.token_ids), c.start_pos) for c in captured[-1].chunks]
                samples.append((chunks, dt))

    try:
        run([64], 2, 1024, record=False)  # warm-up: first-step allocations, kernels
        for chunk, prompt in plan.prefill:
            t0 = time.perf_counter()
            run([prompt], 1, chunk, record=True)
            log(f"[calibrate] threads={threads} prefill {prompt} tokens in chunks of {chunk}:"
                f" {time.perf_counter() - t0:.2f} s")
        for batch, prompt in plan.decode:
            t0 = time.perf_counter()
            run([prompt] * batch, plan.decode_steps + 1, max(1024, longest), record=True)
            log(f"[calibrate] threads={threads} decode batch {batch} at {prompt} tokens: "
                f"{time.perf_counter() - t0:.2f} s")
        for batch, prompt, new in plan.mixed:
            t0 = time.perf_counter()
            run([prompt] * batch, plan.decode_steps + 2, max(1024, longest), record=True,
                later=[(2, new)])
            log(f"[calibrate] threads={threads} decode batch {batch} at {prompt} tokens + "
                f"a {new}-token prompt: {time.perf_counter() - t0:.2f} s")
    finally:
        eng.shutdown()
    return samples


def nnls_fit(rows: Sequence[Sequence[float]], targets: Sequence[float],
             weights: Sequence[float]) -> list[float]:
    """Weighted least squares with non-negative coefficients (active set: drop the most
    negative coefficient and refit until none is negative)."""
    import numpy as np

    x = np.asarray(rows, dtype=float) * np.asarray(weights, dtype=float)[:, None]
    y = np.asarray(targets, dtype=float) * np.asarray(weights, dtype=float)
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        scale = np.abs(x[:, active]).max(axis=0)
        scale[scale == 0] = 1.0
        sol, *_ = np.linalg.lstsq(x[:, active] / scale, y, rcond=None)
        sol = sol / scale
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            return coef.tolist()
        active.pop(int(np.argmin(sol)))
    return coef.tolist()


def fit_linear(samples: Sequence[Sample]) -> tuple[LinearStepModel, dict[str, float]]:
    """The step model and its fit quality (median / max relative error)."""
    if len(samples) < len(FIT_FIELDS):
        raise ValueError(f"need at least {len(FIT_FIELDS)} samples to fit, got {len(samples)}")
    rows, ys = [], []
    for chunks, dt in samples:
        t, a, s, c, _ = step_features(chunks)
        rows.append([1.0, t, a, s, c])
        ys.append(dt)
    coef = nnls_fit(rows, ys, [1.0 / y for y in ys])
    model = LinearStepModel(**dict(zip(FIT_FIELDS, coef)))
    errs = sorted(abs(model.step_time(ch) - dt) / dt for ch, dt in samples)
    return model, {"median_rel_err": errs[len(errs) // 2], "max_rel_err": errs[-1],
                   "samples": float(len(samples))}


def _shape_of(model_dir: Path) -> dict[str, Any]:
    from kvpush.config import ModelConfig

    m = ModelConfig.from_dir(model_dir)
    return {"name": model_dir.name, "num_layers": m.num_layers, "num_kv_heads": m.num_kv_heads,
            "head_dim": m.head_dim, "hidden_size": m.hidden_size, "num_heads": m.num_heads,
            "intermediate_size": m.intermediate_size, "vocab_size": m.vocab_size,
            "kv_bytes_per_elem": 4, "weight_bytes_per_elem": 4,
            "tied_embeddings": m.tie_word_embeddings}


def load_avg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def calibrate(model: str | None, out: str | Path, plan: CalibrationPlan,
              transfer: bool = True, note: str = "", clock: str = "auto",
              log: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure and write a profile; returns its dict."""
    from kvpush.models.registry import DEFAULT_MODEL, resolve_model

    model_dir = resolve_model(model or DEFAULT_MODEL)
    shape = _shape_of(model_dir)
    started = time.time()
    load_before = load_avg()
    clock = choose_clock(clock)
    log(f"[calibrate] load average {load_before} on {os.cpu_count()} cpus: {clock} clock")
    step_models: dict[str, Any] = {}
    fits: dict[str, Any] = {}
    for th in plan.threads:
        samples = measure_steps(model_dir, th, plan, clock=clock, log=log)
        m, quality = fit_linear(samples)
        step_models[f"threads={th}"] = {"kind": "linear", **dataclasses.asdict(m)}
        fits[f"threads={th}"] = quality
        log(f"[calibrate] threads={th}: {m} (median rel. err {quality['median_rel_err']:.1%})")
    one = f"threads={plan.threads[0]}"
    two = f"threads={plan.threads[-1]}"
    if transfer:
        from kvpush.sim.transfer_probe import probe_transfer

        tr, tr_rows = probe_transfer(shape, log=log)
    else:
        tr = {"bandwidth_Bps": 5e9, "latency_s": 5e-5, "post_base_s": 0.0,
              "post_per_desc_s": 0.0, "per_desc_s": 2e-6, "setup_s": 1e-4}
        tr_rows = []
    data = {
        "name": Path(out).stem,
        "description": f"this machine ({platform.node() or 'host'}), {model_dir.name} fp32, "
                       "measured by `kvpush simulate calibrate`",
        "measured": {"started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
                     "wall_s": round(time.time() - started, 1), "cpus": os.cpu_count(),
                     "load_avg_before": load_before, "load_avg_after": load_avg(),
                     "clock": clock,
                     "fits": fits, "transfer_samples": tr_rows, "plan": dataclasses.asdict(plan)},
        "notes": [n for n in (note,) if n] + [
            f"Step times are {'wall' if clock == 'wall' else 'stepping-thread CPU'} times of "
            "LLMEngine.step() (scheduling, forward, sampling, detokenization), one engine "
            "per thread count, fitted by non-negative least squares on relative error."
            + (" CPU time was used because the machine was loaded: it estimates dedicated "
               "cores (the stepping thread is busy, or spins at barriers, for a whole step)."
               if clock == "cpu" else ""),
            "roles: P/D instances use 1 torch thread each and colocated uses all (as "
            "`kvpush bench compare` does on 2 cores).",
            "The HTTP front, SSE streaming and the router are not in the step times; their "
            "latency is the handoff block (estimates, not measured here).",
            "kvpush posts pull's READ from its transfer thread, not the step loop "
            "(pull_post_on_step_loop false). Over cma the copy happens inside post(), so the "
            "whole cost is on the wire terms.",
        ],
        "sources": {
            "step_models": "measured here (LLMEngine.step wall time)",
            "transfer": "measured here (NIXL UCX WRITE between two processes)" if transfer
                        else "PLATFORM.md figures (5-6 GB/s, ~2 us per descriptor)",
            "handoff": "estimates: localhost HTTP hop through uvicorn/httpx ~1 ms; side "
                       "channel one-way ~12 us (PLATFORM.md: 25 us round trip)",
        },
        "model": shape,
        "step_models": step_models,
        "roles": {"prefill": one, "decode": one, "colocated": two},
        "transfer": tr,
        "handoff": {"http_hop_s": 1e-3, "client_hop_s": 1e-3, "relay_s": 5e-4,
                    "side_channel_s": 1.2e-5, "handshake_s": 5e-3,
                    "pull_post_on_step_loop": False},
        "instance": {"block_size": 32, "num_blocks": (1 << 30) // (
            32 * 2 * shape["num_layers"] * shape["num_kv_heads"] * shape["head_dim"] * 4),
                     "max_num_batched_tokens": 1024, "max_num_seqs": 64},
    }
    from kvpush.sim.profile import profile_from_dict

    profile_from_dict(data, str(out))  # refuse to write what cannot be loaded
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(data, indent=1) + "\n")
    log(f"[calibrate] wrote {out}")
    return data
