"""--kv-cache-memory is the total: the KV region and the dense decode cache fit inside it.

The split (kv_budget.py): a prefill instance, or one decoding with the paged decode
attention, gives the whole budget to blocks; an instance that decodes through the dense
cache gives it half by default (capped at what max_num_seqs x max_model_len positions
can use, and so that the region holds one request of max_model_len); an explicit
--decode-cache-memory is carved out of the budget.
"""

from __future__ import annotations

import pytest

from engine_helpers import make_engine
from kvpush.config import EngineConfig, KVTransferConfig, resolve_decode_attention
from kvpush.errors import ConfigError
from kvpush.kv_budget import DECODE_CACHE_SHARE, DecodeCacheSizing

MiB = 1 << 20


def _build(model, role="both", **kw):
    kw.setdefault("block_size", 16)
    kw.setdefault("max_model_len", 256)
    kvt = KVTransferConfig(role=role, engine_id=role) if role != "both" else None
    return EngineConfig.build(model, kv_transfer=kvt, **kw)


def _per_block(cfg: EngineConfig) -> int:
    return cfg.model.kv_bytes_per_token(cfg.cache.dtype) * cfg.cache.block_size


@pytest.mark.parametrize("role", ["both", "decode", "prefill"])
@pytest.mark.parametrize("budget", [1 * MiB, 3 * MiB + 12345, 64 * MiB])
@pytest.mark.parametrize("max_num_seqs", [1, 64])
def test_region_and_dense_cache_fit_the_budget(tiny_llama, role, budget, max_num_seqs):
    cfg = _build(tiny_llama, role, kv_cache_memory=budget, max_num_seqs=max_num_seqs)
    c = cfg.cache
    per_block = _per_block(cfg)
    assert c.num_blocks * per_block + c.decode_cache_bytes <= budget
    assert c.memory.region_bytes == c.num_blocks * per_block
    assert c.memory.total_bytes <= budget == c.memory.budget_bytes
    # nothing wasted but less than a block
    assert budget - c.memory.total_bytes < per_block
    if role == "prefill":
        assert c.decode_cache_bytes == 0 and c.memory.sizing is DecodeCacheSizing.NOT_USED
        assert c.num_blocks == budget // per_block
        return
    usable = max_num_seqs * 256 * cfg.model.kv_bytes_per_token(cfg.dtype)
    assert 0 < c.decode_cache_bytes <= min(int(budget * DECODE_CACHE_SHARE), usable)
    assert c.decode_cache_bytes in (int(budget * DECODE_CACHE_SHARE), usable,
                                    budget - 16 * per_block)  # 256 tokens: 16 blocks
    assert c.num_blocks >= 16


def test_engines_allocate_no_more_than_the_budget(tiny_llama):
    """What the runner allocates: the region's tensor and the dense cache's reserved
    storage (CPU, decoding roles), together within --kv-cache-memory."""
    budget = 2 * MiB
    for role in ("both", "decode", "prefill"):
        kvt = KVTransferConfig(role=role, engine_id=role) if role != "both" else None
        engine = make_engine(tiny_llama, num_blocks=None, kv_cache_memory=budget,
                             max_model_len=256, kv_transfer=kvt)
        runner = engine.runner
        region = runner.kv_region.kv
        storage = runner.decode_cache.storage
        reserved = 0 if storage is None else storage.numel() * storage.element_size()
        assert region.numel() * region.element_size() + runner.decode_cache.max_bytes \
            <= budget, role
        assert reserved <= runner.decode_cache.max_bytes
        assert (reserved > 0) == (role != "prefill"), role
        info = engine.kv_info().kv_memory
        assert info["budget_bytes"] == budget
        assert info["region_bytes"] + info["decode_cache_bytes"] <= budget
        assert info["decode_attention"] == "dense"


