"""benchmarks/sim_check.py: the simulated-against-measured table and the replay of a
compare set's cells (the measurement itself runs only when the script is run)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

pytest.importorskip("simpy")

from kvpush.bench.compare import CompareConfig, ModeSpec  # noqa: E402
from kvpush.sim.profile import profile_from_dict  # noqa: E402
from test_sim import BASE  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "sim_check", Path(__file__).resolve().parents[1] / "benchmarks" / "sim_check.py")
sim_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sim_check)

CELL = {"median_ttft_ms": 100.0, "p90_ttft_ms": 200.0, "mean_tpot_ms": 20.0,
        "median_tpot_ms": 10.0}


def test_rows_pair_the_cells_and_report_each_error():
    measured = {"push@1": CELL, "pull@1": CELL, "push@inf": dict(CELL, median_tpot_ms=0.0)}
    simulated = {"push@1": {**CELL, "median_ttft_ms": 110.0, "p90_ttft_ms": 150.0},
                 "push@inf": CELL}  # pull@1 was not simulated: no row
    rows = sim_check.check_rows(measured, simulated)
    assert [r["cell"] for r in rows] == ["push@1", "push@inf"]
    push = rows[0]
    assert push["median_ttft_ms"] == {"measured": 100.0, "simulated": 110.0,
                                      "error_pct": pytest.approx(10.0)}
    assert push["p90_ttft_ms"]["error_pct"] == pytest.approx(-25.0)
    assert push["worst"] == pytest.approx(25.0)
    # nothing measured (0 ms): no error, and it does not count as the worst
    assert math.isnan(rows[1]["median_tpot_ms"]["error_pct"]) and rows[1]["worst"] == 0.0
    table = sim_check.format_table(rows)
    assert "| push@1 | 100 / 110 (+10%) | 200 / 150 (-25%) | 20.0 / 20.0 (+0%) |" in table
    assert table.splitlines()[2].endswith("| no |")
    assert "| 0.0 / 10.0 (-) | yes |" in table
    assert "1 of 2 cells within 15% on every metric" in table
    assert "2 of 2 cells within 30%" in sim_check.format_table(rows, limit=30)


def test_cells_replay_each_mode_and_rate_of_the_compare_set():
    """Each cell is the compare set's workload (lengths, count, the rate's arrival seed)
    on its configuration: colocated one instance, P/D one prefill + one decode."""
    profile = profile_from_dict(BASE)
    cfg = CompareConfig(modes=[ModeSpec("colocated"), ModeSpec("push"), ModeSpec("pull")],
                        rates=[2.0, math.inf], out_dir=Path("unused"), input_len=64,
                        output_len=4, num_prompts=5, seed=3)
    cells = sim_check.simulate_cells(profile, cfg)
    assert set(cells) == {f"{m}@{r}" for m in ("colocated", "push", "pull")
                          for r in ("2", "inf")}
    assert cells["colocated@2"]["label"] == "1x colocated"
    assert cells["push@inf"]["label"] == "1P1D push"
    assert all(c["completed"] == 5 and c["unfinished"] == 0 for c in cells.values())
    for key, _ in sim_check.METRICS:
        assert all(c[key] > 0 for c in cells.values())
    # the arrival draw is the one bench compare gives the rate (seed + 1000 x its index)
    from kvpush.sim.cluster import ClusterConfig, simulate
    from kvpush.sim.workload import Workload

    again = simulate(profile, Workload(5, 2.0, 64, 4, seed=3), ClusterConfig("push"))
    assert again.summary()["p90_ttft_ms"] == cells["push@2"]["p90_ttft_ms"]
    with pytest.raises(ValueError, match="one arrival draw"):
        sim_check.simulate_cells(profile, CompareConfig(**{**cfg.__dict__,
                                                           "arrivals_per_repeat": True}))
