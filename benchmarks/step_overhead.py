"""Per-step overhead of a steady decode, split by phase (issue 32, point 2).

Builds an LLMEngine (no HTTP) on a model, puts B requests into steady decode (their
prompts prefilled and a few warm-up steps run) and times N more ``engine.step()`` calls.
Each step is split by wrapping the engine's phase functions with timers:

* ``sched``: ``Scheduler.schedule`` (the plan, block allocation);
* ``metadata``: the runner's part outside the model and the sampler — input tensors,
  the attention metadata, the dense decode cache's bookkeeping, moving logits;
* ``forward``: the model's forward pass (every layer, the lm_head);
* ``sample``: the sampler;
* ``output``: everything else of ``engine.step()`` — ``update_after_step``, the stop
  checks, detokenization, the RequestOutputs.

It prints the median of each over the N steps (the phase medians need not add up to
the step's median exactly), the step's median CPU time of the calling thread (``cpu``:
with one torch thread all of the step's work runs there, and it moves less than wall
time when other processes share the cores), and the number of torch ops one step
dispatches (``ops``, counted with a TorchDispatchMode over one extra step: the figure
that per-op overhead scales with, and that does not depend on the host's load).

The default model is the random ``bench`` preset (3 layers, the serving benchmarks'
model); ``--preset tiny`` is the unit tests' 2-layer one,
``--smollm2`` the real SmolLM2-135M (30 layers).

    PYTHONPATH=src python benchmarks/step_overhead.py --batches 1,8,32
    PYTHONPATH=src python benchmarks/step_overhead.py --smollm2 --batches 1,8 --prompt 512

Run-to-run noise on a shared 2-vCPU host is 10-20%: compare runs made back to back.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if "PYTHONPATH" not in os.environ:  # else PYTHONPATH says which kvpush (A/B runs)
    sys.path.insert(0, str(ROOT / "src"))

PHASES = ("sched", "metadata", "forward", "sample", "output")


class PhaseTimer:
    """Wraps the engine's phase functions; each step's seconds per phase."""

    def __init__(self, engine) -> None:
        import kvpush.engine.model_runner as mr

        self.acc: dict[str, float] = {}
        self._mr = mr
        self._sample = mr.sample
        runner = engine.runner
        engine.scheduler.schedule = self._wrap("sched", engine.scheduler.schedule)
        runner.execute = self._wrap("execute", runner.execute)
        runner.model.forward = self._wrap("forward", runner.model.forward)
        mr.sample = self._wrap("sample", mr.sample)

    def _wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.acc[name] = self.acc.get(name, 0.0) + time.perf_counter() - t
        return timed

    def restore(self) -> None:
        self._mr.sample = self._sample

    def split(self, total: float) -> dict[str, float]:
        a = self.acc
        execute = a.get("execute", 0.0)
        fwd, smp = a.get("forward", 0.0), a.get("sample", 0.0)
        sched = a.get("sched", 0.0)
        return {"sched": sched, "metadata": execute - fwd - smp, "forward": fwd,
                "sample": smp, "output": total - sched - execute, "step": total}


def measure(engine, batch: int, prompt_len: int, warm: int, steps: int,
            seed: int = 0) -> dict[str, float]:
    """Median ms per phase over ``steps`` steady decode steps at ``batch``; the requests
    run up to the engine's max_model_len, so none finishes inside the measured steps
    (requests prefilled early decode while later ones still prefill)."""
    ids = start_decode(engine, batch, prompt_len, warm, seed)
    n_ops = count_ops(engine)
    timer = PhaseTimer(engine)
    rows: list[dict[str, float]] = []
    try:
        for _ in range(steps):
            timer.acc = {}
            c = time.thread_time()
            t = time.perf_counter()
            outs = engine.step()
            total = time.perf_counter() - t
            cpu = time.thread_time() - c
            assert len(outs) == batch, f"not a steady decode step: {len(outs)} outputs"
            rows.append({**timer.split(total), "cpu": cpu})
    finally:
        timer.restore()
        for rid in ids:
            engine.abort_request(rid)
    out = {k: 1e3 * statistics.median(r[k] for r in rows) for k in (*PHASES, "step", "cpu")}
    return {**out, "ops": n_ops}


def start_decode(engine, batch: int, prompt_len: int, warm: int, seed: int = 0) -> list[str]:
    """Add ``batch`` greedy requests of random ``prompt_len``-token prompts, step until
    each has its first token, then ``warm`` decode steps; their ids."""
    import torch

    from kvpush.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(seed + batch)
    vocab = engine.vocab_size
    params = SamplingParams(max_tokens=engine.max_model_len - prompt_len, temperature=0.0,
                            ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, torch.randint(3, vocab, (prompt_len,), generator=gen).tolist(),
                           params)
    # prefill until every request has its first token, then warm decode steps
    for _ in range(10_000):
        engine.step()
        reqs = [engine.scheduler.requests.get(r) for r in ids]
        if all(r is not None and r.output_token_ids for r in reqs):
            break
    for _ in range(warm):
        engine.step()
    return ids


def build_engine(tmp: str, smollm2: bool, preset: str, arch: str, threads: int, dtype: str,
                 max_len: int, max_seqs: int, batched: int, kv_bytes: int = 1 << 30):
    """An LLMEngine on SmolLM2-135M or a random model written under ``tmp``; its name."""
    from kvpush.config import EngineConfig
    from kvpush.engine.llm_engine import LLMEngine

    if smollm2:
        from kvpush.models.registry import resolve_model

        path, name = resolve_model("smollm2-135m"), "SmolLM2-135M"
    else:
        from kvpush.models.random_model import make_random_model

        path = make_random_model(Path(tmp), arch, preset, seed=0)
        name = f"random {arch}/{preset}"
    engine = LLMEngine(EngineConfig.build(
        path, threads=threads, dtype=dtype, max_model_len=max_len,
        max_num_seqs=max_seqs, max_num_batched_tokens=batched,
        # the region and the dense decode cache share this budget (half each):
        # 1 GiB leaves SmolLM2 room for 8 x (512 + steps) positions in both
        kv_cache_memory=kv_bytes))
    return engine, name


def count_ops(engine) -> int:
    """Torch ops (aten overloads, views included) that one engine step dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        engine.step()
    return Count.n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smollm2", action="store_true",
                    help="SmolLM2-135M instead of a random model")
    ap.add_argument("--preset", default="bench",
                    help="random model preset (default bench: 3 layers)")
    ap.add_argument("--arch", default="llama", choices=("llama", "qwen3"))
    ap.add_argument("--batches", default="1,8", help="comma-separated decode batch sizes")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=50, help="measured decode steps per batch")
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args(argv)

    import torch

    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        max_len = args.prompt + args.warm + args.steps + 256
        t0 = time.perf_counter()
        engine, name = build_engine(tmp, args.smollm2, args.preset, args.arch, args.threads,
                                    args.dtype, max_len, max(batches), max(1024, args.prompt))
        build_s = time.perf_counter() - t0
        torch.set_num_threads(args.threads)
        layers = engine.config.model.num_layers
        print(f"model {name} ({layers} layers), {args.dtype}, {args.threads} thread(s), "
              f"prompt {args.prompt}, median of {args.steps} steps after {args.warm} warm; "
              f"engine built in {build_s:.1f} s\n")
        print("| batch | " + " | ".join(f"{p} (ms)" for p in PHASES)
              + " | step (ms) | cpu (ms) | ops |")
        print("|---:|" + "---:|" * (len(PHASES) + 3))
        for b in batches:
            r = measure(engine, b, args.prompt, args.warm, args.steps)
            cells = " | ".join(f"{r[p]:.2f}" for p in (*PHASES, "step", "cpu"))
            cells += f" | {r['ops']}"
            print(f"| {b} | {cells} |", flush=True)
        engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
