"""The projections' matmul choice (model/linear_pick.py, issue 32): the timed table per
(weight shape, row bucket), its dispatch by row count, the ``KVPUSH_LINEAR`` overrides,
and a model whose table mixes both kernels giving the same greedy tokens as F.linear.

Timings are injected (a fake :data:`Timer`) wherever a choice is asserted, so the tests
do not depend on this host's speed; the real measurement is only checked for being
bounded and positive.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from engine_helpers import greedy, hf_greedy, make_engine, run_to_completion
from kvpush.model import linear_pick as lp
from kvpush.model.linear_pick import Kernel, LinearMode
from kvpush.model.shapes import padded_size
from test_engine_behaviour import random_prompts

MKL, DNN = Kernel.ATEN, Kernel.ONEDNN


def fake_timer(rule, calls=None):
    """A Timer from ``rule(kernel, shape, rows) -> seconds``, recording its calls."""
    def timer(kernel, w, rows):
        if calls is not None:
            calls.append((kernel, tuple(w.shape), rows))
        return rule(kernel, tuple(w.shape), rows)
    return timer


def refusing_timer(kernel, w, rows):
    raise AssertionError(f"timed {kernel} {tuple(w.shape)} at {rows} rows")


def test_the_faster_kernel_wins_per_shape_and_bucket_and_each_shape_is_timed_once():
    big_a = torch.randn(1024, 512)  # above SMALL_LINEAR_NUMEL
    big_b = torch.randn(600, 512)
    small = torch.randn(128, 256)  # at most SMALL_LINEAR_NUMEL: never timed
    assert big_b.numel() > lp.SMALL_LINEAR_NUMEL >= small.numel()

    def rule(kernel, shape, rows):
        if shape == (1024, 512):  # MKL faster at one row, oneDNN from 2 rows on
            return 1.0 if (kernel is MKL) == (rows == 1) else 2.0
        return 1.0 if (kernel is MKL) == (rows > 8) else 2.0  # the other way round

    calls: list = []
    weights = [big_a, small, big_b, torch.randn(1024, 512), small]
    plan = lp.plan_linears(weights, LinearMode.AUTO, True, fake_timer(rule, calls))
    assert plan.choices[(1024, 512)].kernels == (MKL, DNN, DNN, DNN)
    assert plan.choices[(600, 512)].kernels == (DNN, DNN, MKL, MKL)
    assert plan.choices[(128, 256)].kernels == (MKL, MKL, MKL, MKL)
    assert plan.choices[(128, 256)].timings == ()
    # two timed shapes x four buckets x two kernels, at the buckets' row counts
    assert len(calls) == 16 == plan.timed_series
    assert sorted({r for _, _, r in calls}) == list(lp.BUCKET_ROWS)
    assert {s for _, s, _ in calls} == {(1024, 512), (600, 512)}
    text = plan.describe()
    assert "1024x512 aten/onednn/onednn/onednn" in text and "128x256" in text


def test_a_tie_keeps_onednn():
    w = torch.randn(1024, 512)
    plan = lp.plan_linears([w], LinearMode.AUTO, True, fake_timer(lambda k, s, r: 1.0))
    assert plan.choices[(1024, 512)].kernels == (DNN,) * 4


@pytest.mark.parametrize(("mode", "expect"), [
    (LinearMode.ATEN, (MKL, MKL, MKL, MKL)),
    (LinearMode.ONEDNN, (DNN, DNN, DNN, DNN)),
    (LinearMode.ROWS, (MKL, DNN, DNN, DNN)),
])
def test_forced_modes_are_fixed_tables_without_timing(mode, expect):
    big, small = torch.randn(1024, 512), torch.randn(64, 64)
    plan = lp.plan_linears([big, small], mode, True, refusing_timer)
    assert plan.choices[(1024, 512)].kernels == expect
    assert plan.choices[(64, 64)].kernels == (MKL,) * 4  # small weights: F.linear always
    assert plan.timed_series == 0
    assert not lp.needs_timing([big, small], mode, True)


def test_without_onednn_everything_is_f_linear_and_nothing_is_timed():
    big = torch.randn(1024, 512)
    assert not lp.needs_timing([big], LinearMode.AUTO, False)
    plan = lp.plan_linears([big], LinearMode.AUTO, False, refusing_timer)
    assert plan.choices[(1024, 512)].kernels == (MKL,) * 4
    assert lp.needs_timing([big], LinearMode.AUTO, True)
    assert not lp.needs_timing([torch.randn(64, 64)], LinearMode.AUTO, True)


def test_mode_from_the_environment(monkeypatch):
    monkeypatch.delenv("KVPUSH_LINEAR", raising=False)
    assert lp.linear_mode() is LinearMode.AUTO
    monkeypatch.setenv("KVPUSH_LINEAR", " Rows ")
    assert lp.linear_mode() is LinearMode.ROWS
    for name in ("aten", "onednn", "auto", ""):
        assert lp.linear_mode(name) is LinearMode(name or "auto")
    monkeypatch.setenv("KVPUSH_LINEAR", "mkl")
    with pytest.raises(ValueError, match="KVPUSH_LINEAR='mkl'"):
        lp.linear_mode()


def test_dispatch_sends_each_row_count_to_its_buckets_kernel(monkeypatch):
    seen: list[tuple[str, int]] = []

    def recorder(name):
        def f(x, w, b=None):
            seen.append((name, x.shape[0]))
            return F.linear(x, w, b)
        return f

    monkeypatch.setitem(lp.KERNELS, MKL, recorder("aten"))
    monkeypatch.setitem(lp.KERNELS, DNN, recorder("onednn"))
    assert lp.dispatcher((DNN, DNN, DNN, DNN)) is lp.KERNELS[DNN]  # one kernel: no wrapper
    lin = lp.dispatcher((MKL, DNN, MKL, DNN))
    w, b = torch.randn(16, 8), torch.randn(16)
    for rows in (1, 2, 8, 9, 64, 65, 300):
        x = torch.randn(rows, 8)
        assert torch.allclose(lin(x, w, b), F.linear(x, w, b))
    assert seen == [("aten", 1), ("onednn", 2), ("onednn", 8), ("aten", 9), ("aten", 64),
                    ("onednn", 65), ("onednn", 300)]
    assert [lp.bucket_of(r) for r in (1, 2, 8, 9, 64, 65)] == [0, 1, 1, 2, 2, 3]


def test_real_timing_is_positive_and_large_buckets_time_a_bounded_slice():
    ws = [torch.randn(640, 512), torch.randn(640, 512)]
    for rows in (1, 128):
        a, o = lp.time_pair(ws, rows)
        assert 0 < a < 1 and 0 < o < 1 and math.isfinite(a + o)
    head = torch.empty(1, 576).expand(49152, 576)  # a SmolLM2-sized head, no memory
    assert lp.timed_weight(head, 8) is head  # bandwidth-bound: the whole weight
    part = lp.timed_weight(head, 128)
    assert part.shape[1] == 576 and 256 <= part.shape[0] < 49152
    assert part.shape[0] * 576 * 128 <= lp.MAX_TIMED_MACS


def test_a_model_with_a_mixed_table_decodes_the_same_tokens(tiny_llama, monkeypatch):
    """Every projection timed (the small-weight bound lowered), the fake timings making
    oneDNN win above one row: prefill and batched decode run oneDNN, single-row decode
    F.linear, and the greedy tokens equal the all-F.linear engine's and HF's."""
    prompts = {f"r{i}": p for i, p in enumerate(random_prompts([9, 30, 17], seed=5))}
    monkeypatch.setenv("KVPUSH_LINEAR", "aten")
    ref = run_to_completion(make_engine(tiny_llama), prompts, greedy(10))
    solo = run_to_completion(make_engine(tiny_llama), {"r0": prompts["r0"]}, greedy(10))
    monkeypatch.setenv("KVPUSH_LINEAR", "auto")
    monkeypatch.setattr(lp, "SMALL_LINEAR_NUMEL", 0)
    used: dict[Kernel, set[int]] = {MKL: set(), DNN: set()}

    def counting(kernel):
        real = lp.KERNELS[kernel]

        def f(x, w, b=None):
            used[kernel].add(x.shape[0])
            return real(x, w, b)
        return f

    monkeypatch.setitem(lp.KERNELS, MKL, counting(MKL))
    monkeypatch.setitem(lp.KERNELS, DNN, counting(DNN))
    engine = make_engine(tiny_llama)
    model = engine.runner.model
    if not model.onednn_ok:
        pytest.fail("oneDNN's fp32 linear is not usable on this CPU build")
    plan = model.tune_linears(fake_timer(lambda k, s, r: 1.0 if (k is MKL) == (r == 1) else 2.0))
    assert all(c.kernels == (MKL, DNN, DNN, DNN) for c in plan.choices.values())
    for rows in used.values():  # the build's real timings called both kernels
        rows.clear()
    got = run_to_completion(engine, prompts, greedy(10))
    assert got == ref
    assert used[DNN] and min(used[DNN]) > 1 and used[MKL] == set()  # 3 rows decode together
    assert run_to_completion(engine, {"r0": prompts["r0"]}, greedy(10)) == solo
    assert used[MKL] == {1}  # the lone request's decode steps
    assert solo["r0"] == hf_greedy(tiny_llama, prompts["r0"], 10)


def test_an_engine_built_off_the_step_thread_tunes_on_its_first_step(tiny_llama, monkeypatch):
    """``build_threads`` given (as AsyncEngine does): nothing is timed at build; the
    first forward times on the stepping thread (the real measurement, on the tiny
    model's weights) and the tokens equal F.linear's."""
    prompts = {"a": random_prompts([12], seed=2)[0]}
    monkeypatch.setenv("KVPUSH_LINEAR", "aten")
    ref = run_to_completion(make_engine(tiny_llama), prompts, greedy(6))
    monkeypatch.setenv("KVPUSH_LINEAR", "auto")
    monkeypatch.setattr(lp, "SMALL_LINEAR_NUMEL", 0)
    from kvpush.config import EngineConfig
    from kvpush.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig.build(tiny_llama, block_size=16, num_blocks=256,
                                          max_model_len=1024), build_threads=1)
    model = engine.runner.model
    assert model.onednn_ok and model.linear_plan is None
    assert run_to_completion(engine, prompts, greedy(6)) == ref
    plan = model.linear_plan
    assert plan is not None and plan.timed_series == 2 * 4 * len(plan.choices)
    assert plan.threads == torch.get_num_threads()
    assert all(len(c.timings) == 4 for c in plan.choices.values())


def test_timed_calls_walk_through_the_shapes_weights(monkeypatch):
    """Each call streams a different layer's weight than the call before it (as a step
    does), and both kernels see every layer's."""
    ws = [torch.randn(300, 1000) for _ in range(3)]
    index = {w.data_ptr(): i for i, w in enumerate(ws)}
    seen: list[tuple[Kernel, int]] = []

    def recorder(kernel):
        def f(x, w, b=None):
            seen.append((kernel, index[w.data_ptr()]))
            return F.linear(x, w, b)
        return f

    monkeypatch.setitem(lp.KERNELS, MKL, recorder(MKL))
    monkeypatch.setitem(lp.KERNELS, DNN, recorder(DNN))
    lp.time_pair(ws, 1)
    assert lp.MIN_REPS * 2 <= len(seen) <= (lp.MAX_REPS + lp.WARM_CALLS) * 2
    assert all(a[1] != b[1] for a, b in zip(seen, seen[1:]))
    assert {i for k, i in seen if k is MKL} == {i for k, i in seen if k is DNN} == {0, 1, 2}


