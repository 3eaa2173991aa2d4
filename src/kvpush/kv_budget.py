"""How ``--kv-cache-memory`` is split between the KV region and the dense decode cache.

The budget is the total: the paged KV region (the blocks: prefix cache, transfers, the
source of truth) and the dense decode cache (``model.attention.DecodeKVCache``, a
contiguous copy of the decoding requests' KV that decode attention reads in place) both
fit inside it.

* An instance that never decodes (role ``prefill``), or that decodes with the paged
  decode attention (``model.paged_decode``, the default on CUDA), needs no dense cache:
  the whole budget goes to blocks.
* Otherwise the dense cache takes by default :data:`DECODE_CACHE_SHARE` of the budget,
  but never more than it can use (``max_num_seqs`` x ``max_model_len`` positions) and
  never so much that the region could not hold one request of ``max_model_len``; the
  region gets the rest. Half is the share at which the dense cache holds as many
  positions as the region (in the same dtype): every request the region holds can have
  its dense copy, which is the ratio the instance ran at before the budget counted both
  (the dense cache's default cap was the region's own size, on top of it).
* ``--decode-cache-memory`` overrides the share and is carved out of the budget; it is
  an error when what is left cannot hold one request of ``max_model_len``.
* With ``--num-blocks`` there is no budget: the region is exactly that many blocks and
  the dense cache defaults to the region's size (capped as above), on top of it.

:meth:`kvpush.config.EngineConfig.build` resolves the split with :func:`split_kv_memory`;
this module sits below the config (it imports only :mod:`kvpush.errors`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvpush.errors import ConfigError

#: share of --kv-cache-memory the dense decode cache takes by default (see above)
DECODE_CACHE_SHARE = 0.5


class DecodeCacheSizing(str, Enum):
    """Why the dense decode cache got the size it did (logged, and in /kv/info)."""

    SHARE = "share"  # the default share of the budget
    USABLE = "usable"  # capped at max_num_seqs x max_model_len positions
    MIN_BLOCKS = "min-blocks"  # capped so that the region holds one longest request
    EXPLICIT = "explicit"  # --decode-cache-memory
    REGION = "region-size"  # --num-blocks: as large as the region (capped)
    NOT_USED = "not-used"  # prefill role or paged decode attention: no dense cache


@dataclass(frozen=True)
class KVMemorySplit:
    """The resolved split, in bytes."""

    budget_bytes: int | None  # --kv-cache-memory (None: sized by --num-blocks)
    num_blocks: int
    block_bytes: int  # one block of every layer, K and V
    decode_cache_bytes: int  # the dense decode cache's cap (0: none)
    sizing: DecodeCacheSizing

    @property
    def region_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def total_bytes(self) -> int:
        return self.region_bytes + self.decode_cache_bytes

    def describe(self) -> str:
        mib = 1 << 20
        budget = ("no budget (--num-blocks)" if self.budget_bytes is None
                  else f"budget {self.budget_bytes / mib:.1f} MiB")
        return (f"KV memory: {budget}: region {self.region_bytes / mib:.1f} MiB "
                f"({self.num_blocks} blocks), dense decode cache "
                f"{self.decode_cache_bytes / mib:.1f} MiB ({self.sizing.value}), "
                f"total {self.total_bytes / mib:.1f} MiB")

    def as_dict(self) -> dict:
        return {"budget_bytes": self.budget_bytes, "region_bytes": self.region_bytes,
                "num_blocks": self.num_blocks,
                "decode_cache_bytes": self.decode_cache_bytes,
                "decode_cache_sizing": self.sizing.value}


def split_kv_memory(
    *,
    budget: int | None,
    num_blocks: int | None,
    block_bytes: int,
    min_blocks: int,
    dense_usable_bytes: int,
    dense: bool,
    decode_cache_memory: int | None,
) -> KVMemorySplit:
    """Resolve the split.

    ``block_bytes``: one block in the region; ``min_blocks``: the blocks of one request
    of max_model_len; ``dense_usable_bytes``: the most the dense cache can use
    (max_num_seqs x max_model_len positions); ``dense``: whether this instance decodes
    through the dense cache at all; ``decode_cache_memory``: the explicit override.
    Exactly one of ``budget`` and ``num_blocks`` is set."""
    if num_blocks is not None:
        if not dense:
            return KVMemorySplit(None, num_blocks, block_bytes, 0, DecodeCacheSizing.NOT_USED)
        if decode_cache_memory is not None:
            return KVMemorySplit(None, num_blocks, block_bytes, decode_cache_memory,
                                 DecodeCacheSizing.EXPLICIT)
        region = num_blocks * block_bytes
        sizing = DecodeCacheSizing.REGION if region <= dense_usable_bytes \
            else DecodeCacheSizing.USABLE
        return KVMemorySplit(None, num_blocks, block_bytes, min(region, dense_usable_bytes),
                             sizing)
    assert budget is not None
    if not dense:
        return KVMemorySplit(budget, budget // block_bytes, block_bytes, 0,
                             DecodeCacheSizing.NOT_USED)
    if decode_cache_memory is not None:
        blocks = (budget - decode_cache_memory) // block_bytes
        if decode_cache_memory > budget or blocks < min_blocks:
            raise ConfigError(
                f"--decode-cache-memory {decode_cache_memory} leaves "
                f"{max(0, budget - decode_cache_memory)} of --kv-cache-memory {budget} "
                f"bytes for KV blocks, less than one request of --max-model-len needs "
                f"({min_blocks} blocks of {block_bytes} bytes); lower it or raise "
                "--kv-cache-memory")
        return KVMemorySplit(budget, blocks, block_bytes, decode_cache_memory,
                             DecodeCacheSizing.EXPLICIT)
    candidates = [
        (int(budget * DECODE_CACHE_SHARE), DecodeCacheSizing.SHARE),
        (dense_usable_bytes, DecodeCacheSizing.USABLE),
        (max(0, budget - min_blocks * block_bytes), DecodeCacheSizing.MIN_BLOCKS),
    ]
    dense_bytes, sizing = min(candidates, key=lambda c: c[0])
    return KVMemorySplit(budget, (budget - dense_bytes) // block_bytes, block_bytes,
                         dense_bytes, sizing)
