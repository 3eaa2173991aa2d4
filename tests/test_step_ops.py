"""The decode step's op-saving paths (issue 32, point 2): each one against the general
path it replaces.

* ``paged_attention`` writes K and V of every token with one indexed write into the
  region (and one into the dense decode cache): the region and the cache must hold
  exactly the step's K/V at the tokens' slots, and nothing elsewhere may change;
* the gather path's block tables and mask are built only when that path runs;
* a decode group whose slots all have the group's length runs SDPA without a mask:
  the same output as with the all-zero mask;
* small weights go to ``F.linear`` in every ``KVPUSH_LINEAR`` mode, untimed (the
  timed choice for larger ones: tests/test_linear_pick.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine_helpers import greedy, make_engine, run_to_completion
from kvpush.model.attention import build_metadata, paged_attention
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