def test_padded_rows_are_few_sizes_at_most_a_quarter_over():
    """oneDNN compiles and caches a kernel per row count (issue 67, point 5): the row
    counts it runs at are 36 sizes for every count from 1 to 1,024, none more than 25 %
    over the rows asked for, and each size maps to itself."""
    sizes = [padded_size(n) for n in range(1, 1025)]
    assert sizes[:8] == list(range(1, 9))
    assert all(n <= p <= 1.25 * n for n, p in zip(range(1, 1025), sizes, strict=True))
    assert sizes == sorted(sizes)
    assert len(set(sizes)) == 36
    assert all(padded_size(p) == p for p in set(sizes))
    assert [padded_size(n) for n in (9, 17, 33, 65, 129, 1025)] == [10, 20, 40, 80, 160, 1280]


def test_onednn_calls_run_on_padded_rows_and_give_the_unpadded_rows(monkeypatch):
    seen: list[int] = []

    def recorder(x, w, b=None):
        seen.append(x.shape[0])
        return F.linear(x, w, b)

    monkeypatch.setitem(lp.KERNELS, DNN, recorder)
    monkeypatch.setitem(lp.KERNELS, MKL, recorder)
    lin = lp.dispatcher((MKL, DNN, DNN, DNN), (False, True, True, True))
    w, b = torch.randn(16, 8), torch.randn(16)
    for rows in (1, 7, 9, 30, 65, 300):
        x = torch.randn(rows, 8)
        y = lin(x, w, b)
        assert y.shape == (rows, 16) and y.is_contiguous()
        torch.testing.assert_close(y, F.linear(x, w, b))
    assert seen == [1, 7, 10, 32, 80, 320]


