"""The engine's per-step trace (KVPUSH_STEP_TRACE) and the simulator's served factors
built on it (kvpush.sim.served)."""

from __future__ import annotations

import asyncio
import copy
from types import SimpleNamespace

import pytest

from engine_helpers import greedy, make_engine
from kvpush.engine.step_trace import ENV_VAR, StepShapes, read_arrivals, read_trace


def _plan(*chunks):
    return SimpleNamespace(chunks=[SimpleNamespace(request_id=r, token_ids=[0] * n,
                                                   start_pos=pos, sample=smp)
                                   for r, n, pos, smp in chunks])


def test_step_shapes_mark_decodes_that_continue_from_the_step_before():
    s = StepShapes()
    assert s.shapes(_plan(("a", 8, 0, True))) == [(8, 0, True, False)]
    # a's first decode: its context is not in the dense decode cache yet
    assert s.shapes(_plan(("a", 1, 8, True), ("b", 4, 0, False))) == [
        (1, 8, True, False), (4, 0, False, False)]
    # a decoded at 8 in the step before: no fill now; b's chunk was no decode
    assert s.shapes(_plan(("a", 1, 9, True), ("b", 4, 4, True))) == [
        (1, 9, True, True), (4, 4, True, False)]
    # a step without a breaks the run: its next decode fills again
    s.shapes(_plan(("b", 1, 8, True)))
    assert s.shapes(_plan(("a", 1, 10, True))) == [(1, 10, True, False)]


def test_engine_writes_one_line_per_step_when_asked(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "steps"))
    eng = make_engine(tiny_llama)
    try:
        eng.add_request("r", list(range(5, 25)), greedy(max_tokens=3))
        steps = 0
        while eng.has_work() and steps < 20:
            eng.step()
            steps += 1
    finally:
        eng.shutdown()
    files = list((tmp_path / "steps").glob("both-*.jsonl"))
    assert len(files) == 1
    trace = read_trace(files[0])
    # the prompt samples token 1; two decodes follow, the first one filling the cache
    assert [st["chunks"] for st in trace] == [[[20, 0, True, False]], [[1, 20, True, False]],
                                              [[1, 21, True, True]]]
    assert all(st["dur"] > 0 for st in trace)
    assert trace[0]["t"] <= trace[1]["t"] <= trace[2]["t"]


def test_engine_writes_no_trace_by_default(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.chdir(tmp_path)
    eng = make_engine(tiny_llama)
    try:
        assert eng.step_trace is None
        eng.add_request("r", [1, 2, 3], greedy(max_tokens=1))
        eng.step()
    finally:
        eng.shutdown()
    assert not list(tmp_path.rglob("*.jsonl"))


def test_served_requests_leave_arrival_lines(tiny_llama, tmp_path, monkeypatch):
    """The front end notes each request as it hands it to the step loop; steps and
    arrivals are read apart."""
    from kvpush.engine.async_engine import AsyncEngine

    monkeypatch.setenv(ENV_VAR, str(tmp_path / "steps"))
    eng = make_engine(tiny_llama)

    async def main() -> float:
        engine = AsyncEngine(eng.config, engine=eng)
        engine.start()
        try:
            async def one(i: int) -> None:
                async for _ in engine.generate(f"r{i}", list(range(3 + i, 20)), greedy(2)):
                    pass

            t0 = __import__("time").time()
            await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(3))), 60)
            return t0
        finally:
            await engine.shutdown()

    t0 = asyncio.run(main())
    eng.shutdown()
    (path,) = (tmp_path / "steps").glob("both-*.jsonl")
    arrivals = read_arrivals(path)
    steps = read_trace(path)
    assert len(arrivals) == 3
    assert all(t0 - 1 <= t <= steps[-1]["t"] for t in arrivals)
    assert steps and all("chunks" in st and "arrival" not in st for st in steps)
    assert arrivals[0] <= steps[0]["t"]  # the first step ran what had arrived