def test_explicit_decode_cache_memory_is_carved_out(tiny_llama):
    cfg = _build(tiny_llama, kv_cache_memory=4 * MiB, decode_cache_memory=3 * MiB)
    assert cfg.cache.decode_cache_bytes == 3 * MiB
    assert cfg.cache.num_blocks == MiB // _per_block(cfg)
    assert cfg.cache.memory.sizing is DecodeCacheSizing.EXPLICIT
    off = _build(tiny_llama, kv_cache_memory=4 * MiB, decode_cache_memory=0)
    assert off.cache.decode_cache_bytes == 0
    assert off.cache.num_blocks == 4 * MiB // _per_block(off)
    # what is left must hold one request of max_model_len (16 blocks here)
    per_block = _per_block(cfg)
    for dcm in (4 * MiB - 15 * per_block, 4 * MiB, 5 * MiB):
        with pytest.raises(ConfigError, match="decode-cache-memory"):
            _build(tiny_llama, kv_cache_memory=4 * MiB, decode_cache_memory=dcm)
    ok = _build(tiny_llama, kv_cache_memory=4 * MiB, decode_cache_memory=4 * MiB - 16 * per_block)
    assert ok.cache.num_blocks == 16
    # a prefill instance has no dense cache, whatever the flag says
    p = _build(tiny_llama, "prefill", kv_cache_memory=4 * MiB, decode_cache_memory=3 * MiB)
    assert p.cache.decode_cache_bytes == 0 and p.cache.num_blocks == 4 * MiB // per_block


def test_small_budget_shrinks_the_dense_cache_before_failing(tiny_llama):
    """A budget that holds one max_model_len request (and a little more) starts: the
    dense cache takes only what the region can spare; one that cannot hold the request
    is refused as before."""
    per_block = _per_block(_build(tiny_llama, num_blocks=16))
    cfg = _build(tiny_llama, kv_cache_memory=18 * per_block)
    assert cfg.cache.num_blocks == 16 and cfg.cache.decode_cache_bytes == 2 * per_block
    assert cfg.cache.memory.sizing is DecodeCacheSizing.MIN_BLOCKS
    with pytest.raises(ConfigError, match="cannot hold one request"):
        _build(tiny_llama, kv_cache_memory=15 * per_block)


def test_num_blocks_keeps_the_region_and_adds_the_dense_cache(tiny_llama):
    cfg = _build(tiny_llama, num_blocks=100)
    per_block = _per_block(cfg)
    assert cfg.cache.num_blocks == 100 and cfg.cache.memory.budget_bytes is None
    assert cfg.cache.decode_cache_bytes == 100 * per_block  # the region's size
    small = _build(tiny_llama, num_blocks=100, max_num_seqs=1)
    assert small.cache.decode_cache_bytes == 256 * small.model.kv_bytes_per_token(small.dtype)
    assert _build(tiny_llama, "prefill", num_blocks=100).cache.decode_cache_bytes == 0


def test_paged_decode_attention_gives_every_byte_to_blocks(tiny_llama):
    cfg = _build(tiny_llama, kv_cache_memory=4 * MiB, decode_attention="paged")
    assert cfg.cache.decode_attention == "paged" and cfg.cache.decode_cache_bytes == 0
    assert cfg.cache.num_blocks == 4 * MiB // _per_block(cfg)
    with pytest.raises(ConfigError, match="decode-attention"):
        _build(tiny_llama, kv_cache_memory=4 * MiB, decode_attention="paged",
               decode_cache_memory=MiB)
    with pytest.raises(ConfigError, match="decode-attention"):
        _build(tiny_llama, decode_attention="flash")


def test_auto_decode_attention_is_paged_on_cuda_only():
    assert resolve_decode_attention("auto", "cpu", None) == "dense"
    assert resolve_decode_attention("auto", "cuda", None) == "paged"
    assert resolve_decode_attention("auto", "cuda:1", 0) == "paged"
    # asking for a dense cache on CUDA keeps it
    assert resolve_decode_attention("auto", "cuda:0", 256 * MiB) == "dense"
    assert resolve_decode_attention("dense", "cuda:0", None) == "dense"
    assert resolve_decode_attention("paged", "cpu", 0) == "paged"


def test_serve_cli_passes_decode_attention(tiny_llama):
    import argparse

    from kvpush.server import cli as serve_cli

    p = argparse.ArgumentParser()
    serve_cli.add_serve_parser(p.add_subparsers())
    args = p.parse_args(["serve", str(tiny_llama), "--max-model-len", "256",
                         "--kv-cache-memory", "4MiB", "--decode-attention", "paged"])
    cfg = serve_cli.build_config(args)
    assert cfg.cache.decode_attention == "paged" and cfg.cache.decode_cache_bytes == 0
    assert p.parse_args(["serve", "m"]).decode_attention == "auto"
    with pytest.raises(SystemExit):
        p.parse_args(["serve", "m", "--decode-attention", "flash"])
