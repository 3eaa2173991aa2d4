"""The scripts that make the simulator's validation tables (benchmarks/sim_validate.py,
sim_validate_sets.py, arrival_steps.py), on a committed run set (benchmarks/results/
sim/v19) and on synthetic rows: which cells they replay, with which configuration, and
what they fit."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("simpy")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import arrival_steps  # noqa: E402
import sim_validate as sv  # noqa: E402
import sim_validate_sets as svs  # noqa: E402

SET = "sim/v19"
PROFILE = ROOT / "benchmarks/results" / SET / "cpu-local-pooled.json"


def test_cells_replay_each_measured_cell_with_its_own_configuration():
    name = f"{SET}/short_high_rate"
    summary = json.loads((ROOT / "benchmarks/results" / name / "summary.json").read_text())
    cfg = summary["config"]
    got = list(sv.cells(name))
    assert {(rate, label) for rate, label, *_ in got} == {
        (r, m) for r in summary["rates"] for m in summary["modes"]}
    for rate, label, w, cluster, cell, reps in got:
        i = summary["rates"].index(rate)
        # the bench's own arrival process: its seed per rate index, its lengths
        assert (w.seed, w.num_prompts, w.input_len, w.output_len) == (
            cfg["seed"] + 1000 * i, cfg["num_prompts"], cfg["input_len"], cfg["output_len"])
        assert w.rate == (float("inf") if rate == "inf" else float(rate))
        threads = f"threads={cfg['threads'][label]}"
        if label.startswith("colocated"):  # bench compare's one `role both` instance
            assert (cluster.mode, cluster.num_prefill, cluster.num_decode) == ("colocated", 0, 1)
            assert dict(cluster.step_models) == {"colocated": threads}
        else:
            assert (cluster.mode, cluster.num_prefill, cluster.num_decode) == (
                label, cfg["prefill"], cfg["decode"])
            assert dict(cluster.step_models) == {"prefill": threads, "decode": threads}
        assert len(reps) == cfg["repeats"]
        assert all(r["mode_label"] == label for r in reps)
        assert cell == summary["cells"][f"{label}@{rate}"]


def test_cells_model_the_warm_prefix_on_both_roles_and_the_tail_policy():
    for name, tail in (("prefix_hit", "prefill"), ("prefix_hit_tail_on_decode", "decode")):
        for _rate, _label, w, cluster, *_ in sv.cells(f"{SET}/{name}"):
            assert w.prefix_len == 992 and set(w.prefix_cached_on) == {"prefill", "decode"}
            assert cluster.prefix_hit_tail == tail


def test_validate_sets_pools_the_repeats_of_every_set():
    one = svs.validate_sets([(SET, PROFILE)], replicas=1)
    two = svs.validate_sets([(SET, PROFILE), (SET, PROFILE)], replicas=2)
    assert len(one) == len(two) == 37
    for a, b in zip(one, two, strict=True):
        assert (a["workload"], a["mode"], a["rate"]) == (b["workload"], b["mode"], b["rate"])
        assert b["n"] == 2 * a["n"] and b["repeats"] == 2 * a["repeats"]
        # the same runs twice: the same measured percentiles
        assert b["meas_median_ttft_ms"] == pytest.approx(a["meas_median_ttft_ms"])


def test_validate_sets_simulates_each_set_on_its_own_profile():
    """Two sets on two profiles: every simulated request of each set comes from its own
    profile, each set with its own noise seeds, all pooled."""
    from kvpush.sim.cluster import simulate_pooled, summarize
    from kvpush.sim.profile import load_profile

    other = ROOT / "benchmarks/results/sim/v18/cpu-local-pooled.json"
    rows = svs.validate_sets([(SET, PROFILE), (SET, other)], replicas=2)
    got = next(r for r in rows if (r["workload"], r["mode"], r["rate"]) == (
        "short_high_rate", "push", "4"))
    _rate, _label, w, cluster, *_ = next(c for c in sv.cells(f"{SET}/short_high_rate")
                                          if c[:2] == ("4", "push"))
    runs = (simulate_pooled(load_profile(PROFILE), w, cluster, 1)
            + simulate_pooled(load_profile(other), w,
                              dataclasses.replace(cluster, seed=cluster.seed + 1), 1))
    want = summarize(runs)
    alone = summarize(simulate_pooled(load_profile(PROFILE), w, cluster, 2))
    assert got["sim_median_ttft_ms"] == pytest.approx(want["median_ttft_ms"])
    assert got["sim_median_ttft_ms"] != pytest.approx(alone["median_ttft_ms"])


def test_validate_sets_arrival_cost_what_if_lengthens_loaded_cells():
    base = {(r["workload"], r["mode"], r["rate"]): r
            for r in svs.validate_sets([(SET, PROFILE)], replicas=1, arrival_step_s=0.0)}
    more = svs.validate_sets([(SET, PROFILE)], replicas=1, arrival_step_s=0.05)
    key = ("short_high_rate", "colocated", "4")
    row = next(r for r in more if (r["workload"], r["mode"], r["rate"]) == key)
    assert row["sim_median_ttft_ms"] > 1.2 * base[key]["sim_median_ttft_ms"]
    assert row["meas_median_ttft_ms"] == base[key]["meas_median_ttft_ms"]


def test_arrival_fit_recovers_the_cost_per_arrival_beside_per_run_speeds():
    rows = []
    for run, k in enumerate((0.9, 1.0, 1.15)):  # each run at its own host speed
        for i in range(40):
            modelled, arrivals = 0.05 + 0.01 * (i % 7), i % 4
            rows.append((run, modelled, k * modelled + 0.004 * arrivals
                         + 1e-4 * ((i * 7919) % 11 - 5), arrivals))
    c, err = arrival_steps.fit(rows)
    assert c == pytest.approx(0.004, abs=3 * err) and err < 2e-4
    assert arrival_steps.fit([(r, m, d, 0) for r, m, d, _ in rows]) is None
    # two runs' speeds and the cost from three steps: not enough to fit
    assert arrival_steps.fit([rows[0], rows[1], rows[40]]) is None


def test_bimodal_cells_counts_the_requests_that_waited_a_mixed_step():
    """bimodal_cells.py on v20's 512-token colocated cells at 0.5 req/s: 15 of the 30
    requests waited a mixed step (5 in each repeat), so the median lies in the gap
    between the two middle TPOTs; the simulation's requests are counted the same way."""
    import bimodal_cells

    rows = {r["instance"]: r for r in bimodal_cells.cell_rows("sim/v20", "quiet_512", "0.5",
                                                              0.6, 2)}
    assert set(rows) == {"colocated", "colocated-1t"}
    two = rows["colocated"]
    assert (two["meas_hit"], two["meas_n"], two["sim_n"]) == (15, 30, 20)
    assert two["meas_middle"][1:3] == [53, 95] and two["meas_median"] == 74  # in the gap
    assert 0 < two["sim_hit"] < two["sim_n"]
    reps = [json.loads(p.read_text()) for p in sorted(
        (ROOT / "benchmarks/results/sim/v20/quiet_512/runs").glob("colocated_r0.5_rep*.json"))]
    assert [sum(max(i) > 0.6 for i in r["itls"] if i) for r in reps] == [5, 5, 5]


