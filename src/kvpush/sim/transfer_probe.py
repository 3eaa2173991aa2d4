"""Transfer micro-benchmark for calibration: NIXL WRITEs between two local processes.

The same set-up as ``benchmarks/transfer_micro.py`` (kvpush's region layout and
descriptor builder, :class:`kvpush.kv_transfer.nixl_transport.NixlTransport`, a peer in a
spawned process), reduced to what a profile needs: a few sizes, contiguous and
fragmented, WRITE only, and a fit ``time = latency + bytes / bandwidth + descs *
per_desc``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

BLOCK = 32


def _region(shape: dict[str, Any], blocks: int):
    import torch

    t = torch.empty((shape["num_layers"], blocks, 2, BLOCK, shape["num_kv_heads"],
                     shape["head_dim"]), dtype=torch.float32)
    t.view(torch.uint8).fill_(1)
    return t


def _layout(t):
    from kvpush.kv_cache.kv_region import LAYOUT_NAME, KVLayout

    layers, blocks, _, bs, heads, dim = t.shape
    block_bytes = 2 * bs * heads * dim * t.element_size()
    return KVLayout(LAYOUT_NAME, layers, blocks, bs, heads, dim, str(t.dtype), block_bytes,
                    blocks * block_bytes)


def _peer(conn, shape: dict[str, Any], blocks: int) -> None:
    import torch

    torch.set_num_threads(1)
    from kvpush.kv_transfer.nixl_transport import NixlTransport

    kv = _region(shape, blocks)
    tr = NixlTransport("probe-peer")
    tr.register_region(kv.data_ptr(), kv.numel() * kv.element_size())
    conn.send(tr.metadata())
    while not conn.poll(0.001):
        tr.progress()
    conn.recv()
    conn.recv()
    tr.close()


def _wait(tr, h: int, timeout: float = 60.0) -> None:
    from kvpush.kv_transfer.transport import XferState

    deadline = time.monotonic() + timeout
    while (st := tr.state(h)) is XferState.PENDING:
        if time.monotonic() > deadline:
            raise TimeoutError("transfer did not complete")
    if st is not XferState.DONE:
        raise RuntimeError(f"transfer ended {st}")
    tr.release(h)


def probe_transfer(shape: dict[str, Any], tokens: Sequence[int] = (256, 1024, 4096),
                   iters: int = 3, seed: int = 0,
                   log: Callable[[str], None] = print) -> tuple[dict[str, float], list[dict]]:
    """(profile ``transfer`` block, raw rows)."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    import torch

    from kvpush.kv_transfer.nixl_transport import NixlTransport
    from kvpush.kv_transfer.transport import layer_block_descs
    from kvpush.sim.calibrate import nnls_fit

    torch.set_num_threads(1)
    blocks = max(tokens) // BLOCK * 2
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    peer = ctx.Process(target=_peer, args=(child, shape, blocks), daemon=True)
    peer.start()
    rows: list[dict] = []
    tr = None
    try:
        kv = _region(shape, blocks)
        layout = _layout(kv)
        tr = NixlTransport("probe-init")
        tr.register_region(kv.data_ptr(), kv.numel() * kv.element_size())
        if not parent.poll(120):
            raise TimeoutError("transfer probe: the peer process did not start")
        name = tr.add_peer(parent.recv())
        rbase = tr._peers[name].region.base  # noqa: SLF001 (same as the bench)
        lo, ro = layer_block_descs(kv.data_ptr(), layout, [0], rbase, layout, [0], [0])
        _wait(tr, tr.post("WRITE", name, lo, ro))
        parent.send("connected")
        rng = random.Random(seed)
        for n in tokens:
            nb = n // BLOCK
            for pattern in ("contiguous", "fragmented"):
                if pattern == "contiguous":
                    lb = rb = list(range(nb))
                else:
                    lb, rb = rng.sample(range(blocks), nb), rng.sample(range(blocks), nb)
                local, remote = layer_block_descs(kv.data_ptr(), layout, lb, rbase, layout, rb,
                                                  range(layout.num_layers))
                posts, totals = [], []
                for _ in range(iters):
                    t0 = time.perf_counter()
                    h = tr.post("WRITE", name, local, remote)
                    t1 = time.perf_counter()
                    _wait(tr, h)
                    posts.append(t1 - t0)
                    totals.append(time.perf_counter() - t0)
                row = {"tokens": n, "pattern": pattern, "descs": len(local),
                       "bytes": nb * layout.block_bytes * layout.num_layers,
                       "post_s": statistics.median(posts), "total_s": statistics.median(totals)}
                rows.append(row)
                log(f"[calibrate] WRITE {n} tokens {pattern}: {row['descs']} descs, "
                    f"{row['total_s'] * 1e3:.2f} ms")
    finally:
        if tr is not None:
            tr.close()
        if peer.is_alive():
            parent.send("stop")
            peer.join(10)
        if peer.is_alive():
            peer.kill()
            peer.join(5)
    lat, per_byte, per_desc = nnls_fit([[1.0, r["bytes"], r["descs"]] for r in rows],
                                       [r["total_s"] for r in rows],
                                       [1.0 / r["total_s"] for r in rows])
    return ({"bandwidth_Bps": 1.0 / per_byte if per_byte > 0 else 1e12, "latency_s": lat,
             "post_base_s": 0.0, "post_per_desc_s": 0.0, "per_desc_s": per_desc,
             "setup_s": 1e-4}, rows)
