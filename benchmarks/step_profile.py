"""Where an engine step spends its time, by op class, against the weight-bandwidth floor
(issue 55, point 1; docs/ENGINE_PROFILE.md).

Builds an LLMEngine (no HTTP) as step_overhead.py does and, under ``torch.profiler``,
runs N steady decode steps at each batch and R single-chunk prefills of ``--prefill``
tokens. The model's pieces are wrapped in ``record_function`` labels, so each class is
the profiler's time inside its label: ``linear`` (the 4 projections of every layer),
``lm_head``, ``attention`` (``paged_attention``: the KV writes, the decode cache, SDPA),
``norm``; the rest of ``forward`` is rope, SiLU*up, residual adds, the embedding
(``rope/act/add``); ``sampling`` is the sampler; the rest of the step is the runner's
metadata, the scheduler and the outputs (``engine``). ``outside ops`` is the time in no
torch op at all (the labels' self time: Python, plus the profiler's own cost per op).

Also measured, without the profiler: each step's median wall time and the calling
thread's CPU time, and the memory bandwidth (best of 5 of a 1 GiB float32 tensor's
``sum()``, which reads it once, and ``copy_`` into another, counted as read + write), so
that ``floor`` = bytes of weights one step reads / read bandwidth.

    PYTHONPATH=src python benchmarks/step_profile.py --smollm2 --threads 2
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        PYTHONPATH=src python benchmarks/step_profile.py --smollm2 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
if "PYTHONPATH" not in os.environ:
    sys.path.insert(0, str(HERE.parent / "src"))

from step_overhead import build_engine, start_decode  # noqa: E402

LABELS = ("step", "forward", "linear", "lm_head", "attention", "norm", "sampling")
#: thread CPU seconds inside each label, inclusive (the calling thread's: all of a
#: step's work at one torch thread, so unlike the profiler's wall times it does not
#: grow when other processes take the cores)
CPU: dict[str, float] = {}
ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def bandwidth(gib: float = 1.0, reps: int = 5) -> dict[str, float]:
    """GB/s (1e9 B/s) of reading a large float32 tensor (``sum``) and copying it."""
    import torch

    n = int(gib * (1 << 30)) // 4
    src = torch.ones(n)
    dst = torch.empty(n)
    best = {"read": 0.0, "copy": 0.0}
    for _ in range(reps):
        t = time.perf_counter()
        src.sum()
        best["read"] = max(best["read"], 4 * n / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        dst.copy_(src)
        best["copy"] = max(best["copy"], 8 * n / (time.perf_counter() - t) / 1e9)
    return best


def label(engine) -> None:
    """Wrap the model's pieces in record_function labels (for the rest of the run)."""
    import torch

    import kvpush.engine.model_runner as mr
    import kvpush.model.llama as llama

    rf = torch.profiler.record_function
    clock = time.thread_time

    def wrap(name, fn):
        def labelled(*a, **kw):
            c = clock()
            try:
                with rf(name):
                    return fn(*a, **kw)
            finally:
                CPU[name] = CPU.get(name, 0.0) + clock() - c
        return labelled

    model = engine.runner.model
    model.ensure_linears()
    model.layer_linears = [tuple(wrap("linear", f) for f in fs) for fs in model.layer_linears]
    model.head_linear = wrap("lm_head", model.head_linear)
    model._norm = wrap("norm", model._norm)
    model.forward = wrap("forward", model.forward)
    llama.paged_attention = wrap("attention", llama.paged_attention)
    mr.sample = wrap("sampling", mr.sample)
    engine.step = wrap("step", engine.step)


def classes(t: dict[str, float]) -> dict[str, float]:
    """ms per class from ms per label (inclusive)."""
    g = lambda k: t.get(k, 0.0)  # noqa: E731
    return {"step": g("step"), "linear": g("linear"), "lm_head": g("lm_head"),
            "attention": g("attention"), "norm": g("norm"),
            "rope/act/add": g("forward") - g("linear") - g("lm_head") - g("attention")
            - g("norm"),
            "sampling": g("sampling"), "engine": g("step") - g("forward") - g("sampling")}


