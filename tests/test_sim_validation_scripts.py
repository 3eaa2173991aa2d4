"""The scripts that make the simulator's validation tables (benchmarks/sim_validate.py,
sim_validate_sets.py, arrival_steps.py), on a committed run set (benchmarks/results/
sim/v19) and on synthetic rows: which cells they replay, with which configuration, and
what they fit."""

from __future__ import annotations

import dataclasses
import json
import math
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
    profile, one run per measured repeat (at least), each set on its own noise seeds
    after the ones of the set before it, all pooled."""
    from kvpush.sim.cluster import simulate_pooled, summarize
    from kvpush.sim.profile import load_profile

    other = ROOT / "benchmarks/results/sim/v18/cpu-local-pooled.json"
    rows = svs.validate_sets([(SET, PROFILE), (SET, other)], replicas=2)
    got = next(r for r in rows if (r["workload"], r["mode"], r["rate"]) == (
        "short_high_rate", "push", "4"))
    _rate, _label, w, cluster, _cell, reps = next(
        c for c in sv.cells(f"{SET}/short_high_rate") if c[:2] == ("4", "push"))
    n = len(reps)  # 3 repeats per set: 2 noise seeds over 6 repeats is 1 run each
    assert got["sim_runs"] == 2 * n
    runs = (simulate_pooled(load_profile(PROFILE), w, cluster, n)
            + simulate_pooled(load_profile(other), w,
                              dataclasses.replace(cluster, seed=cluster.seed + n), n))
    want = summarize(runs)
    alone = summarize(simulate_pooled(load_profile(PROFILE), w, cluster, 2 * n))
    assert got["sim_median_ttft_ms"] == pytest.approx(want["median_ttft_ms"])
    assert got["sim_median_ttft_ms"] != pytest.approx(alone["median_ttft_ms"])


def test_validate_sets_weigh_each_set_as_its_repeats_weigh_measured():
    """v19 (one arrival draw, 10 prompts a run) and v21 (each repeat its own draw, 20
    prompts a run): every set gets the same whole number of simulated runs per measured
    repeat, so the pooled simulation mixes the sets as the pooled measurement does."""
    v21 = ROOT / "benchmarks/results/sim/v21/cpu-local-pooled.json"
    rows = {(r["workload"], r["mode"], r["rate"]): r
            for r in svs.validate_sets([(SET, PROFILE), ("sim/v21", v21)], replicas=16)}
    quiet = rows["quiet_512", "push", "0.5"]
    assert quiet["repeats"] == 6 and quiet["n"] == 3 * 10 + 3 * 20
    assert quiet["sim_runs"] == 3 * 6  # ceil(16 / 6) runs per repeat
    hit = rows["prefix_hit", "push", "1"]
    assert hit["repeats"] == 8 and hit["sim_runs"] == 2 * 8


def test_validate_sets_arrival_cost_what_if_lengthens_loaded_cells():
    base = {(r["workload"], r["mode"], r["rate"]): r
            for r in svs.validate_sets([(SET, PROFILE)], replicas=1, arrival_step_s=0.0)}
    more = svs.validate_sets([(SET, PROFILE)], replicas=1, arrival_step_s=0.05)
    key = ("short_high_rate", "colocated", "4")
    row = next(r for r in more if (r["workload"], r["mode"], r["rate"]) == key)
    assert row["sim_median_ttft_ms"] > 1.2 * base[key]["sim_median_ttft_ms"]
    assert row["meas_median_ttft_ms"] == base[key]["meas_median_ttft_ms"]


def test_validate_sets_without_a_served_kind_prices_its_steps_by_the_fallback():
    """v21's 2-thread profile prices batched prefills at 1.14x the engine alone, lone
    ones at ~1.05x: without the batched factor, the colocated instance's short-prompt
    bursts (eight prompts a step) simulate faster; the measurement is untouched."""
    v21 = ("sim/v21", ROOT / "benchmarks/results/sim/v21/cpu-local-pooled.json")
    key = ("short_high_rate", "colocated", "inf")

    def cell(**what_if):
        rows = svs.validate_sets([v21], replicas=1, **what_if)
        return next(r for r in rows if (r["workload"], r["mode"], r["rate"]) == key)

    base, dropped = cell(), cell(without_kind="prefill_batched")
    assert dropped["sim_median_ttft_ms"] < 0.97 * base["sim_median_ttft_ms"]
    assert dropped["meas_median_ttft_ms"] == base["meas_median_ttft_ms"]
    # v21's profile has no burst factor: dropping it prices every step as before
    assert cell(without_kind="prefill_burst")["sim_median_ttft_ms"] == pytest.approx(
        base["sim_median_ttft_ms"])


def test_validate_sets_lends_a_burst_start_and_drops_it(tmp_path):
    """v26's profile measured no burst start. Lent one whose first gap (0) is shorter
    than its engine wake (0.3 ms), every simulated burst's first step takes two prompts:
    the 2-thread short-prompt burst's staircase moves up a step and its median TTFT falls
    (the measurement is untouched); dropped again, the cell simulates as before. A lender
    without first gaps is refused."""
    import json

    v26 = ("sim/v26", ROOT / "benchmarks/results/sim/v26/cpu-local-pooled-quantiles.json")
    key = ("short_high_rate", "colocated", "inf")
    data = json.loads(v26[1].read_text())
    data["handoff"].update(burst_first_gaps_s=[0.0], engine_wake_s=0.0003)
    lender = tmp_path / "lender.json"
    lender.write_text(json.dumps(data))

    def cell(sets, **what_if):
        rows = svs.validate_sets(sets, replicas=3, **what_if)
        return next(r for r in rows if (r["workload"], r["mode"], r["rate"]) == key)

    base, lent = cell([v26]), cell([v26], burst_start_from=lender)
    assert lent["sim_median_ttft_ms"] < 0.9 * base["sim_median_ttft_ms"]
    assert lent["meas_median_ttft_ms"] == base["meas_median_ttft_ms"]
    # the lender's own start, dropped: as the profile without it
    dropped = cell([("sim/v26", lender)], without_burst_start=True)
    assert dropped["sim_median_ttft_ms"] == pytest.approx(base["sim_median_ttft_ms"])
    import burst_start

    out = burst_start.burst_starts("sim/v26", "cpu-local-pooled-quantiles.json", seeds=2,
                                   burst_start_from=lender)
    assert out["simulated"] == [2] * 6
    # the holdout lends it alike (v25 held out against v26 and back)
    import sim_holdout

    v25 = ("sim/v25", ROOT / "benchmarks/results/sim/v25/cpu-local-pooled-quantiles.json")

    def held(**lend):
        rows = sim_holdout.holdout([v25, v26], replicas=3, **lend)
        return next(r for r in rows if (r["set"], r["workload"], r["rate"], r["mode"])
                    == ("sim/v26", "short_high_rate", "inf", "colocated"))

    assert held(burst_start_from=lender)["err_sim_median_ttft_ms"] < \
        held()["err_sim_median_ttft_ms"] - 0.05
    data["handoff"]["burst_first_gaps_s"] = []
    lender.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="burst_first_gaps_s"):
        svs.validate_sets([v26], replicas=1, burst_start_from=lender)


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


def test_validate_sets_writes_results_md_only_when_asked(tmp_path, monkeypatch, capsys):
    """--results puts the pooled table into RESULTS.md as well (the validation of record);
    without it only SIMULATION.md's section is written."""
    sim_doc, results_doc = tmp_path / "SIMULATION.md", tmp_path / "RESULTS.md"
    results_doc.write_text("# results\n")
    monkeypatch.setattr(sv, "DOC", sim_doc)
    monkeypatch.setattr(sv, "RESULTS_DOC", results_doc)
    args = ["--set", f"{SET}=sim/v19/cpu-local-pooled.json", "--replicas", "1",
            "--marker", "pooled_check"]
    assert svs.main(args) == 0
    assert "<!-- pooled_check:begin -->" in sim_doc.read_text()
    # the command shown regenerates the table: a seed count other than the default is in it
    assert "--replicas 1 --marker pooled_check`" in sim_doc.read_text()
    assert results_doc.read_text() == "# results\n"
    # RESULTS.md without the markers: refused, nothing appended
    with pytest.raises(SystemExit):
        svs.main(args + ["--results"])
    assert "has no <!-- pooled_check:begin/end -->" in capsys.readouterr().err
    assert results_doc.read_text() == "# results\n"
    results_doc.write_text("# results\n\n<!-- pooled_check:begin -->\n"
                           "<!-- pooled_check:end -->\n\nafter\n")
    assert svs.main(args + ["--results"]) == 0
    text = results_doc.read_text()
    assert "<!-- pooled_check:begin -->" in text and "--results`" in text
    assert "TPOT med:" in text and text.endswith("\n\nafter\n")
    capsys.readouterr()


