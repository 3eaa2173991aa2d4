"""The decode step's op-saving paths (issue 32, point 2): each one against the general
path it replaces.

* ``paged_attention`` writes K and V of every token with one indexed write into the
  region (and one into the dense decode cache): the region and the cache must hold
  exactly the step's K/V at the tokens' slots, and nothing elsewhere may change;
* the gather path's block tables and mask are built only when that path runs;
* a decode group whose slots all have the group's length runs SDPA without a mask:
  the same output as with the all-zero mask;
* small weights go to ``F.linear`` in every ``KVPUSH_LINEAR`` mode, untimed (the
  timed choice for larger ones: tests/test_linear_pick.py);
* prompt attention on a CPU runs at padded lengths (issue 67, point 5): the real rows
  equal attention at the unpadded length, and prompts of every length from 2 to 300
  meet a few dozen shapes, not 299.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine_helpers import greedy, make_engine, run_to_completion
from kvpush.model import attention
from kvpush.model.attention import build_metadata, paged_attention
from kvpush.model.shapes import padded_size
from test_engine_behaviour import random_prompts


def test_one_write_puts_k_and_v_at_every_tokens_slot():
    g = torch.Generator().manual_seed(0)
    nb, bs, hkv, d, h = 8, 4, 2, 8, 4
    region = torch.randn(nb, 2, bs, hkv, d, generator=g)
    before = region.clone()
    # a prefill chunk of 6 tokens at 0 and a continuation of 3 tokens at 5
    md = build_metadata([(0, 6, [3, 1]), (5, 3, [6, 2])], bs, "cpu")
    q = torch.randn(9, h, d, generator=g)
    kv_new = torch.randn(9, 2, hkv, d, generator=g)
    paged_attention(q, kv_new, region, md, d**-0.5)
    slots = [(3, p) for p in range(4)] + [(1, 0), (1, 1)] + [(2, 1), (2, 2), (2, 3)]
    for t, (blk, off) in enumerate(slots):
        assert torch.equal(region[blk, 0, off], kv_new[t, 0]), t
        assert torch.equal(region[blk, 1, off], kv_new[t, 1]), t
    touched = torch.zeros(nb, bs, dtype=torch.bool)
    for blk, off in slots:
        touched[blk, off] = True
    untouched = ~touched[:, None, :].expand(nb, 2, bs)
    assert torch.equal(region[untouched], before[untouched])


def test_gather_tables_are_built_only_on_the_gather_path():
    md = build_metadata([(9, 1, [5, 2, 7]), (3, 1, [4])], 4, "cpu")
    assert md.decode_tables is None and md.decode_mask is None
    md.build_gather_tables()
    assert md.decode_tables.tolist() == [[5, 2, 7], [4, 0, 0]]
    assert md.decode_mask.shape == (2, 1, 1, 12)
    assert torch.isinf(md.decode_mask[1, 0, 0, 4:]).all()
    assert (md.decode_mask[0, 0, 0, :10] == 0).all()
    assert torch.isinf(md.decode_mask[0, 0, 0, 10:]).all()


def test_uniform_decode_groups_run_without_a_mask_and_match_the_masked_result(tiny_llama):
    # same-length prompts decode in lockstep: one group, every slot at its length
    prompts = {f"r{i}": p for i, p in enumerate(random_prompts([20] * 3, seed=3))}
    engine = make_engine(tiny_llama)
    seen: list[list] = []
    cache = engine.runner.decode_cache
    prepare = cache.prepare

    def spy(md, *a, **kw):
        prepare(md, *a, **kw)
        if md.decode_cache is not None:
            seen.append(list(md.decode_group_masks))
    cache.prepare = spy
    got = run_to_completion(engine, prompts, greedy(12))
    assert seen and all(m == [None] for m in seen), seen[:3]

    # the same requests at mixed lengths need masks, and give the same tokens per prompt
    mixed = make_engine(tiny_llama)
    seen_mixed: list[list] = []
    mprep = mixed.runner.decode_cache.prepare

    def spy_mixed(md, *a, **kw):
        mprep(md, *a, **kw)
        if md.decode_cache is not None:
            seen_mixed.append(list(md.decode_group_masks))
    mixed.runner.decode_cache.prepare = spy_mixed
    extra = {"long": random_prompts([57], seed=9)[0]}
    ref = run_to_completion(mixed, {**prompts, **extra}, greedy(12))
    assert any(m != [None] for m in seen_mixed)
    for rid in prompts:
        assert got[rid] == ref[rid], rid


def test_small_weights_use_f_linear_untimed(tiny_llama, monkeypatch):
    # in every mode (linear_pick.py): the tiny model's weights are all under the bound
    for mode in ("auto", "onednn", "rows"):
        monkeypatch.setenv("KVPUSH_LINEAR", mode)
        model = make_engine(tiny_llama).runner.model
        assert all(f is F.linear for lin in model.layer_linears for f in lin), mode
        assert model.head_linear is F.linear
        assert model.linear_plan is not None and model.linear_plan.timed_series == 0


def _reference(q, k, v, start_pos, scale):
    """Causal attention of ``q`` ([n, H, D]) at positions start_pos.. over ``k``/``v``
    ([ctx, H, D]), unpadded, in float64."""
    n, ctx = q.shape[0], k.shape[0]
    w = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    q_pos = torch.arange(start_pos, start_pos + n)[:, None]
    w = w.masked_fill(torch.arange(ctx)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", w.softmax(-1), v.double())


def test_padded_prompt_attention_equals_the_unpadded_one():
    g = torch.Generator().manual_seed(1)
    bs, hkv, d = 4, 2, 8  # heads equal KV heads: no grouping in the reference
    # a fresh prompt of 11 tokens (padded to 12) and a chunk of 9 after 13 cached
    # tokens (queries padded to 10, context of 22 to 24)
    region = torch.zeros(16, 2, bs, hkv, d)
    md = build_metadata([(0, 11, [0, 1, 2]), (13, 9, [3, 4, 5, 6, 7, 8])], bs, "cpu")
    assert [s.padded for s in md.prefills] == [padded_size(11), padded_size(9)] == [12, 10]
    assert md.prefills[1].mask.shape == (10, padded_size(22)) == (10, 24)
    cached = torch.randn(13, 2, hkv, d, generator=g)
    for p in range(13):  # the cached context of the second request
        region[[3, 4, 5, 6][p // bs], :, p % bs] = cached[p]
    q = torch.randn(20, hkv, d, generator=g)
    kv_new = torch.randn(20, 2, hkv, d, generator=g)
    out = paged_attention(q, kv_new, region, md, d**-0.5)
    first = _reference(q[:11], kv_new[:11, 0], kv_new[:11, 1], 0, d**-0.5)
    ctx = torch.cat([cached, kv_new[11:]])
    second = _reference(q[11:], ctx[:, 0], ctx[:, 1], 13, d**-0.5)
    assert torch.allclose(out[:11].double(), first, atol=1e-5)
    assert torch.allclose(out[11:].double(), second, atol=1e-5)


def test_prompts_of_every_length_meet_few_attention_shapes(monkeypatch):
    shapes: set[tuple[int, ...]] = set()
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        shapes.add((*q.shape, *k.shape))
        return sdpa(q, k, v, **kw)
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    bs, hkv, d = 16, 1, 4
    region = torch.zeros(20, 2, bs, hkv, d)
    for n in range(2, 301):
        blocks = list(range(-(-n // bs)))
        md = build_metadata([(0, n, blocks)], bs, "cpu")
        paged_attention(torch.zeros(n, hkv, d), torch.zeros(n, 2, hkv, d), region, md, 1.0)
    assert len(shapes) == len({padded_size(n) for n in range(2, 301)}) <= 40
