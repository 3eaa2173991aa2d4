"""BlockPool and KV layout: reference counts, prefix-cache lookup, LRU reuse, runs."""

from __future__ import annotations

import pytest

from kvpush.config import CacheConfig, ModelConfig
from kvpush.kv_cache.block_pool import (
    BlockPool,
    NoFreeBlocksError,
    hash_block_tokens,
    hash_prefix_blocks,
)
from kvpush.kv_cache.kv_region import KVRegion, block_runs


def test_allocate_free_refcounts():
    pool = BlockPool(8)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free == 5
    pool.touch(a[:2])
    pool.free(a)
    assert pool.num_free == 6  # a[0], a[1] still referenced once
    pool.free(a[:2])
    assert pool.num_free == 8
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(a[:1])
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(9)
    assert pool.num_free == 8  # all-or-nothing


def test_hash_chain_depends_on_prefix():
    h1 = hash_prefix_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(h1) == 2
    h2 = hash_prefix_blocks([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert h1[1] != h2[1]  # same tokens in block 2, different parent
    assert h1[0] == hash_block_tokens(None, [1, 2, 3, 4])


def test_lookup_reuse_and_lru_eviction():
    pool = BlockPool(4)
    hashes = hash_prefix_blocks(list(range(8)), 4)
    blocks = pool.allocate(2)
    for b, h in zip(blocks, hashes):
        pool.cache_full_block(b, h)
    pool.free(blocks)
    assert pool.num_free == 4  # cached blocks count as free
    assert pool.lookup(hashes) == blocks
    # allocation takes never-used blocks first (they head the LRU queue)...
    fresh = pool.allocate(2)
    assert not set(fresh) & set(blocks)
    assert pool.lookup(hashes) == blocks
    # ...then evicts the least recently freed cached block: the tail block of the
    # sequence was freed first, so the chain keeps its head
    pool.allocate(1)
    assert pool.lookup(hashes) == blocks[:1]
    pool.touch(pool.lookup(hashes))
    assert pool.num_free == 0


def test_prefix_caching_disabled_never_hits():
    pool = BlockPool(4, enable_prefix_caching=False)
    h = hash_prefix_blocks(list(range(4)), 4)
    b = pool.allocate(1)
    pool.cache_full_block(b[0], h[0])
    pool.free(b)
    assert pool.lookup(h) == []


def test_block_runs():
    assert block_runs([]) == []
    assert block_runs([3, 4, 5, 9, 10, 2]) == [(3, 3), (9, 2), (2, 1)]


def test_layer_major_layout_ranges(tiny_qwen3):
    import torch

    model = ModelConfig.from_dir(tiny_qwen3)
    region = KVRegion(model, CacheConfig(block_size=16, num_blocks=10, dtype=torch.float32))
    lay = region.layout
    assert lay.block_bytes == 2 * 16 * model.num_kv_heads * model.head_dim * 4
    assert region.nbytes == lay.layer_bytes * model.num_layers
    # one layer of blocks 3..5 is one contiguous range that is exactly kv[1, 3:6]
    off, length = lay.range_of(1, 3, 3)
    view = region.kv[1, 3:6]
    assert view.is_contiguous()
    assert view.data_ptr() - region.base_address == off
    assert view.numel() * view.element_size() == length
    with pytest.raises(IndexError):
        lay.range_of(0, 8, 3)


def test_shuffled_free_blocks_scatter_ids():
    plain = BlockPool(256).allocate(64)
    assert block_runs(plain) == [(plain[0], 64)]
    a = BlockPool(256, shuffle_seed=7).allocate(64)
    assert sorted(set(a)) == sorted(a) and all(0 <= b < 256 for b in a)
    assert a == BlockPool(256, shuffle_seed=7).allocate(64)  # same seed, same order
    assert a != BlockPool(256, shuffle_seed=8).allocate(64)
    assert len(block_runs(a)) > 40  # mostly runs of one block
    pool = BlockPool(256, shuffle_seed=7)
    pool.free(pool.allocate(256))
    assert pool.num_free == 256