def test_read_trace_skips_a_torn_last_line(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"t": 1, "dur": 0.1, "chunks": [[4, 0, true, false]]}\n{"t": 2, "du')
    assert read_trace(p) == [{"t": 1, "dur": 0.1, "chunks": [[4, 0, True, False]]}]


# ------------------------------------------------------------------- served factors
pytest.importorskip("simpy")

from kvpush.sim.profile import ProfileError, profile_from_dict  # noqa: E402
from kvpush.sim.served import (  # noqa: E402
    curve_factor,
    first_gap,
    front_end_gap,
    idle_wakes,
    served_curve,
    served_model_from,
    step_kind,
    step_pairs,
    without_kind,
)
from kvpush.sim.step_models import ScaledStepModel  # noqa: E402
from test_sim import BASE  # noqa: E402


def test_served_factors_scale_step_times_per_kind():
    plain = profile_from_dict(copy.deepcopy(BASE))
    d = copy.deepcopy(BASE)
    d["host"] = {"corun_slowdown": 1.0, "served_factors": {"s": {"prefill": 1.2,
                                                                   "decode": 1.5}}}
    served = profile_from_dict(d)
    a, b = plain.step_model("prefill"), served.step_model("prefill")
    prefill, decode, mixed = [(64, 0)], [(1, 64), (1, 30)], [(1, 64), (32, 0)]
    assert b.step_time(prefill) == pytest.approx(1.2 * a.step_time(prefill))
    assert b.step_time(decode) == pytest.approx(1.5 * a.step_time(decode))
    assert b.step_time(mixed) == pytest.approx(1.2 * a.step_time(mixed))  # a prefill step
    assert step_kind(mixed) == "prefill" and step_kind(decode) == "decode"
    # two prompts prefilled together: their own factor, else the prefill one
    batched, tail = [(128, 0), (128, 0), (1, 64)], [(1000, 0), (24, 0)]
    assert step_kind(batched) == "prefill_batched" and step_kind(tail) == "prefill"
    assert b.step_time(batched) == pytest.approx(1.2 * a.step_time(batched))
    d["host"]["served_factors"]["s"]["prefill_batched"] = 1.4
    c = profile_from_dict(d).step_model("prefill")
    assert c.step_time(batched) == pytest.approx(1.4 * a.step_time(batched))
    assert c.step_time(tail) == pytest.approx(1.2 * a.step_time(tail))
    # four or more prompts to a step: a burst, priced by its own factor, else batched's
    burst = [(128, 0)] * 4 + [(1, 64)]
    assert step_kind(burst) == "prefill_burst" and step_kind(burst[1:]) == "prefill_batched"
    # two full 384-token prompts and the ends of two more: four chunks, not short ones
    assert step_kind([(130, 0), (384, 0), (384, 0), (122, 0)]) == "prefill_batched"
    assert step_kind([(256, 0)] * 4) == "prefill_burst"
    assert step_kind([(257, 0)] + [(256, 0)] * 3) == "prefill_batched"
    assert c.step_time(burst) == pytest.approx(1.4 * a.step_time(burst))
    d["host"]["served_factors"]["s"]["prefill_burst"] = 0.9
    e = profile_from_dict(d).step_model("prefill")
    assert e.step_time(burst) == pytest.approx(0.9 * a.step_time(burst))
    assert e.step_time(batched) == pytest.approx(1.4 * a.step_time(batched))
    del d["host"]["served_factors"]["s"]["prefill_batched"]  # burst's own, batched prefill's
    f = profile_from_dict(d).step_model("prefill")
    assert f.step_time(burst) == pytest.approx(0.9 * a.step_time(burst))
    assert f.step_time(batched) == pytest.approx(1.2 * a.step_time(batched))


def test_a_served_kind_dropped_falls_back():
    """The what-if of sim_validate_sets.py --without-served-kind: the kind's own factor
    and curve go, its steps take the fallback's; other kinds and plain models stay."""
    d = copy.deepcopy(BASE)
    d["host"] = {"corun_slowdown": 1.0, "served_factors": {"s": {
        "prefill": 1.2, "prefill_batched": 1.4, "prefill_burst": 0.9, "decode": 1.5}},
        "served_factor_curves": {"s": {"prefill_burst": [[0.1, 0.8], [1.0, 0.9]]}}}
    served = profile_from_dict(d).step_model("prefill")
    plain = profile_from_dict(copy.deepcopy(BASE)).step_model("prefill")
    burst, batched = [(128, 0)] * 8, [(128, 0)] * 2
    dropped = without_kind(served, "prefill_burst")
    assert dropped.step_time(burst) == pytest.approx(1.4 * plain.step_time(burst))
    assert dropped.step_time(batched) == served.step_time(batched)
    assert without_kind(dropped, "prefill_batched").step_time(burst) == pytest.approx(
        1.2 * plain.step_time(burst))
    assert without_kind(plain, "prefill_burst") is plain
    scaled = ScaledStepModel(served, 2.0)  # a wrapper around a served model: reached
    assert without_kind(scaled, "prefill_burst").step_time(burst) == pytest.approx(
        2 * 1.4 * plain.step_time(burst))
    with pytest.raises(ValueError, match="no fallback"):
        without_kind(served, "decode")


@pytest.mark.parametrize("bad, message", [
    ({"nope": {"prefill": 1.1}}, "no such step model"),
    ({"s": {"prefil": 1.1}}, "keys among prefill, prefill_batched, prefill_burst, decode"),
    ({"s": {"decode": 0}}, "must be > 0"),
    ([1.2], "must be an object"),
])
def test_bad_served_factors_are_refused(bad, message):
    d = copy.deepcopy(BASE)
    d["host"] = {"corun_slowdown": 1.0, "served_factors": bad}
    with pytest.raises(ProfileError, match=message):
        profile_from_dict(d)


def test_factors_are_median_measured_over_modelled_per_kind():
    model = profile_from_dict(copy.deepcopy(BASE)).step_model("decode")
    steps = []
    for scale in (1.1, 1.3, 5.0):  # one disturbed step must not move the median
        steps.append({"t": 0, "dur": scale * model.step_time([(1, 100)]),
                      "chunks": [[1, 100, True, True]]})
    steps.append({"t": 0, "dur": 2 * model.step_time([(50, 0)]), "chunks": [[50, 0, True]]})
    decode = step_pairs(steps, model)["decode"]
    assert sorted(m / p for p, m in decode) == pytest.approx([1.1, 1.3, 5.0])
    factors, curves = served_model_from(step_pairs(steps, model))
    assert factors == {"prefill": pytest.approx(2.0),
                       "prefill_batched": pytest.approx(2.0),  # none: prefill's
                       "prefill_burst": pytest.approx(2.0),  # none: batched's
                       "decode": pytest.approx(1.3)}
    assert curves == {}  # one prefill step: no curve
    assert served_model_from({}) == ({"prefill": 1.0, "prefill_batched": 1.0,
                                      "prefill_burst": 1.0, "decode": 1.0}, {})
    # a burst measured, batched not: batched takes prefill's, the burst keeps its own
    burst = [(1.0, 0.9), (1.0, 0.95), (1.0, 0.8)]
    factors, _ = served_model_from({"prefill": [(1.0, 1.2)], "prefill_burst": burst})
    assert factors["prefill_batched"] == pytest.approx(1.2)
    assert factors["prefill_burst"] == pytest.approx(0.9)


def test_prefill_steps_of_two_lengths_get_a_factor_curve():
    """Short steps 1.10x, long ones 0.97x (the probe's 384- and 1024-token prompts): two
    points at the sides' median times; linear between, flat beyond; one odd step moves
    neither point."""
    short = [(0.5, 0.55), (0.55, 0.605), (0.6, 0.66), (0.52, 3.0)]
    long = [(1.7, 1.649), (1.75, 1.6975), (1.8, 1.746)]
    curve = served_curve(short + long)
    assert curve == ((pytest.approx(0.535), pytest.approx(1.1)),
                     (pytest.approx(1.75), pytest.approx(0.97)))
    assert curve_factor(curve, 0.06) == pytest.approx(1.1)  # a short chunk: the short side's
    assert curve_factor(curve, 4.0) == pytest.approx(0.97)
    mid = (0.535 + 1.75) / 2
    assert curve_factor(curve, mid) == pytest.approx((1.1 + 0.97) / 2)
    # one length only, too few steps, or two factors alike: no curve
    assert served_curve(short) == ()
    assert served_curve(short[:1] + long) == ()
    assert served_curve([(p, 1.05 * p) for p in (0.5, 0.6, 1.7, 1.8)]) == ()
    factors, curves = served_model_from({"prefill": short + long})
    assert curves == {"prefill": curve, "prefill_batched": curve, "prefill_burst": curve}


def test_profile_factor_curves_price_steps_by_length():
    d = copy.deepcopy(BASE)
    plain = profile_from_dict(copy.deepcopy(BASE)).step_model("prefill")
    short, long = plain.step_time([(16, 0)]), plain.step_time([(512, 0)])
    assert long > 2 * short
    d["host"] = {"corun_slowdown": 1.0,
                 "served_factors": {"s": {"prefill": 1.05, "decode": 1.0}},
                 "served_factor_curves": {"s": {"prefill": [[short, 1.2], [long, 0.9]]}}}
    m = profile_from_dict(d).step_model("prefill")
    assert m.step_time([(16, 0)]) == pytest.approx(1.2 * short)
    assert m.step_time([(512, 0)]) == pytest.approx(0.9 * long)
    assert m.step_time([(1, 30)]) == pytest.approx(plain.step_time([(1, 30)]))  # decode
    d["host"]["served_factor_curves"]["s"]["prefill"] = [[short, 0]]
    with pytest.raises(ProfileError, match="served_factor_curves"):
        profile_from_dict(d)
    d["host"]["served_factor_curves"] = {"nope": {}}
    with pytest.raises(ProfileError, match="no such step model"):
        profile_from_dict(d)


def test_front_end_gap_is_the_mean_gap_of_a_burst():
    assert front_end_gap([10.0]) is None and front_end_gap([]) is None
    # order does not matter; 4 arrivals over 3 ms: 1 ms per request
    assert front_end_gap([10.003, 10.0, 10.001, 10.002]) == pytest.approx(0.001)


def test_first_gap_is_the_gap_between_a_bursts_first_two_arrivals():
    assert first_gap([10.0]) is None and first_gap([]) is None
    assert first_gap([10.02, 10.0, 10.021, 10.0005]) == pytest.approx(0.0005)


def test_idle_wakes_time_arrivals_that_found_the_engine_idle():
    """Steps at 0-0.1 s and 1.0-1.1 s. An arrival at 0.5 s waits for the step at 1.0 s
    (0.5 s); one at 0.05 s came mid-step and one at 2.0 s has no step after it: skipped."""
    steps = [{"t": 1.0, "dur": 0.1}, {"t": 0.0, "dur": 0.1}]
    assert idle_wakes([0.5, 0.05, 2.0], steps) == pytest.approx([0.5])
    # an arrival right at a step's end found the engine idle
    assert idle_wakes([0.1], steps) == pytest.approx([0.9])
    assert idle_wakes([], steps) == [] and idle_wakes([0.5], []) == []
