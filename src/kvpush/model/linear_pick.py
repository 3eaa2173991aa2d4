"""Which matmul each projection runs on: MKL's ``F.linear`` or oneDNN's linear, per
weight shape and number of rows, picked once per model (issue 32).

On CPU fp32, ``F.linear`` goes to MKL sgemm and ``torch.ops.mkldnn._linear_pointwise``
(plain weights) to oneDNN. Both compute in full fp32, but which one is faster depends on
the CPU, the weight's shape and the number of rows: on one AMD host oneDNN was 2-2.5x
faster at 1 to 1024 rows, on one Intel host MKL streamed SmolLM2's weights faster at one
row while oneDNN won at more (benchmarks/ENGINE.md, "Per-step overhead"). So in the
default mode (``auto``) the model times both kernels on this machine for each of its
distinct weight shapes at one row count per bucket (:data:`ROW_BUCKETS`), keeps the
faster, and each projection then dispatches on its input's row count with a tuple
lookup (no per-call timing). Weights of at most :data:`SMALL_LINEAR_NUMEL` elements are
not timed: they always use ``F.linear`` (oneDNN's per-call overhead exceeds their whole
matmul).

``KVPUSH_LINEAR`` overrides the choice, read at model load:

* ``auto`` (or unset): timed as above;
* ``aten``: ``F.linear`` everywhere;
* ``onednn``: oneDNN for every weight above the small-weight bound (the default before
  the autotune);
* ``rows``: as ``onednn``, but single-row inputs on ``F.linear``.

Timings are taken on the calling thread at its torch thread count, so the model tunes
itself from the thread that runs its steps (``DecoderModel.ensure_linears``). Tests
inject a :data:`Timer` to make the choice deterministic.

oneDNN compiles a kernel for every input shape it meets and keeps it in its primitive
cache (1,024 entries; here 0.7 MiB of resident memory and 1-3 ms of compiling each, at
any weight size). A projection called at every row count that the steps make (decode
batches of 1 to max_num_seqs, prefill chunks of 1 to max_num_batched_tokens) filled
that cache within minutes of varied load and then kept evicting and compiling: the
engine cores' memory grew by hundreds of MiB under load (issue 67, point 5). So every
call that runs on oneDNN (:func:`on_onednn`) has its rows padded up to
:func:`~kvpush.model.shapes.padded_size`: at most 25 % more rows, and a few dozen shapes per weight.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

import torch
import torch.nn.functional as F

from kvpush.model.shapes import padded_size

log = logging.getLogger("kvpush.model")

Linear = Callable[..., torch.Tensor]

#: Weights with at most this many elements always use ``F.linear``: oneDNN's fp32 linear
#: costs ~25-40 us per call before any arithmetic (it builds its primitive for the plain
#: weight every call), MKL's a few, so for the small matrices of the random test models
#: (128 x 1024 at most) F.linear is 3-8x faster at 1-32 rows. SmolLM2's smallest
#: projection (576 x 576) is above it and is timed.
SMALL_LINEAR_NUMEL = 1 << 18

#: Upper bounds of the row buckets: 1, 2-8, 9-64, and above 64 rows.
ROW_BUCKETS: tuple[int, ...] = (1, 8, 64)
#: The row count timed for each bucket (decode batches of 1 and 8, a mid batch, and a
#: prefill chunk's worth).
BUCKET_ROWS: tuple[int, ...] = (1, 8, 32, 256)
#: Timed calls of a bucket above 8 rows (compute-bound) run on the weight's first output
#: rows, so that one call stays under this many multiply-adds (SmolLM2's 49152 x 576
#: head at 256 rows would be 7.2 G, ~80 ms a call; 2^26 is ~1-3 ms here). Up to 8 rows
#: (bandwidth-bound) the whole weight is streamed, as in a step.
MAX_TIMED_MACS = 1 << 26

#: Per kernel and bucket: one warm call, then at least MIN_REPS and at most MAX_REPS
#: timed calls, the two kernels alternating, stopping after MIN_REPS once a series has
#: spent REP_BUDGET_S; the minimum is kept (noise on a shared host only adds time).
WARM_CALLS = 1
MIN_REPS = 3
MAX_REPS = 9
REP_BUDGET_S = 0.01


class Kernel(str, Enum):
    ATEN = "aten"  # F.linear (MKL sgemm for fp32 on CPU)
    ONEDNN = "onednn"  # torch.ops.mkldnn._linear_pointwise, plain weights


class LinearMode(str, Enum):
    AUTO = "auto"
    ATEN = "aten"
    ONEDNN = "onednn"
    ROWS = "rows"


def onednn_linear(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


KERNELS: dict[Kernel, Linear] = {Kernel.ATEN: F.linear, Kernel.ONEDNN: onednn_linear}

#: (kernel, weight, rows) -> seconds of one call; the autotune's measurement, replaceable
#: in tests.
Timer = Callable[[Kernel, torch.Tensor, int], float]


def linear_mode(value: str | None = None) -> LinearMode:
    """The mode from ``value`` (default: the ``KVPUSH_LINEAR`` environment variable);
    an unknown name is an error rather than a silent fallback."""
    raw = os.environ.get("KVPUSH_LINEAR", "") if value is None else value
    raw = raw.strip().lower() or LinearMode.AUTO.value
    try:
        return LinearMode(raw)
    except ValueError:
        names = ", ".join(m.value for m in LinearMode)
        raise ValueError(f"KVPUSH_LINEAR={raw!r}: expected one of {names}") from None


def onednn_usable(device: str, dtype: torch.dtype) -> bool:
    """oneDNN's fp32 linear is a candidate: CPU, fp32 (bf16/fp16 F.linear already runs on
    oneDNN), built in, and it agrees with F.linear on a small self-check."""
    if (not str(device).startswith("cpu") or dtype != torch.float32
            or not torch.backends.mkldnn.is_available()):
        return False
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(5, 24, generator=g)
        w = torch.randn(7, 24, generator=g)
        b = torch.randn(7, generator=g)
        with torch.inference_mode():
            ok = torch.allclose(onednn_linear(x, w, b), F.linear(x, w, b),
                                rtol=1e-2, atol=1e-2)
            return ok and torch.allclose(onednn_linear(x, w, None), F.linear(x, w))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def on_onednn(kernel: Kernel, w: torch.Tensor) -> bool:
    """Whether ``kernel`` runs on oneDNN for weight ``w``: its own linear, and F.linear in
    bf16 or fp16 on a CPU (torch's matmul sends those to oneDNN)."""
    if kernel is Kernel.ONEDNN:
        return True
    return (w.device.type == "cpu" and w.dtype in (torch.bfloat16, torch.float16)
            and torch.backends.mkldnn.is_available())


def padded(f: Linear) -> Linear:
    """``f`` run on its input's rows padded with zero rows up to :func:`padded_size`;
    the padding's output rows are dropped (a view of the first rows)."""

    def on_padded_rows(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
                       ) -> torch.Tensor:
        n = x.shape[0]
        p = padded_size(n)
        if p == n:
            return f(x, w, b)
        return f(F.pad(x, (0, 0, 0, p - n)), w, b)[:n]

    return on_padded_rows


def compile_padded(lin: Linear, w: torch.Tensor, b: torch.Tensor | None,
                   max_rows: int) -> int:
    """Run ``lin`` once at every padded row count up to ``max_rows`` (zeros in): oneDNN
    compiles all the shapes that a projection which pads can meet now, at start-up,
    rather than on a later step's path, and the memory they hold is there from the
    start. Returns the number of shapes run."""
    sizes = sorted({padded_size(n) for n in range(1, max_rows + 1)})
    x = torch.zeros(sizes[-1], w.shape[1], dtype=w.dtype, device=w.device)
    with torch.inference_mode():
        for p in sizes:
            lin(x[:p], w, b)
    return len(sizes)


def bucket_of(rows: int) -> int:
    """Index into ROW_BUCKETS (len(ROW_BUCKETS) for rows above the last bound)."""
    for i, bound in enumerate(ROW_BUCKETS):
        if rows <= bound:
            return i
    return len(ROW_BUCKETS)


@dataclass(frozen=True)
class ShapeChoice:
    """The kernel per row bucket of one weight shape, and the timings behind it
    (seconds per call for (aten, onednn) per bucket; empty when not timed)."""

    shape: tuple[int, int]
    kernels: tuple[Kernel, ...]
    timings: tuple[tuple[float, float], ...] = ()

    def describe(self) -> str:
        n, k = self.shape
        picks = "/".join(kn.value for kn in self.kernels)
        if not self.timings:
            return f"{n}x{k} {picks}"
        us = " ".join(f"{r}:{a * 1e6:.0f}/{o * 1e6:.0f}"
                      for r, (a, o) in zip(BUCKET_ROWS, self.timings, strict=True))
        return f"{n}x{k} {picks} [rows: aten/onednn us {us}]"


@dataclass
class LinearPlan:
    """Every distinct weight shape's choice, how it was made and what it cost."""

    mode: LinearMode
    choices: dict[tuple[int, int], ShapeChoice] = field(default_factory=dict)
    tune_s: float = 0.0
    threads: int = 1
    timed_series: int = 0

    def pads(self, w: torch.Tensor) -> bool:
        """Whether some row count of ``w``'s projection runs on padded rows."""
        return any(on_onednn(k, w) for k in self.choices[_shape(w)].kernels)

    def linear_for(self, w: torch.Tensor) -> Linear:
        kernels = self.choices[_shape(w)].kernels
        return dispatcher(kernels, tuple(on_onednn(k, w) for k in kernels))

    def describe(self) -> str:
        head = (f"linear kernels ({self.mode.value}, {self.threads} thread(s), "
                f"{self.timed_series} kernel-bucket series timed in {self.tune_s * 1e3:.0f} ms; "
                f"buckets rows 1/2-8/9-64/>64)")
        return "; ".join([head, *(c.describe() for c in self.choices.values())])


def _shape(w: torch.Tensor) -> tuple[int, int]:
    return (int(w.shape[0]), int(w.shape[1]))


def dispatcher(kernels: Sequence[Kernel], pads: Sequence[bool] | None = None) -> Linear:
    """The callable for one weight: the kernel itself when every bucket agrees, else a
    function that looks the kernel up by the input's row count (a tuple index).
    ``pads[i]``: bucket i's kernel runs on :func:`padded` rows (default: none does)."""
    pads = pads or (False,) * len(kernels)
    fn_of = {(k, p): padded(KERNELS[k]) if p else KERNELS[k]
             for k, p in zip(kernels, pads, strict=True)}
    fns = [fn_of[k, p] for k, p in zip(kernels, pads, strict=True)]
    if all(f is fns[0] for f in fns):
        return fns[0]
    last = ROW_BUCKETS[-1]
    table = tuple(fns[bucket_of(r)] for r in range(last + 1))  # table[0] unused
    big = fns[-1]

    def by_rows(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
                ) -> torch.Tensor:
        n = x.shape[0]
        return (table[n] if n <= last else big)(x, w, b)

    return by_rows


def _fixed_kernels(mode: LinearMode) -> tuple[Kernel, ...]:
    nb = len(ROW_BUCKETS) + 1
    if mode is LinearMode.ATEN:
        return (Kernel.ATEN,) * nb
    if mode is LinearMode.ROWS:
        return (Kernel.ATEN,) + (Kernel.ONEDNN,) * (nb - 1)
    return (Kernel.ONEDNN,) * nb


def timed_weight(w: torch.Tensor, rows: int) -> torch.Tensor:
    """The weight a timed call at ``rows`` runs on: the whole weight up to 8 rows, else
    its first output rows within MAX_TIMED_MACS (a contiguous view)."""
    if rows <= 8:
        return w
    n = max(256, MAX_TIMED_MACS // (rows * w.shape[1]))
    return w[:n] if n < w.shape[0] else w


def time_pair(ws: Sequence[torch.Tensor], rows: int) -> tuple[float, float]:
    """Seconds per call of (aten, onednn) at ``rows`` rows on weights of one shape: the
    minimum of the timed calls, the two kernels alternating. Successive calls walk
    through ``ws`` (the model's weights of that shape, one per layer), so that, as in
    a step, a call mostly streams its weight from memory rather than from the cache
    the previous call filled (a shape whose layers add up to less than the last-level
    cache is still partly timed from it)."""
    ws = [timed_weight(w, rows) for w in ws]
    x = torch.randn(rows, ws[0].shape[1], dtype=ws[0].dtype, device=ws[0].device)
    fns = (KERNELS[Kernel.ATEN], KERNELS[Kernel.ONEDNN])
    best = [float("inf"), float("inf")]
    spent = [0.0, 0.0]
    calls = 0
    with torch.inference_mode():
        for f in fns:
            for _ in range(WARM_CALLS):
                f(x, ws[calls % len(ws)])
                calls += 1
        for rep in range(MAX_REPS):
            if rep >= MIN_REPS and min(spent) >= REP_BUDGET_S:
                break
            for i, f in enumerate(fns):
                w = ws[calls % len(ws)]
                calls += 1
                t0 = time.perf_counter()
                f(x, w)
                dt = time.perf_counter() - t0
                spent[i] += dt
                best[i] = min(best[i], dt)
    return best[0], best[1]


def needs_timing(weights: Iterable[torch.Tensor], mode: LinearMode, onednn_ok: bool) -> bool:
    """Whether :func:`plan_linears` would time anything for these weights."""
    return (mode is LinearMode.AUTO and onednn_ok
            and any(w.numel() > SMALL_LINEAR_NUMEL for w in weights))


def plan_linears(
    weights: Iterable[torch.Tensor],
    mode: LinearMode,
    onednn_ok: bool,
    timer: Timer | None = None,
) -> LinearPlan:
    """Choose a kernel per (distinct weight shape, row bucket) for ``weights``.

    Small weights (SMALL_LINEAR_NUMEL) and everything when oneDNN is not usable or the
    mode is ``aten`` get F.linear; ``onednn``/``rows`` are fixed tables; ``auto`` times
    both kernels per bucket with ``timer`` (default: :func:`time_pair` over all the
    weights of the shape; an injected timer gets the first) and keeps the faster
    (oneDNN on a tie)."""
    plan = LinearPlan(mode=mode, threads=torch.get_num_threads())
    t0 = time.perf_counter()
    nb = len(ROW_BUCKETS) + 1
    by_shape: dict[tuple[int, int], list[torch.Tensor]] = {}
    for w in weights:
        by_shape.setdefault(_shape(w), []).append(w)
    for shape, ws in by_shape.items():
        w = ws[0]
        if w.numel() <= SMALL_LINEAR_NUMEL or not onednn_ok or mode is LinearMode.ATEN:
            plan.choices[shape] = ShapeChoice(shape, (Kernel.ATEN,) * nb)
            continue
        if mode is not LinearMode.AUTO:
            plan.choices[shape] = ShapeChoice(shape, _fixed_kernels(mode))
            continue
        timings = []
        for rows in BUCKET_ROWS:
            if timer is None:
                pair = time_pair(ws, rows)
            else:
                pair = (timer(Kernel.ATEN, w, rows), timer(Kernel.ONEDNN, w, rows))
            timings.append(pair)
            plan.timed_series += 2
        kernels = tuple(Kernel.ATEN if a < o else Kernel.ONEDNN for a, o in timings)
        plan.choices[shape] = ShapeChoice(shape, kernels, tuple(timings))
    plan.tune_s = time.perf_counter() - t0
    return plan
