"""kvpush simulate: what a request arriving at the host costs the steps in flight
(host.arrival_step_s; kvpush.sim.arrival_cost)."""

from __future__ import annotations

import pytest

pytest.importorskip("simpy")

from kvpush.sim.profile import ProfileError  # noqa: E402
from test_sim import prof  # noqa: E402


def engines(cost: float):
    import simpy

    from kvpush.sim.engine import EngineSim, Job, JobKind
    from kvpush.sim.workload import SimRequest

    p = prof(host={"corun_slowdown": 1.0, "arrival_step_s": {"s": cost}})
    env = simpy.Environment()
    m = p.step_model("colocated")
    a, b = (EngineSim(env, n, "colocated", m, p.instance) for n in "ab")
    done: dict[str, float] = {}
    for e in (a, b):
        e.arrival_cost = p.arrival_cost("colocated")

    def job(name: str, prompt: int) -> Job:
        return Job(SimRequest(rid=0, arrival=0.0, prompt_len=prompt, output_len=1),
                   JobKind.FULL, 1, on_finish=lambda _j, t: done.setdefault(name, t))

    return env, m, a, b, job, done


def test_an_arrival_lengthens_the_step_in_flight_and_not_an_idle_engine():
    env, m, a, b, job, done = engines(0.02)
    step = m.step_time([(256, 0, True, False)])
    a.submit(lambda: a.add(job("a", 256)))
    for t in (0.001, 0.002):  # two arrivals during a's step; b is idle throughout
        env.timeout(t).callbacks.append(lambda _e: (a.host_arrival(), b.host_arrival()))
    # one more while the step runs its extension: it counts too
    env.timeout(step + 0.01).callbacks.append(lambda _e: a.host_arrival())
    env.run()
    assert done["a"] == pytest.approx(step + 3 * 0.02)
    assert a.busy_time == pytest.approx(step + 3 * 0.02) and b.busy_time == 0.0
    # b was idle when they arrived: its next step is its own time
    b.submit(lambda: b.add(job("b", 64)))
    start = env.now
    env.run()
    assert done["b"] - start == pytest.approx(m.step_time([(64, 0, True, False)]))


def test_no_arrival_cost_leaves_a_step_as_modelled():
    env, m, a, _b, job, done = engines(0.0)
    a.submit(lambda: a.add(job("a", 256)))
    env.timeout(0.001).callbacks.append(lambda _e: a.host_arrival())
    env.run()
    assert done["a"] == pytest.approx(m.step_time([(256, 0, True, False)]))


def test_simulated_arrivals_charge_the_steps_in_flight():
    """Through the cluster: a lone request finds the host idle (its TTFT is unchanged);
    at a high rate, the engine is busy longer by the cost of the arrivals that landed
    during its steps, and none of it with the cost at 0."""
    from kvpush.sim.cluster import ClusterConfig, simulate
    from kvpush.sim.workload import Workload

    def run(cost: float, n: int, rate: float):
        p = prof(host={"corun_slowdown": 1.0, "arrival_step_s": {"s": cost}})
        return simulate(p, Workload(n, rate, 256, 4, seed=3), ClusterConfig("colocated"))

    lone = [run(c, 1, 1.0).requests[0].ttft for c in (0.0, 0.05)]
    assert lone[0] == pytest.approx(lone[1])
    base, costly = run(0.0, 40, 200.0), run(0.005, 40, 200.0)
    assert costly.engines[0].busy_time > base.engines[0].busy_time + 0.005
    ttft = [sum(r.ttft for r in res.requests) for res in (base, costly)]
    assert ttft[1] > ttft[0]
    for pd in ("pull", "push"):  # every instance of the host is charged: arrivals over
        # 2 s, while P prefills and D decodes 32 tokens each
        res = [simulate(prof(host={"corun_slowdown": 1.0, "arrival_step_s": {"s": c}}),
                        Workload(40, 20.0, 256, 32, seed=3), ClusterConfig(pd))
               for c in (0.0, 0.005)]
        assert all(b.busy_time > a.busy_time for a, b in zip(res[0].engines,
                                                             res[1].engines))


