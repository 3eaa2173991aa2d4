"""The paged decode attention (model/paged_decode.py) against the other decode paths.

It reads the KV region through the block tables in chunks of block columns, merged by
an online softmax; it must give the gather path's and the dense cache's outputs (fp32
tolerance) for any chunking, and an engine decoding with it must match HF transformers
token for token under greedy sampling. It is the CUDA default; here it runs on CPU,
selected explicitly (``decode_attention="paged"``).
"""

from __future__ import annotations

import pytest
import torch

from engine_helpers import assert_all_blocks_free, greedy, hf_greedy, make_engine, run_to_completion
from kvpush.model import paged_decode
from kvpush.model.attention import AttentionMetadata, _decode_attention, build_metadata
from kvpush.model.paged_decode import paged_decode_attention
from test_engine_behaviour import random_prompts


def _reference(q, layer_kv, blocks_of, lens, scale):
    """Per request: its blocks concatenated, softmax attention in float64."""
    bs, hkv = layer_kv.shape[2], layer_kv.shape[3]
    group = q.shape[1] // hkv
    out = []
    for b, (blocks, n) in enumerate(zip(blocks_of, lens, strict=True)):
        kv = layer_kv[torch.tensor(blocks)].double()  # [nb, 2, bs, Hkv, D]
        k = kv[:, 0].flatten(0, 1)[:n].repeat_interleave(group, dim=1)  # [n, H, D]
        v = kv[:, 1].flatten(0, 1)[:n].repeat_interleave(group, dim=1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[b].double(), k) * scale, dim=-1)
        out.append(torch.einsum("hn,nhd->hd", w, v))
    assert bs > 0
    return torch.stack(out).float()


