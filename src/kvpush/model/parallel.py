"""Tensor parallelism's split of the weights: which heads and MLP columns a rank holds.

Megatron's split, with the fused projections of ``llama.py``::

    q|k|v   column-parallel: rank r's query heads, then its KV heads' K, then their V
    o       row-parallel: the columns of its query heads; the ranks' partial outputs
            are summed by one all-reduce (the bias, if any, is added by rank 0 only)
    gate|up column-parallel: its share of the MLP width, gate rows then up rows
    down    row-parallel: the same share of columns; one all-reduce
    norms, q_norm/k_norm (per head_dim), embedding, lm_head: replicated

Rank r of n holds query heads ``[r*H/n, (r+1)*H/n)`` and KV heads ``tp_kv_heads`` (config):
``Hkv/n`` of them when n divides them, else (n a multiple of Hkv) the one KV head its
query heads read, which ``n/Hkv`` ranks then hold alike. Its KV region holds only those
heads, for every block, under the block ids every rank shares.

The embedding and the LM head are replicated: each rank embeds the step's tokens itself
(no broadcast of hidden states) and only rank 0, which samples, computes logits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvpush.config import ModelConfig, tp_kv_heads, tp_problem
from kvpush.errors import ConfigError
from kvpush.model.llama import LayerWeights


@dataclass(frozen=True)
class TPShard:
    """What rank ``rank`` of ``size`` holds of a model: ranges of head and column ids."""

    rank: int
    size: int
    heads: range  # query heads
    kv_heads: range
    mlp: range  # columns of the MLP's intermediate width

    @classmethod
    def of(cls, cfg: ModelConfig, size: int, rank: int) -> TPShard:
        problem = tp_problem(cfg, size)
        if problem is not None:
            raise ConfigError(problem)
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} of {size}")
        h, i = cfg.num_heads // size, cfg.intermediate_size // size
        return cls(rank, size, range(rank * h, (rank + 1) * h),
                   tp_kv_heads(cfg, size, rank), range(rank * i, (rank + 1) * i))

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The shape this rank computes: its heads, its KV heads, its MLP width."""
        return dataclasses.replace(cfg, num_heads=len(self.heads),
                                   num_kv_heads=len(self.kv_heads),
                                   intermediate_size=len(self.mlp))

    def describe(self) -> dict:
        """The rank's share, as /kv/info shows it."""
        return {"rank": self.rank, "attention_heads": list(self.heads),
                "kv_heads": list(self.kv_heads),
                "mlp_columns": [self.mlp.start, self.mlp.stop]}

    def shard_layer(self, lw: LayerWeights, cfg: ModelConfig) -> LayerWeights:
        """This rank's part of one layer of the full model ``cfg`` (fresh tensors: the
        full layer can be freed)."""
        d, h, hkv, inter = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size

        def rows(t: torch.Tensor, start: int, r: range, width: int = 1) -> torch.Tensor:
            return t[start + r.start * width : start + r.stop * width]

        def qkv(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            return torch.cat((rows(t, 0, self.heads, d), rows(t, h * d, self.kv_heads, d),
                              rows(t, (h + hkv) * d, self.kv_heads, d)))

        def gate_up(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            return torch.cat((rows(t, 0, self.mlp), rows(t, inter, self.mlp)))

        def first_rank_only(t: torch.Tensor | None) -> torch.Tensor | None:
            return t if self.rank == 0 else None  # summed once by the all-reduce

        cols = slice(self.heads.start * d, self.heads.stop * d)
        return LayerWeights(
            input_norm=lw.input_norm,
            qkv=qkv(lw.qkv),
            qkv_bias=qkv(lw.qkv_bias),
            o=lw.o[:, cols].contiguous(),
            o_bias=first_rank_only(lw.o_bias),
            q_norm=lw.q_norm,
            k_norm=lw.k_norm,
            post_norm=lw.post_norm,
            gate_up=gate_up(lw.gate_up),
            gate_up_bias=gate_up(lw.gate_up_bias),
            down=lw.down[:, self.mlp.start : self.mlp.stop].contiguous(),
            down_bias=first_rank_only(lw.down_bias),
        )