def test_which_calls_run_on_onednn():
    """oneDNN's own linear always; F.linear when torch sends it there (bf16/fp16 on a
    CPU), not in fp32 (MKL)."""
    w32, w16 = torch.empty(4, 4), torch.empty(4, 4, dtype=torch.bfloat16)
    assert lp.on_onednn(DNN, w32) and not lp.on_onednn(MKL, w32)
    assert lp.on_onednn(MKL, w16) == torch.backends.mkldnn.is_available()


def test_a_bf16_engine_runs_its_projections_at_padded_row_counts_only(tiny_llama,
                                                                      monkeypatch):
    """The engine runs every padded row count once at start (compiled then, on the
    stepping thread); then prompts of many lengths, batched (a 395-token prefill step,
    then decode steps of 8 rows): every projection call reaches the kernel at a padded
    row count it ran at start, so oneDNN compiles nothing more however the steps' token
    counts vary; the greedy tokens equal those of unpadded calls."""
    prompts = {f"r{i}": p for i, p in
               enumerate(random_prompts([3, 9, 17, 30, 41, 66, 100, 129], seed=7))}
    monkeypatch.setenv("KVPUSH_LINEAR", "aten")
    rows: set[int] = set()
    real = F.linear

    def counting(x, w, b=None):
        rows.add(x.shape[0])
        return real(x, w, b)

    monkeypatch.setitem(lp.KERNELS, MKL, counting)
    engine = make_engine(tiny_llama, dtype="bfloat16", max_num_batched_tokens=512)
    if not lp.on_onednn(MKL, engine.runner.model.lm_head):
        pytest.skip("torch here has no oneDNN: bf16 F.linear runs on its own kernels")
    # built on this thread: every padded count up to 512 rows (logits: 64) already run
    assert rows == {padded_size(n) for n in range(1, 513)}
    compiled, rows = set(rows), set()
    got = run_to_completion(engine, prompts, greedy(6))
    assert rows and all(padded_size(n) == n for n in rows) and rows <= compiled
    monkeypatch.setattr(lp, "on_onednn", lambda k, w: False)
    assert run_to_completion(make_engine(tiny_llama, dtype="bfloat16"), prompts,
                             greedy(6)) == got
