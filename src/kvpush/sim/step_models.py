"""Step models: the time of one engine step as a function of the chunks it runs.

A profile (:mod:`kvpush.sim.profile`) names one or more, and which one each role runs.
Two kinds:

* ``linear`` (fitted by ``kvpush simulate calibrate``): ``t = base + per_token * T +
  per_attn * A + per_seq * S + per_ctx * C + per_sample * N + g * G(T) + H(N)`` with ``T``
  new tokens, ``A`` the attention pairs ``sum n * (c + (n + 1) / 2)``, ``S`` sequences,
  ``C`` the context the decode rows read ``sum (c + n)`` and ``N`` the sampled rows.
  ``G`` and ``H`` are optional measured tables (rows -> seconds, interpolated) of the
  model's matmuls: all layers' projections over ``T`` token rows, and the LM head over
  ``N`` rows; ``per_fill * F`` charges the context ``F`` of decode rows that enter
  kvpush's dense decode cache (a request's first decode). They carry what a linear term
  cannot: on CPU torch a 1-row matmul runs a
  GEMV kernel and 2+ rows a GEMM one that costs about twice as much (a decode batch of 2
  is ~1.6x a batch of 1, then each further row adds little). ``g``
  (``token_rows_scale``, default 1) is G's level: 1 takes the table as timed; fitted,
  the table gives the shape and the engine's own timed steps its level.
* ``roofline`` (GPU profiles from public figures): ``max(FLOPs / (peak * mfu), bytes /
  (bandwidth * bw_efficiency)) + overhead`` with FLOPs and bytes from the model's shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

#: A chunk of one step: (new tokens, tokens already in the context before them), and
#: optionally whether it samples a token (ends its prompt, or decodes; default True) and,
#: for a decode row, whether its KV is already in the engine's dense decode cache
#: (it decoded in the step before; default True: no fill).
Chunk = tuple[int, int] | tuple[int, int, bool] | tuple[int, int, bool, bool]
#: A measured cost table: ((rows, seconds), ...), rows ascending.
RowTable = tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    kv_bytes_per_elem: int = 2
    weight_bytes_per_elem: int = 2
    tied_embeddings: bool = False

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes_per_elem

    @property
    def layer_params(self) -> int:
        h = self.hidden_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size

    @property
    def lm_head_params(self) -> int:
        return self.hidden_size * self.vocab_size

    @property
    def weight_bytes(self) -> int:
        emb = 0 if self.tied_embeddings else self.lm_head_params
        total = self.num_layers * self.layer_params + self.lm_head_params + emb
        return total * self.weight_bytes_per_elem


class StepModel(Protocol):
    def step_time(self, chunks: Sequence[Chunk]) -> float: ...


def decode_only(chunks: Sequence[Sequence[Any]]) -> bool:
    """Whether a step is one-token rows only (a decode step), the split every kind of
    step the simulator tells apart starts from."""
    return all(c[0] == 1 for c in chunks)


def step_features(chunks: Sequence[Chunk]) -> tuple[float, float, float, float, float]:
    """(T, A, S, C, N) of a step; see the module docstring. A chunk samples one row when
    it ends a prompt or decodes; a chunk given without its flag counts as sampled."""
    t = a = c = smp = 0.0
    for ch in chunks:
        n, ctx = ch[0], ch[1]
        t += n
        a += n * (ctx + (n + 1) / 2)
        if n == 1:
            c += ctx + 1
        if len(ch) < 3 or ch[2]:  # type: ignore[misc]
            smp += 1
    return t, a, float(len(chunks)), c, smp


def completed_blocks(context: int, tokens: int, ends_prompt: bool,
                     block_size: int) -> tuple[int, int]:
    """[first, end) of the KV blocks a chunk of ``tokens`` after ``context`` completes:
    the whole blocks it fills and, when it ends the prompt, the last partial one (what
    push WRITEs to decode for it, before any prefix hit)."""
    after = context + tokens
    end = -(-after // block_size) if ends_prompt else after // block_size
    return context // block_size, end


def fill_tokens(chunks: Sequence[Chunk]) -> float:
    """Context tokens copied into kvpush's dense decode cache (``DecodeKVCache``) this
    step: a decode row that did not decode in the step before has its whole context
    gathered from the paged KV region first."""
    return float(sum(ch[1] for ch in chunks
                     if ch[0] == 1 and len(ch) >= 4 and not ch[3]))  # type: ignore[misc]


def interp(table: RowTable, x: float) -> float:
    """``table`` at ``x`` rows: 0 at 0 rows, linear between the measured points (and from
    (0, 0) to the first), extended with the last segment's slope beyond the last."""
    if not table or x <= 0:
        return 0.0
    px, py = 0.0, 0.0
    for i, (rx, ry) in enumerate(table):
        if x <= rx:
            if i == 0:
                return ry if x >= rx else ry * x / rx  # below the first point: pro rata
            return py + (ry - py) * (x - px) / (rx - px)
        px, py = rx, ry
    if len(table) == 1:
        return py * x / px
    (ax, ay), (bx, by) = table[-2], table[-1]
    return by + (by - ay) / (bx - ax) * (x - bx)


