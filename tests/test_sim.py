"""kvpush simulate: closed forms, stage sums, determinism, profiles, CLI, calibration."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path

import pytest

pytest.importorskip("simpy")

from kvpush.cli import main as cli_main  # noqa: E402
from kvpush.sim.cluster import ClusterConfig, simulate  # noqa: E402
from kvpush.sim.profile import ProfileError, load_profile, profile_from_dict  # noqa: E402
from kvpush.sim.workload import Stage, Workload  # noqa: E402

L, BS = 4, 16

BASE = {
    "name": "unit",
    "model": {"num_layers": L, "num_kv_heads": 2, "head_dim": 8, "hidden_size": 32,
              "num_heads": 4, "intermediate_size": 64, "vocab_size": 100,
              "kv_bytes_per_elem": 2},
    "step_models": {"s": {"kind": "linear", "base_s": 0.010, "per_token_s": 0.001,
                          "per_seq_s": 0.0005}},
    "roles": {"prefill": "s", "decode": "s", "colocated": "s"},
    "transfer": {"bandwidth_Bps": 1e8, "latency_s": 2e-4, "post_base_s": 1e-4,
                 "post_per_desc_s": 1e-5, "per_desc_s": 1e-6, "setup_s": 3e-4},
    "handoff": {"http_hop_s": 0.002, "client_hop_s": 0.001, "relay_s": 0.0007,
                "side_channel_s": 0.0003, "pull_post_on_step_loop": True},
    "instance": {"block_size": BS, "num_blocks": 10000, "max_num_batched_tokens": 4096,
                 "max_num_seqs": 64},
}


def prof(**changes):
    d = copy.deepcopy(BASE)
    for path, value in changes.items():
        node = d
        *head, last = path.split("__")
        for k in head:
            node = node[k]
        node[last] = value
    return profile_from_dict(d)


def one(mode: str, p, prompt: int = 256, out: int = 4, tail: str = "prefill", **w):
    r = simulate(p, Workload(1, 1.0, prompt, out, **w),
                 ClusterConfig(mode, prefix_hit_tail=tail))
    return r.requests[0]


# --------------------------------------------------------------------- closed forms
def test_md1_prefill_queue_matches_pollaczek_khinchine():
    """One instance serving one prompt per step of fixed length S (budget = one prompt,
    one output token) is an M/D/1 queue: mean wait W = rho * S / (2 (1 - rho)). At this
    length the estimate's run-to-run spread is about 3% (seeds 0-5: -3% .. +5%)."""
    service, rho, n = 0.1, 0.5, 20000
    p = prof(step_models={"s": {"kind": "linear", "base_s": service, "per_token_s": 0.0}},
             instance__max_num_batched_tokens=64)
    res = simulate(p, Workload(n, rho / service, 64, 1, seed=0),
                   ClusterConfig("colocated", 0, 1))
    waits = [r.stages[Stage.PREFILL_STARTED] - r.stages[Stage.PREFILL_RECEIVED]
             for r in res.requests[n // 10:]]  # drop the warm-up from an empty queue
    expected = rho * service / (2 * (1 - rho))
    assert sum(waits) / len(waits) == pytest.approx(expected, rel=0.05)
    busy = res.engines[0].busy_time / res.end_time
    assert busy == pytest.approx(rho, rel=0.05)


def _step(p, chunks):
    return p.step_model("prefill").step_time(chunks)


def test_single_request_colocated_ttft_is_sum_of_stages():
    p = prof()
    ho = p.handoff
    r = one("colocated", p)
    expected = ho.client_hop_s + ho.http_hop_s + _step(p, [(256, 0)]) + ho.http_hop_s \
        + ho.client_hop_s
    assert r.ttft == pytest.approx(expected, abs=1e-9)
    # later tokens: one decode step each
    assert r.tpot == pytest.approx(_step(p, [(1, 257)]), rel=0.01)


@pytest.mark.parametrize("on_step_loop", [True, False])
def test_single_request_pull_ttft_is_sum_of_stages(on_step_loop):
    p = prof(handoff__pull_post_on_step_loop=on_step_loop)
    ho, tr = p.handoff, p.transfer
    r = one("pull", p)
    blocks = 256 // BS
    descs = L  # contiguous: one descriptor per layer
    nbytes = blocks * BS * p.model.kv_bytes_per_token
    expected = (ho.client_hop_s + ho.http_hop_s            # client -> router -> P
                + _step(p, [(256, 0)])                       # P's prefill
                + ho.http_hop_s + ho.relay_s + ho.http_hop_s  # P -> router -> D
                + tr.setup_s + tr.post_time(descs)           # D sets up and posts the READ
                + tr.wire_time(nbytes, descs) + tr.latency_s  # the READ
                + _step(p, [(1, 255)])                       # D recomputes the last token
                + ho.http_hop_s + ho.client_hop_s)           # D -> router -> client
    assert r.ttft == pytest.approx(expected, abs=1e-9)
    assert r.descs == descs and r.transfer_bytes == nbytes
    st = r.stages
    assert st[Stage.PREFILL_DONE] < st[Stage.RELAYED] < st[Stage.DECODE_RECEIVED] \
        <= st[Stage.TRANSFER_POSTED] < st[Stage.TRANSFER_DONE] < st[Stage.FIRST_TOKEN]


@pytest.mark.parametrize("group", [1, 3, L])
def test_single_request_push_ttft_is_sum_of_stages(group):
    p = prof(handoff__push_layers_per_write=group)
    ho, tr = p.handoff, p.transfer
    r = one("push", p)
    per_layer_bytes = 256 * p.model.kv_bytes_per_token // L
    prefill = _step(p, [(256, 0)])
    # the last layer group is ready when the forward ends; its WRITE: post, wire, latency
    n = L - (L - 1) // group * group
    expected = (ho.client_hop_s + ho.http_hop_s + prefill + tr.post_time(n)
                + tr.wire_time(n * per_layer_bytes, n) + tr.latency_s
                + ho.side_channel_s                          # PushDone carries token #1
                + ho.http_hop_s + ho.client_hop_s)
    assert r.ttft == pytest.approx(expected, abs=1e-9)
    assert r.descs == L
    assert r.stages[Stage.REGISTERED] < r.stages[Stage.PREFILL_DONE]  # registered early
    assert Stage.RELAYED not in r.stages


def test_push_prefill_step_cost_lengthens_push_prefill_steps_only():
    """handoff.push_prefill_step_s (the pull / push pair probe's figure) is added to each
    prefill step of P that carries a push request it sends: a lone push request's TTFT
    grows by it once per prefill step (here 2 chunks); pull and colocated do not move."""
    base, cost = prof(), prof(handoff__push_prefill_step_s=0.007)
    assert cost.handoff.push_prefill_step_s == 0.007 and base.handoff.push_prefill_step_s == 0
    assert one("push", cost).ttft == pytest.approx(one("push", base).ttft + 0.007, abs=1e-9)
    chunked = dict(instance__max_num_batched_tokens=128)
    assert one("push", prof(handoff__push_prefill_step_s=0.007, **chunked)).ttft == \
        pytest.approx(one("push", prof(**chunked)).ttft + 2 * 0.007, abs=1e-9)
    for mode in ("pull", "colocated"):
        assert one(mode, cost).ttft == pytest.approx(one(mode, base).ttft, abs=1e-12)
    with pytest.raises(ProfileError, match="push_prefill_step_s: must be >= 0"):
        prof(handoff__push_prefill_step_s=-0.001)


@pytest.mark.parametrize("mode", ["colocated", "pull", "push"])
def test_measured_request_path_and_token_return_replace_the_estimated_hops(mode):
    """A profile with handoff.request_path_s / token_return_s (measured by the served
    probe) takes them for the client's way in and token #1's way out instead of the two
    hops each; the rest of the path is unchanged."""
    hops = one(mode, prof())
    ho = prof().handoff
    measured = one(mode, prof(handoff__request_path_s=0.0045, handoff__token_return_s=0.004))
    delta = (0.0045 - (ho.client_hop_s + ho.http_hop_s)) + (
        0.004 - (ho.http_hop_s + ho.client_hop_s))
    assert measured.ttft == pytest.approx(hops.ttft + delta, abs=1e-9)
    assert measured.tpot == pytest.approx(hops.tpot, abs=1e-9)  # every token shifts alike


def test_lone_paths_from_a_run_and_its_trace():
    from kvpush.sim.served import lone_paths

    run = {"start_wall": 1000.0, "start_times": [0.0, 2.0, 4.0, -1.0],
           "ttfts": [0.2, 0.25, 0.1, 0.0], "errors": ["", "", "HTTP 500: x", "never sent"]}
    arrivals = [999.5, 1000.004, 1002.005, 1004.003]  # a warm-up's, then one per send
    step_ends = [999.7, 1000.195, 1002.244, 1002.3]  # the last: after #1's first token
    ins, outs = lone_paths(run, arrivals, step_ends)
    assert ins == pytest.approx([0.004, 0.005]) and outs == pytest.approx([0.005, 0.006])
    assert lone_paths({**run, "start_wall": None}, arrivals, step_ends) == ([], [])


def test_push_decode_full_prefix_hit_tail_on_decode_skips_transfer_and_prefill():
    p = prof()
    r = one("push", p, prefix_len=250, prefix_cached_on=("decode",), tail="decode")
    assert r.full_hit and r.descs == 0
    ho = p.handoff
    # D computes the tail (256 - 240 cached tokens) itself
    expected = 2 * (ho.client_hop_s + ho.http_hop_s) + _step(p, [(16, 240)])
    assert r.ttft == pytest.approx(expected, abs=1e-9)
    pull = one("pull", p, prefix_len=250, prefix_cached_on=("decode",))
    assert pull.ttft > 2 * r.ttft  # pull still prefills and relays


def test_push_decode_full_prefix_hit_tail_on_prefill_pushes_only_the_tail_block():
    """kvpush's default: P computes the prompt (here it holds no prefix: all of it) and
    pushes only the block D lacks; D computes nothing before token #1."""
    p = prof()
    ho, tr = p.handoff, p.transfer
    r = one("push", p, prefix_len=250, prefix_cached_on=("decode",))
    assert not r.full_hit
    assert r.descs == L  # one block, one descriptor per layer
    tail_bytes = BS * p.model.kv_bytes_per_token // L
    expected = (ho.client_hop_s + ho.http_hop_s + _step(p, [(256, 0)]) + tr.post_time(1)
                + tr.wire_time(tail_bytes, 1) + tr.latency_s + ho.side_channel_s
                + ho.http_hop_s + ho.client_hop_s)
    assert r.ttft == pytest.approx(expected, abs=1e-9)
    # with the prefix cached on P as well, P computes only the tail
    both = one("push", p, prefix_len=250, prefix_cached_on=("decode", "prefill"))
    assert both.ttft < r.ttft - 0.5 * _step(p, [(256, 0)])


def test_fragmentation_raises_descriptors_and_pull_tpot_on_step_loop():
    gpu = load_profile("h200-tp8-qwen3-32b")
    w = Workload(60, 4.0, 2048, 64, seed=1)
    out = {}
    for mode in ("pull", "push"):
        for frag in (0.0, 1.0):
            out[mode, frag] = simulate(gpu, w, ClusterConfig(mode, fragmentation=frag)).summary()
    assert out["pull", 1.0]["mean_descs"] > 50 * out["pull", 0.0]["mean_descs"]
    # fragmented posts stall pull's decode step loop; push posts on P's writer thread
    assert out["pull", 1.0]["mean_tpot_ms"] > 1.05 * out["pull", 0.0]["mean_tpot_ms"]
    assert out["push", 1.0]["mean_tpot_ms"] == pytest.approx(out["push", 0.0]["mean_tpot_ms"],
                                                             rel=0.02)
    assert out["push", 0.0]["median_ttft_ms"] < out["pull", 0.0]["median_ttft_ms"]


def test_block_capacity_preempts_and_still_finishes():
    p = prof(instance__num_blocks=40)  # 640 tokens: two requests of 256 in + 100 out overflow
    res = simulate(p, Workload(6, math.inf, 256, 100), ClusterConfig("colocated", 0, 1))
    assert all(r.done for r in res.requests)
    assert res.engines[0].preemptions > 0
    assert res.engines[0].free_blocks == 40


# -------------------------------------------------------------------- determinism
@pytest.mark.parametrize("mode", ["colocated", "pull", "push"])
def test_deterministic_for_a_seed(mode):
    p = prof()
    cfg = ClusterConfig(mode, 1, 1)

    def run(seed):
        return [r.token_times for r in simulate(p, Workload(40, 8.0, 200, 8, seed=seed),
                                                cfg).requests]

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_deterministic_across_processes():
    """The same run in two fresh interpreters gives the same token times: nothing may
    depend on object addresses or hash order (an id-keyed set once did)."""
    import os
    import subprocess
    import sys

    code = ("import json; from test_sim import prof;"
            "from kvpush.sim.cluster import ClusterConfig, simulate;"
            "from kvpush.sim.workload import Workload;"
            "p = prof(step_models__s__per_fill_s=2e-5);"  # first decodes cost more
            "out = {m: [r.token_times for r in simulate(p, Workload(200, 30.0, 200, 6,"
            " seed=3, prefix_len=96, prefix_cached_on=('decode',)), ClusterConfig(m, 1, 1)"
            ").requests] for m in ('colocated', 'pull', 'push')};"
            "print(json.dumps(out))")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120, check=True, env=env).stdout for _ in range(3)]
    assert runs[0] and runs[0] == runs[1] == runs[2]