def profiled(engine, n: int, each=None) -> dict:
    """ms per step in each class over ``n`` engine steps (``each()`` before each one):
    the profiler's (wall) and the labels' thread CPU time (``cpu by class``)."""
    from torch.profiler import ProfilerActivity, profile

    CPU.clear()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            if each is not None:
                each()
            engine.step()
    ev = {e.key: e for e in prof.key_averages()}
    t = {k: ev[k].cpu_time_total / 1e3 / n if k in ev else 0.0 for k in LABELS}
    outside = sum(ev[k].self_cpu_time_total for k in LABELS if k in ev) / 1e3 / n
    ops = sorted((e for e in ev.values() if e.key not in LABELS),
                 key=lambda e: -e.self_cpu_time_total)[:6]
    return {
        **classes(t), "outside ops": outside,
        "top ops": {e.key: round(e.self_cpu_time_total / 1e3 / n, 2) for e in ops},
        "cpu by class": {k: round(v, 2) for k, v in
                         classes({k: 1e3 * v / n for k, v in CPU.items()}).items()},
    }


def timed(engine, n: int, each=None) -> dict[str, float]:
    """Median wall and thread-CPU ms of ``n`` steps, no profiler."""
    wall, cpu = [], []
    for _ in range(n):
        if each is not None:
            each()
        c, t = time.thread_time(), time.perf_counter()
        engine.step()
        wall.append(time.perf_counter() - t)
        cpu.append(time.thread_time() - c)
    return {"wall": 1e3 * statistics.median(wall), "cpu": 1e3 * statistics.median(cpu)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smollm2", action="store_true")
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--batches", default="1,8", help="decode batch sizes")
    ap.add_argument("--prompt", type=int, default=512, help="decode requests' prompt tokens")
    ap.add_argument("--prefill", type=int, default=512, help="prefill tokens (0: none)")
    ap.add_argument("--steps", type=int, default=10, help="steps per measurement")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-gib", type=float, default=1.0, help="--kv-cache-memory (GiB)")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args(argv)

    import torch

    from kvpush.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    res: dict = {"env": {k: os.environ.get(k) for k in ENV},
                 "capability": torch.backends.cpu.get_cpu_capability(),
                 "threads": args.threads, "bandwidth_gbs": bandwidth()}
    with tempfile.TemporaryDirectory() as tmp:
        max_len = max(args.prompt, args.prefill) + 4 * args.steps + 64
        engine, name = build_engine(tmp, args.smollm2, args.preset, "llama", args.threads,
                                    args.dtype, max_len, max(batches),
                                    max(1024, args.prefill), int(args.kv_gib * (1 << 30)))
        torch.set_num_threads(args.threads)
        model = engine.runner.model
        model.ensure_linears()
        # what one decode step reads of the weights: every projection and the head
        # (the embedding only a row per token, the norms are negligible)
        wbytes = sum(w.nbytes for w in model._linear_weights())
        res.update(model=name, weight_mb=wbytes / 1e6, linear_plan=model.linear_plan.describe())
        res["floor_ms"] = 1e3 * wbytes / (res["bandwidth_gbs"]["read"] * 1e9)
        label(engine)
        for b in batches:
            ids = start_decode(engine, b, args.prompt, warm=3)
            row = timed(engine, args.steps)
            row.update(profiled(engine, args.steps))
            res[f"decode b={b}"] = row
            for rid in ids:
                engine.abort_request(rid)
            print(name, f"decode b={b}", json.dumps(row), flush=True)
        if args.prefill:
            gen = torch.Generator().manual_seed(1)
            params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
            k = iter(range(10**6))

            def add() -> None:  # a fresh prompt each time: no prefix-cache hit
                engine.add_request(f"p{next(k)}", torch.randint(
                    3, engine.vocab_size, (args.prefill,), generator=gen).tolist(), params)

            timed(engine, 1, add)
            row = timed(engine, args.steps, add)
            row.update(profiled(engine, args.steps, add))
            res[f"prefill {args.prefill}"] = row
            print(name, f"prefill {args.prefill}", json.dumps(row), flush=True)
        engine.shutdown()
    print(json.dumps({k: v for k, v in res.items() if not k.startswith(("decode", "prefill"))}))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
