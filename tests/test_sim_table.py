"""kvpush simulate held against vLLM PR 35264's push-vs-pull table (AWS P5en, Qwen3-32B,
1 prefill + 1 decode of TP 4, vllm bench serve, sonnet): the shape the built-in
``p5en-tp4-qwen3-32b`` profile reproduces from public figures, and the saturation it does
not (docs/SIMULATOR.md, "Against the published table")."""

from __future__ import annotations

import json
from importlib import resources

import pytest

pytest.importorskip("simpy")

from kvpush.sim.cluster import ClusterConfig, simulate  # noqa: E402
from kvpush.sim.profile import load_profile, profile_from_dict  # noqa: E402
from kvpush.sim.workload import Workload  # noqa: E402

PROFILE = "p5en-tp4-qwen3-32b"
#: the table's rows: (output tokens, offered req/s); 512 prompt tokens each
ROWS = ((64, 4.0), (128, 4.0), (128, 8.0))
#: vllm bench serve's sonnet data set: the first 200 tokens are the same in every prompt,
#: and the benchmark's test prompt leaves them in both instances' prefix caches
SONNET = {"prefix_len": 200, "prefix_cached_on": ("prefill", "decode")}


def summary(profile, mode: str, output_len: int, rate: float, num_prompts: int = 100):
    w = Workload(num_prompts, rate, 512, output_len, seed=0, **SONNET)
    return simulate(profile, w, ClusterConfig(mode)).summary()


@pytest.fixture(scope="module")
def rows():
    p = load_profile(PROFILE)
    return {(out, rate): {m: summary(p, m, out, rate) for m in ("pull", "push")}
            for out, rate in ROWS}


def test_profile_names_a_source_for_each_figure_and_vllm_semantics():
    p = load_profile(PROFILE)
    for key in ("model", "peak_flops", "mfu", "mem_bandwidth", "transfer.bandwidth_Bps",
                "transfer.post", "handoff.push_layers_per_write",
                "handoff.push_token_with_kv", "instance"):
        assert p.sources.get(key), key
    # vLLM's connector, not kvpush's: one WRITE after the forward pass, token #1 from D
    assert p.handoff.push_layers_per_write == p.model.num_layers
    assert not p.handoff.push_token_with_kv and p.handoff.pull_post_on_step_loop


def test_push_is_ahead_of_pull_on_every_row_by_a_modest_median_and_tpot_is_the_same(rows):
    """The table: push's median TTFT 1.10-1.12x below pull's at 4 QPS (its 3x is a
    mean), the same TPOT in both modes."""
    for key, r in rows.items():
        pull, push = r["pull"], r["push"]
        assert pull["completed"] == push["completed"] == 100, key
        for stat in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms"):
            assert push[stat] < pull[stat], (key, stat)
        assert 1.0 < pull["median_ttft_ms"] / push["median_ttft_ms"] < 1.5, key
        assert push["mean_tpot_ms"] == pytest.approx(pull["mean_tpot_ms"], rel=0.02), key


def test_public_figures_do_not_saturate_either_mode_at_8_qps(rows):
    """What the model lacks: the table's pull serves 4.65 req/s of 8 offered (push 5.92);
    from public figures the cluster keeps up with 8 in both modes. If a mechanism that
    reproduces the saturation is added, this test and the docs change together."""
    for mode, s in rows[(128, 8.0)].items():
        assert s["completion_rate"] >= 0.9 * s["arrival_rate"], mode
        assert s["unfinished"] == 0 and s["p99_ttft_ms"] < 200, mode


def test_a_decode_slot_cap_saturates_pull_and_push_alike():
    """Admission is not what separates the modes: with max_num_seqs low enough to bind at
    8 QPS, both queue for a decode slot and serve the same rate (the KV transfer happens
    before the slot is taken, in pull as in push)."""
    text = (resources.files("kvpush.sim") / "profiles" / f"{PROFILE}.json").read_text()
    data = json.loads(text)
    data["instance"]["max_num_seqs"] = 8
    capped = profile_from_dict(data)
    pull, push = (summary(capped, m, 128, 8.0) for m in ("pull", "push"))
    for s in (pull, push):
        assert s["completion_rate"] < 0.9 * s["arrival_rate"]
    assert push["request_throughput"] == pytest.approx(pull["request_throughput"], rel=0.03)
    assert push["mean_tpot_ms"] == pytest.approx(pull["mean_tpot_ms"], rel=0.02)
