"""KV transfer micro-benchmark: push (WRITE) and pull (READ) over real NIXL between two
processes, against an in-process torch copy of the same bytes.

Two processes on this host, each with a KV region of kvpush's layout
(``kv[layer, block, K/V, token, kv_head, head_dim]``, 32-token blocks) registered with a
:class:`kvpush.kv_transfer.transports.nixl_transport.NixlTransport` (UCX; over loopback UCX copies
with cma). The initiator (this process) moves the KV of N tokens to (WRITE = push:
prefill writes into decode's blocks) or from (READ = pull: decode reads prefill's blocks)
the peer, with descriptors built by ``layer_block_descs`` exactly as the engine does:

* contiguous: block ids 0..n-1 on both sides: one descriptor per layer;
* fragmented: block ids drawn at random (an independent permutation of the region's
  blocks on each side): about one descriptor per layer per block.

For each case: descriptors per transfer, the time to build them, ``post()`` (over cma the
copy happens inside it), post -> DONE, and bytes per second; the baseline is a torch copy
(1 thread) of the same blocks inside one process (slices when contiguous, index gather /
scatter when fragmented). The median of ``--iters`` transfers is reported.

    .venv/bin/python benchmarks/transfer_micro.py                      # SmolLM2 shape
    .venv/bin/python benchmarks/transfer_micro.py --qwen --qwen-max-tokens 4096

Writes ``benchmarks/results/transfer_micro.json`` (``--json`` to change). Needs NIXL.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

BLOCK = 32
#: name -> (layers, kv heads, head dim, torch dtype name, bytes per element)
SHAPES = {
    "smollm2-135m fp32": (30, 3, 64, "float32", 4),       # 45 KiB per token
    "qwen3-32b bf16": (64, 8, 128, "bfloat16", 2),        # 256 KiB per token
}
RESULTS = Path(__file__).resolve().parent / "results"


def bench_shape(name: str, shape: tuple, token_counts: list[int], iters: int,
                seed: int) -> list[dict]:
    import torch

    from kvpush.sim.loopback import LoopbackPair, kv_region

    layers, heads, dim, dtype, _ = shape
    rows: list[dict] = []
    with LoopbackPair(layers=layers, heads=heads, head_dim=dim, dtype=dtype,
                      blocks=max(token_counts) // BLOCK, block_size=BLOCK,
                      name="micro") as pair:
        kv, layout = pair.kv, pair.layout
        dst = kv_region(layers, layout.num_blocks, heads, dim, dtype, BLOCK)
        rng = random.Random(seed)
        for tokens in token_counts:
            nb = tokens // BLOCK
            nbytes = nb * layout.block_bytes * layout.num_layers
            for pattern in ("contiguous", "fragmented"):
                if pattern == "contiguous":
                    lb, rb = list(range(nb)), list(range(nb))
                else:
                    lb = rng.sample(range(layout.num_blocks), nb)
                    rb = rng.sample(range(layout.num_blocks), nb)
                t0 = time.perf_counter()
                local, remote = pair.descs(lb, rb)
                build_s = time.perf_counter() - t0
                row = {"shape": name, "tokens": tokens, "bytes": nbytes, "pattern": pattern,
                       "descs": len(local), "build_ms": build_s * 1e3}
                for op in ("WRITE", "READ"):
                    post_s, total_s = pair.time(op, local, remote, iters)
                    key = "push_write" if op == "WRITE" else "pull_read"
                    row[f"{key}_post_ms"] = post_s * 1e3
                    row[f"{key}_ms"] = total_s * 1e3
                    row[f"{key}_GBps"] = nbytes / total_s / 1e9
                li = torch.tensor(lb)
                ri = torch.tensor(rb)
                times = []
                for _ in range(iters):
                    t0 = time.perf_counter()
                    if pattern == "contiguous":
                        dst[:, :nb].copy_(kv[:, :nb])
                    else:
                        dst[:, ri] = kv.index_select(1, li)
                    times.append(time.perf_counter() - t0)
                row["memcpy_ms"] = statistics.median(times) * 1e3
                row["memcpy_GBps"] = nbytes / statistics.median(times) / 1e9
                rows.append(row)
                print(_fmt_row(row), flush=True)
    return rows


HEADER = (f"{'shape':<18} {'tokens':>6} {'MiB':>7} {'pattern':<10} {'descs':>6} "
          f"{'build':>7} | {'WRITE post':>10} {'WRITE':>8} {'GB/s':>5} | {'READ post':>9} "
          f"{'READ':>8} {'GB/s':>5} | {'memcpy':>8} {'GB/s':>5}")


def _fmt_row(r: dict) -> str:
    return (f"{r['shape']:<18} {r['tokens']:>6} {r['bytes'] / 2**20:>7.1f} {r['pattern']:<10} "
            f"{r['descs']:>6} {r['build_ms']:>5.1f}ms | {r['push_write_post_ms']:>8.2f}ms "
            f"{r['push_write_ms']:>6.2f}ms {r['push_write_GBps']:>5.2f} | "
            f"{r['pull_read_post_ms']:>7.2f}ms {r['pull_read_ms']:>6.2f}ms "
            f"{r['pull_read_GBps']:>5.2f} | {r['memcpy_ms']:>6.2f}ms {r['memcpy_GBps']:>5.2f}")


def markdown(rows: list[dict]) -> str:
    out = ["| shape | tokens | MiB | blocks | descs | build ms | WRITE post ms | WRITE ms | "
           "WRITE GB/s | READ post ms | READ ms | READ GB/s | memcpy ms | memcpy GB/s |",
           "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['shape']} | {r['tokens']} | {r['bytes'] / 2**20:.1f} | "
                   f"{r['pattern']} | {r['descs']} | {r['build_ms']:.2f} | "
                   f"{r['push_write_post_ms']:.2f} | {r['push_write_ms']:.2f} | "
                   f"{r['push_write_GBps']:.2f} | {r['pull_read_post_ms']:.2f} | "
                   f"{r['pull_read_ms']:.2f} | {r['pull_read_GBps']:.2f} | "
                   f"{r['memcpy_ms']:.2f} | {r['memcpy_GBps']:.2f} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="512,1024,2048,4096,8192",
                    help="KV sizes in tokens (default: 512,1024,2048,4096,8192)")
    ap.add_argument("--qwen", action="store_true", help="also the Qwen3-32B KV shape")
    ap.add_argument("--qwen-max-tokens", type=int, default=4096,
                    help="largest Qwen3-32B size (each process holds two or one region of "
                         "it: 4096 tokens = 1 GiB each; default: 4096)")
    ap.add_argument("--iters", type=int, default=5, help="transfers per case (median)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=RESULTS / "transfer_micro.json")
    args = ap.parse_args()
    try:
        import nixl._api  # noqa: F401
    except ImportError:
        print("NIXL is not installed (make venv installs it)", file=sys.stderr)
        return 2
    tokens = sorted({int(t) for t in args.tokens.split(",") if t.strip()})
    if any(t % BLOCK for t in tokens):
        ap.error(f"token counts must be multiples of {BLOCK}")
    print(HEADER, flush=True)
    rows = bench_shape("smollm2-135m fp32", SHAPES["smollm2-135m fp32"], tokens,
                       args.iters, args.seed)
    if args.qwen:
        qt = [t for t in tokens if t <= args.qwen_max_tokens]
        rows += bench_shape("qwen3-32b bf16", SHAPES["qwen3-32b bf16"], qt, args.iters,
                            args.seed)
    print()
    print(markdown(rows))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"argv": sys.argv[1:], "iters": args.iters,
                                     "block_size": BLOCK, "rows": rows}, indent=1) + "\n")
    print(f"\nwritten to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