def test_arrivals_are_the_bench_generators():
    from kvpush.bench.client import arrival_offsets

    w = Workload(7, 2.0, 10, 2, seed=1000)
    assert w.arrivals() == arrival_offsets(7, 2.0, 1000)


# ----------------------------------------------------------------------- profiles
@pytest.mark.parametrize("change,needle", [
    ({"transfer": None}, "transfer"),
    ({"step_models": {"s": {"kind": "cubic"}}}, "kind"),
    ({"step_models": {"s": {"kind": "linear", "base_s": -1, "per_token_s": 0}}}, "base_s"),
    ({"roles": {"prefill": "s", "decode": "nope", "colocated": "s"}}, "roles.decode"),
    ({"instance": {"block_size": 16}}, "num_blocks"),
    ({"model": {"num_layers": "many"}}, "num_layers"),
    ({"handoff": {**BASE["handoff"], "push_layers_per_write": 0}}, "push_layers_per_write"),
    ({"handoff": {**BASE["handoff"], "push_layers_per_write": 2.5}}, "push_layers_per_write"),
])
def test_profile_errors_name_the_field(change, needle):
    d = copy.deepcopy(BASE)
    for k, v in change.items():
        if v is None:
            del d[k]
        else:
            d[k] = v
    with pytest.raises(ProfileError, match=needle):
        profile_from_dict(d, "x.json")


