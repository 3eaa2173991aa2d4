"""The projections' matmul autotune on a real model (issue 32; model/linear_pick.py):
what it picks on this machine and what it costs at start-up.

Loads the model's weights (no engine), then runs ``DecoderModel.tune_linears`` --runs
times at --threads torch threads and prints, per run, the time it took and the kernel
chosen per weight shape and row bucket with the timings behind it (seconds per call of
F.linear/MKL against oneDNN at the bucket's row count). Runs that disagree show where
the two kernels are within this host's noise.

    PYTHONPATH=src python benchmarks/linear_pick.py --threads 1 --runs 3
"""

from __future__ import annotations

import argparse
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="installed model name or folder")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)

    import torch

    from kvpush.bench.machine import cpu_flags
    from kvpush.config import ModelConfig
    from kvpush.model.linear_pick import LinearMode
    from kvpush.model.loader import load_model
    from kvpush.models.registry import resolve_model

    torch.set_num_threads(args.threads)
    cfg = ModelConfig.from_dir(resolve_model(args.model))
    t0 = time.perf_counter()
    model = load_model(cfg, torch.float32, "cpu", 2048)
    load_s = time.perf_counter() - t0
    print(f"{cfg.path}: {cfg.num_layers} layers, fp32, {args.threads} thread(s); "
          f"{cpu_flags()}; weights loaded in {load_s:.2f} s")
    if model.linear_mode is not LinearMode.AUTO or not model.onednn_ok:
        print(f"mode {model.linear_backend}: nothing to time")
        return 0
    for run in range(args.runs):
        plan = model.tune_linears()
        print(f"\nrun {run + 1}: {plan.timed_series} series in {plan.tune_s * 1e3:.0f} ms")
        for c in plan.choices.values():
            print("  " + c.describe())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
