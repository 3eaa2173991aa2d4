"""The engine's own matmuls timed by row count: the step model's ``token_rows_s`` and
``sample_rows_s`` tables (:mod:`kvpush.sim.step_fit`).

CPU torch runs a 1-row matmul as GEMV and 2+ rows as GEMM at about twice the cost, a
step the linear terms of the step model cannot express, so `kvpush simulate calibrate`
times them before it fits: one layer's projections through the engine's ``linear`` on
its real weights, times the number of layers, for 1..1024 token rows, and the LM head
for 1..64 sampled rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from kvpush.sim.step_fit import Tables

TOKEN_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128, 256, 512, 1024)
SAMPLE_ROWS = (1, 2, 3, 4, 6, 8, 16, 32, 64)
#: handoff's figures from the pull / push pair probe (kvpush.sim.push_step)

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
