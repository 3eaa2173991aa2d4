"""kvpush simulate's step noise (the M/G/1 closed form, measurement, seeds, pooled runs)
and pooled calibrations (`kvpush simulate refit A B`)."""

from __future__ import annotations

import copy
import dataclasses
import math
import random
import statistics

import pytest

pytest.importorskip("simpy")

from kvpush.sim.cluster import ClusterConfig, simulate, simulate_pooled, summarize  # noqa: E402
from kvpush.sim.noise import (  # noqa: E402
    MIN_QUANTILE_STEPS,
    StepNoise,
    even_quantiles,
    measure_noise,
    measure_noise_quantiles,
    quantile_draw,
    robust_sigma,
)
from kvpush.sim.profile import ProfileError, profile_from_dict  # noqa: E402
from kvpush.sim.step_models import LinearStepModel  # noqa: E402
from kvpush.sim.workload import Stage, Workload  # noqa: E402
from test_sim import BASE, prof  # noqa: E402

HOST = {"corun_slowdown": 1.0}


def noisy(prefill: float = 0.0, decode: float = 0.0, **changes):
    return prof(host={**HOST, "step_noise": {"s": {"prefill": prefill, "decode": decode}}},
                **changes)


def test_mg1_prefill_queue_matches_pollaczek_khinchine():
    """With log-normal step noise, one prompt per step is an M/G/1 queue: mean wait
    W = lambda E[S^2] / (2 (1 - rho)), which for sigma 0.5 is 1.28x the M/D/1 wait at
    the same load: the noise reaches the queue, not only the step times. (Workload seeds
    0-3 x noise seeds 0-2: -4% .. +5% of the closed form.)"""
    median, sigma, rho, n = 0.1, 0.5, 0.5, 20000
    mean_s = median * math.exp(sigma ** 2 / 2)
    second = median ** 2 * math.exp(2 * sigma ** 2)
    lam = rho / mean_s
    p = noisy(prefill=sigma, step_models={"s": {"kind": "linear", "base_s": median,
                                                "per_token_s": 0.0}},
              instance__max_num_batched_tokens=64)
    res = simulate(p, Workload(n, lam, 64, 1, seed=0), ClusterConfig("colocated", 0, 1))
    waits = [r.stages[Stage.PREFILL_STARTED] - r.stages[Stage.PREFILL_RECEIVED]
             for r in res.requests[n // 10:]]
    expected = lam * second / (2 * (1 - rho))
    assert sum(waits) / len(waits) == pytest.approx(expected, rel=0.08)
    assert expected > 1.2 * rho * mean_s / (2 * (1 - rho))  # the M/D/1 wait
    busy = res.engines[0].busy_time / res.end_time
    assert busy == pytest.approx(rho, rel=0.05)


def test_noise_draws_have_the_profile_sigma_per_kind():
    noise = StepNoise({"prefill": 0.2}, random.Random(1))
    pre = [math.log(noise.factor(decode=False)) for _ in range(4000)]
    assert robust_sigma(pre) == pytest.approx(0.2, rel=0.08)
    assert abs(sorted(pre)[2000]) < 0.02  # median 1
    assert {noise.factor(decode=True) for _ in range(10)} == {1.0}  # no decode sigma


def test_measure_noise_recovers_sigma_around_the_model_not_its_level():
    model = LinearStepModel(base_s=0.01, per_token_s=1e-4)
    rng = random.Random(7)
    steps = []
    for i in range(600):
        chunks = [[64 + i % 512, 0, True]] if i % 3 else [[1, 100, True, True]] * 4
        sigma, level = (0.05, 1.3) if i % 3 else (0.12, 0.8)
        steps.append({"chunks": chunks,
                      "dur": level * model.step_time([tuple(c) for c in chunks])
                      * rng.lognormvariate(0, sigma)})
    steps.append({"chunks": [[300, 0, True]], "dur": 50.0})  # a stray stall sets nothing
    got = measure_noise(steps, model)
    assert got["prefill"] == pytest.approx(0.05, rel=0.15)
    assert got["decode"] == pytest.approx(0.12, rel=0.15)
    assert measure_noise(steps[:5], model) == {}  # too few steps to say


def test_quantile_draw_is_linear_between_points_from_first_to_last():
    table = (-0.1, 0.0, 0.4)  # at probabilities 0, 1/2, 1
    assert quantile_draw(table, 0.0) == -0.1
    assert quantile_draw(table, 0.25) == pytest.approx(-0.05)
    assert quantile_draw(table, 0.5) == pytest.approx(0.0)
    assert quantile_draw(table, 0.75) == pytest.approx(0.2)
    assert quantile_draw(table, 1.0) == pytest.approx(0.4)
    assert even_quantiles([3.0, 1.0, 2.0], 5) == (1.0, 1.5, 2.0, 2.5, 3.0)  # min .. max


def skewed_logs(n: int, rng: random.Random) -> list[float]:
    """log factors: a narrow core and one step in eight 1.2-1.8x (a stray stall)."""
    return [math.log(rng.uniform(1.2, 1.8)) if rng.random() < 0.125
            else rng.gauss(0.0, 0.03) for _ in range(n)]


def test_quantile_noise_keeps_the_tail_and_mean_the_log_normal_loses():
    """A TPOT is a mean of steps, so the tail counts: drawn from the quantile table the
    factors average what the measured ones did; the log-normal of the same robust sigma
    keeps the core only and averages ~1."""
    rng = random.Random(3)
    logs = skewed_logs(4000, rng)
    measured_mean = sum(math.exp(x) for x in logs) / len(logs)
    assert measured_mean > 1.05
    table = even_quantiles(logs)
    draws = StepNoise({"decode": robust_sigma(logs)}, random.Random(5), {"decode": table})
    got = [draws.factor(decode=True) for _ in range(20000)]
    assert sum(got) / len(got) == pytest.approx(measured_mean, rel=0.01)
    assert sorted(got)[10000] == pytest.approx(math.exp(sorted(logs)[2000]), abs=0.01)
    assert sorted(got)[19000] == pytest.approx(
        math.exp(sorted(logs)[3800]), rel=0.03)  # the 95th percentile, in the tail
    plain = StepNoise({"decode": robust_sigma(logs)}, random.Random(5))
    alone = [plain.factor(decode=True) for _ in range(20000)]
    assert sum(alone) / len(alone) < 1.01
    # a kind without a table keeps its log-normal, a kind with neither is 1
    mixed = StepNoise({"prefill": 0.2}, random.Random(5), {"decode": table})
    pre = [math.log(mixed.factor(decode=False)) for _ in range(4000)]
    assert robust_sigma(pre) == pytest.approx(0.2, rel=0.08)
    assert {draws.factor(decode=False) for _ in range(10)} == {1.0}


def test_without_tables_the_draws_are_the_log_normal_ones_as_before():
    """Profiles calibrated before the tables simulate exactly as they did: the same
    generator calls, the same factors."""
    ref = random.Random(9)
    expected = [ref.lognormvariate(0.0, 0.07) for _ in range(50)]
    for noise in (StepNoise({"decode": 0.07}, random.Random(9)),
                  StepNoise({"decode": 0.07}, random.Random(9), {})):
        assert [noise.factor(decode=True) for _ in range(50)] == expected


def test_measure_noise_quantiles_are_the_log_ratios_to_the_model_given():
    model = LinearStepModel(base_s=0.01, per_token_s=1e-4)
    rng = random.Random(11)
    logs = skewed_logs(800, rng)
    steps = [{"chunks": [[1, 100, True, True]] * 4,
              "dur": 0.8 * model.step_time([(1, 100, True, True)] * 4) * math.exp(x)}
             for x in logs]
    got = measure_noise_quantiles(steps, model)
    assert set(got) == {"decode"} and len(got["decode"]) == 101
    assert list(got["decode"]) == sorted(got["decode"])
    expect = even_quantiles([x + math.log(0.8) for x in logs])
    assert got["decode"] == pytest.approx(expect, abs=1e-4)
    assert measure_noise_quantiles(steps[:MIN_QUANTILE_STEPS - 1], model) == {}  # too few


def test_fit_served_keeps_a_table_for_decode_around_the_served_model_not_the_engine():
    """The served probe's fit: decode steps 1.2x the engine alone with a tail; the table
    is around the served model (median 0, mean the tail's), and the probe's few prefill
    steps get a sigma but no table."""
    from kvpush.sim.served import fit_served

    model = LinearStepModel(base_s=0.01, per_token_s=1e-4)
    rng = random.Random(4)
    dec = [(1, 100, True, True)] * 4
    steps = [{"chunks": dec, "dur": 1.2 * model.step_time(dec) * math.exp(x)}
             for x in skewed_logs(400, rng)]
    steps += [{"chunks": [(300, 0, True)], "dur": model.step_time([(300, 0, True)])
               * rng.lognormvariate(0, 0.04)} for _ in range(60)]
    fit = fit_served(steps, model)
    assert fit.factors["decode"] == pytest.approx(1.2, rel=0.03)
    assert set(fit.noise) == {"prefill", "decode"} and set(fit.noise_quantiles) == {"decode"}
    table = fit.noise_quantiles["decode"]
    assert abs(table[50]) < 0.01
    assert statistics.mean(math.exp(quantile_draw(table, (i + 0.5) / 2000))
                           for i in range(2000)) > 1.04


def test_a_profile_with_quantile_noise_only_scatters_per_seed_and_pools():
    d = copy.deepcopy(BASE)
    d["host"] = {**HOST, "step_noise_quantiles": {"s": {"decode": [-0.05, 0.0, 0.05, 0.5]}}}
    p = profile_from_dict(d)
    assert p.has_noise and p.noise_sigmas("decode") == {}
    assert p.noise_quantiles("decode") == {"decode": (-0.05, 0.0, 0.05, 0.5)}
    w = Workload(6, 2.0, 200, 40, seed=2)
    runs = simulate_pooled(p, w, ClusterConfig("colocated", 0, 1, seed=1), replicas=3)
    assert len(runs) == 3
    assert runs[0].requests[0].token_times != runs[1].requests[0].token_times
    again = simulate(p, w, ClusterConfig("colocated", 0, 1, seed=1))
    assert [r.token_times for r in again.requests] == [r.token_times
                                                         for r in runs[0].requests]
    # the decode steps average the table's mean factor: longer than without noise
    quiet = simulate(prof(), w, ClusterConfig("colocated", 0, 1))
    gaps = [sum(b - a for a, b in zip(t, t[1:])) for res in runs
            for t in (r.token_times for r in res.requests)]
    base = [sum(b - a for a, b in zip(t, t[1:])) for t in (r.token_times
                                                            for r in quiet.requests)]
    assert sum(gaps) / len(gaps) > 1.05 * sum(base) / len(base)


@pytest.mark.parametrize("mode", ["colocated", "pull", "push"])
def test_noise_is_deterministic_for_a_seed_and_pooling_runs_each_seed(mode):
    p = noisy(prefill=0.1, decode=0.1)
    w = Workload(30, 8.0, 200, 6, seed=2)

    def times(seed):
        return [r.token_times for r in simulate(p, w, ClusterConfig(mode, seed=seed)).requests]

    assert times(3) == times(3)
    assert times(3) != times(4)
    runs = simulate_pooled(p, w, ClusterConfig(mode, seed=3), replicas=3)
    assert [[r.token_times for r in res.requests] for res in runs] == [
        times(3), times(4), times(5)]
    s = summarize(runs)
    assert s["completed"] == 90 and s["replicas"] == 3
    ttfts = sorted(r.ttft for res in runs for r in res.requests)
    assert s["median_ttft_ms"] == pytest.approx(1e3 * (ttfts[44] + ttfts[45]) / 2)


def test_without_noise_seeds_change_nothing_and_pooling_runs_once():
    p = prof()
    w = Workload(20, 8.0, 200, 6, seed=2)
    a = [r.token_times for r in simulate(p, w, ClusterConfig("push", seed=0)).requests]
    b = [r.token_times for r in simulate(p, w, ClusterConfig("push", seed=9)).requests]
    assert a == b
    assert len(simulate_pooled(p, w, ClusterConfig("push"), replicas=5)) == 1
    with pytest.raises(ValueError, match="replicas"):
        simulate_pooled(p, w, ClusterConfig("push"), replicas=0)


def test_noise_follows_the_step_model_a_role_runs():
    """Sigma belongs to a step model: an override to a model without noise has none."""
    d = copy.deepcopy(BASE)
    d["step_models"]["quiet"] = dict(d["step_models"]["s"])
    d["host"] = {**HOST, "step_noise": {"s": {"prefill": 0.3}}}
    p = profile_from_dict(d)
    assert p.noise_sigmas("prefill") == {"prefill": 0.3}
    assert p.noise_sigmas("prefill", "quiet") == {}
    d["host"]["step_noise_quantiles"] = {"s": {"decode": [0.0, 0.1]}}
    tables = profile_from_dict(d)
    assert tables.noise_quantiles("decode") == {"decode": (0.0, 0.1)}
    assert tables.noise_quantiles("decode", "quiet") == {}
    w = Workload(10, 4.0, 200, 3, seed=1)
    quiet = ClusterConfig("colocated", 0, 1, step_models=(("colocated", "quiet"),))
    reseeded = dataclasses.replace(quiet, seed=5)
    assert ([r.token_times for r in simulate(p, w, quiet).requests]
            == [r.token_times for r in simulate(p, w, reseeded).requests])


@pytest.mark.parametrize("key, noise, needle", [
    ("step_noise", {"nope": {"prefill": 0.1}}, "no such step model"),
    ("step_noise", {"s": {"prefil": 0.1}}, "keys among"),
    ("step_noise", {"s": {"prefill": 1.5}}, "[0, 1)"),
    ("step_noise", {"s": {"decode": -0.1}}, ">= 0"),
    ("step_noise", {"s": {"decode": "x"}}, "decode"),
    ("step_noise", [0.1], "must be an object"),
    ("step_noise_quantiles", {"nope": {"decode": [0.0, 0.1]}}, "no such step model"),
    ("step_noise_quantiles", {"s": {"decod": [0.0, 0.1]}}, "keys among"),
    ("step_noise_quantiles", {"s": {"decode": [0.1]}}, "at least two numbers"),
    ("step_noise_quantiles", {"s": {"decode": [0.1, "x"]}}, "at least two numbers"),
    ("step_noise_quantiles", {"s": {"decode": [0.2, 0.1]}}, "non-decreasing"),
    ("step_noise_quantiles", {"s": {"prefill": [0.0, 4.0]}}, "within (-3, 3)"),
    ("step_noise_quantiles", {"s": {"prefill": [0.0, float("nan")]}}, "within (-3, 3)"),
    ("step_noise_quantiles", [0.1], "must be an object"),
])
def test_step_noise_errors_name_the_field(key, noise, needle):
    d = copy.deepcopy(BASE)
    d["host"] = {**HOST, key: noise}
    with pytest.raises(ProfileError, match=key) as e:
        profile_from_dict(d)
    assert needle in str(e.value)


def test_cli_run_pools_replicas_of_a_noisy_profile(tmp_path, capsys):
    import json

    from kvpush.cli import main

    d = copy.deepcopy(BASE)
    d["host"] = {**HOST, "step_noise": {"s": {"prefill": 0.2, "decode": 0.1}}}
    path = tmp_path / "noisy.json"
    path.write_text(json.dumps(d))
    args = ["simulate", "run", "--profile", str(path), "--rate", "8", "--num-prompts", "12",
            "--input-len", "128", "--output-len", "4", "--modes", "push"]
    assert main(args + ["--replicas", "3", "--json", str(tmp_path / "r.json")]) == 0
    (row,) = json.loads((tmp_path / "r.json").read_text())
    assert row["replicas"] == 3 and row["completed"] == 36
    capsys.readouterr()
    assert main(args + ["--replicas", "0"]) == 2
    assert "replicas must be >= 1" in capsys.readouterr().err


def test_refit_pools_calibrations_of_one_host(tmp_path, capsys):
    """kvpush simulate refit A B: one fit over both calibrations' samples, the served
    factors over both probes' steps, tables and co-run figures averaged."""
    import json

    from kvpush.cli import main

    truth = LinearStepModel(base_s=0.01, per_token_s=1e-4, per_seq_s=5e-4)
    shapes = [[(n, 0, True)] for n in (32, 128, 512, 1024)] + [[(1, 64, True)] * b
                                                              for b in (1, 4, 16)]

    def calibration(speed: float, served: float, corun: float, path_s: float) -> dict:
        d = copy.deepcopy(BASE)
        d["step_models"]["s"]["token_rows_s"] = [[1, 0.001 * speed], [64, 0.004 * speed]]
        d["host"] = {**HOST, "corun_by_kind": {"prefill": corun, "decode": corun},
                     "arrival_step_s": {"s": 0.004 * speed}}
        d["handoff"]["request_path_s"] = path_s
        d["handoff"]["push_prefill_step_s"] = 0.002 * speed
        d["handoff"]["push_layers_per_write"] = 3  # a setting: kept, not averaged
        d["handoff"]["burst_first_gaps_s"] = [0.001 * speed, 0.01 * speed]
        d["handoff"]["engine_wake_s"] = 0.0002 * speed
        d["measured"] = {
            "started_utc": f"t{speed}", "host_probe_ms": {"s": [200 * speed, 210 * speed]},
            "matmul_timings": {"s": [{"token_rows_s": [[1, 0.001 * speed]]}] * 3},
            "push_step": {"push_prefill_step_s": 0.002 * speed},
            "step_samples": {"s": [[[list(c) for c in ch], speed * truth.step_time(ch)]
                                   for ch in shapes]},
            "served": {"s": {"trace": [[[[n, 0, True]], served * speed
                                        * truth.step_time([(n, 0, True)])]
                                       for n in (100, 110, 120, 130)]}}}
        return d

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(calibration(1.0, 1.2, 1.02, 0.004)))
    b.write_text(json.dumps(calibration(1.1, 1.2, 1.10, 0.006)))
    out = tmp_path / "pooled.json"
    assert main(["simulate", "refit", str(a), str(b), "--out", str(out)]) == 0
    new = json.loads(out.read_text())
    assert len(new["measured"]["step_samples"]["s"]) == 2 * len(shapes)
    assert len(new["measured"]["served"]["s"]["trace"]) == 8
    # the step counts behind the factors are the pooled trace's, not the first profile's
    assert sum(new["measured"]["served"]["s"]["steps"].values()) == 8
    assert new["measured"]["pooled_from"] == ["t1.0", "t1.1"]
    assert new["measured"]["host_probe_ms"]["s"] == pytest.approx([200, 210, 220, 231])
    # every calibration's per-pass table timings are kept, in order
    assert [t["token_rows_s"][0][1] for t in new["measured"]["matmul_timings"]["s"]] == \
        pytest.approx([0.001] * 3 + [0.0011] * 3)
    # one pass per calibration (no plan recorded): how fast each ran against the fit
    first, second = new["measured"]["fits"]["s"]["pass_levels"]
    assert second / first == pytest.approx(1.1, rel=0.01)
    rows = new["step_models"]["s"]["token_rows_s"]
    assert [r for r, _ in rows] == [1, 64]
    assert [t for _, t in rows] == pytest.approx([0.00105, 0.0042])
    assert new["host"]["corun_by_kind"]["prefill"] == pytest.approx(1.06)
    assert new["host"]["arrival_step_s"] == {"s": pytest.approx(0.0042)}
    # the bursts' first gaps of both, together; the wake averaged
    assert new["handoff"]["burst_first_gaps_s"] == pytest.approx([0.001, 0.01, 0.0011, 0.011])
    assert new["handoff"]["engine_wake_s"] == pytest.approx(0.00021)
    assert new["handoff"]["request_path_s"] == pytest.approx(0.005)
    assert new["handoff"]["push_prefill_step_s"] == pytest.approx(0.0021)
    assert new["handoff"]["push_layers_per_write"] == 3
    assert isinstance(new["handoff"]["push_layers_per_write"], int)
    assert [p["push_prefill_step_s"] for p in new["measured"]["push_step"]] == \
        pytest.approx([0.002, 0.0022])
    # the served probe's steps were 1.2x their own calibration: 1.2x the pooled fit too
    assert new["host"]["served_factors"]["s"]["prefill"] == pytest.approx(1.2, rel=0.06)
    # a table measured against an older fit does not outlive a refit whose trace is too
    # short for a new one (with no trace at all, factors and noise stay as they were)
    stale = calibration(1.0, 1.2, 1.0, 0.004)
    stale["host"]["step_noise_quantiles"] = {"s": {"prefill": [0.0, 0.1]}}
    a.write_text(json.dumps(stale))
    assert main(["simulate", "refit", str(a), "--out", str(out)]) == 0
    assert "s" not in json.loads(out.read_text())["host"].get("step_noise_quantiles", {})
    # a trace long enough gives one, measured around the new served model
    long = calibration(1.0, 1.2, 1.0, 0.004)
    dec = [[1, 64, True, True]] * 4
    long["measured"]["served"]["s"]["trace"] += [
        [dec, 1.3 * truth.step_time([tuple(c) for c in dec]) * (1.5 if i % 10 == 0 else 1.0)]
        for i in range(MIN_QUANTILE_STEPS)]
    a.write_text(json.dumps(long))
    assert main(["simulate", "refit", str(a), "--out", str(out)]) == 0
    table = json.loads(out.read_text())["host"]["step_noise_quantiles"]["s"]["decode"]
    assert len(table) == 101 and abs(table[50]) < 0.02
    assert table[-1] == pytest.approx(math.log(1.5), abs=0.03)  # the slow tenth's steps
    # profiles of another model are refused, nothing written
    other = calibration(1.0, 1.2, 1.0, 0.004)
    other["model"]["num_layers"] = 8
    b.write_text(json.dumps(other))
    out.unlink()
    capsys.readouterr()
    assert main(["simulate", "refit", str(a), str(b), "--out", str(out)]) == 2
    assert "different models" in capsys.readouterr().err and not out.exists()
    # the tables of calibrations 10% apart pool quietly; one timed at half speed (v24's
    # 2-thread table ran at 1-thread speed) draws a warning, and the mean still pools
    a.write_text(json.dumps(calibration(1.0, 1.2, 1.0, 0.004)))
    b.write_text(json.dumps(calibration(1.1, 1.2, 1.0, 0.004)))
    assert main(["simulate", "refit", str(a), str(b), "--out", str(out)]) == 0
    assert "tables differ" not in capsys.readouterr().out
    slow = calibration(1.0, 1.2, 1.0, 0.004)
    slow["step_models"]["s"]["token_rows_s"] = [[1, 0.002], [64, 0.008]]
    del slow["measured"]["matmul_timings"]  # calibrated before they were recorded
    b.write_text(json.dumps(slow))
    assert main(["simulate", "refit", str(a), str(b), "--out", str(out)]) == 0
    assert "warning: s: the calibrations' token_rows_s tables differ by up to 100%" in \
        capsys.readouterr().out
    assert "matmul_timings" not in json.loads(out.read_text())["measured"]
    assert [t for _, t in json.loads(out.read_text())["step_models"]["s"]["token_rows_s"]] \
        == pytest.approx([0.0015, 0.006])


def test_host_level_is_the_run_probe_over_the_calibration_probe():
    """kvpush.sim.host_level: a run probed 20% slower than the calibration's mean level
    scales its own thread count's step model by 1.2; unprobed sides are refused."""
    from kvpush.sim.host_level import HostLevelError, calibration_level, level_scale

    measured = {"host_probe_ms": {"threads=1": [300.0, 330.0, 315.0],
                                  "threads=2": [190.0, 250.0, 220.0]}}
    assert calibration_level(measured, "threads=2") == pytest.approx(220.0)
    run = {"mode_label": "colocated", "repeat": 0,
           "host_probe_ms": {"threads": 2, "before": 250.0, "after": 278.0}}
    model, factor = level_scale(measured, run)
    assert model == "threads=2" and factor == pytest.approx(264.0 / 220.0)
    one = {"host_probe_ms": {"threads": 1, "before": 315.0, "after": None}}
    assert level_scale(measured, one) == ("threads=1", pytest.approx(1.0))
    with pytest.raises(HostLevelError, match="repeat 0 has no host_probe_ms"):
        level_scale(measured, {"mode_label": "push", "repeat": 0})
    with pytest.raises(HostLevelError, match="no host probe for threads=4"):
        level_scale(measured, {"host_probe_ms": {"threads": 4, "before": 100.0}})
    with pytest.raises(HostLevelError, match="no host probe"):
        level_scale({}, run)


def test_calibrate_writes_the_served_probes_noise_into_host(tiny_llama, tmp_path, monkeypatch):
    """calibrate() copies each served probe's sigmas and percentile tables into
    host.step_noise / host.step_noise_quantiles under its step model (the probes stand
    in here: they serve for minutes), and the written profile draws its decode steps
    from the table."""
    import json

    import kvpush.sim.corun as corun
    import kvpush.sim.served as served
    from kvpush.sim.calibrate import CalibrationPlan, calibrate
    from kvpush.sim.profile import load_profile

    table = [round(-0.2 + 0.005 * i, 6) for i in range(101)]  # percentiles 0-100

    def fake_probe(model, threads, engine_model, log=print):
        return {"factors": {"prefill": 1.1, "prefill_batched": 1.2, "decode": 1.05},
                "noise": {"prefill": 0.08, "decode": 0.04},
                "noise_quantiles": {"decode": table},
                "burst_first_gaps_s": [0.0001, 0.012], "engine_wake_s": 0.0002,
                "arrival_step": {"arrival_step_s": 0.002, "steps": {}}}

    def fake_pair(model, engine_model, log=print):
        return {"prefill": 1.03, "decode": 1.07,
                "arrival_step": {"arrival_step_s": 0.003, "steps": {}}}

    monkeypatch.setattr(served, "probe_served", fake_probe)
    monkeypatch.setattr(corun, "probe_served_pair", fake_pair)
    out = tmp_path / "local.json"
    plan = dataclasses.replace(CalibrationPlan.quick(), served=True)
    calibrate(str(tiny_llama), out, plan, transfer=False, log=lambda _m: None)
    host = json.loads(out.read_text())["host"]
    assert host["step_noise"] == {"threads=1": {"prefill": 0.08, "decode": 0.04}}
    assert host["step_noise_quantiles"] == {"threads=1": {"decode": table}}
    assert host["corun_by_kind"] == {"prefill": 1.03, "decode": 1.07}
    p = load_profile(out)
    assert p.has_noise and p.noise_quantiles("decode") == {"decode": tuple(table)}
    # how the probe's bursts started, into the hand-off
    assert p.handoff.burst_first_gaps_s == (0.0001, 0.012)
    assert p.handoff.engine_wake_s == pytest.approx(0.0002)
    # the decode steps are drawn from the written table: without it (the log-normal of
    # the same sigmas) the same seed gives other token times
    w = Workload(4, 20.0, 32, 8)
    with_table = simulate(p, w, ClusterConfig("push", seed=0)).requests
    without = simulate(dataclasses.replace(p, step_noise_quantiles={}), w,
                       ClusterConfig("push", seed=0)).requests
    assert all(r.done for r in with_table + without)
    assert [r.token_times for r in with_table] != [r.token_times for r in without]