def _run(ttft_s: float, tpot_s: float, n: int = 4) -> dict:
    """A measured repeat of n requests with one TTFT and one TPOT (3 output tokens)."""
    return {"ttfts": [ttft_s] * n, "e2els": [ttft_s + 2 * tpot_s] * n,
            "output_lens": [3] * n, "errors": [""] * n}


def test_resampled_shares_count_the_draws_whose_pool_the_simulation_is_within():
    import random

    fast, slow = _run(1.0, 0.1), _run(2.0, 0.1)
    sim = {"median_ttft_ms": 1000.0, "p90_ttft_ms": 1100.0, "median_tpot_ms": 100.0}
    # every repeat alike: each draw pools the same requests
    shares = svs.resampled_shares([fast, fast, fast], sim, 200, random.Random(0))
    assert shares == {"median_ttft_ms": 1.0, "p90_ttft_ms": 1.0, "median_tpot_ms": 1.0}
    shares = svs.resampled_shares([slow, slow], sim, 200, random.Random(0))
    assert shares["median_ttft_ms"] == 0.0 and shares["median_tpot_ms"] == 1.0
    # one fast and one slow repeat: only a draw of the fast one twice (1 in 4) pools a
    # median of 1000 ms; any slow repeat drawn puts it at 1500 or 2000 ms
    shares = svs.resampled_shares([fast, slow], sim, 2000, random.Random(0))
    assert 0.2 < shares["median_ttft_ms"] < 0.3
    # the same draws for the same generator: a table regenerates as it was
    assert shares == svs.resampled_shares([fast, slow], sim, 2000, random.Random(0))


