"""Refit a calibrated profile's step models from the samples it recorded.

`kvpush simulate calibrate` stores every step it timed (``measured.step_samples``) and,
from the served probe, every step the serving instance ran (``measured.served[...]
.trace``). When the step model changes (a new feature, a new fit), ``kvpush simulate
refit OLD.json --out NEW.json`` fits it again from those samples and prices the probe's
steps with the new fit for new ``host.served_factors`` and ``host.step_noise``: no
engine runs, so the new profile describes the same host at the same moment as the old
one, and the two can be compared on the same benchmark runs.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from kvpush.sim.calibrate import fit_linear


def refit_profile(data: dict[str, Any], log: Callable[[str], None] = print
                  ) -> dict[str, Any]:
    """A copy of the profile ``data`` with its linear step models fitted again and, where
    the probe's trace was kept, its served factors re-measured against the new fits."""
    from kvpush.sim.noise import measure_noise
    from kvpush.sim.served import ServedStepModel, describe, served_model_from, step_pairs

    if not isinstance(data, dict) or not isinstance(data.get("measured", {}), dict):
        raise ValueError("not a calibrated profile (a JSON object with a measured object)")
    out = copy.deepcopy(data)
    measured = out.get("measured", {})
    samples = measured.get("step_samples") or {}
    if not isinstance(samples, dict) or not samples:
        raise ValueError("the profile has no measured.step_samples to refit from "
                         "(only profiles written by `kvpush simulate calibrate` have)")
    served = measured.get("served") or {}
    host = out.setdefault("host", {"corun_slowdown": 1.0})
    factors = host.setdefault("served_factors", {})
    for name, rows in samples.items():
        old = out["step_models"].get(name, {})
        tables = {k: old[k] for k in ("token_rows_s", "sample_rows_s") if k in old}
        model, quality = fit_linear([([tuple(c) for c in ch], dt) for ch, dt in rows], tables)
        out["step_models"][name] = {"kind": "linear", **{
            k: v for k, v in dataclasses.asdict(model).items() if v is not None}}
        measured.setdefault("fits", {})[name] = quality
        log(f"[refit] {name}: median rel. err {quality['median_rel_err']:.1%}, max "
            f"{quality['max_rel_err']:.1%} over {len(rows)} samples")
        trace = (served.get(name) or {}).get("trace")
        if trace:
            steps = [{"chunks": ch, "dur": dt} for ch, dt in trace]
            factors[name], curves = served_model_from(step_pairs(steps, model))
            table = host.setdefault("served_factor_curves", {})
            table.pop(name, None)
            if curves:
                table[name] = {k: [list(p) for p in v] for k, v in curves.items()}
            noise = measure_noise(steps, ServedStepModel(model, factors[name], curves))
            host.setdefault("step_noise", {}).pop(name, None)
            if noise:
                host["step_noise"][name] = noise
            served[name].update(factors=factors[name], curves=table.get(name, {}),
                                noise=noise)
            log(f"[refit] {name}: served factors " + ", ".join(
                f"{k} {describe(v, curves.get(k))}" for k, v in factors[name].items()))
        elif name in factors:
            log(f"[refit] {name}: no probe trace kept; served factors left as they were "
                "(measured against the old fit)")
    out.setdefault("notes", []).append(
        f"Step models refitted from the recorded samples by `kvpush simulate refit` on "
        f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}.")
    return out