def test_scaled_profile_scales_step_times():
    p = prof()
    s = p.scaled(2.5)
    assert s.step_model("decode").step_time([(10, 5)]) == pytest.approx(
        2.5 * p.step_model("decode").step_time([(10, 5)]))
    with pytest.raises(ProfileError, match="scale"):
        p.scaled(0)
    # one step model only: the other keeps its times, and its arrival cost
    two = prof(step_models__t={"kind": "linear", "base_s": 0.02, "per_token_s": 0.002},
               host={"corun_slowdown": 1.0, "arrival_step_s": {"s": 0.004, "t": 0.003}})
    one_model = two.scaled(2.0, "t")
    assert one_model.step_models["t"].step_time([(10, 5)]) == pytest.approx(
        2.0 * two.step_models["t"].step_time([(10, 5)]))
    assert one_model.step_models["s"] is two.step_models["s"]
    assert one_model.arrival_step_s == pytest.approx({"s": 0.004, "t": 0.006})
    assert two.scaled(0.5).arrival_step_s == pytest.approx({"s": 0.002, "t": 0.0015})
    with pytest.raises(ProfileError, match="no step model"):
        two.scaled(2.0, "threads=99")


def test_profile_file_errors(tmp_path):
    with pytest.raises(ProfileError, match="no profile"):
        load_profile(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(bad)
    good = tmp_path / "good.json"
    good.write_text(json.dumps(BASE))
    assert load_profile(good).name == "unit"


def test_builtin_gpu_profiles_have_sources():
    from kvpush.sim.profile import builtin_profiles

    names = builtin_profiles()
    assert "h200-tp8-qwen3-32b" in names
    for n in names:
        p = load_profile(n)
        assert p.sources and p.notes
        assert p.model.kv_bytes_per_token == 64 * 8 * 128 * 2 * 2


# ----------------------------------------------------------- step model and mixed steps
GEMM = {"kind": "linear", "base_s": 0.010, "per_token_s": 0.0001, "per_seq_s": 0.0005,
        # 1 row: GEMV; 2+ rows: GEMM at about twice the cost, then ~0.5 ms per row
        "token_rows_s": [[1, 0.006], [2, 0.012], [4, 0.013], [64, 0.043]],
        "sample_rows_s": [[1, 0.003], [2, 0.006], [8, 0.007]]}


def test_row_tables_interpolate_and_extend():
    from kvpush.sim.step_models import interp

    t = ((1.0, 0.006), (2.0, 0.012), (4.0, 0.013), (64.0, 0.043))
    assert interp(t, 0) == 0.0
    assert interp(t, 1) == pytest.approx(0.006)
    assert interp(t, 3) == pytest.approx(0.0125)
    assert interp(t, 34) == pytest.approx(0.028)
    assert interp(t, 124) == pytest.approx(0.073)  # the last segment's slope
    assert interp(((4.0, 0.008),), 2) == pytest.approx(0.004)  # pro rata below the first
    assert interp((), 10) == 0.0


def test_tabled_step_model_decode_batch_of_two_costs_a_gemm():
    m = prof(step_models={"s": GEMM}).step_model("decode")
    one_row = m.step_time([(1, 100)])
    two_rows = m.step_time([(1, 100), (1, 100)])
    three_rows = m.step_time([(1, 100), (1, 100), (1, 100)])
    assert one_row == pytest.approx(0.010 + 0.0001 + 0.0005 + 0.006 + 0.003)
    # 1 -> 2 rows: GEMV -> GEMM (+6 ms projections, +3 ms LM head); 2 -> 3 adds little
    assert two_rows - one_row == pytest.approx(0.0001 + 0.0005 + 0.006 + 0.003)
    assert three_rows - two_rows == pytest.approx(0.0001 + 0.0005 + 0.0005 + 0.001 / 6)
    # a prefill chunk that does not end its prompt samples nothing: no LM head
    assert m.step_time([(64, 0, False)]) == pytest.approx(0.010 + 0.0064 + 0.0005 + 0.043)
    assert m.step_time([(64, 0, True)]) - m.step_time([(64, 0, False)]) == pytest.approx(0.003)


def test_first_decode_fills_the_dense_decode_cache():
    """kvpush copies a request's context into DecodeKVCache the first step it decodes
    (after its prefill, or after its KV arrived on D); later decodes only append."""
    fill = dict(GEMM, per_fill_s=1e-5)
    p = prof(step_models={"s": fill})
    m = p.step_model("decode")
    assert m.step_time([(1, 512, True, False)]) - m.step_time([(1, 512, True, True)]) == \
        pytest.approx(512e-5)
    assert m.step_time([(1, 512)]) == m.step_time([(1, 512, True, True)])  # default: no fill
    res, steps = _colocated_steps(p, Workload(1, 1.0, 256, 4))
    assert [c for c, _, _ in steps] == [[(256, 0, True, False)], [(1, 256, True, False)],
                                        [(1, 257, True, True)], [(1, 258, True, True)]]
    r = res.requests[0]
    gaps = [y - x for x, y in zip(r.token_times, r.token_times[1:])]
    assert gaps[0] - gaps[1] == pytest.approx(256e-5, abs=1e-6)


def test_fit_recovers_the_step_model_it_was_sampled_from():
    from kvpush.sim.step_fit import FIT_FIELDS, fit_linear
    from kvpush.sim.step_models import LinearStepModel

    truth = LinearStepModel(base_s=0.01, per_token_s=1e-4, per_attn_s=1e-6, per_seq_s=5e-4,
                            per_ctx_s=3e-6, per_fill_s=1e-5)
    shapes = [[(n, 0)] for n in (32, 128, 512, 1024)]
    shapes += [[(n, c)] for n, c in ((32, 96), (128, 384), (512, 512), (32, 992))]
    shapes += [[(128, 0)] * 8, [(256, 0)] * 4, [(32, 992)] * 15, [(32, 480)] * 4]
    shapes += [[(1, c, True, True)] * b for b, c in ((1, 128), (4, 128), (16, 128),
                                                      (8, 1024))]
    shapes += [[(1, 1024, True, False)] * 8, [(1, 130, True, True)] * 2 + [(512, 0)]]
    model, fit = fit_linear([(ch, truth.step_time(ch)) for ch in shapes])
    assert fit["max_rel_err"] < 1e-6
    for name in FIT_FIELDS:
        assert getattr(model, name) == pytest.approx(getattr(truth, name), rel=1e-4,
                                                     abs=1e-12), name


def test_fit_table_scale_takes_back_a_table_timed_above_the_steps(tmp_path, capsys):
    """The projections' table timed 40% above what the engine's steps spend on those
    matmuls: the plain fit cannot take it back (its per-token term clamps at 0 and the
    prefills are priced high), the fit with the table's level recovers the steps exactly
    and the level (1 / 1.4); a profile carries it, and refit --fit-table-scale writes it."""
    from kvpush.sim.step_fit import fit_linear
    from kvpush.sim.step_models import LinearStepModel

    table = ((1.0, 0.006), (2.0, 0.012), (4.0, 0.013), (64.0, 0.043), (1024.0, 0.6))
    truth = LinearStepModel(base_s=0.01, per_token_s=2e-5, per_attn_s=1e-7, per_seq_s=5e-4,
                            per_ctx_s=3e-6, per_fill_s=1e-5, token_rows_s=table)
    timed = {"token_rows_s": [[r, 1.4 * t] for r, t in table]}
    shapes = [[(n, 0)] for n in (32, 128, 512, 1024)] + [[(128, 0)] * 8, [(32, 992)] * 15]
    shapes += [[(n, c)] for n, c in ((32, 96), (128, 384), (512, 512))]
    shapes += [[(1, c, True, True)] * b for b, c in ((1, 128), (4, 128), (16, 1024))]
    shapes += [[(1, 1024, True, False)] * 8]
    samples = [(ch, truth.step_time(ch)) for ch in shapes]
    plain, plain_fit = fit_linear(samples, timed)
    assert plain.per_token_s == 0.0 and plain_fit["max_rel_err"] > 0.1
    assert plain.step_time([(128, 0)]) > 1.1 * truth.step_time([(128, 0)])
    model, fit = fit_linear(samples, timed, fit_table_scale=True)
    assert fit["max_rel_err"] < 1e-6
    assert model.token_rows_scale == pytest.approx(1 / 1.4, rel=1e-4)
    assert model.per_token_s == pytest.approx(2e-5, rel=1e-3)
    # without a table there is no level to fit: the plain fit
    alone, _ = fit_linear(samples, None, fit_table_scale=True)
    assert alone.token_rows_scale == 1.0 and alone == fit_linear(samples)[0]
    # the profile and refit
    d = copy.deepcopy(BASE)
    d["step_models"]["s"]["token_rows_s"] = timed["token_rows_s"]
    d["measured"] = {"step_samples": {"s": [[[list(c) for c in ch], dt] for ch, dt in samples]}}
    src, out = tmp_path / "old.json", tmp_path / "new.json"
    src.write_text(json.dumps(d))
    assert cli_main(["simulate", "refit", str(src), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["step_models"]["s"]["token_rows_scale"] == 1.0
    assert cli_main(["simulate", "refit", str(src), "--fit-table-scale", "--out",
                     str(out)]) == 0
    new = json.loads(out.read_text())["step_models"]["s"]
    assert new["token_rows_scale"] == pytest.approx(1 / 1.4, rel=1e-4)
    assert new["token_rows_s"] == timed["token_rows_s"]  # the table kept as timed
    got = load_profile(out).step_models["s"]
    for ch in ([(128, 0)], [(1, 512, True, True)] * 4):
        assert got.step_time(ch) == pytest.approx(truth.step_time(ch), rel=1e-4)
    assert "dropped the projections' table" not in capsys.readouterr().out
    # steps that take less the more the table prices them: the level clamps at 0 and
    # refit says the model lost the table's 1-row / 2-row shape
    linear = LinearStepModel(base_s=0.5, per_token_s=2e-5, per_seq_s=5e-4, per_ctx_s=3e-6)
    shape_only = LinearStepModel(0.0, 0.0, token_rows_s=table)
    d["measured"]["step_samples"]["s"] = [
        [[list(c) for c in ch], linear.step_time(ch) - 0.5 * shape_only.tabled_time(ch)]
        for ch in shapes]
    src.write_text(json.dumps(d))
    assert cli_main(["simulate", "refit", str(src), "--fit-table-scale", "--out",
                     str(out)]) == 0
    assert json.loads(out.read_text())["step_models"]["s"]["token_rows_scale"] == 0.0
    assert "warning: s: the fit dropped the projections' table (level 0)" in \
        capsys.readouterr().out


def test_pass_levels_tell_a_host_that_slowed_between_passes():
    """Two passes over the same shapes, the second 20% slower: the fit sits between
    them, each pass's level says how fast it ran, and the spread draws a warning."""
    from kvpush.sim.step_fit import fit_linear, pass_levels, pass_warning
    from kvpush.sim.step_models import LinearStepModel

    truth = LinearStepModel(base_s=0.01, per_token_s=1e-4, per_attn_s=1e-6, per_seq_s=5e-4,
                            per_ctx_s=3e-6, per_fill_s=1e-5)
    shapes = [[(n, 0)] for n in (32, 128, 512, 1024)] + [
        [(1, c, True, True)] * b for b, c in ((1, 128), (4, 128), (16, 128), (8, 1024))]
    slow = [(ch, truth.step_time(ch)) for ch in shapes] + [
        (ch, 1.2 * truth.step_time(ch)) for ch in shapes]
    model, _ = fit_linear(slow)
    first, second = pass_levels(slow, model, 2)
    assert first < 1.0 < second
    assert second / first == pytest.approx(1.2, rel=0.02)
    assert "20% apart" in pass_warning("threads=2", [first, second])
    steady = [(ch, truth.step_time(ch)) for ch in shapes] * 2
    model, _ = fit_linear(steady)
    assert pass_levels(steady, model, 2) == pytest.approx([1.0, 1.0], abs=1e-4)
    assert pass_warning("threads=2", pass_levels(steady, model, 2)) is None
    assert pass_warning("threads=1", [1.0]) is None and pass_levels(steady, model, 0) == []


def test_refit_fits_again_and_reprices_the_probe_trace(tmp_path):
    """kvpush simulate refit: the step model from the recorded samples, the served
    factors from the recorded probe steps against that new fit."""
    from kvpush.sim.step_models import LinearStepModel

    truth = LinearStepModel(base_s=0.01, per_token_s=1e-4, per_attn_s=1e-6, per_seq_s=5e-4,
                            per_ctx_s=3e-6)
    shapes = [[(n, 0)] for n in (32, 128, 512, 1024)] + [[(128, 0)] * 8, [(32, 992)] * 15]
    shapes += [[(n, c)] for n, c in ((32, 96), (128, 384), (512, 512))]
    shapes += [[(1, c)] * b for b, c in ((1, 128), (4, 128), (16, 1024))]
    d = copy.deepcopy(BASE)
    d["measured"] = {"step_samples": {"s": [[[list(c) for c in ch], truth.step_time(ch)]
                                            for ch in shapes]},
                     "served": {"s": {"trace": [
                         [[[300, 0, True]], 1.25 * truth.step_time([(300, 0)])],
                         [[[200, 0], [200, 0]], 1.5 * truth.step_time([(200, 0)] * 2)],
                         [[[1, 50, True, True]] * 3, 0.9 * truth.step_time([(1, 50)] * 3)],
                         [[[128, 0]] * 8, 0.85 * truth.step_time([(128, 0)] * 8)]]
                         + [[[[n, 0, True]], f * truth.step_time([(n, 0)])]
                            for n, f in ((400, 1.1), (420, 1.1), (440, 1.1), (1000, 0.95),
                                         (1024, 0.95), (1050, 0.95))]}}}
    src, out = tmp_path / "old.json", tmp_path / "new.json"
    src.write_text(json.dumps(d))
    assert cli_main(["simulate", "refit", str(src), "--out", str(out)]) == 0
    new = json.loads(out.read_text())
    assert new["step_models"]["s"]["per_ctx_s"] == pytest.approx(3e-6, rel=1e-3)
    assert new["host"]["served_factors"]["s"] == pytest.approx(
        {"prefill": 1.1, "prefill_batched": 1.5, "prefill_burst": 0.85, "decode": 0.9},
        rel=1e-3)
    # the lone prefills span two lengths: short ones 1.1-1.25x, long ones 0.95x
    (t_short, f_short), (t_long, f_long) = new["host"]["served_factor_curves"]["s"]["prefill"]
    assert f_short == pytest.approx(1.1, rel=1e-3) and f_long == pytest.approx(0.95, rel=1e-3)
    p = load_profile(out)
    assert p.step_model("prefill").step_time([(32, 992)]) == pytest.approx(
        1.1 * truth.step_time([(32, 992)]), rel=1e-3)  # shorter than the short side
    assert p.step_model("prefill").step_time([(2048, 0)]) == pytest.approx(
        0.95 * truth.step_time([(2048, 0)]), rel=1e-3)
    # a profile without samples is refused with a clear message, nothing written
    del d["measured"]
    src.write_text(json.dumps(d))
    out.unlink()
    assert cli_main(["simulate", "refit", str(src), "--out", str(out)]) == 2
    assert not out.exists()
    for bad in ("[1, 2]", '{"measured": 3}', "{not json"):
        src.write_text(bad)
        assert cli_main(["simulate", "refit", str(src), "--out", str(out)]) == 2
        assert not out.exists()


@pytest.mark.parametrize("bad", [[[0, 0.1]], [[2, 0.1], [1, 0.2]], [[1, -0.1]], "x",
                                 [[1, 0.1, 3]]])
def test_row_table_errors_name_the_field(bad):
    d = copy.deepcopy(BASE)
    d["step_models"]["s"]["token_rows_s"] = bad
    with pytest.raises(ProfileError, match="token_rows_s"):
        profile_from_dict(d, "x.json")


def test_negative_table_level_is_refused():
    """A negative token_rows_scale (a hand-edited profile) would price steps below their
    linear terms: the loader refuses it and names the field."""
    d = copy.deepcopy(BASE)
    d["step_models"]["s"]["token_rows_scale"] = -0.5
    with pytest.raises(ProfileError, match=r"token_rows_scale: must be >= 0"):
        profile_from_dict(d, "x.json")


def _colocated_steps(p, w):
    """Run a colocated instance and record every step: (plan as chunks, t0, t1)."""
    import simpy

    from kvpush.sim.engine import EngineSim

    steps = []
    orig = EngineSim.__init__

    def init(self, *a, **k):
        orig(self, *a, **k)
        self.step_hook = lambda plan, t0, t1: steps.append((self.chunks(plan), t0, t1))

    EngineSim.__init__ = init  # type: ignore[method-assign]
    try:
        res = simulate(p, w, ClusterConfig("colocated", 0, 1))
    finally:
        EngineSim.__init__ = orig  # type: ignore[method-assign]
    assert simpy  # imported for the engine
    return res, steps


def test_mixed_step_lasts_what_the_step_model_says_and_decodes_wait_for_it():
    """Two 512-token prompts at once on one colocated instance, token budget 300: steps
    [A 300], [A 212 + B 88], [A decode + B 299], [A decode + B 125], then decodes. A's
    first decodes share a step with B's chunks and wait for the whole chunk (running
    requests first, then the rest of the budget, as kvpush's scheduler does)."""
    p = prof(step_models={"s": GEMM}, instance__max_num_batched_tokens=300)
    m = p.step_model("colocated")
    res, steps = _colocated_steps(p, Workload(2, math.inf, 512, 8, seed=0))
    for chunks, t0, t1 in steps:
        assert t1 - t0 == pytest.approx(m.step_time(chunks), abs=1e-12)
    # (tokens, context, samples?, decode row already in the dense decode cache?)
    assert [c for c, _, _ in steps[:4]] == [
        [(300, 0, False, False)], [(212, 300, True, False), (88, 0, False, False)],
        [(1, 512, True, False), (299, 88, False, False)],
        [(1, 513, True, True), (125, 387, True, False)]]
    first, second = sorted(res.requests, key=lambda r: r.token_times[0])
    gaps = [y - x for x, y in zip(first.token_times, first.token_times[1:])]
    # A's 2nd and 3rd tokens came out of the mixed steps, after the whole chunk
    assert gaps[0] == pytest.approx(steps[2][2] - steps[2][1], abs=1e-12)
    assert gaps[1] == pytest.approx(steps[3][2] - steps[3][1], abs=1e-12)
    assert gaps[0] > 5 * gaps[-1]  # vs a decode step of two rows at the end
    assert first.done and second.done


def test_corun_slowdown_applies_only_while_a_neighbour_is_mid_step():
    import simpy

    from kvpush.sim.engine import EngineSim, Job, JobKind
    from kvpush.sim.workload import SimRequest

    p = prof(host={"corun_slowdown": 1.5})
    assert p.corun_slowdown == 1.5 and prof().corun_slowdown == 1.0
    env = simpy.Environment()
    m = p.step_model("prefill")
    a, b = (EngineSim(env, n, "prefill", m, p.instance) for n in "ab")
    for e in (a, b):
        e.host, e.corun = [a, b], p
    done: dict[str, float] = {}

    def job(name: str, prompt: int) -> Job:
        return Job(SimRequest(rid=0, arrival=0.0, prompt_len=prompt, output_len=1),
                   JobKind.PREFILL_ONLY, 1, on_finish=lambda _j, t: done.setdefault(name, t))

    a.submit(lambda: a.add(job("a", 256)))  # a starts first, alone: its own time
    env.timeout(0.001).callbacks.append(lambda _e: b.submit(lambda: b.add(job("b", 64))))
    env.run()
    assert done["a"] == pytest.approx(m.step_time([(256, 0)]))
    assert done["b"] == pytest.approx(0.001 + 1.5 * m.step_time([(64, 0)]))
    with pytest.raises(ProfileError, match="corun_slowdown"):
        prof(host={"corun_slowdown": 0.5})


def test_corun_by_kind_prices_decode_and_prefill_steps_apart():
    """A served 1P1D pair slows decode steps more than prefill ones beside the other
    instance (v8/v9 traces: 1.07-1.10 against 1.02-1.03); host.corun_by_kind carries
    both and replaces the single corun_slowdown."""
    p = prof(host={"corun_slowdown": 1.0, "corun_by_kind": {"prefill": 1.03, "decode": 1.1}})
    assert (p.corun_factor(decode=False), p.corun_factor(decode=True)) == (1.03, 1.1)
    assert prof(host={"corun_slowdown": 1.2}).corun_factor(decode=True) == 1.2
    # a lone request in push mode: its decode steps start while nothing else runs, so
    # nothing changes; two overlapping requests: the decode instance's steps slow down
    alone = one("push", p)
    assert alone.tpot == pytest.approx(one("push", prof()).tpot)
    w = Workload(4, 4.0, 256, 64, seed=1)  # later prompts prefill while earlier decode
    plain = simulate(prof(), w, ClusterConfig("push")).summary()
    slowed = simulate(p, w, ClusterConfig("push")).summary()
    assert slowed["median_tpot_ms"] > plain["median_tpot_ms"]
    for bad in ({"prefill": 0.9, "decode": 1.1}, {"decode": 1.1}, [1.1, 1.1]):
        with pytest.raises(ProfileError, match="corun_by_kind"):
            prof(host={"corun_slowdown": 1.0, "corun_by_kind": bad})


def test_front_end_spreads_a_burst_and_the_first_step_runs_the_first_arrival():
    """Eight requests at once through a front end of 5 ms each: request k reaches the
    instance k x 5 ms after the first, so the first step runs request 0 alone and the
    second step everything that came during it; without the front end, one step."""
    fe, hop = 0.005, BASE["handoff"]["client_hop_s"] + BASE["handoff"]["http_hop_s"]
    w = Workload(8, math.inf, 64, 2, seed=0)
    res, steps = _colocated_steps(prof(handoff__front_end_s=fe), w)
    got = sorted(r.stages[Stage.PREFILL_RECEIVED] for r in res.requests)
    assert got == pytest.approx([k * fe + hop for k in range(8)], abs=1e-9)
    prefill_rows = [sum(1 for c in chunks if c[0] > 1) for chunks, _, _ in steps]
    assert prefill_rows[:2] == [1, 7]
    _, together = _colocated_steps(prof(), w)
    assert sum(1 for c in together[0][0] if c[0] > 1) == 8
    with pytest.raises(ProfileError, match="front_end_s"):
        prof(handoff__front_end_s=-1.0)


def test_a_bursts_first_gap_is_drawn_from_the_measured_ones():
    """Eight requests at once, front end 5 ms each, a measured first gap of 20 ms: the
    second request reaches the instance 20 ms after the first, the rest 5 ms apart after
    it; several gaps measured: each run draws one, the same for the same seed."""
    fe, hop = 0.005, BASE["handoff"]["client_hop_s"] + BASE["handoff"]["http_hop_s"]
    w = Workload(8, math.inf, 64, 2, seed=0)
    res, _ = _colocated_steps(prof(handoff__front_end_s=fe,
                                   handoff__burst_first_gaps_s=[0.02]), w)
    got = sorted(r.stages[Stage.PREFILL_RECEIVED] for r in res.requests)
    assert got == pytest.approx([hop, 0.02 + hop] + [0.02 + k * fe + hop
                                                     for k in range(1, 7)], abs=1e-9)
    p = prof(handoff__front_end_s=fe, handoff__burst_first_gaps_s=[0.001, 0.002, 0.03])

    def second(seed: int) -> float:
        r = simulate(p, w, ClusterConfig("colocated", 0, 1, seed=seed)).requests
        s = sorted(q.stages[Stage.PREFILL_RECEIVED] for q in r)
        return s[1] - s[0]

    gaps = [second(seed) for seed in range(12)]
    assert gaps == [second(seed) for seed in range(12)]  # deterministic per seed
    assert set(round(g, 9) for g in gaps) == {0.001, 0.002, 0.03}
    # requests arriving apart are not a burst: the first gap does not apply
    spaced = Workload(8, 2.0, 64, 2, seed=0)
    a = simulate(prof(handoff__front_end_s=fe), spaced, ClusterConfig("colocated", 0, 1))
    b = simulate(p, spaced, ClusterConfig("colocated", 0, 1))
    assert [r.token_times for r in a.requests] == [r.token_times for r in b.requests]
    for bad in ([-0.001], "0.01", [True]):
        with pytest.raises(ProfileError, match="burst_first_gaps_s"):
            prof(handoff__burst_first_gaps_s=bad)


def test_an_idle_engine_starts_its_step_after_the_wake_and_takes_what_came_meanwhile():
    """A lone request's first token comes engine_wake_s later than without the wake. In a
    burst whose first gap (1 ms) is shorter than the wake (2 ms), the first step takes
    two prompts; with a first gap longer than the wake, one."""
    w1 = Workload(1, 1.0, 64, 2, seed=0)
    plain = simulate(prof(), w1, ClusterConfig("colocated", 0, 1)).requests[0]
    woken = simulate(prof(handoff__engine_wake_s=0.002), w1,
                     ClusterConfig("colocated", 0, 1)).requests[0]
    assert woken.ttft - plain.ttft == pytest.approx(0.002, abs=1e-9)
    w = Workload(8, math.inf, 64, 2, seed=0)
    for first, rows in ((0.001, 2), (0.003, 1)):
        _, steps = _colocated_steps(prof(handoff__front_end_s=0.005,
                                         handoff__engine_wake_s=0.002,
                                         handoff__burst_first_gaps_s=[first]), w)
        assert sum(1 for c in steps[0][0] if c[0] > 1) == rows
    with pytest.raises(ProfileError, match="engine_wake_s"):
        prof(handoff__engine_wake_s=-1.0)


# ---------------------------------------------------------------------------- CLI
def test_cli_help(capsys):
    from kvpush.cli import main

    for argv in (["simulate", "--help"], ["simulate", "run", "--help"],
                 ["simulate", "plan", "--help"], ["simulate", "calibrate", "--help"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0
    assert "--ttft-p90" in capsys.readouterr().out


def test_cli_small_plan(tmp_path, capsys):
    from kvpush.cli import main

    png = tmp_path / "frontier.png"
    rc = main(["simulate", "plan", "--profile", "h200-tp8-qwen3-32b", "--rate", "4",
               "--ttft-p90", "200", "--tpot-p90", "50", "--max-instances", "3",
               "--num-prompts", "30", "--output-len", "16", "--plot", str(png),
               "--json", str(tmp_path / "plan.json")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "smallest configuration meeting the targets" in out
    assert png.stat().st_size > 1000
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["best"] and len(plan["candidates"]) == 1 + 3 + 5  # sizes 1, 2, 3


def test_cli_bad_profile(capsys):
    from kvpush.cli import main

    rc = main(["simulate", "run", "--profile", "no-such-profile", "--rate", "1"])
    assert rc == 2
    assert "no profile 'no-such-profile'" in capsys.readouterr().err


# ---------------------------------------------------------------------- calibrate
def test_calibration_passes_repeat_the_plan(tiny_llama):
    """repeats=2 measures every shape of the plan twice (the fit pools both passes)."""
    import dataclasses

    from kvpush.sim.calibrate import CalibrationPlan, measure_steps

    one = CalibrationPlan.quick()
    once = measure_steps(tiny_llama, 1, one, log=lambda _m: None)
    twice = measure_steps(tiny_llama, 1, dataclasses.replace(one, repeats=2),
                          log=lambda _m: None)
    assert len(twice) == 2 * len(once)
    assert [c for c, _ in twice[:len(once)]] == [c for c, _ in once]
    assert [c for c, _ in twice[len(once):]] == [c for c, _ in once]


def test_matmul_tables_median_drops_one_slow_timing():
    """The tables timed at each pass boundary go in as their lower median per row, so one
    timing the host ran at half speed through (v24) does not set the level; timings of
    different tables or rows are refused."""
    from kvpush.sim.matmul_tables import median_tables, table_spread

    def timing(scale: float) -> dict:
        return {"token_rows_s": [[1, 0.01 * scale], [128, 0.14 * scale]],
                "sample_rows_s": [[1, 0.002 * scale]]}

    timings = [timing(2.0), timing(1.0), timing(1.1)]
    assert median_tables(timings) == timing(1.1)
    assert table_spread([t["token_rows_s"] for t in timings]) == pytest.approx(1.0)
    # two timings: the faster (contention only slows a best-of timing)
    assert median_tables([timing(2.0), timing(1.0)]) == timing(1.0)
    other = timing(1.0)
    other["token_rows_s"][1][0] = 256
    with pytest.raises(ValueError, match="token_rows_s timed different rows"):
        median_tables([timing(1.0), other])
    with pytest.raises(ValueError, match="no table timings"):
        median_tables([])
    with pytest.raises(ValueError, match="different tables"):
        median_tables([timing(1.0), {"token_rows_s": timing(1.0)["token_rows_s"]}])


def test_thread_warning_when_more_threads_are_not_faster(tmp_path, capsys):
    """v24's calibration timed its 2-thread table at 1-thread speed (279 ms at 128 rows
    against 273): that draws a warning, whichever thread count was calibrated first; a
    2-thread table at half the time does not."""
    from kvpush.sim.matmul_tables import thread_warning, thread_warnings

    one = {"token_rows_s": [[1, 0.009], [128, 0.273]]}
    assert thread_warning(one, {"token_rows_s": [[1, 0.008], [128, 0.137]]}, 1, 2) is None
    warning = thread_warning(one, {"token_rows_s": [[1, 0.008], [128, 0.279]]}, 1, 2)
    assert warning is not None
    assert "threads=2" in warning and "128 rows (279 ms)" in warning
    assert "threads=1 (273 ms)" in warning
    assert thread_warning(one, {}, 1, 2) is None  # calibrated without tables
    slow = {"token_rows_s": [[1, 0.008], [128, 0.279]]}
    for models in ({"threads=1": one, "threads=2": slow}, {"threads=2": slow, "threads=1": one}):
        warnings = thread_warnings(models)
        assert len(warnings) == 1 and "threads=2: the projections' table" in warnings[0]
    # the committed v24 calibrations: the one before the runs timed both tables at 2.02 s
    # for 1024 rows, the one after timed the 2-thread one at 1.01 s; refit says which
    v24 = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "sim" / "v24"
    for name, warns in (("cpu-local.json", True), ("cpu-local-after.json", False)):
        sm = json.loads((v24 / name).read_text())["step_models"]
        assert (thread_warning(sm["threads=1"], sm["threads=2"], 1, 2) is not None) == warns
        assert len(thread_warnings(sm)) == warns
    out = tmp_path / "pooled.json"
    capsys.readouterr()
    assert cli_main(["simulate", "refit", str(v24 / "cpu-local.json"),
                     str(v24 / "cpu-local-after.json"), "--out", str(out)]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "not clearly faster" in ln]
    assert len(lines) == 1 and lines[0].startswith(
        "[refit] calibration 1 of 2 (2026-12-01T05:37:36Z): warning: threads=2")
    assert thread_warnings({"threads=1": one, "colocated": {}}) == []


def test_calibrate_keeps_the_median_table_and_warns_on_a_slow_timing(
        tiny_llama, tmp_path, monkeypatch):
    """One of the three timings of a calibration's table ran at half speed: the profile
    gets the median (the level of the other two) and the log says how far apart the
    timings were."""
    from kvpush.sim import calibrate as cal

    def calibrated(*speeds: float) -> tuple[dict, list[str]]:
        left = iter(speeds)

        def fake(model, clock="wall"):
            k = next(left)
            return {"token_rows_s": [[1, 0.001 * k], [64, 0.004 * k]],
                    "sample_rows_s": [[1, 0.0005 * k]]}

        monkeypatch.setattr(cal, "measure_matmuls", fake)
        out, lines = tmp_path / "p.json", []
        plan = dataclasses.replace(cal.CalibrationPlan.quick(), repeats=2)
        cal.calibrate(str(tiny_llama), out, plan, transfer=False, log=lines.append)
        assert next(left, None) is None  # timed before each of 2 passes and after the last
        return json.loads(out.read_text()), lines

    # slow first, as v24's was: neither the first nor the last nor the fastest is kept
    data, lines = calibrated(2.0, 1.1, 1.0)
    sm = data["step_models"]["threads=1"]
    assert [t for _, t in sm["token_rows_s"]] == pytest.approx([0.0011, 0.0044])
    assert len(data["measured"]["matmul_timings"]["threads=1"]) == 3
    expected = ("warning: threads=1: the projections' table timings before each pass and "
                "after the last differ by up to 100%")
    assert any(expected in line for line in lines)
    assert any(expected in w for w in data["measured"]["warnings"])
    # timings within 10% of each other: quiet
    data, lines = calibrated(1.0, 1.1, 1.05)
    assert not any("table timings" in line for line in lines)
    assert not any("table timings" in w for w in data["measured"]["warnings"])


def test_calibrate_quick_on_tiny_model(tiny_llama, tmp_path):
    from kvpush.sim.calibrate import CalibrationPlan, calibrate
    from kvpush.sim.matmul_tables import median_tables

    out = tmp_path / "local.json"
    plan = dataclasses.replace(CalibrationPlan.quick(), repeats=2, host_probe=0.1)
    calibrate(str(tiny_llama), out, plan, transfer=False, log=lambda _m: None)
    p = load_profile(out)
    m = p.step_model("prefill")
    assert 0 < m.step_time([(1, 10)]) < m.step_time([(64, 0)]) * 10
    assert p.model.num_layers >= 1 and p.roles["colocated"] == "threads=1"
    data = json.loads(out.read_text())
    sm = data["step_models"]["threads=1"]
    assert [r for r, _ in sm["token_rows_s"]][:3] == [1, 2, 3]
    assert all(t > 0 for _, t in sm["token_rows_s"] + sm["sample_rows_s"])
    samples = data["measured"]["step_samples"]["threads=1"]
    assert len(data["measured"]["fits"]["threads=1"]["pass_levels"]) == 2  # repeats=2
    # the tables timed before each pass and after the last; the profile has their median
    timings = data["measured"]["matmul_timings"]["threads=1"]
    assert len(timings) == 3
    assert sm["token_rows_s"] == median_tables(timings)["token_rows_s"]
    # the idle host probe before each pass and after the last
    probes = data["measured"]["host_probe_ms"]["threads=1"]
    assert len(probes) == 3 and all(v > 0 for v in probes)
    # the prefix plan (2, 32, 8): both prompts hit the cached 32 tokens and compute 8
    assert [[8, 32, True, False]] * 2 in [chunks for chunks, _ in samples]
    r = simulate(p, Workload(3, 50.0, 32, 3), ClusterConfig("push")).requests
    assert all(x.done for x in r)


def test_pair_corun_ratios_split_steps_by_the_neighbour_at_their_start():
    from kvpush.sim.corun import pair_corun_ratios

    class Flat:  # prefill steps 1 s, decode steps 0.1 s, whatever the shape
        def step_time(self, chunks):
            return 0.1 if all(c[0] == 1 for c in chunks) else 1.0

    pre, dec = [[64, 0, True, False]], [[1, 64, True, True]]
    # P: 4 steps alone at 1.0 s, then 4 that start inside D's steps at 1.05 s
    p_steps = [{"t": 10.0 * i, "dur": 1.0, "chunks": pre} for i in range(4)]
    p_steps += [{"t": 100.0 + 10 * i + 0.05, "dur": 1.05, "chunks": pre} for i in range(4)]
    # D: 4 decode steps inside P's first steps (0.12 s), 4 alone (0.1 s), and the
    # steps P starts inside
    d_steps = [{"t": 10.0 * i + 0.5, "dur": 0.12, "chunks": dec} for i in range(4)]
    d_steps += [{"t": 50.0 + i, "dur": 0.1, "chunks": dec} for i in range(4)]
    d_steps += [{"t": 100.0 + 10 * i, "dur": 0.1, "chunks": dec} for i in range(4)]
    out = pair_corun_ratios(p_steps, d_steps, Flat())
    assert out["prefill"] == pytest.approx(1.05) and out["decode"] == pytest.approx(1.2)
    assert out["steps"] == {"prefill": {"busy": 4, "alone": 4},
                            "decode": {"busy": 4, "alone": 8}}
    assert out["alone"] == {"prefill": pytest.approx(1.0), "decode": pytest.approx(1.0)}
    # too few steps on a side: no figure; never a speed-up
    few = pair_corun_ratios(p_steps[:2], d_steps[4:8], Flat())
    assert (few["prefill"], few["decode"]) == (1.0, 1.0)
    faster = [dict(s, dur=0.08) for s in d_steps[:4]] + d_steps[4:]
    assert pair_corun_ratios(p_steps, faster, Flat())["decode"] == 1.0