def test_resampled_shares_pool_as_the_table_does():
    """One repeat: every draw is that repeat, so each share says whether the table's
    own verdict holds; its requests' TTFTs spread out (the p90 is not the median) and
    failed requests are left out, as compare_report.pooled leaves them out."""
    import random

    from kvpush.bench.compare_report import pooled

    run = {"ttfts": [0.1 * k for k in range(1, 11)] + [9.0] * 5,
           "e2els": [0.1 * k + 0.05 * k for k in range(1, 11)] + [9.5] * 5,
           "output_lens": [2] * 15, "errors": [""] * 10 + ["timeout"] * 5,
           "itls": [[0.05]] * 15, "request_throughput": 1.0, "completed": 10, "failed": 5}
    exact = {m: pooled([run])[m] for m in ("median_ttft_ms", "p90_ttft_ms", "median_tpot_ms")}
    assert exact["p90_ttft_ms"] == pytest.approx(910.0)
    assert svs.resampled_shares([run], exact, 20, random.Random(1)) == dict.fromkeys(exact, 1.0)
    off = dict(exact, p90_ttft_ms=exact["p90_ttft_ms"] * 1.2)
    assert svs.resampled_shares([run], off, 20, random.Random(1))["p90_ttft_ms"] == 0.0
    # a share just under the floor is not shown as the floor
    row = {"workload": "w", "mode": "pull", "rate": "1", "repeats": 1,
           "share_median_ttft_ms": 0.8999, "share_p90_ttft_ms": 1.0, "share_median_tpot_ms": 1.0}
    assert "| w | pull | 1 | 1 | 89.9% | 100.0% | 100.0% |" in svs.resample_table([row], 10)


def test_resample_table_lists_only_the_cells_below_the_floor():
    rows = [{"workload": "w", "mode": m, "rate": "inf", "repeats": 3,
             "share_median_ttft_ms": a, "share_p90_ttft_ms": 1.0, "share_median_tpot_ms": b}
            for m, a, b in (("push", 1.0, 0.95), ("pull", 0.5, 1.0))]
    text = svs.resample_table(rows, 100)
    assert "| w | pull | inf | 3 | 50.0% | 100.0% | 100.0% |" in text
    assert "| w | push |" not in text
    assert "at least 90% of the draws: 1 / 2 / 2 of 2 cells" in text


def test_validate_sets_resamples_show_in_the_table_and_its_command(capsys):
    args = ["--set", f"{SET}=sim/v19/cpu-local-pooled.json", "--replicas", "1", "--no-write"]
    assert svs.main(args + ["--resamples", "5"]) == 0
    out = capsys.readouterr().out
    assert "--replicas 1 --resamples 5`" in out and "Resampled (5 draws" in out
    assert "of the draws:" in out
    assert svs.main(args) == 0
    assert "Resampled" not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        svs.main(args + ["--resamples", "-1"])
    assert "--resamples must be >= 0" in capsys.readouterr().err


