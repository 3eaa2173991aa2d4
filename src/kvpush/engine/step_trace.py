"""Step shapes and the optional per-step trace of an engine.

A step's *shape* is what its time depends on: for each scheduled chunk, the number of
tokens, the position of its first token, whether it samples, and (for a one-token
decode row) whether the request decoded in the step before, so that its context is
already in the engine's dense decode cache (a row that did not pays for copying its
context in). :class:`StepShapes` derives these from the scheduler's plans; the
simulator's calibration fits its step model to (shape, seconds) samples.

With ``KVPUSH_STEP_TRACE=DIR`` in its environment, an engine writes one JSON line per
non-empty step to ``DIR/<role>-<pid>.jsonl``::

    {"t": 1764437000.123, "dur": 0.412, "chunks": [[512, 0, true, true]]}

``t`` is the wall-clock start (seconds since the epoch), ``dur`` the step's wall time
(scheduling, forward, sampling, detokenization, connector hooks). A served instance
also writes one line per request as its front end hands the request to the step loop,
``{"t": 1764437000.101, "arrival": 1}``: how fast a burst of requests gets through the
client, the router and the HTTP server into the engine (the simulator's
``handoff.front_end_s``). It is a diagnostic for comparing a serving instance's real
steps with the simulator's model of them (``benchmarks/sim_steps.py``). The file is
line-buffered: a line costs one write.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import IO, Any

ENV_VAR = "KVPUSH_STEP_TRACE"

#: (tokens, start position, samples, context already in the dense decode cache)
Shape = tuple[int, int, bool, bool]


class StepShapes:
    """Turns scheduler plans into step shapes, remembering which requests decoded in
    the step before (the only state a shape needs)."""

    def __init__(self) -> None:
        self._decoded: dict[str, int] = {}  # request -> position it decoded at, last step

    def shapes(self, plan: Any) -> list[Shape]:
        out = [(len(c.token_ids), c.start_pos, bool(c.sample),
                len(c.token_ids) == 1 and self._decoded.get(c.request_id) == c.start_pos - 1)
               for c in plan.chunks]
        self._decoded = {c.request_id: c.start_pos for c in plan.chunks
                         if len(c.token_ids) == 1}
        return out


class StepTrace:
    """Appends one JSON line per step to ``path``."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = self.path.open("a", buffering=1)
        self._shapes = StepShapes()
        self._offset = time.time() - time.perf_counter()
        self._lock = threading.Lock()  # the step loop and the HTTP thread both write

    def record(self, plan: Any, started: float, seconds: float) -> None:
        """``started``: time.perf_counter() at the step's start."""
        if self._file is None or not plan.chunks:
            return
        line = {"t": round(self._offset + started, 6), "dur": round(seconds, 6),
                "chunks": self._shapes.shapes(plan)}
        self._write(line)

    def arrival(self) -> None:
        """A request reached the engine's inbox now (called by the front end)."""
        self._write({"t": round(self._offset + time.perf_counter(), 6), "arrival": 1})

    def _write(self, line: dict[str, Any]) -> None:
        with self._lock:
            if self._file is not None:
                self._file.write(json.dumps(line, separators=(",", ":")) + "\n")

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def step_trace_from_env(role: str) -> StepTrace | None:
    """The trace ``KVPUSH_STEP_TRACE`` asks for, or None."""
    folder = os.environ.get(ENV_VAR)
    if not folder:
        return None
    return StepTrace(Path(folder) / f"{role}-{os.getpid()}.jsonl")


def _lines(path: str | os.PathLike) -> list[dict[str, Any]]:
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a torn last line, from a killed process
            continue
    return out


def read_trace(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The steps of one trace file."""
    return [st for st in _lines(path) if "dur" in st]


def read_arrivals(path: str | os.PathLike) -> list[float]:
    """When each request reached the engine's inbox (wall clock), in file order."""
    return [st["t"] for st in _lines(path) if "arrival" in st]
