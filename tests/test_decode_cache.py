"""The dense decode cache's reserved storage (DecodeKVCache.reserve).

A CPU instance that decodes touches the cache's whole cap at start-up, and every buffer
shape after that is a view of the same storage: growing the batch past the buffer's
slots copies the kept entries, but allocates nothing. Outputs must not change: greedy
tokens against HF transformers and against the engine without the cache (gather path).
"""

from __future__ import annotations

from engine_helpers import greedy, hf_greedy, make_engine
from test_engine_behaviour import random_prompts


def _staggered(engine, prompts: dict[str, list[int]], every: int, max_tokens: int
               ) -> tuple[dict[str, list[int]], list[tuple[int, int]]]:
    """Add one prompt every ``every`` steps while the earlier ones decode (so the decode
    batch grows one request at a time, past the buffer's slots); step until done.
    Returns the outputs and each step's (decode-cache slots, length, data pointer)."""
    outs: dict[str, list[int]] = {rid: [] for rid in prompts}
    todo = list(prompts.items())
    shapes: list[tuple[int, int, int]] = []
    for step in range(5_000):
        if todo and step % every == 0:
            rid, p = todo.pop(0)
            engine.add_request(rid, p, greedy(max_tokens))
        if not todo and not engine.has_work():
            break
        for o in engine.step():
            outs[o.request_id].extend(o.new_token_ids)
        buf = engine.runner.decode_cache.buf
        if buf is not None:
            shapes.append((buf.shape[2], buf.shape[4], buf.data_ptr()))
    assert not engine.has_work()
    return outs, shapes


def test_growing_batch_reuses_the_reserved_storage(tiny_llama):
    # later prompts are longer, so the buffer's length (sized for the longest request)
    # must grow while earlier requests are still decoding and are carried over
    lens = [10 + 12 * i for i in range(12)]
    prompts = {f"r{i}": p for i, p in enumerate(random_prompts(lens, seed=5))}
    engine = make_engine(tiny_llama, max_num_seqs=32)
    cache = engine.runner.decode_cache
    assert cache.storage is not None  # role both on CPU: reserved at start-up
    assert cache.storage.numel() * cache.storage.element_size() <= cache.max_bytes
    base = cache.storage.data_ptr()
    got, shapes = _staggered(engine, prompts, every=3, max_tokens=40)

    assert len({(s, n) for s, n, _ in shapes}) >= 3, shapes  # it was reshaped
    assert {ptr for _, _, ptr in shapes} == {base}  # every shape a view of the storage
    for rid, p in prompts.items():
        assert got[rid] == hf_greedy(tiny_llama, p, 40), rid

    gather = make_engine(tiny_llama, max_num_seqs=32)
    gather.runner.decode_cache_bytes = 0  # no dense cache at all
    assert gather.runner.decode_cache.storage is None
    ref, _ = _staggered(gather, prompts, every=3, max_tokens=40)
    assert got == ref


def test_prefill_instances_reserve_nothing(tiny_llama):
    from kvpush.config import KVTransferConfig

    p = make_engine(tiny_llama, kv_transfer=KVTransferConfig(role="prefill", engine_id="p"))
    assert p.runner.decode_cache.storage is None
    d = make_engine(tiny_llama, kv_transfer=KVTransferConfig(role="decode", engine_id="d"))
    assert d.runner.decode_cache.storage is not None


def test_decode_cache_memory_sets_the_reserved_cap(tiny_llama):
    """--decode-cache-memory caps (and so reserves) the dense cache; 0 turns it off and
    decode gathers from the paged region; a negative size is refused."""
    import pytest

    from kvpush.config import EngineConfig
    from kvpush.errors import ConfigError

    small = make_engine(tiny_llama, decode_cache_memory=1 << 20)
    cache = small.runner.decode_cache
    assert cache.max_bytes == 1 << 20
    assert cache.storage.numel() * cache.storage.element_size() == 1 << 20
    off = make_engine(tiny_llama, decode_cache_memory=0)
    assert off.runner.decode_cache.max_bytes == 0
    assert off.runner.decode_cache.storage is None
    prompts = {f"r{i}": p for i, p in enumerate(random_prompts([30, 45], seed=3))}
    got, _ = _staggered(off, prompts, every=1, max_tokens=12)
    assert off.runner.decode_cache.buf is None  # never used
    for rid, p in prompts.items():
        assert got[rid] == hf_greedy(tiny_llama, p, 12)
    with pytest.raises(ConfigError, match="decode-cache-memory"):
        EngineConfig.build(tiny_llama, decode_cache_memory=-1)


def test_serve_cli_reads_decode_cache_memory():
    import argparse

    import pytest

    from kvpush.server import cli as serve_cli

    p = argparse.ArgumentParser()
    serve_cli.add_serve_parser(p.add_subparsers())
    for zero in ("0", "0MiB", "0.0"):
        assert p.parse_args(["serve", "m", "--decode-cache-memory", zero]).decode_cache_memory == 0
    got = p.parse_args(["serve", "m", "--decode-cache-memory", "256MiB"])
    assert got.decode_cache_memory == 256 << 20
    assert p.parse_args(["serve", "m"]).decode_cache_memory is None
    for bad in ("-5", "0.4", "lots"):
        with pytest.raises(SystemExit):
            p.parse_args(["serve", "m", "--decode-cache-memory", bad])


def test_reserve_is_bounded_by_what_the_cache_can_use(tiny_llama):
    """A cap above max_num_seqs x max_model_len positions reserves only those; setting
    the cap at run time (before serving) re-reserves, from 0 too."""
    engine = make_engine(tiny_llama, max_num_seqs=4, max_model_len=256,
                         decode_cache_memory=1 << 30)
    cache = engine.runner.decode_cache
    usable = 4 * 256 * cache._per_slot_pos
    assert cache.storage.numel() * cache.storage.element_size() == usable < 1 << 30
    engine.runner.decode_cache_bytes = 0
    assert cache.storage is None
    engine.runner.decode_cache_bytes = usable // 2
    assert cache.storage.numel() * cache.storage.element_size() == usable // 2