def test_lender_arg_refuses_a_missing_file_or_a_profile_without_a_burst_start(capsys):
    """The three scripts' --burst-start-from: a usage error, not a traceback, for a
    file that is not there or a profile calibrated before the probe measured a start."""
    import argparse

    ap = argparse.ArgumentParser(prog="check")
    assert svs.lender_arg(ap, None) is None
    with pytest.raises(SystemExit):
        svs.lender_arg(ap, "sim/no-such-profile.json")
    assert "--burst-start-from: no file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        svs.lender_arg(ap, "sim/v26/cpu-local-pooled-quantiles.json")
    assert "no handoff.burst_first_gaps_s to lend" in capsys.readouterr().err
    assert svs.lender_arg(ap, "sim/v27/cpu-local-pooled-quantiles.json") == \
        sv.RESULTS / "sim/v27/cpu-local-pooled-quantiles.json"


def test_noise_phrase_names_each_kinds_noise():
    """The header says which kinds draw from percentiles (their draws' mean factor) and
    which keep a log-normal (its sigma); old profiles read as before."""
    from kvpush.sim.noise import table_mean

    table = [-0.05, 0.0, 0.02, 0.4]
    host = {"step_noise": {"threads=2": {"prefill": 0.05, "decode": 0.07}},
            "step_noise_quantiles": {"threads=2": {"decode": table}}}
    assert table_mean(table) < sum(math.exp(x) for x in table) / len(table)
    phrase = sv.noise_phrase(host)
    assert f"threads=2 prefill sigma 0.050/decode mean {table_mean(table):.3f}" in phrase
    assert sv.noise_phrase({"step_noise": {"s": {"decode": 0.07}}}) == (
        "Step noise (host.step_noise, sigma of log step time): s decode 0.070")
    assert sv.noise_phrase({}) == ""


def test_burst_start_reads_the_first_step_and_replays_it():
    """burst_start.py on v26's short-prompt burst: the measured first steps took 1, 1
    and 2 prompts, the 2-prompt one where the first two arrivals came 0.1 ms apart; the
    simulator's front end spaces arrivals evenly, so its first step takes one (the
    lead of SIMULATION.md 1-v26: a change there shows here)."""
    import burst_start

    out = burst_start.burst_starts("sim/v26", "cpu-local-pooled-quantiles.json", seeds=2)
    assert [n for n, _, _ in out["measured"]] == [1, 1, 2]
    gaps = [gap for _, gap, _ in out["measured"]]
    assert gaps[2] < 0.001 < min(gaps[:2])
    assert all(0 <= wake < 0.01 for _, _, wake in out["measured"])
    assert out["simulated"] == [1] * 6


def test_bimodal_cells_counts_the_requests_that_waited_a_mixed_step():
    """bimodal_cells.py on v20's 512-token colocated cells at 0.5 req/s: 15 of the 30
    requests waited a mixed step (5 in each repeat), so the median lies in the gap
    between the two middle TPOTs; the simulation's requests are counted the same way,
    and request by request it calls every 2-thread request's wait as measured."""
    import bimodal_cells

    rows = {r["instance"]: r for r in bimodal_cells.cell_rows("sim/v20", "quiet_512", "0.5",
                                                              0.6, 3)}
    assert set(rows) == {"colocated", "colocated-1t"}
    two = rows["colocated"]
    assert (two["meas_hit"], two["meas_n"], two["sim_n"]) == (15, 30, 3 * 3 * 10)
    assert two["meas_middle"][1:3] == [53, 95] and two["meas_median"] == 74  # in the gap
    assert 0 < two["sim_hit"] < two["sim_n"]
    assert two["agree"] == 30 and rows["colocated-1t"]["agree"] < 30
    reps = [json.loads(p.read_text()) for p in sorted(
        (ROOT / "benchmarks/results/sim/v20/quiet_512/runs").glob("colocated_r0.5_rep*.json"))]
    assert [sum(max(i) > 0.6 for i in r["itls"] if i) for r in reps] == [5, 5, 5]
    assert bimodal_cells.waited([0.0, 0.1, 0.8, 0.9], 0.6)
    assert not bimodal_cells.waited([0.0, 0.5, 1.0], 0.6)
    # for --pooled: v20 replayed one arrival draw (seed 0) in its three repeats; v22 drew
    # seeds 0-2, so the two sets pooled rest on three draws, v20's inside v22's first
    assert [d for d, _ in two["repeat_tpots"]] == [0, 0, 0]
    v22 = bimodal_cells.cell_rows("sim/v22", "quiet_512", "0.5", 0.6, 1)
    pooled = {r["instance"]: r for r in bimodal_cells.pooled_rows(
        list(rows.values()) + v22, resamples=20)}
    assert (pooled["colocated"]["draws"], pooled["colocated"]["repeats"]) == (3, 6)
    assert pooled["colocated"]["meas_n"] == 30 + 60
    burst = bimodal_cells.cell_rows("sim/v22", "quiet_512", "inf", 0.6, 1)
    assert {d for r in burst for d, _ in r["repeat_tpots"]} == {"burst"}


