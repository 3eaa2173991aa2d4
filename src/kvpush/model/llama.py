"""Llama and Qwen3 decoder in plain torch over the paged KV region.

The two architectures differ only in Qwen3's per-head RMSNorm on q and k (applied
before rotary embedding) and in config defaults (explicit head_dim, tied embeddings),
so one class serves both. Projections are fused (q|k|v and gate|up) at load time so a
layer is four matmuls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpush.config import ModelConfig
from kvpush.model.attention import AttentionMetadata, paged_attention


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for the config's rope type, computed by
    transformers' own rope functions for anything beyond the default."""
    raw = cfg.hf_config
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or params.get("type") or "default"
    theta = float(params.get("rope_theta") or raw.get("rope_theta") or 10000.0)
    dim = cfg.head_dim
    if rope_type == "default":
        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv, 1.0
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    hf_cfg = AutoConfig.from_pretrained(cfg.path)
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, torch.device("cpu"))
    return inv.float(), float(scaling)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DecoderModel:
    """Holds the weights; :meth:`forward` runs one flattened step."""

    def __init__(
        self,
        cfg: ModelConfig,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
        max_positions: int,
        device: str,
    ):
        self.cfg = cfg
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.dtype = embed.dtype
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        inv, attn_scaling = rope_inv_freq(cfg)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * attn_scaling).to(device=device, dtype=self.dtype)
        self.sin = (emb.sin() * attn_scaling).to(device=device, dtype=self.dtype)

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # As in HF: normalise in fp32, scale in the weight's dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return w * xf.to(x.dtype)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv: torch.Tensor,  # the KV region [L, NB, 2, bs, Hkv, D]
        md: AttentionMetadata,
        logits_idx: torch.Tensor,  # [N] rows of the batch whose logits are wanted
        layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Logits [N, vocab] (float32). ``layer_done(i)`` is called as soon as layer i's
        K/V are in the KV region, so a transfer of that layer can start while the
        following layers compute."""
        cfg = self.cfg
        h = F.embedding(input_ids, self.embed)
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1)
        T = input_ids.shape[0]
        for i, lw in enumerate(self.layers):
            x = self._norm(h, lw.input_norm)
            qkv = F.linear(x, lw.qkv, lw.qkv_bias)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.reshape(T, cfg.num_heads, cfg.head_dim)
            k = k.reshape(T, cfg.num_kv_heads, cfg.head_dim)
            v = v.reshape(T, cfg.num_kv_heads, cfg.head_dim)
            if lw.q_norm is not None:
                q = self._norm(q, lw.q_norm)
                k = self._norm(k, lw.k_norm)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            attn = paged_attention(q, k, v, kv[i], md, self.scale)
            if layer_done is not None:
                layer_done(i)
            h = h + F.linear(attn.reshape(T, self.q_size), lw.o, lw.o_bias)
            x = self._norm(h, lw.post_norm)
            gu = F.linear(x, lw.gate_up, lw.gate_up_bias)
            gate, up = gu.chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, lw.down, lw.down_bias)
        h = self._norm(h[logits_idx], self.final_norm)
        return F.linear(h, self.lm_head).float()
