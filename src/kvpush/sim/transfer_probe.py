"""Calibration's transfer probe: NIXL WRITEs between two local processes.

:class:`kvpush.sim.loopback.LoopbackPair` (kvpush's region layout and descriptor
builder, a peer in a spawned process, as ``benchmarks/transfer_micro.py`` uses it): a
few sizes, contiguous and fragmented, fitted as ``latency + bytes / bandwidth + descs *
per_desc``.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Sequence
from typing import Any

BLOCK = 32


def probe_transfer(shape: dict[str, Any], tokens: Sequence[int] = (256, 1024, 4096),
                   iters: int = 3, seed: int = 0,
                   log: Callable[[str], None] = print) -> tuple[dict[str, float], list[dict]]:
    """(profile ``transfer`` block, raw rows)."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from kvpush.sim.fit import nnls_fit
    from kvpush.sim.loopback import LoopbackPair

    blocks = max(tokens) // BLOCK * 2
    rows: list[dict] = []
    with LoopbackPair(layers=shape["num_layers"], heads=shape["num_kv_heads"],
                      head_dim=shape["head_dim"], dtype="float32", blocks=blocks,
                      block_size=BLOCK, name="probe") as pair:
        rng = random.Random(seed)
        for n in tokens:
            nb = n // BLOCK
            for pattern in ("contiguous", "fragmented"):
                if pattern == "contiguous":
                    lb = rb = list(range(nb))
                else:
                    lb, rb = rng.sample(range(blocks), nb), rng.sample(range(blocks), nb)
                local, remote = pair.descs(lb, rb)
                post_s, total_s = pair.time("WRITE", local, remote, iters)
                row = {"tokens": n, "pattern": pattern, "descs": len(local),
                       "bytes": nb * pair.layout.block_bytes * pair.layout.num_layers,
                       "post_s": post_s, "total_s": total_s}
                rows.append(row)
                log(f"[calibrate] WRITE {n} tokens {pattern}: {row['descs']} descs, "
                    f"{row['total_s'] * 1e3:.2f} ms")
    lat, per_byte, per_desc = nnls_fit([[1.0, r["bytes"], r["descs"]] for r in rows],
                                       [r["total_s"] for r in rows],
                                       [1.0 / r["total_s"] for r in rows])
    return ({"bandwidth_Bps": 1.0 / per_byte if per_byte > 0 else 1e12, "latency_s": lat,
             "post_base_s": 0.0, "post_per_desc_s": 0.0, "per_desc_s": per_desc,
             "setup_s": 1e-4}, rows)