def test_bimodal_cells_pooled_interval_resamples_arrival_draws():
    """--pooled: the measured median's interval comes from arrival draws drawn again
    whole, a draw being every repeat (of any set) at one arrival seed. Two sets, each
    with a fast repeat at seed 0 and a slow one at seed 1: two draws, so a resample is
    all fast (1 in 4), all slow (1 in 4) or half and half (median in the gap), and only
    the all-fast ones lie within 15% of a simulated median at the fast level (4
    independent repeats would give 5 in 16). All-alike draws give no spread."""
    import bimodal_cells as bc

    same = bc.resampled_medians([[0.05, 0.07]] * 4, resamples=50)
    assert same == pytest.approx([0.06] * 50)
    fast, slow = [0.060] * 10, [0.090] * 10
    rows = [{"instance": "colocated", "meas_hit": 10, "meas_n": 20, "sim_hit": 40,
             "sim_n": 80, "repeat_tpots": [(0, fast), (1, slow)], "sim_tpots": [0.061] * 80},
            {"instance": "colocated", "meas_hit": 10, "meas_n": 20, "sim_hit": 40,
             "sim_n": 80, "repeat_tpots": [(0, fast), (1, slow)], "sim_tpots": [0.063] * 80},
            {"instance": "colocated-1t", "meas_hit": 0, "meas_n": 20, "sim_hit": 0,
             "sim_n": 80, "repeat_tpots": [(0, fast), (1, fast)], "sim_tpots": [0.2] * 80}]
    two, one = bc.pooled_rows(rows, resamples=2000)
    assert (two["instance"], two["repeats"], two["draws"]) == ("colocated", 4, 2)
    assert (two["meas_hit"], two["meas_n"], two["sim_hit"], two["sim_n"]) == (20, 40, 80, 160)
    assert two["meas_median"] == 75 and two["sim_median"] == 62
    assert two["err"] == pytest.approx((0.062 - 0.075) / 0.075)
    assert two["interval"] == (60, 90)
    assert two["within"] == pytest.approx(0.25, abs=0.04)
    assert one["draws"] == 2 and one["interval"] == (60, 60) and one["within"] == 0.0


def test_bimodal_cells_simulates_on_the_profile_file_named():
    """--profile picks each set's profile file: the measured side is the same, the
    simulated side comes from that file (v20's decode-percentile profile draws its decode
    steps from the tables, so its simulated requests differ), and a name no set has is
    an error, not a silent fallback."""
    import bimodal_cells

    from kvpush.sim.profile import ProfileError

    plain = bimodal_cells.cell_rows("sim/v20", "quiet_512", "0.5", 0.6, 2)
    tables = bimodal_cells.cell_rows("sim/v20", "quiet_512", "0.5", 0.6, 2,
                                     "cpu-local-pooled-quantiles.json")
    for a, b in zip(plain, tables, strict=True):
        assert (a["meas_hit"], a["meas_middle"]) == (b["meas_hit"], b["meas_middle"])
    assert [(r["sim_hit"], r["sim_median"]) for r in plain] != [
        (r["sim_hit"], r["sim_median"]) for r in tables]
    with pytest.raises(ProfileError, match="no profile"):
        bimodal_cells.cell_rows("sim/v20", "quiet_512", "0.5", 0.6, 2, "nope.json")


