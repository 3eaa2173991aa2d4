"""What --kv-digest costs (issue 63, point 4): the digests alone, and the hand-off.

1. Digests alone: ``BlockDigests.of`` over the blocks of a prompt of each length, in a
   KV region of the model's shape (one side's cost; push and pull pay it once on
   prefill, once on decode, both before token #1 is out).
2. The hand-off: a prefill and a decode engine of the model in this process over the
   in-process transport (a memmove per descriptor; the engines' own transfer threads,
   side channel and step loops), pushed or pulled one request at a time with
   ``max_tokens`` 1: from the prefill leg's arrival to token #1 out of decode, with and
   without --kv-digest alternating request by request; medians.

    PYTHONPATH=src:tests .venv/bin/python benchmarks/kv_digest_cost.py \
        [--model smollm2-135m] [--lengths 16,1024] [--n 20] [--mode push]

Prints two tables. The host's CPU model and load go first: timings taken while other
work runs are noisy.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path


def cpu_line() -> str:
    from kvpush.bench.machine import cpu_flags

    return f"CPU: {cpu_flags()}, load {os.getloadavg()[0]:.1f}"


def digest_only(cfg, lengths: list[int], block_size: int, n: int) -> None:
    import torch

    from kvpush.kv_transfer.digest import HASHERS, BlockDigests

    m = cfg.model
    blocks = max(-(-x // block_size) for x in lengths)
    storage = torch.randn((m.num_layers, blocks, 2, m.num_kv_heads, block_size, m.head_dim),
                          dtype=cfg.dtype)
    digests = BlockDigests(storage)
    print(f"\ndigests alone ({m.num_layers} layers, {m.num_kv_heads} KV heads x "
          f"{m.head_dim}, {str(cfg.dtype).removeprefix('torch.')}, {block_size}-token "
          "blocks), one side:")
    print(f"{'hash':>9} {'prompt tokens':>14} {'blocks':>7} {'KV MiB':>8} {'ms median':>10} "
          f"{'GB/s':>6}")
    for algorithm in HASHERS:
        for length in lengths:
            ids = list(range(-(-length // block_size)))
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                digests.of(ids, algorithm)
                times.append(time.perf_counter() - t0)
            nbytes = storage[:, ids].numel() * storage.element_size()
            med = statistics.median(times)
            print(f"{algorithm:>9} {length:>14} {len(ids):>7} {nbytes / 2**20:>8.2f} "
                  f"{med * 1e3:>10.3f} {nbytes / med / 1e9:>6.2f}")


def one(drv, rid: str, prompt: list[int], params) -> tuple[float, float]:
    """(prefill leg in -> token #1 out of decode, prefill's leg done -> token #1 out), s."""
    t0 = time.perf_counter()
    drv.submit(rid, prompt, params)
    p_done = d_first = None
    deadline = t0 + 300
    while d_first is None:
        if not drv.pump():
            time.sleep(0.0002)
        now = time.perf_counter()
        if p_done is None and drv.p_legs[rid].finished:
            p_done = now
        leg = drv.d_legs.get(rid)
        if leg is not None and leg.error is not None:
            raise RuntimeError(leg.error)
        if leg is not None and leg.tokens:
            d_first = now
        if now > deadline:
            raise TimeoutError(rid)
    drv.run(timeout=60)
    drv.settle()
    return d_first - t0, d_first - (p_done or d_first)


def handoff(model: Path, mode: str, lengths: list[int], n: int, kw: dict) -> None:
    from engine_helpers import greedy, random_prompts
    from kvpush_testing.faults import FaultPlan
    from pd_helpers import PDDriver, make_instance

    print(f"\nhand-off ({mode}, in process), median of {n} per cell, ms: 'total' from the "
          "prefill leg in, 'hand-off' from prefill's leg done, to token #1 out of decode")
    print(f"{'prompt tokens':>14} {'total off':>10} {'total on':>9} {'hand-off off':>13} "
          f"{'hand-off on':>12} {'on - off':>9}")
    pairs = {}
    for digest in (False, True):
        faults = FaultPlan()
        p = make_instance(model, "prefill", mode, faults=faults, kv_digest=digest, **kw)
        d = make_instance(model, "decode", mode, faults=faults, kv_digest=digest, **kw)
        pairs[digest] = PDDriver(p, d)
    try:
        for length in lengths:
            times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
            prompts = random_prompts([length] * (n + 2), seed=length)
            for i, prompt in enumerate(prompts):
                for digest in ((False, True) if i % 2 else (True, False)):
                    got = one(pairs[digest], f"{length}-{i}-{int(digest)}", prompt, greedy(1))
                    if i >= 2:  # two warm-ups
                        times[digest].append(got)
            med = {k: [statistics.median(x[j] for x in v) * 1e3 for j in (0, 1)]
                   for k, v in times.items()}
            print(f"{length:>14} {med[False][0]:>10.2f} {med[True][0]:>9.2f} "
                  f"{med[False][1]:>13.2f} {med[True][1]:>12.2f} "
                  f"{med[True][1] - med[False][1]:>9.2f}")
        checked = pairs[True].d.connector.counters
        print(f"(with --kv-digest: {checked.transfers_ok} receives checked, "
              f"{checked.digest_mismatches} mismatches)")
    finally:
        for drv in pairs.values():
            drv.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", default="16,1024")
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--mode", choices=("push", "pull"), default="push")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    from kvpush.config import EngineConfig
    from kvpush.kv_transfer.digest import HASHERS
    from kvpush.models.registry import resolve_model

    model = resolve_model(args.model)
    lengths = [int(x) for x in args.lengths.split(",")]
    kw = {"lease": 120.0, "block_size": args.block_size,
          "num_blocks": 4 * (max(lengths) // args.block_size + 2),
          "max_model_len": max(lengths) + 64, "threads": args.threads, "dtype": "float32"}
    print(cpu_line())
    print(f"model {model.name}, {args.threads} torch thread(s) per engine, float32; "
          f"--kv-digest hashes with {next(iter(HASHERS))}")
    build = {k: v for k, v in kw.items() if k != "lease"}
    digest_only(EngineConfig.build(model, **build), lengths, args.block_size, args.n)
    handoff(model, args.mode, lengths, args.n, kw)


if __name__ == "__main__":
    main()
