"""The least-squares fit calibration uses, for the step models
(:mod:`kvpush.sim.calibrate`) and for the transfer link (:mod:`kvpush.sim.transfer_probe`)."""

from __future__ import annotations

from collections.abc import Sequence


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
