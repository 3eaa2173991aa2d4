"""Push's cost on the prefill instance's steps: the per-step and per-block figures, how
the probe's traces price them (kvpush.sim.push_step) and how the simulator charges them
(kvpush.sim.handoff.PushHandoff.push_step_extra)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("simpy")

from kvpush.sim.push_step import (  # noqa: E402
    ProbeLoad,
    excess_fit,
    push_step_cost,
    step_blocks,
    theil_sen,
)
from test_sim import BS, one, prof  # noqa: E402


class Flat:
    """Every prefill step modelled at 0.1 s."""

    def step_time(self, chunks):
        return 0.1


def test_step_blocks_counts_whole_blocks_and_the_prompts_last_partial_one():
    assert step_blocks([(128, 0, True)], 32) == 4
    assert step_blocks([(100, 0, True)], 32) == 4  # the partial 4th goes with the prompt
    assert step_blocks([(100, 0, False)], 32) == 3  # a chunk mid-prompt: whole blocks only
    assert step_blocks([(40, 20, False)], 32) == 1  # tokens 20-59 fill block 0
    assert step_blocks([(12, 20, True)], 32) == 1
    assert step_blocks([(64, 0)], 32) == 2  # no flag: ends its prompt
    assert step_blocks([(30, 64, False)], 32) == 0  # tokens 64-93: block 2 not yet full
    assert step_blocks([(128, 0, True), (50, 0, True), (32, 64, False)], 32) == 4 + 2 + 1


def test_theil_sen_ignores_one_outlier_and_is_flat_without_spread():
    pts = [(x, 2.0 + 0.5 * x) for x in range(1, 9)] + [(4, 40.0)]
    a, k = theil_sen(pts)
    assert a == pytest.approx(2.0) and k == pytest.approx(0.5)
    assert theil_sen([(3, 1.0), (3, 5.0), (3, 2.0)]) == (2.0, 0.0)


def test_excess_fit_recovers_per_step_and_per_block_over_pulls_line():
    """Pull's residual grows with the blocks (what the model misses in both modes); push's
    runs over it by 2 ms a step and 0.5 ms a block: both come back. Without a spread of
    blocks, the difference of medians is one per-step figure."""
    xs = [4, 4, 8, 12, 16, 20, 24, 28, 32]
    pull = [(x, 0.01 + 0.001 * x) for x in xs]
    push = [(x, 0.01 + 0.001 * x + 0.002 + 0.0005 * x) for x in xs] + [(16, 0.5)]
    s, b = excess_fit(pull, push)
    assert s == pytest.approx(0.002) and b == pytest.approx(0.0005)
    same = [(4, 0.010), (4, 0.011), (4, 0.012)]
    assert excess_fit(same, [(4, 0.015), (4, 0.017), (4, 0.016)]) == (pytest.approx(0.005), 0.0)
    # push no slower, or a negative slope: no per-block figure, never below 0
    assert excess_fit(pull, pull) == (0.0, 0.0)
    down = [(x, 0.01 + 0.001 * x + 0.01 - 0.0001 * x) for x in xs]
    s, b = excess_fit(pull, down)
    assert b == 0.0 and s == pytest.approx(0.01 - 0.0001 * 16)  # the median excess
    # steps that complete no block (a chunk inside one) do not switch the fit off
    zero = [(0, 0.0)] + [(x, 0.0005 * x) for x in (4, 8, 12)]
    assert excess_fit([(x, 0.0) for x, _ in zero], zero) == (0.0, pytest.approx(0.0005))
    # a steep line with a negative intercept: through the origin instead
    steep = [(x, 0.01 + 0.001 * x - 0.004 + 0.001 * x) for x in xs]
    s, b = excess_fit(pull, steep)
    assert s == 0.0 and b == pytest.approx(0.001 - 0.004 / 16)


def test_push_step_cost_is_push_residual_over_pull_residual():
    pre, dec = [[128, 0, True, False]], [[1, 128, True, True]]
    pull = [{"t": i, "dur": d, "chunks": pre} for i, d in enumerate((0.10, 0.11, 0.12))]
    push = [{"t": i, "dur": d, "chunks": pre} for i, d in enumerate((0.115, 0.118, 0.13))]
    decodes = [{"t": 9, "dur": 5.0, "chunks": dec}] * 5  # not prefill steps: ignored
    out = push_step_cost(pull + decodes, push + decodes, Flat(), [], [])  # D never busy
    assert out["push_prefill_step_s"] == pytest.approx(0.008)  # medians 0.118 - 0.110
    assert out["push_prefill_corun_step_s"] == 0.0  # no step started beside D
    assert out["push_prefill_block_s"] == out["push_prefill_corun_block_s"] == 0.0
    assert out["steps"] == {"D idle": {"pull": 3, "push": 3, "fitted": 3},
                            "beside D": {"pull": 0, "push": 0, "fitted": 0}}
    assert out["residual_s"] == {"D idle": [{"pull": 0.01, "push": 0.018}],
                                 "beside D": [None]}
    # push no slower: 0, never negative; too few steps on a side: 0
    assert push_step_cost(push, pull, Flat(), [], [])["push_prefill_step_s"] == 0.0
    assert push_step_cost(pull, push[:2], Flat(), [], [])["push_prefill_step_s"] == 0.0
    # with D's steps: P steps that started inside one are priced on their own
    d_busy = [{"t": i - 0.01, "dur": 0.05, "chunks": dec} for i in (3, 4, 5)]
    late = [{"t": i, "dur": d, "chunks": pre} for i, d in ((3, 0.12), (4, 0.12), (5, 0.13))]
    later = [{"t": i, "dur": d, "chunks": pre} for i, d in ((3, 0.14), (4, 0.15), (5, 0.15))]
    split = push_step_cost(pull + late, push + later, Flat(), d_busy, d_busy)
    assert split["push_prefill_step_s"] == pytest.approx(0.008)
    assert split["push_prefill_corun_step_s"] == pytest.approx(0.03)  # 0.15 - 0.12
    assert split["steps"] == {"D idle": {"pull": 3, "push": 3, "fitted": 3},
                              "beside D": {"pull": 3, "push": 3, "fitted": 3}}
    # every step the same blocks: with the block size, still one per-step figure
    same = push_step_cost(pull, push, Flat(), [], [], block_size=32)
    assert same["push_prefill_step_s"] == pytest.approx(0.008)
    assert same["push_prefill_block_s"] == 0.0 and same["blocks"]["D idle"] == [4, 4]


def test_push_step_cost_prices_blocks_where_steps_batch_prompts():
    """P's steps of 1-8 prompts of 128 tokens (4 blocks each): push's run 1 ms a step and
    0.25 ms a block longer than pull's beside a decoding D, nothing with D idle."""
    dec = [[1, 128, True, True]]
    d_busy = [{"t": 10 + i - 0.01, "dur": 0.05, "chunks": dec} for i in range(8)]
    pull, push = [], []
    for i in range(8):
        prompts = i + 1
        chunks = [[128, 0, True, False]] * prompts
        for t, beside in ((i, 0.0), (10 + i, 1.0)):
            pull.append({"t": t, "dur": 0.1 + 0.002 * prompts, "chunks": chunks})
            extra = beside * (0.001 + 0.00025 * 4 * prompts)
            push.append({"t": t, "dur": 0.1 + 0.002 * prompts + extra, "chunks": chunks})
    out = push_step_cost(pull, push, Flat(), d_busy, d_busy, block_size=32)
    assert out["push_prefill_corun_step_s"] == pytest.approx(0.001)
    assert out["push_prefill_corun_block_s"] == pytest.approx(0.00025)
    assert out["push_prefill_step_s"] == 0.0 and out["push_prefill_block_s"] == 0.0
    assert out["blocks"]["beside D"] == [4, 32]


