"""Step models: the time of one engine step as a function of the chunks it runs.

A profile (:mod:`kvpush.sim.profile`) names one or more, and which one each role runs.
Two kinds:

* ``linear`` (fitted by ``kvpush simulate calibrate``): ``t = base + per_token * T +
  per_attn * A + per_seq * S + per_ctx * C + per_sample * N`` with ``T`` new tokens,
  ``A`` the attention pairs ``sum n * (c + (n + 1) / 2)``, ``S`` chunks, ``C`` the
  context the decode rows read ``sum (c + 1)`` and ``N`` the rows that sample a token.
* ``roofline`` (GPU profiles from public figures): ``max(FLOPs / (peak * mfu), bytes /
  (bandwidth * bw_efficiency)) + overhead`` with FLOPs and bytes from the model's shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

#: A chunk of one step: (new tokens, tokens already in the context before them), and
#: optionally whether it samples a token (ends its prompt, or decodes; default True).
Chunk = tuple[int, int] | tuple[int, int, bool]


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


def step_features(chunks: Sequence[Chunk]) -> tuple[float, float, float, float, float]:
    """(T, A, S, C, N) of a step; see the module docstring. A chunk given without its
    sample flag counts as sampled."""
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


#: the linear model's coefficients, in the order of :func:`step_features` after base_s
LINEAR_FIELDS = ("base_s", "per_token_s", "per_attn_s", "per_seq_s", "per_ctx_s",
                 "per_sample_s")


@dataclass(frozen=True)
class LinearStepModel:
    base_s: float
    per_token_s: float
    per_attn_s: float = 0.0
    per_seq_s: float = 0.0
    per_ctx_s: float = 0.0
    per_sample_s: float = 0.0

    def step_time(self, chunks: Sequence[Chunk]) -> float:
        if not chunks:
            return 0.0
        t, a, s, c, n = step_features(chunks)
        return (self.base_s + self.per_token_s * t + self.per_attn_s * a + self.per_seq_s * s
                + self.per_ctx_s * c + self.per_sample_s * n)


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
