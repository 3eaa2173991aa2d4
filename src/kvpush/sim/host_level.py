"""The host's speed level beside a run, against the level its profile was calibrated at.

A calibrated profile prices steps at the speed the host ran while the calibration timed
them. A shared VM does not hold one speed: on the 2-vCPU host of benchmarks/SIMULATION.md
(section 1-host) a fixed 2-thread job ran at two levels 25-30% apart for seconds to
minutes at a time, so runs of one cell minutes apart differed by 20-30% in TTFT, more
than any queueing model can absorb. Both sides now carry the same idle probe
(:mod:`kvpush.bench.host_probe`): ``kvpush simulate calibrate`` before each pass over its
plan (``measured.host_probe_ms[model]``), ``kvpush bench compare --host-probe`` right
before and after each run (``host_probe_ms`` in the run's JSON, at the run's threads
per instance).

:func:`level_scale` turns them into one number per run: the run's probe over the
calibration's, for the step model of the run's thread count. ``1.2`` says the host ran
the fixed job 20% slower beside the run than while the profile was measured;
benchmarks/sim_validate.py ``--host-level`` multiplies that step model's times by it for
that run (the probe is measured apart from kvpush, on an idle cluster; nothing of the
run's own latencies goes in).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any


class HostLevelError(ValueError):
    pass


def calibration_level(measured: Mapping[str, Any], model: str) -> float | None:
    """Mean ms of the calibration's host probes for step model ``model`` (every pass,
    of every calibration a pooled profile came from: the fit weighs them alike); None
    when it recorded none."""
    values = (measured.get("host_probe_ms") or {}).get(model) or []
    return statistics.fmean(values) if values else None


def run_level(run: Mapping[str, Any]) -> tuple[int, float] | None:
    """(threads, mean ms of the probes before and after) of one run; None when the run
    was not probed."""
    probe = run.get("host_probe_ms")
    if not probe:
        return None
    values = [v for v in (probe.get("before"), probe.get("after")) if v]
    return (int(probe["threads"]), statistics.fmean(values)) if values else None


def level_scale(measured: Mapping[str, Any], run: Mapping[str, Any]) -> tuple[str, float]:
    """(step model, run level / calibration level) for one run of `kvpush bench
    compare`; :class:`HostLevelError` when either side has no probe."""
    level = run_level(run)
    if level is None:
        raise HostLevelError(f"run {run.get('mode_label', '?')} repeat {run.get('repeat', '?')}"
                             " has no host_probe_ms (made without bench compare --host-probe)")
    threads, ms = level
    model = f"threads={threads}"
    ref = calibration_level(measured, model)
    if not ref:
        raise HostLevelError(f"the profile recorded no host probe for {model} "
                             "(calibrated before measured.host_probe_ms)")
    return model, ms / ref