def test_repeats_with_their_own_arrivals_are_replayed_each_at_its_seed():
    """bench compare --arrivals-per-repeat: each repeat's run JSON records its own arrival
    seed, and simulate_cell replays every repeat at that seed (noise seeds shared out);
    repeats of one draw stay one pooled workload, as before."""
    from kvpush.sim.cluster import simulate_pooled
    from kvpush.sim.profile import load_profile

    prof = load_profile(PROFILE)
    rate, _label, w, cluster, _cell, reps = next(
        c for c in sv.cells(f"{SET}/quiet_512") if c[0] == "0.5" and c[1] == "push")
    assert not sv.per_repeat_arrivals(w, reps)  # v19: one draw for every repeat
    arrivals = [[q.arrival for q in res.requests]
                for res in sv.simulate_cell(prof, w, cluster, reps, 4)]
    assert len(arrivals) == 4 and all(a == arrivals[0] for a in arrivals)
    own = [{**r, "seed": w.seed + k} for k, r in enumerate(reps)]
    assert sv.per_repeat_arrivals(w, own)
    got = sv.simulate_cell(prof, w, cluster, own, 4)
    share = -(-4 // len(own))
    assert len(got) == share * len(own)
    for k in range(len(own)):
        wk = dataclasses.replace(w, seed=w.seed + k)
        want = simulate_pooled(prof, wk, dataclasses.replace(cluster, seed=k * share), share)
        for g, x in zip(got[k * share:(k + 1) * share], want, strict=True):
            assert [q.arrival for q in g.requests] == [q.arrival for q in x.requests]
            assert [q.token_times for q in g.requests] == [q.token_times for q in x.requests]
        assert [q.arrival for q in want[0].requests] == pytest.approx(wk.arrivals())
    assert [q.arrival for q in got[0].requests] != [q.arrival for q in got[share].requests]