def _case(seed: int, B: int, hkv: int, group: int, bs: int, nb_region: int):
    g = torch.Generator().manual_seed(seed)
    D = 16
    layer_kv = torch.randn((nb_region, 2, bs, hkv, D), generator=g)
    lens = torch.randint(1, 9 * bs, (B,), generator=g).tolist()
    lens[0] = 1  # a request with only its own token
    perm = torch.randperm(nb_region, generator=g).tolist()  # scattered block ids
    blocks_of, used = [], 0
    for n in lens:
        nb = -(-n // bs)
        blocks_of.append(perm[used : used + nb])
        used += nb
    assert used <= nb_region
    q = torch.randn((B, hkv * group, D), generator=g)
    chunks = [(n - 1, 1, blocks) for n, blocks in zip(lens, blocks_of, strict=True)]
    md = build_metadata(chunks, bs, "cpu")
    md.build_gather_tables()  # built lazily by the step (attention.py); the kernel takes them
    return q, layer_kv, md, blocks_of, lens


@pytest.mark.parametrize("seed,B,hkv,group,bs", [
    (0, 1, 1, 1, 4), (1, 5, 2, 3, 8), (2, 7, 3, 1, 16), (3, 12, 1, 4, 2),
])
@pytest.mark.parametrize("columns", [1, 2, 3, None])  # block columns per chunk; None: one
def test_matches_the_gather_path_and_a_reference(seed, B, hkv, group, bs, columns):
    q, layer_kv, md, blocks_of, lens = _case(seed, B, hkv, group, bs, nb_region=B * 10)
    scale = 0.25
    per_column = 2 * B * bs * hkv * q.shape[-1] * layer_kv.element_size()
    chunk_bytes = paged_decode.CHUNK_BYTES if columns is None else columns * per_column
    if columns is not None:
        assert paged_decode.chunk_blocks(B, layer_kv, chunk_bytes) == columns
    got = paged_decode_attention(q, layer_kv, md.decode_tables, md.decode_mask, scale,
                                 chunk_bytes=chunk_bytes)
    gathered = _decode_attention(q, None, layer_kv, md, scale, None, hkv, group)
    torch.testing.assert_close(got, gathered, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, _reference(q, layer_kv, blocks_of, lens, scale),
                               rtol=1e-5, atol=1e-5)


def test_dispatched_from_paged_attention_when_the_metadata_asks(monkeypatch):
    """decode_paged on the metadata routes decode through the paged function (and a
    decode-cache metadata does not)."""
    q, layer_kv, md, _, _ = _case(4, 3, 2, 2, 8, nb_region=40)
    calls = []
    real = paged_decode_attention

    def spy(*a, **k):
        calls.append(a[2].shape)
        return real(*a, **k)

    import kvpush.model.attention as attention

    monkeypatch.setattr(attention, "paged_decode_attention", spy)
    plain = _decode_attention(q, None, layer_kv, md, 0.5, None, 2, 2)
    assert calls == []
    md.decode_paged = True
    paged = _decode_attention(q, None, layer_kv, md, 0.5, None, 2, 2)
    assert calls == [md.decode_tables.shape]
    torch.testing.assert_close(paged, plain, rtol=1e-5, atol=1e-5)
    assert isinstance(md, AttentionMetadata)


def test_bf16_region_against_the_gather_path():
    q, layer_kv, md, _, _ = _case(5, 6, 2, 2, 8, nb_region=60)
    kv16 = layer_kv.to(torch.bfloat16)
    got = paged_decode_attention(q, kv16, md.decode_tables, md.decode_mask, 0.3,
                                 chunk_bytes=1)  # one block column per chunk
    ref = _decode_attention(q, None, kv16, md, 0.3, None, 2, 2)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_decoding_paged_matches_hf_and_the_dense_cache(model_factory, monkeypatch, arch):
    """Greedy tokens of an engine decoding through the paged function (several chunks a
    step: CHUNK_BYTES made tiny) equal HF's and the dense-cache engine's; no dense cache
    is ever allocated; every block comes back."""
    model = model_factory(arch)
    monkeypatch.setattr(paged_decode, "CHUNK_BYTES", 1)  # one block column per chunk
    columns = []
    real = paged_decode.chunk_blocks
    monkeypatch.setattr(paged_decode, "chunk_blocks",
                        lambda *a: columns.append(real(*a)) or columns[-1])
    prompts = {f"r{i}": p for i, p in enumerate(random_prompts([5, 23, 40, 61], seed=8))}
    paged = make_engine(model, decode_attention="paged", max_model_len=256)
    assert paged.runner.paged_decode and paged.config.cache.decode_cache_bytes == 0
    got = run_to_completion(paged, prompts, greedy(24))
    assert columns and set(columns) == {1}  # it ran, one block column per chunk
    assert paged.runner.decode_cache.buf is None and paged.runner.decode_cache.storage is None
    assert_all_blocks_free(paged)
    dense = make_engine(model, max_model_len=256)
    assert not dense.runner.paged_decode
    assert got == run_to_completion(dense, prompts, greedy(24))
    for rid, p in prompts.items():
        assert got[rid] == hf_greedy(model, p, 24), rid


def test_paged_decode_in_mixed_steps_matches_the_dense_cache(tiny_llama, monkeypatch):
    """Requests arriving while others decode: steps mix prefill chunks with paged
    decodes (the decode rows scattered back into the batch); same tokens as the dense
    cache's engine, which sees the same steps."""
    from test_decode_cache import _staggered

    monkeypatch.setattr(paged_decode, "CHUNK_BYTES", 1)
    prompts = {f"r{i}": p for i, p in enumerate(random_prompts([12, 70, 33, 90, 7], seed=9))}
    paged = make_engine(tiny_llama, decode_attention="paged", max_model_len=256)
    got, shapes = _staggered(paged, prompts, every=2, max_tokens=20)
    assert shapes == []  # no dense buffer, ever
    assert_all_blocks_free(paged)
    dense = make_engine(tiny_llama, max_model_len=256)
    ref, dense_shapes = _staggered(dense, prompts, every=2, max_tokens=20)
    assert dense_shapes  # the reference did decode through its dense cache
    assert got == ref
