"""KVRegion: the one KV-cache tensor of an instance, allocated once at start-up.

Layout (``layer-major``, role ``both``)::

    kv[layer, block, kv, token_in_block, kv_head, head_dim]      kv: 0 = K, 1 = V

so one layer of one block (its K then its V) is one contiguous range of
``block_bytes`` bytes, and one layer of a run of consecutive block ids is one range
too. A transfer of ``n`` consecutive blocks therefore costs one descriptor per layer,
whatever ``n`` is; fragmentation (non-consecutive ids) is what adds descriptors.

P/D instances (``head_major``) keep the heads outer within a block's K and V::

    storage[layer, block, kv, kv_head, token_in_block, head_dim]

so that any range of KV heads of one block's K (or V) is one contiguous range: a
prefill and a decode of different tensor parallelism move their head slices with one
descriptor per layer, block and K|V (``kv_map.py``). ``kv`` is always the view in the
first order (the attention code indexes it so); only the bytes' order differs.

The region is what the KV transport registers with NIXL; nothing reallocates it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpush.config import HEAD_MAJOR, LAYER_MAJOR, CacheConfig, ModelConfig, dtype_name

LAYOUT_NAME = LAYER_MAJOR


@dataclass(frozen=True)
class KVLayout:
    """Everything a peer needs to address this region: compared at handshake."""

    layout: str
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_bytes: int  # one layer of one block, K and V
    layer_bytes: int  # one layer of all blocks

    def range_of(self, layer: int, first_block: int, n_blocks: int) -> tuple[int, int]:
        """(byte offset from the region base, length) of one layer of a block run."""
        if not (0 <= layer < self.num_layers):
            raise IndexError(f"layer {layer} out of range")
        if first_block < 0 or n_blocks <= 0 or first_block + n_blocks > self.num_blocks:
            raise IndexError(f"blocks [{first_block}, +{n_blocks}) out of range")
        offset = layer * self.layer_bytes + first_block * self.block_bytes
        return offset, n_blocks * self.block_bytes


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """Coalesce block ids into runs of consecutive ids: [(first, count), ...]."""
    runs: list[tuple[int, int]] = []
    for bid in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == bid:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((bid, 1))
    return runs


class KVRegion:
    def __init__(self, model: ModelConfig, cache: CacheConfig, device: str = "cpu"):
        self.block_size = cache.block_size
        self.num_blocks = cache.num_blocks
        head_major = cache.kv_layout == HEAD_MAJOR
        inner = ((model.num_kv_heads, cache.block_size) if head_major
                 else (cache.block_size, model.num_kv_heads))
        self.storage = torch.zeros((model.num_layers, cache.num_blocks, 2, *inner,
                                    model.head_dim), dtype=cache.dtype.torch(), device=device)
        #: [layer, block, kv, token, kv_head, head_dim], a view of ``storage``
        self.kv = self.storage.transpose(3, 4) if head_major else self.storage
        elem = self.kv.element_size()
        block_bytes = 2 * cache.block_size * model.num_kv_heads * model.head_dim * elem
        self.layout = KVLayout(
            layout=cache.kv_layout,
            num_layers=model.num_layers,
            num_blocks=cache.num_blocks,
            block_size=cache.block_size,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            dtype=dtype_name(cache.dtype),
            block_bytes=block_bytes,
            layer_bytes=block_bytes * cache.num_blocks,
        )

    @property
    def base_address(self) -> int:
        return self.storage.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    def layer(self, i: int) -> torch.Tensor:
        """[num_blocks, 2, block_size, kv_heads, head_dim] view of one layer."""
        return self.kv[i]