def test_push_prefill_block_cost_charges_the_blocks_each_step_completes():
    """handoff.push_prefill_block_s is added per KV block a push prefill step completes
    for D: a 256-token prompt is 256 / BS blocks in one step, or half of them in each of
    two chunks; a decode-side prefix hit leaves only the block D lacks; pull and
    colocated do not move."""
    blocks = 256 // BS
    base, cost = prof(), prof(handoff__push_prefill_block_s=0.001)
    assert one("push", cost).ttft == pytest.approx(one("push", base).ttft + blocks * 0.001,
                                                   abs=1e-9)
    chunked = dict(instance__max_num_batched_tokens=128)
    both = prof(handoff__push_prefill_block_s=0.001, handoff__push_prefill_step_s=0.003,
                **chunked)
    assert one("push", both).ttft == pytest.approx(
        one("push", prof(**chunked)).ttft + blocks * 0.001 + 2 * 0.003, abs=1e-9)
    hit = dict(prefix_len=250, prefix_cached_on=("decode",))  # D holds 15 of 16 blocks
    assert one("push", cost, **hit).ttft == pytest.approx(
        one("push", base, **hit).ttft + 0.001, abs=1e-9)
    for mode in ("pull", "colocated"):
        assert one(mode, cost).ttft == pytest.approx(one(mode, base).ttft, abs=1e-12)
    with pytest.raises(Exception, match="push_prefill_corun_block_s: must be >= 0"):
        prof(handoff__push_prefill_corun_block_s=-0.001)


