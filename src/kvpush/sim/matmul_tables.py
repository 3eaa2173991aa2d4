"""The engine's own matmuls timed by row count: the step model's ``token_rows_s`` and
``sample_rows_s`` tables (:mod:`kvpush.sim.step_fit`).

CPU torch runs a 1-row matmul as GEMV and 2+ rows as GEMM at about twice the cost, a
step the linear terms of the step model cannot express, so `kvpush simulate calibrate`
times them: one layer's projections through the engine's ``linear`` on its real
weights, times the number of layers, for 1..1024 token rows, and the LM head for 1..64
sampled rows. It times them with the engine idle before each pass over its plan and
after the last (just before the host probe, where there is one), and keeps the lower
median per row count (:func:`median_tables`): with three or more timings, one taken
while the host gave the calibration less than its cores no longer sets the level; of
two, the faster is kept (contention only slows a best-of timing). v24's calibration
before its runs timed its 2-thread table once, at 1-thread speed (279 ms at 128 rows
against 273 at 1 thread; 137 in the calibration after), and no linear term could take
that back (benchmarks/SIMULATION.md 1-v24). At calibration time :func:`settle_tables`
warns when one thread count's timings lie far apart, and :func:`thread_warnings` when a
table on more threads is no faster than one on fewer (v24's case). Each timing costs
about 17 s for smollm2-135m on one thread (1024 rows take 2 s a run), 9 s on two.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvpush.sim.step_fit import Tables

#: token rows at which the projections are timed, and sampled rows the LM head
TOKEN_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128, 256, 512, 1024)
SAMPLE_ROWS = (1, 2, 3, 4, 6, 8, 16, 32, 64)
#: several timings of one table (a calibration's passes, or pooled calibrations) more
#: than this far apart at some row count: warn
TABLE_SPREAD_WARN = 0.25
#: a projections' table timed on more threads that takes at least this share of the
#: time of one on fewer at their largest row count: warn (2 threads take about half on
#: this host)
THREAD_SPEEDUP_WARN = 0.8


def measure_matmuls(model: Any, token_rows: Sequence[int] = TOKEN_ROWS,
                    sample_rows: Sequence[int] = SAMPLE_ROWS,
                    budget_s: float = 0.04, clock: str = "wall") -> Tables:
    """Best-of-several time of the model's projections (one layer's qkv, o, gate_up and
    down through the engine's own ``linear``, times the number of layers) for each
    number of token rows, and of its LM head for each number of sampled rows."""
    import torch

    now = time.thread_time if clock == "cpu" else time.perf_counter
    lin, layer, cfg = model.linear, model.layers[0], model.cfg
    h, inter = cfg.hidden_size, cfg.intermediate_size

    def best(fn: Callable[[], Any]) -> float:
        fn()
        out, n, t0 = float("inf"), 0, time.perf_counter()
        while n < 3 or (time.perf_counter() - t0 < budget_s and n < 50):
            a = now()
            fn()
            out = min(out, now() - a)
            n += 1
        return out

    tok: list[list[float]] = []
    smp: list[list[float]] = []
    with torch.inference_mode():
        for m in token_rows:
            x = torch.randn(m, h, dtype=model.dtype)
            xq = torch.randn(m, model.q_size, dtype=model.dtype)
            xi = torch.randn(m, inter, dtype=model.dtype)

            def layer_fn(x=x, xq=xq, xi=xi) -> None:
                lin(x, layer.qkv, layer.qkv_bias)
                lin(xq, layer.o, layer.o_bias)
                lin(x, layer.gate_up, layer.gate_up_bias)
                lin(xi, layer.down, layer.down_bias)

            tok.append([m, best(layer_fn) * len(model.layers)])
        for m in sample_rows:
            x = torch.randn(m, h, dtype=model.dtype)
            smp.append([m, best(lambda x=x: lin(x, model.lm_head))])
    return {"token_rows_s": tok, "sample_rows_s": smp}


def table_spread(tables: Sequence[Sequence[Sequence[float]]]) -> float:
    """The largest max / min - 1 over the row counts of several timings of one table."""
    per_row = zip(*[[seconds for _, seconds in t] for t in tables])
    return max((max(v) / min(v) - 1 for v in per_row if min(v) > 0), default=0.0)


def median_tables(timings: Sequence[Tables]) -> Tables:
    """Per table and row count, the lower median of several timings (one per calibration
    pass boundary); all must have timed the same tables and rows."""
    if not timings:
        raise ValueError("no table timings")
    if any(set(t) != set(timings[0]) for t in timings):
        raise ValueError("the timings hold different tables")
    out: Tables = {}
    for key, first in timings[0].items():
        rows = [r for r, _ in first]
        if any([r for r, _ in t[key]] != rows for t in timings):
            raise ValueError(f"the timings of {key} timed different rows")
        out[key] = [[r, statistics.median_low(t[key][i][1] for t in timings)]
                    for i, r in enumerate(rows)]
    return out


def thread_warning(fewer: Tables, more: Tables, n_fewer: int, n_more: int) -> str | None:
    """A warning when the projections' table timed on ``n_more`` threads is not clearly
    faster at their largest row count than the one on ``n_fewer`` (it takes at least
    :data:`THREAD_SPEEDUP_WARN` of its time): the host gave the calibration fewer cores
    than it asked for while it timed them (v24), and the step model would price every
    step of that thread count as slow."""
    a, b = fewer.get("token_rows_s"), more.get("token_rows_s")
    if not a or not b or n_more <= n_fewer or a[-1][0] != b[-1][0]:
        return None
    (rows, t_fewer), (_, t_more) = a[-1], b[-1]
    if t_more < THREAD_SPEEDUP_WARN * t_fewer:
        return None
    return (f"warning: threads={n_more}: the projections' table at {rows:g} rows "
            f"({t_more * 1e3:.0f} ms) is not clearly faster than at threads={n_fewer} "
            f"({t_fewer * 1e3:.0f} ms): the host did not give this calibration "
            f"{n_more} cores while it timed them; calibrate again on a quieter host, or "
            "refit with --fit-table-scale")


def thread_warnings(step_models: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """:func:`thread_warning` for every pair of a profile's ``threads=N`` step models:
    calibrate checks the profile it writes, refit each calibration it pools (v24's were
    calibrated before the check)."""
    by_threads = {int(name.partition("=")[2]): dict(sm) for name, sm in step_models.items()
                  if name.startswith("threads=") and name.partition("=")[2].isdigit()}
    counts = sorted(by_threads)
    return [warning for i, lo in enumerate(counts) for hi in counts[i + 1:]
            if (warning := thread_warning(by_threads[lo], by_threads[hi], lo, hi))]


def settle_tables(timings: Sequence[Tables], threads: int) -> tuple[Tables, list[str]]:
    """The tables a calibration keeps from its timings on ``threads`` threads
    (:func:`median_tables`), and a warning when the timings lie far apart."""
    tables = median_tables(timings)
    warnings: list[str] = []
    spread = table_spread([t["token_rows_s"] for t in timings if "token_rows_s" in t])
    if spread > TABLE_SPREAD_WARN:
        warnings.append(f"warning: threads={threads}: the projections' table timings "
                        f"before each pass and after the last differ by up to {spread:.0%};"
                        " the lower median of each row is kept")
    return tables, warnings
