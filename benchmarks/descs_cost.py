"""What building a push WRITE's descriptors costs on the step loop (issue 37, point 2).

    PYTHONPATH=src .venv/bin/python benchmarks/descs_cost.py

Times ``layer_block_descs`` for one layer group of 8 blocks (a 128-token prompt at block
size 16) on the tiny model's shape (3 layers, one per WRITE) and SmolLM2's (30 layers,
10 per WRITE), remote blocks offset so no run merges across the two sides' ids.
"""

from __future__ import annotations

import timeit

from kvpush.kv_cache.kv_map import layer_block_descs
from kvpush.sim.loopback import kv_region, layout_of

SHAPES = {  # name: (layers, blocks, kv heads, head dim, dtype), layers per WRITE
    "tiny": ((3, 64, 2, 32, "float32"), 1),
    "smollm2-135m": ((30, 64, 3, 64, "float32"), 10),
}


def main(n: int = 2000) -> None:
    local, remote = list(range(8)), list(range(10, 18))
    for name, (shape, group) in SHAPES.items():
        layout = layout_of(kv_region(*shape))
        t = timeit.timeit(lambda layout=layout, group=group: layer_block_descs(
            0, layout, local, 1 << 30, layout, remote, range(group)), number=n) / n
        print(f"{name}: {t * 1e6:.1f} us per layer group ({group} layers, 8 blocks)")


if __name__ == "__main__":
    main()