def test_profile_arrival_cost_is_per_step_model_and_checked():
    p = prof(host={"corun_slowdown": 1.0, "arrival_step_s": {"s": 0.003}})
    assert p.arrival_cost("prefill") == 0.003 and prof().arrival_cost("decode") == 0.0
    with pytest.raises(ProfileError, match="arrival_step_s"):
        prof(host={"corun_slowdown": 1.0, "arrival_step_s": {"s": -0.001}})
    with pytest.raises(ProfileError, match="arrival_step_s"):
        prof(host={"corun_slowdown": 1.0, "arrival_step_s": {"threads=9": 0.001}})


class Flat:  # every step modelled at 20 ms
    def step_time(self, chunks):
        return 0.02


DEC = [[1, 128, True, True]] * 4
PRE = [[128, 0, True, False]]


def test_arrival_step_cost_is_the_median_excess_per_arrival():
    from kvpush.sim.arrival_cost import arrival_step_cost, arrivals_during

    quiet = [{"t": float(i), "dur": 0.022, "chunks": DEC} for i in range(5)]  # 1.1x
    # 1, 2 and 1 arrivals during these: 5 ms each over 1.1 x 20 ms
    busy = [{"t": 10.0, "dur": 0.027, "chunks": DEC}, {"t": 11.0, "dur": 0.032, "chunks": DEC},
            {"t": 12.0, "dur": 0.027, "chunks": DEC}]
    arrivals = [10.01, 11.005, 11.02, 12.001, 20.0]  # the last lands in no step
    slow_prefill = [{"t": 13.0, "dur": 0.5, "chunks": PRE}]  # not a decode step: ignored
    assert arrivals_during(busy[1], sorted(arrivals)) == 2
    out = arrival_step_cost(quiet + busy + slow_prefill, arrivals + [13.1], Flat())
    assert out["arrival_step_s"] == pytest.approx(0.005)
    assert out["steps"] == {"with": 3, "without": 5} and out["arrivals"] == 6
    # too few steps on a side: no figure; a step no slower than r0: never below 0
    assert arrival_step_cost(quiet[:2] + busy, arrivals, Flat())["arrival_step_s"] is None
    assert arrival_step_cost(quiet + busy[:2], arrivals, Flat())["arrival_step_s"] is None
    fast = [dict(s, dur=0.02) for s in busy]
    assert arrival_step_cost(quiet + fast, arrivals, Flat())["arrival_step_s"] == 0.0


def test_arrival_step_cost_takes_r0_apart_by_the_neighbour():
    """Beside a busy neighbour steps run 1.3x, alone 1.1x: each step's excess is taken
    against its own side's r0, so the cost stays 5 ms."""
    from kvpush.sim.arrival_cost import arrival_step_cost

    neighbour = [{"t": 99.5, "dur": 10.0, "chunks": PRE}]  # mid-step from 99.5 to 109.5
    alone = [{"t": float(i), "dur": 0.022, "chunks": DEC} for i in range(4)]
    beside = [{"t": 100.0 + i, "dur": 0.026, "chunks": DEC} for i in range(4)]
    busy = [{"t": 10.0, "dur": 0.027, "chunks": DEC},      # alone, 1 arrival
            {"t": 105.5, "dur": 0.031, "chunks": DEC},     # beside, 1 arrival
            {"t": 106.5, "dur": 0.031, "chunks": DEC}]     # beside, 1 arrival
    arrivals = [10.01, 105.51, 106.51]
    out = arrival_step_cost(alone + beside + busy, arrivals, Flat(), neighbour)
    assert out["arrival_step_s"] == pytest.approx(0.005)
    # without the split, r0 pools both sides and the figure moves
    pooled = arrival_step_cost(alone + beside + busy, arrivals, Flat())
    assert pooled["arrival_step_s"] != pytest.approx(0.005)


def test_calibrate_takes_one_thread_from_the_pair_and_the_rest_from_the_probes():
    from kvpush.sim.calibrate import arrival_costs

    def probe(cost):
        return {"arrival_step": {"arrival_step_s": cost, "steps": {}}}

    served = {"threads=1": probe(0.001), "threads=2": probe(0.004)}
    assert arrival_costs(served, probe(0.003), "threads=1") == {
        "threads=1": 0.003, "threads=2": 0.004}
    # not measured (too few steps, no pair, an older probe): left out
    assert arrival_costs({"threads=1": probe(0.001), "threads=2": probe(None)}, {},
                         "threads=1") == {}
    assert arrival_costs({"threads=2": {}}, probe(0.002), "threads=1") == {"threads=1": 0.002}


