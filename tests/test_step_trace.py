"""The engine's per-step trace (KVPUSH_STEP_TRACE)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

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
