"""Fitting a linear step model to timed steps, and telling how steady the host was.

``kvpush simulate calibrate`` (:mod:`kvpush.sim.calibrate`) times the engine's steps and
``kvpush simulate refit`` (:mod:`kvpush.sim.refit`) pools recorded ones; both fit them
here: non-negative least squares on relative error, over what the measured matmul tables
leave (:class:`kvpush.sim.step_models.LinearStepModel`). The transfer probe fits its
link with the same solver.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from kvpush.sim.step_models import Chunk, LinearStepModel, fill_tokens, interp, step_features

#: The features fitted (see :func:`kvpush.sim.step_models.step_features`); per_sample is not
#: separable from per_seq (every chunk here samples) and stays 0.
FIT_FIELDS = ("base_s", "per_token_s", "per_attn_s", "per_seq_s", "per_ctx_s", "per_fill_s")

#: one timed step: its chunks and its seconds
Sample = tuple[list[Chunk], float]
#: measured matmul tables by field name (token_rows_s, sample_rows_s): [[rows, seconds], ...]
Tables = dict[str, list[list[float]]]


def nnls_fit(rows: Sequence[Sequence[float]], targets: Sequence[float],
             weights: Sequence[float]) -> list[float]:
    """Weighted least squares with non-negative coefficients (active set: drop the most
    negative coefficient and refit until none is negative)."""
    import numpy as np

    x = np.asarray(rows, dtype=float) * np.asarray(weights, dtype=float)[:, None]
    y = np.asarray(targets, dtype=float) * np.asarray(weights, dtype=float)
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        scale = np.abs(x[:, active]).max(axis=0)
        scale[scale == 0] = 1.0
        sol, *_ = np.linalg.lstsq(x[:, active] / scale, y, rcond=None)
        sol = sol / scale
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            return coef.tolist()
        active.pop(int(np.argmin(sol)))
    return coef.tolist()


def fit_linear(samples: Sequence[Sample], tables: Tables | None = None,
               fit_table_scale: bool = False
               ) -> tuple[LinearStepModel, dict[str, float]]:
    """The step model and its fit quality (median / max relative error). With ``tables``
    (:func:`kvpush.sim.matmul_tables.measure_matmuls`), the linear terms are fitted to what
    the tables leave; with ``fit_table_scale`` too, the level of the projections' table
    (``token_rows_scale``) is fitted with them, the table keeping only its shape.

    Why the level: the tables are timed apart from the steps, and on a shared host a
    2-thread matmul timed a moment slower leaves a table above the steps themselves,
    which non-negative linear terms cannot take back (SIMULATION.md 1-v24: one of the two
    calibrations pooled timed its 2-thread table at 1-thread speed; the pooled table sat
    40-50% above v22's, ``per_token_s`` fell to 0, and 128-token prefills were priced
    12-19% over the calibration's own timings of them)."""
    tab = {k: tuple((float(r), float(v)) for r, v in pts) for k, pts in (tables or {}).items()}
    scaled = fit_table_scale and bool(tab.get("token_rows_s"))
    if len(samples) < len(FIT_FIELDS) + scaled:
        raise ValueError(f"need at least {len(FIT_FIELDS) + scaled} samples to fit, got "
                         f"{len(samples)}")
    zero = LinearStepModel(0.0, 0.0, **tab, token_rows_scale=0.0 if scaled else 1.0)
    rows, ys, ws = [], [], []
    for chunks, dt in samples:
        t, a, s, c, _ = step_features(chunks)
        rows.append([1.0, t, a, s, c, fill_tokens(chunks)]
                    + ([interp(tab["token_rows_s"], t)] if scaled else []))
        ys.append(dt - zero.tabled_time(chunks))
        ws.append(1.0 / dt)  # relative error on the whole step
    coef = nnls_fit(rows, ys, ws)
    fitted = dict(zip(FIT_FIELDS, coef))
    if scaled:
        fitted["token_rows_scale"] = coef[len(FIT_FIELDS)]
    model = LinearStepModel(**fitted, **tab)
    errs = sorted(abs(model.step_time(ch) - dt) / dt for ch, dt in samples)
    return model, {"median_rel_err": errs[len(errs) // 2], "max_rel_err": errs[-1],
                   "samples": float(len(samples))}


#: passes whose speeds differ by more than this get a warning (benchmarks/host_speed.py:
#: on the 2-vCPU VM of SIMULATION.md the host ran one 2-thread job 25-30% slower for
#: seconds to minutes at a time, and 1-thread jobs on both cores 12% slower together)
PASS_SPREAD_WARN = 0.10


def pass_levels(samples: Sequence[Sample], model: Any, passes: int) -> list[float]:
    """How fast the host ran during each pass over the plan: the median of measured /
    fitted step time over that pass's samples (``samples`` in pass order, one equal
    share per pass, as :func:`kvpush.sim.calibrate.measure_steps` records them)."""
    if passes < 1 or len(samples) < passes:
        return []
    n = len(samples) // passes
    return [round(statistics.median(dt / model.step_time(ch)
                                    for ch, dt in samples[i * n:(i + 1) * n]), 4)
            for i in range(passes)]


def pass_warning(name: str, levels: Sequence[float]) -> str | None:
    """A warning when the passes of step model ``name`` ran at different speeds: the host's
    speed moved during the calibration by about as much, and a prediction near
    saturation moves several times that (benchmarks/SIMULATION.md section E)."""
    if len(levels) < 2 or max(levels) <= (1 + PASS_SPREAD_WARN) * min(levels):
        return None
    return (f"warning: {name}: the passes ran "
            + " / ".join(f"{v:.2f}x" for v in levels)
            + f" the fit ({max(levels) / min(levels) - 1:.0%} apart): this host's speed "
            "moved during the calibration (benchmarks/host_speed.py shows how steady a "
            "host is); predictions for it carry that much uncertainty, more near "
            "saturation")