def test_served_pair_probe_measures_the_arrival_cost_on_d(tiny_llama):
    """The served 1P1D pair probe on a tiny model: D's decode steps are counted with and
    without a request arriving during them (P's arrivals), and every process it started
    is gone."""
    pytest.importorskip("nixl._api", reason="push mode needs NIXL")
    import os

    from kvpush.cluster.launcher import descendant_pids
    from kvpush.sim.corun import probe_served_pair
    from kvpush.sim.profile import engine_step_model
    from test_sim import BASE

    before = set(descendant_pids(os.getpid()))
    logged: list[str] = []
    out = probe_served_pair(str(tiny_llama), engine_step_model(BASE, "s"), input_len=24,
                            output_len=16, num_prompts=8, rate=20.0, log=logged.append)
    arrival = out["arrival_step"]
    # 8 requests 50 ms apart, 16 tokens each: D decodes while most of them arrive
    assert arrival["steps"]["with"] + arrival["steps"]["without"] >= 8 * 15 // 2
    assert arrival["arrivals"] >= 8  # P's trace: every request (and the warm-up's)
    assert arrival["arrival_step_s"] is None or arrival["arrival_step_s"] >= 0
    assert "decode steps with / without arrivals" in logged[0]
    assert set(descendant_pids(os.getpid())) <= before


def test_busy_spans_answer_as_a_scan_over_every_step_would():
    """BusySpans (binary search) against the plain rule, on overlapping steps of two
    instances and on the edges: a step is mid-step strictly between start and end."""
    import random

    from kvpush.sim.corun import BusySpans

    rng = random.Random(5)
    steps = [{"t": rng.uniform(0, 10), "dur": rng.uniform(0.01, 1.5)} for _ in range(60)]
    spans = BusySpans(steps)
    for t in [rng.uniform(-1, 12) for _ in range(500)] + [s["t"] for s in steps] + [
            s["t"] + s["dur"] for s in steps]:
        assert spans.at(t) == any(o["t"] < t < o["t"] + o["dur"] for o in steps), t
    assert not BusySpans([]).at(1.0)


def test_served_probe_records_the_arrival_cost(tiny_llama):
    """The colocated served probe on a tiny model counts its decode steps with and
    without an arrival during them, from its own trace, and logs the figure's basis."""
    import math
    import os

    from kvpush.cluster.launcher import descendant_pids
    from kvpush.sim.profile import engine_step_model
    from kvpush.sim.served import ServedProbe, probe_served
    from test_sim import BASE

    before = set(descendant_pids(os.getpid()))
    logged: list[str] = []
    probe = ServedProbe(input_len=24, output_len=16, num_prompts=6, rates=(20.0, math.inf),
                        long_input_len=None, burst_input_len=64, burst_num_prompts=8,
                        burst_output_len=2)
    out = probe_served(str(tiny_llama), 1, engine_step_model(BASE, "s"), probe,
                       log=logged.append)
    arrival = out["arrival_step"]
    # both rates' requests and their two warm-ups each (bench compare), not the burst's
    assert arrival["arrivals"] == 2 * (6 + 2)
    # the burst's steps: prompts prefilled four or more to a step, kept in the trace
    bursts = [ch for ch, _ in out["trace"] if sum(c[0] >= 64 for c in ch) >= 4]
    assert bursts and out["steps"]["prefill_burst"] == len(bursts)
    assert arrival["steps"]["with"] + arrival["steps"]["without"] >= 12 * 15 // 2
    assert arrival["arrival_step_s"] is None or arrival["arrival_step_s"] >= 0
    assert "decode steps with / without arrivals" in logged[0]
    # ~100 decode steps: too few for a percentile table (MIN_QUANTILE_STEPS)
    assert out["noise_quantiles"] == {}
    # the all-at-once run's and the burst's first gaps; light-rate arrivals that found
    # the engine idle time its wake
    assert len(out["burst_first_gaps_s"]) == 2
    assert all(0 <= g < 1.0 for g in out["burst_first_gaps_s"])
    assert 0 <= out["engine_wake_s"] < 0.05
    assert set(descendant_pids(os.getpid())) <= before
