"""Llama and Qwen3 decoder in plain torch over the paged KV region.

The two architectures differ only in Qwen3's per-head RMSNorm on q and k (applied
before rotary embedding) and in config defaults (explicit head_dim, tied embeddings),
so one class serves both. Projections are fused (q|k|v and gate|up) at load time so a
layer is four matmuls.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpush.config import ModelConfig
from kvpush.model.attention import AttentionMetadata, paged_attention
from kvpush.model.linear_pick import (
    LinearPlan,
    Timer,
    compile_padded,
    linear_mode,
    needs_timing,
    onednn_usable,
    plan_linears,
)

log = logging.getLogger("kvpush.model")


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
        #: tensor parallelism (model/parallel.py): sums, in place, the ranks' partial
        #: outputs of the row-parallel o and down projections (None: one rank)
        self.all_reduce: Callable[[torch.Tensor], None] | None = None
        # the matmul of each projection (linear_pick.py): a fixed table, or timed on
        # this machine from the thread that runs the steps (ensure_linears)
        self.linear_mode = linear_mode()
        self.onednn_ok = onednn_usable(device, self.dtype)
        self.linear_plan: LinearPlan | None = None
        self.layer_linears: list[tuple[Callable, ...]] = []
        self.head_linear: Callable | None = None
        #: (most rows of a step's projections, most logits rows): set by the runner; the
        #: padded shapes up to them are compiled once on the stepping thread
        self.step_rows: tuple[int, int] | None = None
        self.rows_compiled_s: float | None = None
        if not self._linears_need_timing():
            self.tune_linears()
        # fp32: torch's fused RMSNorm (one op instead of seven; the same fp32 math as
        # HF's, up to the summation order); other dtypes keep HF's exact recipe
        self.fused_norm = self.dtype == torch.float32
        inv, attn_scaling = rope_inv_freq(cfg)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * attn_scaling).to(device=device, dtype=self.dtype)
        self.sin = (emb.sin() * attn_scaling).to(device=device, dtype=self.dtype)
        # rotate_half(x) * sin == roll(x, D/2) * sin_signed, with the first half of
        # sin negated: the same products (negation is exact), one op instead of two
        half = cfg.head_dim // 2
        self.sin_signed = torch.cat((-self.sin[:, :half], self.sin[:, half:]), dim=-1)

    @property
    def linear_backend(self) -> str:
        """How projections pick their matmul: ``aten`` when oneDNN is not a candidate
        here, else the mode (auto, onednn, rows; see linear_pick.py)."""
        return self.linear_mode.value if self.onednn_ok else "aten"

    def _linear_weights(self) -> Iterator[torch.Tensor]:
        for lw in self.layers:
            yield from (lw.qkv, lw.o, lw.gate_up, lw.down)
        yield self.lm_head

    def _linears_need_timing(self) -> bool:
        return needs_timing(self._linear_weights(), self.linear_mode, self.onednn_ok)

    def tune_linears(self, timer: Timer | None = None) -> LinearPlan:
        """Pick every projection's matmul (timing both kernels in ``auto`` mode, on this
        thread at its torch thread count; ``timer`` replaces the measurement) and
        build the per-layer table that ``forward`` calls."""
        plan = plan_linears(self._linear_weights(), self.linear_mode, self.onednn_ok, timer)
        self.layer_linears = [
            tuple(plan.linear_for(w) for w in (lw.qkv, lw.o, lw.gate_up, lw.down))
            for lw in self.layers
        ]
        self.head_linear = plan.linear_for(self.lm_head)
        self.linear_plan = plan
        if plan.timed_series:
            log.info("%s", plan.describe())
        return plan

    def ensure_linears(self) -> None:
        """Tune the projections if not done yet: called by the thread that will run
        the steps, once its torch thread count is set (the choice can differ between
        1 and 2 threads), and by the first ``forward`` otherwise. Then, once, every
        padded row count a step can make is run through the projections that pad
        (:func:`compile_padded`), at this thread count, which oneDNN's cache keys on."""
        if self.linear_plan is None:
            self.tune_linears()
        if self.rows_compiled_s is None and self.step_rows is not None:
            t0 = time.perf_counter()
            rows, logits_rows = self.step_rows
            lw = self.layers[0]  # every layer's projections have layer 0's shapes
            lins = zip(self.layer_linears[0], (lw.qkv, lw.o, lw.gate_up, lw.down),
                       (lw.qkv_bias, lw.o_bias, lw.gate_up_bias, lw.down_bias), strict=True)
            lins = [(*lwb, rows) for lwb in lins]
            lins.append((self.head_linear, self.lm_head, None, logits_rows))
            plan = self.linear_plan
            assert plan is not None
            shapes = sum(compile_padded(lin, w, b, n) for lin, w, b, n in lins
                         if plan.pads(w))
            self.rows_compiled_s = time.perf_counter() - t0
            if shapes:
                log.info("projections compiled at %d padded row counts in %.0f ms", shapes,
                         self.rows_compiled_s * 1e3)

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.fused_norm:
            return F.rms_norm(x, (x.shape[-1],), w, self.cfg.rms_norm_eps)
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
        logits_idx: torch.Tensor | None,  # [N] rows whose logits are wanted; None: all
        layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Logits [N, vocab] (float32). ``layer_done(i)`` is called as soon as layer i's
        K/V are in the KV region, so a transfer of that layer can start while the
        following layers compute."""
        self.ensure_linears()
        cfg = self.cfg
        h = F.embedding(input_ids, self.embed)
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D]
        sin = self.sin_signed[positions].unsqueeze(1)
        T = input_ids.shape[0]
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qs, kvs = self.q_size, self.kv_size
        reduce = self.all_reduce
        for i, lw in enumerate(self.layers):
            lin_qkv, lin_o, lin_gu, lin_down = self.layer_linears[i]
            x = self._norm(h, lw.input_norm)
            qkv = lin_qkv(x, lw.qkv, lw.qkv_bias)
            if lw.q_norm is None:
                # q and k heads side by side: one rotary pass for both, written back
                # into qkv so that k|v stay one [T, 2, Hkv, D] view for the KV writes
                qk = qkv[:, : qs + kvs].view(T, H + Hkv, D)
                torch.addcmul(qk * cos, qk.roll(D // 2, -1), sin, out=qk)
                q = qk[:, :H]
            else:
                q = self._norm(qkv[:, :qs].view(T, H, D), lw.q_norm)
                k = self._norm(qkv[:, qs : qs + kvs].view(T, Hkv, D), lw.k_norm)
                q = torch.addcmul(q * cos, q.roll(D // 2, -1), sin)
                qkv[:, qs : qs + kvs].view(T, Hkv, D).copy_(
                    torch.addcmul(k * cos, k.roll(D // 2, -1), sin))
            kv_new = qkv[:, qs:].view(T, 2, Hkv, D)  # rotated k, then v
            attn = paged_attention(q, kv_new, kv[i], md, self.scale, i)
            if layer_done is not None and reduce is None:
                layer_done(i)
            o = lin_o(attn.reshape(T, qs), lw.o, lw.o_bias)
            if reduce is not None:
                reduce(o)
                # every rank has entered this all-reduce after writing layer i's KV: a
                # push may WRITE it from every rank now (engine/tp/kv_ranks.py)
                if layer_done is not None:
                    layer_done(i)
            h = h + o
            x = self._norm(h, lw.post_norm)
            gu = lin_gu(x, lw.gate_up, lw.gate_up_bias)
            gate, up = gu.chunk(2, dim=-1)
            down = lin_down(F.silu(gate) * up, lw.down, lw.down_bias)
            if reduce is not None:
                reduce(down)
            h = h + down
        if logits_idx is not None:
            if not len(logits_idx):  # (a tensor-parallel rank other than 0: no logits)
                return torch.empty((0, self.lm_head.shape[0]), device=h.device)
            h = h[logits_idx]
        h = self._norm(h, self.final_norm)
        return self.head_linear(h, self.lm_head).float()
