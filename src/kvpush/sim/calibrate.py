"""`kvpush simulate calibrate`: measure this machine's profile from kvpush's own engine.

Step times come from :class:`kvpush.engine.llm_engine.LLMEngine` itself: a plan of
prompts is run through ``step()`` with the scheduler's plan captured, so every step is
one sample (its chunks and its time, scheduling, sampling and detokenization included):
prefill chunks of set sizes, decode batches at set contexts, decode batches into which
a prompt arrives (the mixed steps colocated instances run) and short tails over a
cached prefix. A ``linear`` step model is fitted per torch thread count by non-negative
least squares on relative error (a 1 ms decode step counts as much as a 1 s prefill).
The transfer link comes from :mod:`kvpush.sim.transfer_probe` (NIXL between two
processes). The engine runs alone here: a serving instance's steps share the host with
its HTTP front end, the router and the load generator, which this does not measure.
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

from kvpush.sim.fit import nnls_fit
from kvpush.sim.step_models import LINEAR_FIELDS, Chunk, LinearStepModel, step_features

#: one timed step: its chunks and its seconds
Sample = tuple[list[Chunk], float]


def fit_linear(samples: Sequence[Sample]) -> tuple[LinearStepModel, dict[str, float]]:
    """The step model and its fit quality (median / max relative error, samples)."""
    if len(samples) < len(LINEAR_FIELDS):
        raise ValueError(f"need at least {len(LINEAR_FIELDS)} samples to fit, got "
                         f"{len(samples)}")
    rows = [[1.0, *step_features(chunks)] for chunks, _ in samples]
    ys = [dt for _, dt in samples]
    model = LinearStepModel(*nnls_fit(rows, ys, [1.0 / dt for dt in ys]))
    errs = sorted(abs(model.step_time(ch) - dt) / dt for ch, dt in samples)
    return model, {"median_rel_err": errs[len(errs) // 2], "max_rel_err": errs[-1],
                   "samples": float(len(samples))}


@dataclass(frozen=True)
class CalibrationPlan:
    #: (chunk tokens, prompt tokens): the prompt is prefilled in chunks of that size.
    prefill: tuple[tuple[int, int], ...] = ((1024, 1024), (512, 1024), (128, 512), (32, 128))
    #: (batch, prompt tokens): decode steps of that many requests (up to the batch a
    #: busy colocated instance decodes at once).
    decode: tuple[tuple[int, int], ...] = ((1, 128), (4, 128), (16, 128), (32, 128),
                                           (1, 1024), (2, 512), (8, 1024))
    #: decode steps each batch runs together once its last prompt is in
    decode_steps: int = 8
    threads: tuple[int, ...] = (1, 2)
    #: (batch, prompt tokens, new prompt tokens): decode steps of a batch into which a new
    #: prompt arrives (mixed prefill + decode steps, as colocated instances run them).
    mixed: tuple[tuple[int, int, int], ...] = ((2, 128, 512), (4, 256, 1024))
    #: (batch, cached prefix tokens, new tokens): prompts that share a prefix already in
    #: the prefix cache, each computing only its tail (decode-side prefix hits)
    prefix: tuple[tuple[int, int, int], ...] = ((15, 992, 32), (4, 480, 128))
    #: passes over the whole plan per thread count, fitted together (a host's speed
    #: drifts; two passes average over more of it)
    repeats: int = 2

    @classmethod
    def quick(cls) -> CalibrationPlan:
        return cls(prefill=((32, 64), (8, 16)), decode=((1, 16), (4, 16)), decode_steps=3,
                   threads=(1,), mixed=((2, 16, 32),), prefix=((2, 32, 8),), repeats=1)


def measure_steps(model_dir: str | Path, threads: int, plan: CalibrationPlan,
                  block_size: int = 32, log: Callable[[str], None] = print) -> list[Sample]:
    """Run ``plan`` through a fresh LLMEngine with ``threads`` torch threads; every step
    as ([(tokens, start position, samples?), ...], wall seconds)."""
    import torch

    from kvpush.config import EngineConfig
    from kvpush.engine.llm_engine import LLMEngine
    from kvpush.sampling_params import SamplingParams

    longest = max([p for _, p in plan.prefill] + [p for _, p in plan.decode]
                  + [m[2] for m in plan.mixed] + [c + n for _, c, n in plan.prefix])
    if any(c % block_size for _, c, _ in plan.prefix):
        raise ValueError(f"prefix lengths must be multiples of the block size {block_size}")
    budget = max(1024, longest)
    prefill_steps = max([-(-b * n // budget) for b, n in plan.decode], default=0)
    cfg = EngineConfig.build(model_dir, threads=threads, block_size=block_size,
                             max_model_len=longest + plan.decode_steps + prefill_steps + 8,
                             enable_prefix_caching=bool(plan.prefix),
                             max_num_batched_tokens=budget, max_num_seqs=64,
                             kv_cache_memory=1 << 30)
    eng = LLMEngine(cfg)
    gen = torch.Generator().manual_seed(0)
    samples: list[Sample] = []
    captured: list[Any] = []
    orig = eng.scheduler.schedule

    def schedule():
        captured.append(orig())
        return captured[-1]

    eng.scheduler.schedule = schedule  # type: ignore[method-assign]
    sched_cfg = eng.scheduler.config
    n_req = 0

    def tokens(n: int) -> list[int]:
        return torch.randint(0, cfg.model.vocab_size, (n,), generator=gen).tolist()

    def run(prompts: Sequence[int | list[int]], max_tokens: int, budget: int, record: bool,
            later: list[tuple[int, int]] | None = None) -> None:
        """``prompts``: a length (random tokens, so the prefix cache never hits) or the
        tokens; ``later``: (after this many steps, prompt tokens) to add mid-run."""
        nonlocal n_req
        eng.scheduler.config = dataclasses.replace(sched_cfg, max_num_batched_tokens=budget)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        later = list(later or [])
        pending = list(prompts)
        steps_done = 0
        while pending or eng.has_work():
            for n in pending:
                eng.add_request(f"cal{n_req}", tokens(n) if isinstance(n, int) else n, params)
                n_req += 1
            pending = []
            captured.clear()
            t0 = time.perf_counter()
            eng.step()
            dt = time.perf_counter() - t0
            steps_done += 1
            if later and steps_done == later[0][0]:
                pending.append(later.pop(0)[1])
            if record and captured and captured[-1].chunks:
                samples.append(([(len(c.token_ids), c.start_pos, bool(c.sample))
                                 for c in captured[-1].chunks], dt))

    def timed(what: str, *runs: tuple[Any, ...]) -> None:
        for args in runs:
            run(*args)
        log(f"[calibrate] threads={threads} {what}")

    try:
        # warm-up: first-step allocations and kernels, the decode cache at full size
        run([64], 2, 1024, record=False)
        run([longest], 3, budget, record=False)
        for _ in range(plan.repeats):
            for chunk, prompt in plan.prefill:
                timed(f"prefill {prompt} tokens in chunks of {chunk}",
                      ([prompt], 1, chunk, True))
            for batch, prompt in plan.decode:
                # every request lasts until the batch has decoded decode_steps times
                steps = plan.decode_steps + 1 + -(-batch * prompt // budget)
                timed(f"decode batch {batch} at {prompt} tokens",
                      ([prompt] * batch, steps, budget, True))
            for batch, prompt, new in plan.mixed:
                timed(f"decode batch {batch} at {prompt} tokens + a {new}-token prompt",
                      ([prompt] * batch, plan.decode_steps + 2, budget, True, [(2, new)]))
            for batch, cached, new in plan.prefix:
                shared = tokens(cached)  # the first run puts it in the prefix cache
                timed(f"{batch} prompts of {new} tokens over a cached {cached}-token prefix",
                      ([shared + tokens(new)], 1, budget, False),
                      ([shared + tokens(new) for _ in range(batch)], 2, budget, True))
    finally:
        eng.shutdown()
    return samples


def _shape_of(model_dir: Path) -> dict[str, Any]:
    from kvpush.config import ModelConfig

    m = ModelConfig.from_dir(model_dir)
    return {"name": model_dir.name, "num_layers": m.num_layers, "num_kv_heads": m.num_kv_heads,
            "head_dim": m.head_dim, "hidden_size": m.hidden_size, "num_heads": m.num_heads,
            "intermediate_size": m.intermediate_size, "vocab_size": m.vocab_size,
            "kv_bytes_per_elem": 4, "weight_bytes_per_elem": 4,
            "tied_embeddings": m.tie_word_embeddings}


#: without the transfer probe: an assumed loopback link (profile field: transfer)
ASSUMED_TRANSFER = {"bandwidth_Bps": 5e9, "latency_s": 5e-5, "post_base_s": 0.0,
                    "post_per_desc_s": 0.0, "per_desc_s": 2e-6, "setup_s": 1e-4}


def calibrate(model: str | None, out: str | Path, plan: CalibrationPlan,
              transfer: bool = True, note: str = "",
              log: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure and write a profile; returns its dict."""
    from kvpush.config import DEFAULT_BLOCK_SIZE
    from kvpush.kv_transfer.step_loop.prefill_side import write_groups
    from kvpush.models.registry import DEFAULT_MODEL, resolve_model
    from kvpush.sim.profile import profile_from_dict

    model_dir = resolve_model(model or DEFAULT_MODEL)
    shape = _shape_of(model_dir)
    started, load = time.time(), [round(x, 2) for x in os.getloadavg()]
    log(f"[calibrate] load average {load} on {os.cpu_count()} cpus (calibrate a quiet host)")
    step_models: dict[str, Any] = {}
    fits: dict[str, Any] = {}
    for th in plan.threads:
        m, quality = fit_linear(measure_steps(model_dir, th, plan, log=log))
        step_models[f"threads={th}"] = {"kind": "linear", **dataclasses.asdict(m)}
        fits[f"threads={th}"] = quality
        log(f"[calibrate] threads={th}: {m} (median rel. err {quality['median_rel_err']:.1%})")
    tr, tr_rows = dict(ASSUMED_TRANSFER), []
    if transfer:
        from kvpush.sim.transfer_probe import probe_transfer

        tr, tr_rows = probe_transfer(shape, log=log)
    kv_bytes = DEFAULT_BLOCK_SIZE * 2 * shape["num_layers"] * shape["num_kv_heads"] \
        * shape["head_dim"] * shape["kv_bytes_per_elem"]
    data = {
        "name": Path(out).stem,
        "description": f"this machine ({platform.node() or 'host'}), {model_dir.name} fp32, "
                       "measured by `kvpush simulate calibrate`",
        "measured": {"started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
                     "wall_s": round(time.time() - started, 1), "cpus": os.cpu_count(),
                     "load_avg_before": load, "fits": fits, "transfer_samples": tr_rows,
                     "plan": dataclasses.asdict(plan)},
        "notes": [n for n in (note,) if n] + [
            "Step models: wall time of LLMEngine.step() with the engine alone, per "
            "torch thread count; P/D roles run the fewest threads, colocated the most.",
            "kvpush posts pull's READ from its transfer thread (pull_post_on_step_loop "
            "false)."],
        "sources": {"step_models": "measured here (LLMEngine.step)",
                    "transfer": "measured here (NIXL WRITE between two processes)"
                                if transfer else "assumed (calibrate --no-transfer)",
                    "handoff": "estimates for HTTP hops and side-channel messages"},
        "model": shape,
        "step_models": step_models,
        "roles": {"prefill": f"threads={min(plan.threads)}",
                  "decode": f"threads={min(plan.threads)}",
                  "colocated": f"threads={max(plan.threads)}"},
        "transfer": tr,
        "handoff": {"http_hop_s": 1e-3, "client_hop_s": 1e-3, "relay_s": 5e-4,
                    "side_channel_s": 1.2e-5, "pull_post_on_step_loop": False,
                    # what served prefill instances use (kvpush serve's CPU default)
                    # (CPU's auto closes groups by compute time; the profile, one a step)
                    "push_layers_per_write": write_groups(0, shape["num_layers"],
                                                          cuda=False).layers
                                             or shape["num_layers"]},
        "instance": {"block_size": DEFAULT_BLOCK_SIZE, "num_blocks": (1 << 30) // kv_bytes,
                     "max_num_batched_tokens": 1024, "max_num_seqs": 64},
    }
    profile_from_dict(data, str(out))  # refuse to write what cannot be loaded
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(data, indent=1) + "\n")
    log(f"[calibrate] wrote {out}")
    return data
