"""A push WRITE's post with its code and data hot, and cold as after a prefill step (issue 61).

    PYTHONPATH=src .venv/bin/python benchmarks/post_cold.py [--iters 100]

Two processes over real NIXL (``kvpush.sim.loopback.LoopbackPair``), the tiny Qwen3's KV
shape (3 layers, 2 KV heads x 32, bf16, 32-token blocks), contiguous blocks. Each post
WRITEs 128 or 1024 tokens; "cold" runs a stand-in for a step before each post (a sweep
of 64 MiB and a 2048 x 2048 bf16 matmul, one thread), as the engine's transfer thread
posts right after the step. Each is timed twice, built as the transfer thread builds
it: "descs" posts descriptor lists (``layer_block_descs``, ``post``: ``get_xfer_descs``
+ ``initialize_xfer``), "prepped" posts by index into the two regions' prepared lists
(``block_indices``, ``post_prepared``: ``make_prepped_xfer``; the lists are prepared at
the first post). Prints the median post's wall and CPU time and the median of each NIXL
call in it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

CALLS = ("get_xfer_descs", "initialize_xfer", "make_prepped_xfer", "transfer")


def main() -> None:
    import torch

    from kvpush.kv_cache.kv_map import block_indices, layer_rows
    from kvpush.sim.loopback import LoopbackPair, wait_done

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=100)
    args = ap.parse_args()
    torch.set_num_threads(1)
    a = torch.randn(2048, 2048, dtype=torch.bfloat16)
    sweep = torch.zeros(64 << 20, dtype=torch.uint8)
    with LoopbackPair(layers=3, heads=2, head_dim=32, dtype="bfloat16", blocks=512,
                      name="post-cold") as pair:
        spent: dict[str, list[float]] = {}
        agent = pair.tr._agent
        for name in CALLS:  # each NIXL call timed where the transport makes it
            def timed(*a_, _f=getattr(agent, name), _n=name, **kw):
                t = time.perf_counter()
                try:
                    return _f(*a_, **kw)
                finally:
                    spent.setdefault(_n, []).append(time.perf_counter() - t)
            setattr(agent, name, timed)
        lay = pair.layout
        every = range(lay.num_layers)

        def by_descs(blocks: int) -> int:
            local, remote = pair.descs(range(blocks), range(100, 100 + blocks))
            return pair.tr.post("WRITE", pair.peer_name, local, remote)

        def by_index(blocks: int) -> int:
            li = block_indices(lay, range(blocks), every)
            ri = block_indices(lay, range(100, 100 + blocks), every)
            return pair.tr.post_prepared("WRITE", pair.peer_name,
                                         layer_rows(pair.kv.data_ptr(), lay), li,
                                         layer_rows(pair.remote_base, lay), ri)

        for cold in (False, True):
            for blocks in (4, 32):
                for how, post in (("descs", by_descs), ("prepped", by_index)):
                    spent.clear()
                    wall, cpu = [], []
                    for _ in range(args.iters):
                        if cold:
                            sweep.add_(1)
                            a @ a
                        t0, c0 = time.perf_counter(), time.thread_time()
                        handle = post(blocks)
                        wall.append(time.perf_counter() - t0)
                        cpu.append(time.thread_time() - c0)
                        wait_done(pair.tr, handle)
                    parts = ", ".join(f"{n} {statistics.median(spent[n]) * 1e6:.0f}"
                                      for n in CALLS if n in spent)
                    print(f"{'cold' if cold else 'hot '} {blocks * 32:>5} tokens {how:>7}: "
                          f"post {statistics.median(wall) * 1e6:.0f} us wall, "
                          f"{statistics.median(cpu) * 1e6:.0f} us CPU ({parts} us)",
                          flush=True)


if __name__ == "__main__":
    main()
