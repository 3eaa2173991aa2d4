"""How fast this host runs a fixed CPU job right now: the host's speed level.

A shared VM does not run at one speed. On the 2-vCPU host of benchmarks/SIMULATION.md
(section 1-host) a fixed 2-thread matmul job ran at two levels 25-30% apart, each held
for seconds to minutes, and a benchmark run at the slow level measured 20% higher TTFT
than the same run at the fast one. A profile calibrated minutes away from a run cannot
know which level the run met; a probe taken beside the run can.

:class:`HostProbe` keeps one child process with torch loaded (started once, ~2 s) that,
asked for ``threads`` and ``seconds``, multiplies a 32 x 576 matrix by a 576 x 4096 one
(the shape of a batch-32 decode step's projections for smollm2-135m) 200 times per
sample for that long and answers the median sample time in ms. Between requests it
blocks on its stdin (nothing spins). The caller keeps the host otherwise idle while it
measures: `kvpush bench compare --host-probe` probes between runs, with the cluster
idle; `kvpush simulate calibrate` before each pass over its plan.

Lifecycle: start (child spawned, torch imported) -> measure()* -> close() (stdin closed,
child reaped; killed after a bound).
"""

from __future__ import annotations

import contextlib
import select
import subprocess
import sys
from typing import IO

#: the job's matrices (rows x inner, inner x cols) and matmuls per timed sample;
#: benchmarks/host_speed.py times the same job per second of wall time
ROWS, INNER, COLS, PER_SAMPLE = 32, 576, 4096, 200

_CHILD = f"""
import statistics, sys, time, torch
a, w = torch.randn({ROWS}, {INNER}), torch.randn({INNER}, {COLS})
print("ready", flush=True)
for line in sys.stdin:
    threads, seconds = line.split()
    torch.set_num_threads(int(threads))
    for _ in range(20):
        a @ w
    end, samples = time.perf_counter() + float(seconds), []
    while time.perf_counter() < end or len(samples) < 3:
        t = time.perf_counter()
        for _ in range({PER_SAMPLE}):
            a @ w
        samples.append(time.perf_counter() - t)
    print(round(1e3 * statistics.median(samples), 3), flush=True)
"""


class HostProbeError(RuntimeError):
    pass


class HostProbe:
    """The probe's child process; use as a context manager."""

    def __init__(self, start_timeout: float = 120.0) -> None:
        self._proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
        if self._read(start_timeout) != "ready":
            self.close()
            raise HostProbeError("the host probe did not start")

    def _read(self, timeout: float) -> str:
        """One line from the child; '' when it died or said nothing for ``timeout`` s
        (it flushes whole lines, one per request, so a readable pipe holds one)."""
        out: IO[str] = self._proc.stdout  # type: ignore[assignment]
        ready, _, _ = select.select([out], [], [], timeout)
        return out.readline().strip() if ready else ""

    def measure(self, threads: int, seconds: float = 1.0) -> float:
        """Median ms per sample of the fixed job on ``threads`` torch threads over
        ``seconds`` (at least three samples)."""
        if threads < 1 or not seconds > 0:
            raise ValueError(f"threads >= 1 and seconds > 0 (got {threads}, {seconds})")
        if self._proc.poll() is not None:
            raise HostProbeError(f"the host probe exited ({self._proc.returncode})")
        assert self._proc.stdin is not None
        self._proc.stdin.write(f"{threads} {seconds}\n")
        self._proc.stdin.flush()
        line = self._read(seconds + 60)
        try:
            return float(line)
        except ValueError:
            raise HostProbeError(f"the host probe answered {line!r}") from None

    def close(self) -> None:
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=10)
        if self._proc.stdout is not None:
            self._proc.stdout.close()

    def __enter__(self) -> HostProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