def test_sim_band_replays_one_measurement_per_group_and_flags_a_wide_band():
    """sim_band.py: every simulated measurement has one run per measured repeat, at its
    noise seed cluster.seed + g x R + k; the band's quantiles and flags follow the
    values."""
    import sim_band

    from kvpush.sim.cluster import simulate
    from kvpush.sim.profile import load_profile

    prof = load_profile(PROFILE)
    _rate, _label, w, cluster, _cell, reps = next(
        c for c in sv.cells(f"{SET}/quiet_512") if c[0] == "0.5" and c[1] == "colocated")
    sims = sv.simulated_measurements(prof, w, cluster, reps, 2)
    assert [len(m) for m in sims] == [len(reps)] * 2
    again = simulate(prof, w, dataclasses.replace(cluster, seed=1 * len(reps) + 2))
    assert [q.token_times for q in sims[1][2].requests] == [
        q.token_times for q in again.requests]
    # repeats with their own arrivals: run k of every measurement at repeat k's seed
    own = [{**r, "arrival_seed": w.seed + 7 * k} for k, r in enumerate(reps)]
    for m in sv.simulated_measurements(prof, w, cluster, own, 2):
        for k, run in enumerate(m):
            assert [q.arrival for q in run.requests] == pytest.approx(
                dataclasses.replace(w, seed=w.seed + 7 * k).arrivals())
    from kvpush.bench.metrics import percentile  # the band's p10 / p90

    assert percentile([1.0, 2.0, 3.0, 5.0], 50) == pytest.approx(2.5)
    assert percentile([4.0], 90) == 4.0
    row = {"measured": 75.0, "sim": 55.0, "values": [50.0, 55.0, 60.0, 90.0, 95.0]}
    d = sim_band.describe(row)
    assert (d["p10"], d["p90"]) == (pytest.approx(52.0), pytest.approx(93.0))
    assert not d["within"] and d["inside"] and d["half_width"] > sv.TOLERANCE
    text = sim_band.table([{**row, "workload": "w", "mode": "colocated", "rate": "0.5",
                            "metric": "TPOT med"}])
    assert "| 52-93 | 50-95 |" in text and "1 of them with the measured value inside" in text
    assert "median ±37%, largest ±37%" in text  # (93 - 52) / 2 / 55