@pytest.mark.parametrize("kind, per_request", [("step", 0.02), ("block", 0.001 * (256 // BS))])
def test_push_prefill_corun_cost_applies_to_steps_beside_a_busy_decode(kind, per_request):
    """push_prefill_corun_step_s (per step) and push_prefill_corun_block_s (per block, a
    256-token prompt's 256 / BS) price a push prefill step that starts while D is
    mid-step; one that starts with D idle gets push_prefill_step_s / _block_s."""
    from kvpush.sim.cluster import ClusterConfig, simulate
    from kvpush.sim.workload import Stage, Workload

    value = 0.02 if kind == "step" else 0.001
    w = Workload(2, 2.0, 256, 200, seed=3)  # the 2nd prompt arrives while D decodes the 1st
    cfg = ClusterConfig("push")
    base = simulate(prof(), w, cfg).requests
    corun = simulate(prof(**{f"handoff__push_prefill_corun_{kind}_s": value}), w, cfg).requests
    idle = simulate(prof(**{f"handoff__push_prefill_{kind}_s": value}), w, cfg).requests
    assert base[1].arrival < base[0].token_times[-1]  # D busy when the 2nd arrives

    def prefill(r):  # P's one prefill step for the request
        return r.stages[Stage.PREFILL_DONE] - r.stages[Stage.PREFILL_STARTED]

    assert corun[0].ttft == pytest.approx(base[0].ttft, abs=1e-12)
    assert prefill(corun[1]) == pytest.approx(prefill(base[1]) + per_request, abs=1e-9)
    assert corun[1].ttft > base[1].ttft + per_request - 1e-9
    assert prefill(idle[0]) == pytest.approx(prefill(base[0]) + per_request, abs=1e-9)
    assert prefill(idle[1]) == pytest.approx(prefill(base[1]), abs=1e-9)


def test_push_block_cost_before_d_allocates_excludes_what_d_holds_then():
    """A push prefill step that starts before D has allocated (D's leg waits for D's
    step boundary while D decodes the 1st request) is priced on D's prefix cache as it is
    then: P, with no prefix cache, computes all 256 / BS blocks, and D, which holds the
    250-token shared prefix (a warm-up), lacks 1 of them: 1 block is charged."""
    from kvpush.sim.cluster import ClusterConfig, simulate
    from kvpush.sim.workload import Stage, Workload

    w = Workload(2, 2.0, 256, 200, seed=3, prefix_len=250, prefix_cached_on=("decode",))
    cfg = ClusterConfig("push", prefill_prefix_cache=False)
    base = simulate(prof(), w, cfg).requests
    cost = simulate(prof(handoff__push_prefill_corun_block_s=0.001), w, cfg).requests
    second = base[1].stages
    assert second[Stage.PREFILL_STARTED] < second[Stage.DECODE_ALLOCATED]  # the branch

    def prefill(r):
        return r.stages[Stage.PREFILL_DONE] - r.stages[Stage.PREFILL_STARTED]

    # P computed the whole prompt: a step over 256 tokens, not over the 6-token tail
    full = simulate(prof(), Workload(2, 2.0, 256, 200, seed=3), cfg).requests
    assert prefill(base[1]) == pytest.approx(prefill(full[1]), abs=1e-9)
    assert prefill(cost[1]) == pytest.approx(prefill(base[1]) + 0.001, abs=1e-9)


def test_push_step_probe_serves_both_pairs_and_stops_them(tiny_llama):
    """The pull / push pair probe on a tiny model: both pairs' prefill steps are
    measured after the warm-up turn, each load is recorded, and every process it
    started is gone."""
    pytest.importorskip("nixl._api", reason="push mode needs NIXL")
    import os

    from kvpush.cluster.launcher import descendant_pids
    from kvpush.sim.corun import PairSpec, serve_side_by_side
    from kvpush.sim.profile import engine_step_model
    from kvpush.sim.push_step import probe_push_step
    from test_sim import BASE

    before = set(descendant_pids(os.getpid()))
    engine = engine_step_model(BASE, "s")
    assert engine.step_time([(10, 0, True, False)]) == pytest.approx(0.010 + 10 * 0.001
                                                                      + 0.0005)
    logged: list[str] = []
    out = probe_push_step(str(tiny_llama), engine, 16, [ProbeLoad(20.0, 3, 2, 2)],
                          input_len=24, log=logged.append)
    # 3 prompts 50 ms apart on a tiny model: one prefill step each, 2 turns
    seen = {m: sum(side[m] for side in out["steps"].values()) for m in ("pull", "push")}
    assert seen["pull"] >= 3 and seen["push"] >= 3
    assert [ld["rate"] for ld in out["loads"]] == [20.0] and "started_utc" in out["loads"][0]
    stored = out["loads"][0]["traces"]  # kept for a later refit (reprice)
    assert len(stored["push_prefill"]) >= 3 and len(stored["pull_decode"]) >= 1
    assert "2 turns each" in logged[0]
    assert set(descendant_pids(os.getpid())) <= before
    with pytest.raises(ValueError, match="turns"):
        probe_push_step(str(tiny_llama), engine, 16, [ProbeLoad(2.0, 8, 0)])
    with pytest.raises(ValueError, match="distinct"):  # refused before anything starts
        serve_side_by_side(str(tiny_llama), [PairSpec("a", "pull"), PairSpec("a", "push")])
    assert set(descendant_pids(os.getpid())) <= before


def test_pooled_cost_takes_each_runs_push_over_its_own_pull():
    """Two loads run minutes apart: the second on a host 20 ms a step slower in both
    modes. Push runs 0.5 ms a block over pull in both; taken run by run and pooled, the
    figure comes back, the drift cancelling within each run."""
    from kvpush.sim.push_step import pooled_push_step_cost

    def run(t0, blocks_per_step, drift):
        pull, push = [], []
        for i, prompts in enumerate(blocks_per_step):
            chunks = [[128, 0, True, False]] * prompts
            for j in range(3):
                t = t0 + 10 * i + j
                pull.append({"t": t, "dur": 0.1 + drift + 0.001 * j, "chunks": chunks})
                push.append({"t": t, "dur": 0.1 + drift + 0.001 * j + 0.0005 * 4 * prompts,
                             "chunks": chunks})
        return pull, push, [], []

    light, loaded = run(0, [1, 1, 1], 0.0), run(1000, [2, 4, 6, 8], 0.02)
    out = pooled_push_step_cost([light, loaded], Flat(), 32)
    assert out["push_prefill_step_s"] == pytest.approx(0.0, abs=1e-9)
    assert out["push_prefill_block_s"] == pytest.approx(0.0005)
    assert out["steps"]["D idle"] == {"pull": 21, "push": 21, "fitted": 21}
    assert out["residual_s"]["D idle"][1]["pull"] == pytest.approx(0.021)  # per run
    # a run with too few steps on a side adds nothing; none at all: 0
    few = run(2000, [3], 0.0)
    short = pooled_push_step_cost([light, (few[0][:2], few[1][:2], [], [])], Flat(), 32)
    assert short["push_prefill_step_s"] == pytest.approx(0.002)  # the light run alone
    assert short["steps"]["D idle"] == {"pull": 11, "push": 11, "fitted": 9}
    assert short["residual_s"]["D idle"][1] is None
    assert pooled_push_step_cost([], Flat(), 32)["push_prefill_block_s"] == 0.0


def _loaded_run(t0=1000.0):
    """P's steps of 1-8 prompts (4 blocks each), push 0.5 ms a block over pull, D idle;
    times and durations on the 0.1 ms grid a profile's record keeps."""
    pull, push = [], []
    for i, prompts in enumerate([1, 2, 4, 6, 8] * 2):
        chunks = [[128, 0, True, False]] * prompts
        t = t0 + 10 * i
        pull.append({"t": t, "dur": 0.1 + 0.001 * (i % 3), "chunks": chunks})
        push.append({"t": t + 5, "dur": 0.1 + 0.001 * (i % 3) + 0.002 * prompts,
                     "chunks": chunks})
    return pull, push, [{"t": t0 - 100, "dur": 1.0, "chunks": []}], []


def test_stored_traces_reprice_to_the_same_figures():
    """A probe run packed into a profile's record and unpacked prices the same; reprice()
    fits every stored load together and each alone, and refuses a record without
    traces."""
    from kvpush.sim.push_step import pack_traces, pooled_push_step_cost, reprice, unpack_traces

    run = _loaded_run()
    packed = json.loads(json.dumps(pack_traces(run)))  # as a profile stores it
    assert packed["t0"] == 900.0 and packed["pull_decode"] == [[0.0, 1.0]]
    back = unpack_traces(packed)
    assert [st["t"] for st in back[1]] == pytest.approx([st["t"] for st in run[1]])
    direct = pooled_push_step_cost([run], Flat(), 32)
    assert pooled_push_step_cost([back], Flat(), 32) == direct
    assert direct["push_prefill_block_s"] == pytest.approx(0.0005)
    record = {"loads": [{"rate": 4.0, "traces": packed}, {"rate": 2.0, "traces": packed}]}
    out = reprice(record, Flat(), 32)
    assert out["push_prefill_block_s"] == pytest.approx(0.0005)
    assert [ld["rate"] for ld in out["loads"]] == [4.0, 2.0]
    assert out["loads"][1]["push_prefill_block_s"] == pytest.approx(0.0005)
    with pytest.raises(ValueError, match="no probe traces"):
        reprice({"loads": [{"rate": 2.0}]}, Flat(), 32)


def test_push_step_probe_script_reprices_a_profile_from_its_record(tmp_path, capsys):
    """benchmarks/push_step_probe.py --reprice serves nothing: it fits the figures from
    the stored traces into a copy of the profile; a pooled profile's calibrations are
    fitted one by one and averaged; a profile without traces is refused."""
    import sys
    from pathlib import Path

    from kvpush.sim.push_step import pack_traces
    from test_sim import BASE

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import push_step_probe

    # BASE's engine model prices each step higher than these durations; the modelled
    # time is the same in both modes, so push's excess over pull stays as built
    run = _loaded_run()
    data = json.loads(json.dumps(BASE))
    half = tuple([dict(st, dur=st["dur"] - 0.001 * len(st["chunks"])) for st in run[1]]
                 if k == 1 else run[k] for k in range(4))  # push 1 ms a prompt over
    data["measured"] = {"push_step": [{"started_utc": "a", "loads": [
        {"traces": pack_traces(run)}]}, {"started_utc": "b", "loads": [
            {"traces": pack_traces(half)}]}]}
    src, out = tmp_path / "p.json", tmp_path / "out.json"
    src.write_text(json.dumps(data))
    assert push_step_probe.main([str(src), "--out", str(out), "--reprice"]) == 0
    got = json.loads(out.read_text())
    per_block = 0.002 / (128 // BS)  # 2 ms a prompt over BASE's blocks of BS tokens
    assert got["handoff"]["push_prefill_block_s"] == pytest.approx(0.75 * per_block)
    assert got["handoff"]["push_prefill_corun_block_s"] == 0.0
    assert "refitted from the stored probe traces" in got["notes"][-1]
    assert [r["push_prefill_block_s"] for r in got["measured"]["push_step"]] == \
        pytest.approx([per_block, per_block / 2])
    del data["measured"]["push_step"]
    src.write_text(json.dumps(data))
    assert push_step_probe.main([str(src), "--out", str(out), "--reprice"]) == 2
    assert "no probe traces" in capsys.readouterr().err