@dataclass(frozen=True)
class LinearStepModel:
    base_s: float
    per_token_s: float
    per_attn_s: float = 0.0
    per_seq_s: float = 0.0
    per_ctx_s: float = 0.0
    per_sample_s: float = 0.0
    #: per context token copied into the dense decode cache (a request's first decode)
    per_fill_s: float = 0.0
    #: measured matmul time of all layers' projections for T token rows (G above)
    token_rows_s: RowTable = ()
    #: measured LM-head time for N sampled rows (H above)
    sample_rows_s: RowTable = ()
    #: G's level against the engine's own steps: 1 takes the table as timed; a refit with
    #: ``--fit-table-scale`` fits it with the linear terms (the table keeps the shape)
    token_rows_scale: float = 1.0

    def tabled_time(self, chunks: Sequence[Chunk]) -> float:
        """The part of a step's time given by the measured matmul tables."""
        t, _, _, _, n = step_features(chunks)
        return self._tabled(t, n)

    def _tabled(self, tokens: float, sampled: float) -> float:
        return (self.token_rows_scale * interp(self.token_rows_s, tokens)
                + interp(self.sample_rows_s, sampled))

    def step_time(self, chunks: Sequence[Chunk]) -> float:
        if not chunks:
            return 0.0
        t, a, s, c, n = step_features(chunks)
        return (self.base_s + self.per_token_s * t + self.per_attn_s * a + self.per_seq_s * s
                + self.per_ctx_s * c + self.per_sample_s * n
                + self.per_fill_s * fill_tokens(chunks) + self._tabled(t, n))


@dataclass(frozen=True)
class RooflineStepModel:
    shape: ModelShape
    peak_flops: float
    mem_bandwidth: float
    mfu: float
    bw_efficiency: float
    overhead_s: float
    per_layer_overhead_s: float = 0.0

    def flops(self, chunks: Sequence[Chunk]) -> float:
        s = self.shape
        t, a, _, _, n = step_features(chunks)
        attn = 4.0 * s.num_layers * s.num_heads * s.head_dim * a
        return 2.0 * s.num_layers * s.layer_params * t + attn + 2.0 * s.lm_head_params * n

    def bytes_moved(self, chunks: Sequence[Chunk]) -> float:
        kv = sum((ch[1] + ch[0]) for ch in chunks) * self.shape.kv_bytes_per_token
        return self.shape.weight_bytes + kv

    def step_time(self, chunks: Sequence[Chunk]) -> float:
        if not chunks:
            return 0.0
        compute = self.flops(chunks) / (self.peak_flops * self.mfu)
        memory = self.bytes_moved(chunks) / (self.mem_bandwidth * self.bw_efficiency)
        return (max(compute, memory) + self.overhead_s
                + self.per_layer_overhead_s * self.shape.num_layers)


@dataclass(frozen=True)
class ScaledStepModel:
    """Another step model's times times ``factor`` (CPU contention, a slower part)."""

    inner: StepModel
    factor: float

    def step_time(self, chunks: Sequence[Chunk]) -> float:
        return self.inner.step_time(chunks) * self.factor