@pytest.mark.parametrize("first_seed", [0, 40])
def test_repeats_with_their_own_arrivals_are_replayed_each_at_its_seed(first_seed):
    """bench compare --arrivals-per-repeat: each repeat's run JSON records its own arrival
    seed, and simulate_cell replays every repeat at that seed, the noise seeds shared
    out from the cluster's on; repeats of one draw stay one pooled workload, as before."""
    from kvpush.sim.cluster import simulate_pooled
    from kvpush.sim.profile import load_profile

    prof = load_profile(PROFILE)
    _rate, _label, w, cluster, _cell, reps = next(
        c for c in sv.cells(f"{SET}/quiet_512") if c[0] == "0.5" and c[1] == "push")
    cluster = dataclasses.replace(cluster, seed=first_seed)
    assert not sv.per_repeat_arrivals(w, reps)  # v19: one draw for every repeat
    arrivals = [[q.arrival for q in res.requests]
                for res in sv.simulate_cell(prof, w, cluster, reps, 4)]
    assert len(arrivals) == 4 and all(a == arrivals[0] for a in arrivals)
    # runs made at 97933e8 record the arrival seed as "seed"; later ones as arrival_seed
    own = [{**r, "seed": w.seed + k} if k % 2 else {**r, "arrival_seed": w.seed + k}
           for k, r in enumerate(reps)]
    assert sv.per_repeat_arrivals(w, own)
    got = sv.simulate_cell(prof, w, cluster, own, 4)
    share = -(-4 // len(own))
    assert len(got) == share * len(own)
    for k in range(len(own)):
        wk = dataclasses.replace(w, seed=w.seed + k)
        want = simulate_pooled(prof, wk, dataclasses.replace(
            cluster, seed=first_seed + k * share), share)
        for g, x in zip(got[k * share:(k + 1) * share], want, strict=True):
            assert [q.arrival for q in g.requests] == [q.arrival for q in x.requests]
            assert [q.token_times for q in g.requests] == [q.token_times for q in x.requests]
        assert [q.arrival for q in want[0].requests] == pytest.approx(wk.arrivals())
    assert [q.arrival for q in got[0].requests] != [q.arrival for q in got[share].requests]
    # all at once: every draw is the same, so the repeats stay one workload
    burst = dataclasses.replace(w, rate=float("inf"))
    assert not sv.per_repeat_arrivals(burst, own)


def test_holdout_pairs_a_set_only_with_sets_that_ran_the_cell_alike():
    """sim_holdout.py: v20 ran quiet_512 with 10 prompts, v21 with 20, so neither is the
    other's reference there; their other workloads match, and the reference error is the
    other set's pooled repeats against this set's measurement. The simulated error is the
    set's own simulation (sim_validate.py's), whatever the other set holds."""
    import sim_holdout

    from kvpush.bench.compare_report import pooled

    cells = {s: {(r, lbl): (w, c, cell, reps) for r, lbl, w, c, cell, reps
                 in sv.cells(f"{s}/quiet_512")} for s in ("sim/v20", "sim/v21", "sim/v23")}
    key = ("0.5", "push")
    assert not sim_holdout.same_cell(cells["sim/v20"][key], cells["sim/v21"][key])
    # v23 drew other prompts and arrivals (seed 23) of the same workload
    assert sim_holdout.same_cell(cells["sim/v21"][key], cells["sim/v23"][key])
    prof = ROOT / "benchmarks/results/sim/v21/cpu-local-pooled-quantiles.json"
    rows = sim_holdout.holdout([("sim/v20", PROFILE), ("sim/v21", prof)], replicas=1)
    assert len(rows) == 2 * 37
    for r in rows:
        assert r["others"] == (0 if r["workload"] == "quiet_512" else 1)
        assert ("err_others_median_ttft_ms" in r) == bool(r["others"])
    row = next(r for r in rows if (r["set"], r["workload"], r["rate"], r["mode"])
               == ("sim/v21", "long_prompts", "0.5", "pull"))
    reps20 = next(reps for r, lbl, _w, _c, _cell, reps in sv.cells("sim/v20/long_prompts")
                  if (r, lbl) == ("0.5", "pull"))
    meas = row["meas_p90_ttft_ms"]
    assert row["err_others_p90_ttft_ms"] == pytest.approx(
        (pooled(reps20)["p90_ttft_ms"] - meas) / meas)
    alone = sim_holdout.holdout([("sim/v21", prof), ("sim/v21", prof)], replicas=1)
    mine = next(r for r in alone if (r["workload"], r["rate"], r["mode"])
                == ("long_prompts", "0.5", "pull"))
    assert mine["err_sim_p90_ttft_ms"] == pytest.approx(row["err_sim_p90_ttft_ms"])
    assert mine["err_others_p90_ttft_ms"] == pytest.approx(0.0)  # itself as the other


def test_holdout_tables_count_only_the_cells_with_a_reference():
    """Counts: the simulation over every cell, the reference over the cells it has, and
    each missed metric of those cells as missed by one side or both."""
    import sim_holdout

    def row(others: int, sim: float, ref: float | None) -> dict:
        r = {"set": "sim/vX", "workload": "w", "mode": "push", "rate": "1", "others": others}
        for m, _ in sv.METRICS:
            r[f"meas_{m}"] = 100.0
            r[f"err_sim_{m}"] = sim
            if ref is not None:
                r[f"err_others_{m}"] = ref
        return r

    rows = [row(1, 0.05, 0.30), row(1, 0.30, 0.30), row(0, 0.20, None), row(1, 0.0, -0.10)]
    c = sim_holdout.counts(rows)
    assert (c["cells"], c["sim"], c["paired"], c["others"]) == ("4", "2 / 2 / 2", "3",
                                                                "1 / 1 / 1")
    assert (c["sim only"], c["others only"], c["both"]) == ("0", "3", "3")
    misses = sim_holdout.miss_table(rows).splitlines()[2:]
    assert len(misses) == 3 * 3  # the last row misses nothing
    assert all(line.endswith("| - |") for line in misses[6:])  # no reference: shown as -
    assert "+30% **x**" in misses[0] and "+5% |" in misses[0]


def test_holdout_refuses_sets_it_cannot_hold_out(capsys):
    """Fewer than two sets, or one folder twice, is a usage error (exit 2)."""
    import sim_holdout

    one = f"{SET}=sim/v19/cpu-local-pooled.json"
    for argv in (["--set", one], ["--set", one, "--set", one],
                 ["--set", "sim/v19=sim/v19/none.json", "--set", one]):
        with pytest.raises(SystemExit) as e:
            sim_holdout.main(argv + ["--no-write"])
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "at least two --set" in err and "named twice" in err and "FOLDER=PROFILE" in err
