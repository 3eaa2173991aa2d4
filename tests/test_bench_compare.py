"""`kvpush bench compare`: clusters started and stopped, tables, JSONs and plots."""

from __future__ import annotations

import argparse
import json
import math
import os

import pytest

from kvpush.bench.compare import (
    CompareConfig,
    CompareError,
    ModeSpec,
    add_compare_parser,
    arrival_seed,
    mode_order,
    run_compare,
)
from kvpush.bench.compare_report import markdown_report, pooled
from kvpush.cluster.launcher import alive, descendant_pids


def _run(mode: str, label: str, rate, rep: int, ttfts: list[float]) -> dict:
    n = len(ttfts)
    return {"mode": mode, "mode_label": label, "request_rate": rate, "repeat": rep,
            "ttfts": ttfts, "e2els": [t + 0.7 for t in ttfts], "output_lens": [8] * n,
            "errors": [""] * n, "itls": [[0.1] * 7 for _ in ttfts], "completed": n,
            "failed": 0, "request_throughput": 2.0,
            "median_ttft_ms": sorted(ttfts)[n // 2] * 1e3}


def _canned() -> tuple[CompareConfig, list[dict]]:
    cfg = CompareConfig(modes=[ModeSpec("pull"), ModeSpec("push")], rates=[1.0, math.inf],
                        out_dir="unused", num_prompts=3, label="canned")
    runs = [_run("pull", "pull", 1.0, 0, [0.3, 0.32, 0.31]),
            _run("push", "push", 1.0, 0, [0.1, 0.11, 0.12]),
            _run("pull", "pull", "inf", 0, [0.6, 0.9, 1.2]),
            _run("push", "push", "inf", 0, [0.2, 0.3, 0.4])]
    return cfg, runs


def test_mode_spec_and_order():
    assert ModeSpec.parse("colocated:1").label == "colocated-1t"
    assert ModeSpec.parse("push") == ModeSpec("push")
    with pytest.raises(CompareError):
        ModeSpec.parse("pushy")
    modes = [ModeSpec("colocated"), ModeSpec("pull"), ModeSpec("push")]
    assert [m.mode for m in mode_order(modes, 1)] == ["push", "pull", "colocated"]
    assert mode_order(modes, 2) == modes


def test_policy_reaches_the_router_of_pd_modes_only(tmp_path):
    from kvpush.bench.compare import _up_args

    cfg = CompareConfig(modes=[ModeSpec("push")], rates=[1.0], out_dir=tmp_path,
                        policy="round-robin")
    assert _up_args(cfg, ModeSpec("push")).policy == "round-robin"
    assert _up_args(cfg, ModeSpec("colocated")).policy is None
    default = CompareConfig(modes=[ModeSpec("push")], rates=[1.0], out_dir=tmp_path)
    assert _up_args(default, ModeSpec("push")).policy is None  # the router's default
    weighted = CompareConfig(modes=[ModeSpec("push")], rates=[1.0], out_dir=tmp_path,
                             load_weight=2.0)
    assert _up_args(weighted, ModeSpec("push")).load_weight == 2.0
    assert _up_args(weighted, ModeSpec("colocated")).load_weight is None
    assert _up_args(default, ModeSpec("pull")).load_weight is None
    # MODE@POLICY: that configuration's own policy, beside the others in one run set
    rr = ModeSpec.parse("push@round-robin")
    assert (rr.mode, rr.policy, rr.label) == ("push", "round-robin", "push-round-robin")
    assert _up_args(default, rr).policy == "round-robin"
    assert _up_args(cfg, ModeSpec.parse("push@cache-aware")).policy == "cache-aware"
    assert ModeSpec.parse("pull:1@least-outstanding").label == "pull-1t-least-outstanding"
    for bad in ("push@nearest", "colocated@round-robin", "vllm-push@round-robin"):
        with pytest.raises(CompareError):
            ModeSpec.parse(bad)


def test_tensor_parallel_per_role_reaches_the_cluster(tmp_path, monkeypatch):
    from kvpush.bench import compare
    from kvpush.cluster.cli import plan_instances, spec_tp

    monkeypatch.setattr(compare, "usable_cores", lambda: 6)
    cfg = CompareConfig(modes=[ModeSpec("push"), ModeSpec("colocated")], rates=[1.0],
                        out_dir=tmp_path, tensor_parallel_size=2, decode_tp=1)
    cfg.validate()
    push = compare._up_args(cfg, ModeSpec("push"))
    assert (push.prefill_tp, push.decode_tp, push.threads) == (2, 1, 2)  # 6 // 3 ranks
    assert [spec_tp(s) for s in plan_instances(push, "m")] == [2, 1]
    colocated = compare._up_args(cfg, ModeSpec("colocated"))
    assert colocated.threads == 3  # one instance of 2 ranks
    assert [spec_tp(s) for s in plan_instances(colocated, "m")] == [2]
    assert compare._up_args(cfg, ModeSpec("push", 1)).threads == 1  # MODE:THREADS, per rank
    assert compare.instances_text(cfg, "push") == "1 prefill + 1 decode (P TP 2, D TP 1)"
    with pytest.raises(CompareError, match="vllm-"):
        CompareConfig(modes=[ModeSpec("vllm-push")], rates=[1.0], out_dir=tmp_path,
                      prefill_tp=2).validate()


def test_arrivals_per_repeat_give_each_repeat_its_own_poisson_draw():
    from kvpush.bench.settings import arrival_offsets

    same = CompareConfig(modes=[ModeSpec("push")], rates=[0.5, 2.0], out_dir="unused",
                         seed=3, repeats=3)
    own = CompareConfig(**{**same.__dict__, "arrivals_per_repeat": True})
    # default: every repeat replays the prompts' seed, so the same arrival times
    assert [arrival_seed(same, 1, k) for k in range(3)] == [1003] * 3
    # per repeat: repeat 0 as the default, later repeats their own seeds and offsets
    seeds = [arrival_seed(own, 1, k) for k in range(3)]
    assert seeds == [1003, 1004, 1005]
    draws = [arrival_offsets(10, 2.0, s) for s in seeds]
    assert draws[0] == arrival_offsets(10, 2.0, arrival_seed(same, 1, 2))
    assert len({tuple(d) for d in draws}) == 3
    # a repeat's seeds never reach the next rate's
    assert arrival_seed(own, 0, 999) < arrival_seed(own, 1, 0)
    with pytest.raises(CompareError, match="at most 1000"):
        CompareConfig(**{**own.__dict__, "repeats": 1001}).validate()
    parser = add_compare_parser(argparse.ArgumentParser().add_subparsers())
    assert parser.parse_args(["--out", "x", "--arrivals-per-repeat"]).arrivals_per_repeat
    assert parser.parse_args(["--out", "x"]).arrivals_per_repeat is False
    summary = {"config": {**own.__dict__, "threads": {}}, "machine": "m", "cells": {},
               "ratios": {}, "modes": [], "rates": [], "skipped": []}
    assert "each repeat with its own arrivals" in markdown_report(summary)


def test_each_run_sends_on_its_repeats_arrival_seed(tmp_path, monkeypatch):
    """run_compare's loop hands every run the arrival seed of its rate and repeat, and the
    run's JSON records it beside the prompts' seed (so that a repeat can be replayed at
    its arrival seed)."""
    from types import SimpleNamespace

    from kvpush.bench import client, compare

    class FakeCluster:  # no processes: the loop's bookkeeping only
        def __init__(self, cfg, spec, *a):
            self.args, self.url = SimpleNamespace(threads=1), "http://127.0.0.1:9"

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    sent = []

    def fake_run(bc, requests, tokenizer):
        sent.append((bc.label, bc.seed, bc.request_rate))
        out = _run("push", "push", bc.request_rate, 0, [0.1] * len(requests))
        return SimpleNamespace(to_dict=lambda: {**out, "mean_tpot_ms": 100.0})

    monkeypatch.setattr(compare, "Cluster", FakeCluster)
    monkeypatch.setattr(client, "run_benchmark", fake_run)
    cfg = CompareConfig(modes=[ModeSpec("pull"), ModeSpec("push")], rates=[0.5, 2.0],
                        out_dir=tmp_path, model=None, input_len=8, output_len=2,
                        num_prompts=2, warmup=0, repeats=2, seed=5,
                        arrivals_per_repeat=True)
    monkeypatch.setattr(compare, "resolve_served_model", lambda m: ("m", "tok"))
    monkeypatch.setattr("kvpush.bench.datasets.load_tokenizer", lambda d: None)
    monkeypatch.setattr(compare, "_prompts", lambda c, t, i: ([object()] * 2, []))
    run_compare(cfg, log=lambda *_: None)
    assert sorted((label.split()[0], seed, rate) for label, seed, rate in sent) == sorted(
        (m, 5 + 1000 * i + rep, rate) for rep in range(2) for m in ("pull", "push")
        for i, rate in enumerate((0.5, 2.0)))
    run = json.loads((tmp_path / "runs" / "push_r2_rep1.json").read_text())
    assert (run["arrival_seed"], run["prompt_seed"], run["repeat"]) == (1006, 1005, 1)


def test_summary_ratios_and_plots_from_canned_runs(tmp_path):
    from kvpush.bench.compare_report import summarize_runs

    cfg, runs = _canned()
    summary = summarize_runs(runs, cfg)
    p = pooled(runs[:1])
    assert p["median_ttft_ms"] == pytest.approx(310)
    assert p["mean_tpot_ms"] == pytest.approx(100)
    r = summary["ratios"]["pull/push@1"]
    assert r["median_ttft_ms"] == pytest.approx(310 / 110)
    assert summary["ratios"]["pull/push@inf"]["median_ttft_ratio_per_repeat"] == [3.0]
    md = markdown_report({**summary, "skipped": []})
    assert "| pull | inf |" in md and "pull/push" in md
    pytest.importorskip("matplotlib")
    from kvpush.bench.plots import plot_summary

    paths = plot_summary(summary, runs, tmp_path)
    assert [p.name for p in paths] == ["ttft_tpot_vs_rate.png", "ttft_cdf.png"]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_two_modes_end_to_end(tiny_llama, tmp_path):
    pytest.importorskip("nixl._api", reason="push mode needs NIXL")
    before = set(descendant_pids(os.getpid()))
    started: list[int] = []
    from kvpush.bench import compare

    real_enter = compare.Cluster.__enter__

    def spy(self):  # record every process each cluster starts
        out = real_enter(self)
        started.extend(self.pids())
        return out

    compare.Cluster.__enter__ = spy
    try:
        cfg = CompareConfig(modes=[ModeSpec("colocated"), ModeSpec("push")], rates=[math.inf],
                            out_dir=tmp_path / "out", model=str(tiny_llama), input_len=24,
                            output_len=4, num_prompts=4, warmup=1, run_timeout=120,
                            startup_timeout=120, time_limit=600, label="test")
        summary = run_compare(cfg, log=lambda *_: None)
    finally:
        compare.Cluster.__enter__ = real_enter
    out = tmp_path / "out"
    assert set(summary["cells"]) == {"colocated@inf", "push@inf"}
    assert all(c["completed"] == 4 and c["failed"] == 0 for c in summary["cells"].values())
    assert "colocated/push@inf" in summary["ratios"]
    assert sorted(p.name for p in (out / "runs").iterdir()) == [
        "colocated_rinf_rep0.json", "push_rinf_rep0.json"]
    run = json.loads((out / "runs" / "push_rinf_rep0.json").read_text())
    assert run["completed"] == 4 and run["threads_per_instance"] >= 1
    assert "| push | inf |" in (out / "summary.md").read_text()
    assert json.loads((out / "summary.json").read_text())["reference"] == "push"
    try:
        import matplotlib  # noqa: F401
        assert (out / "ttft_cdf.png").exists() and (out / "ttft_tpot_vs_rate.png").exists()
    except ImportError:
        pass
    # 2 clusters: colocated (instance + router) and push (prefill + decode + router)
    assert len(started) == 5
    assert alive(started) == []
    assert set(descendant_pids(os.getpid())) <= before


def test_vllm_modes_plan_pinned_instances_behind_the_router(tmp_path, monkeypatch):
    from kvpush.bench import vllm_cluster as vc

    assert ModeSpec.parse("vllm-push").label == "vllm-push"
    with pytest.raises(CompareError, match="pin their cores"):
        ModeSpec.parse("vllm-pull:2")
    specs = vc.plan_vllm("vllm-push", ["/x/vllm"], "/models/m", dtype="float32")
    p, d = specs
    assert (p.role, d.role) == ("prefill", "decode") and p.port != d.port
    assert "VLLM_CPU_OMP_THREADS_BIND=0" in p.argv and "VLLM_CPU_OMP_THREADS_BIND=1" in d.argv
    cfg = json.loads(p.argv[p.argv.index("--kv-transfer-config") + 1])
    assert cfg["kv_connector"] == "NixlPushConnector" and cfg["kv_role"] == "kv_producer"
    assert p.argv[p.argv.index("--dtype") + 1] == "float32"
    router = vc.router_spec("vllm-push", specs, 1234, 60)
    ident = router.argv[router.argv.index("--prefill") + 1]
    url, engine, side = ident.split("@")
    assert url == p.url and engine == "vllm-prefill-push"
    assert f"VLLM_NIXL_SIDE_CHANNEL_PORT={side.split(':')[1]}" in p.argv
    assert router.argv[router.argv.index("--decode") + 1] == d.url
    # vllm-kvpush: kvpush's connector on the same side-channel port, a push router
    kp, kd = vc.plan_vllm("vllm-kvpush", ["/x/vllm"], "/models/m")
    kcfg = json.loads(kp.argv[kp.argv.index("--kv-transfer-config") + 1])
    assert (kcfg["kv_connector"], kcfg["kv_connector_module_path"]) == (
        "KvpushConnector", "kvpush.vllm")
    side = kcfg["kv_connector_extra_config"]["side_channel_port"]
    assert f"VLLM_NIXL_SIDE_CHANNEL_PORT={side}" in kp.argv
    krouter = vc.router_spec("vllm-kvpush", [kp, kd], 1234)
    assert krouter.argv[krouter.argv.index("--mode") + 1] == "push"
    assert krouter.argv[krouter.argv.index("--prefill") + 1].endswith(f":{side}")
    # decode named too: the router (given the bench's cluster secret) signs its params
    assert krouter.argv[krouter.argv.index("--decode") + 1].startswith(
        f"{kd.url}@vllm-decode-kvpush@127.0.0.1:")
    (single,) = vc.plan_vllm("vllm-colocated", ["/x/vllm"], "/models/m")
    assert "--kv-transfer-config" not in single.argv and single.role == "both"
    # no vLLM anywhere: a clear error before anything starts
    monkeypatch.delenv("VLLM_BIN", raising=False)
    monkeypatch.setattr(vc, "find_vllm", lambda explicit=None: None)
    cfg = CompareConfig(modes=[ModeSpec("vllm-pull")], rates=[1.0], out_dir=tmp_path,
                        model=None, num_prompts=1)
    from kvpush.bench.compare import Cluster

    with pytest.raises(CompareError, match="vLLM is not installed"), \
            Cluster(cfg, cfg.modes[0], "m", tmp_path / "logs"):
        pass


def test_handoff_passes_push_layers_per_write_to_the_push_cluster(tmp_path):
    """`bench handoff --push-layers-per-write N` reaches the push cluster's `kvpush up`
    command; a negative N is refused before any cluster starts."""
    from kvpush.bench.compare import _up_args
    from kvpush.bench.handoff import HandoffConfig, add_handoff_parser, compare_config

    parser = add_handoff_parser(argparse.ArgumentParser().add_subparsers())
    args = parser.parse_args(["--modes", "push,pull", "--push-layers-per-write", "3"])
    assert args.push_layers_per_write == 3
    assert parser.parse_args([]).push_layers_per_write is None
    ccfg = compare_config(HandoffConfig(modes=["push", "pull"], push_layers_per_write=3),
                          "m", tmp_path)
    assert _up_args(ccfg, ModeSpec("push")).push_layers_per_write == 3
    assert ccfg.policy == "round-robin"
    with pytest.raises(ValueError, match="push-layers-per-write"):
        HandoffConfig(push_layers_per_write=-1).validate()


def test_report_marks_ratios_inside_the_noise_and_prints_min_max_over_repeats():
    from kvpush.bench.compare_report import summarize_runs

    cfg, runs = _canned()  # 3 requests a cell, one repeat
    summary = summarize_runs(runs, cfg)
    assert summary["ratios"]["pull/push@1"]["noise"] == ["fewer than 30 requests",
                                                          "one repeat"]
    md = markdown_report({**summary, "skipped": []})
    assert ("inside the noise: fewer than 30 requests / one repeat — do not read a ratio "
            "from it") in md
    assert "TTFT med min-max" in md and "| 310.0-310.0 |" in md
    # Two repeats of 20 requests each: 40 a cell, no note; min-max over the repeats.
    cfg2 = CompareConfig(modes=[ModeSpec("pull"), ModeSpec("push")], rates=[1.0],
                         out_dir="unused", num_prompts=20, repeats=2)
    runs2 = [_run(m, m, 1.0, rep, [base + 0.01 * rep] * 20)
             for rep in (0, 1) for m, base in (("pull", 0.3), ("push", 0.1))]
    s2 = summarize_runs(runs2, cfg2)
    assert s2["ratios"]["pull/push@1"]["noise"] == []
    assert s2["cells"]["pull@1"]["median_ttft_ms_range"] == pytest.approx([300, 310])
    md2 = markdown_report({**s2, "skipped": []})
    assert "inside the noise" not in md2 and "| 300.0-310.0 |" in md2
    # One repeat of 40: still one repeat.
    runs3 = [_run(m, m, 1.0, 0, [b] * 40) for m, b in (("pull", 0.3), ("push", 0.1))]
    s3 = summarize_runs(runs3, CompareConfig(modes=cfg2.modes, rates=[1.0],
                                             out_dir="unused"))
    assert s3["ratios"]["pull/push@1"]["noise"] == ["one repeat"]


def test_plots_start_at_zero_carry_the_workload_and_draw_bars_for_one_rate(tmp_path):
    pytest.importorskip("matplotlib")
    from kvpush.bench.compare_report import summarize_runs
    from kvpush.bench.plots import plot_summary

    cfg, runs = _canned()
    for rates, sel in (([1.0, math.inf], runs), ([1.0], runs[:2])):
        cfg.rates = rates
        summary = summarize_runs(sel, cfg)
        figs: list = []
        plot_summary(summary, sel, tmp_path, figures=figs)
        line_fig, cdf_fig = figs
        title = line_fig._suptitle.get_text()
        for part in ("canned", "random 1024 in / 128 out", "3 prompts", "1P + 1D",
                     "1 repeat"):
            assert part in title, (part, title)
        assert "canned" in cdf_fig._suptitle.get_text()
        for ax in line_fig.axes:
            assert ax.get_ylim()[0] == 0
            assert bool(ax.patches) == (len(rates) == 1)  # bars only for one rate
        for ax in cdf_fig.axes:
            assert ax.get_xlim()[0] == 0 and ax.get_ylim()[0] == 0
        import matplotlib.pyplot as plt

        for f in figs:
            plt.close(f)
