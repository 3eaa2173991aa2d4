"""Decode attention that reads the paged KV region through the block tables.

No dense copy of any request's KV is kept (unlike ``attention.DecodeKVCache``), and no
copy of a whole context is made either (unlike the gather path, which copies every
decode's blocks of a layer into one ``[B, context, Hkv, D]`` temporary): the block
columns of the step's ``[B, max_blocks]`` table are visited in chunks, each chunk's
blocks are read from the region into a temporary of at most :data:`CHUNK_BYTES`, and the
chunks are merged with an online softmax (running max, running sum, rescaled
accumulator), the same arithmetic as flash-decoding. A step whose whole context fits in
one chunk is a single SDPA call over its blocks.

It is the decode attention on CUDA (``--decode-attention auto``), where a dense copy
would double the KV's share of GPU memory; CPU keeps the dense cache by default, and
``--decode-attention paged`` selects this path there (that is how the tests compare it
with the other paths). Plain torch ops: the same function runs on CPU and CUDA, but it
has only been run on CPU (no GPU in CI). On CUDA a fused kernel that walks the block
table itself (a flex_attention block mask over the region, or a paged-attention kernel)
would also save the per-chunk temporaries; torch 2.13 has only a private
``torch.nn.attention.experimental._paged_attention`` built on flex_attention, for its
own page layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: the most bytes one chunk's K and V temporaries take together
CHUNK_BYTES = 64 << 20


def chunk_blocks(batch: int, layer_kv: torch.Tensor, chunk_bytes: int) -> int:
    """Block columns per chunk: as many as keep ``batch`` rows of K and V (in the
    region's dtype) under ``chunk_bytes``, at least one."""
    _, _, bs, hkv, d = layer_kv.shape
    per_column = 2 * batch * bs * hkv * d * layer_kv.element_size()
    return max(1, chunk_bytes // per_column)


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D] one query per decoding request
    layer_kv: torch.Tensor,  # [NB, 2, bs, Hkv, D] one layer of the KV region
    tables: torch.Tensor,  # [B, max_blocks] block ids, padded (padding is masked)
    mask: torch.Tensor,  # [B, 1, 1, max_blocks * bs] additive: 0 valid, -inf masked
    scale: float,
    chunk_bytes: int | None = None,  # None: CHUNK_BYTES
) -> torch.Tensor:
    """Attention output [B, H, D] of each query over its request's blocks.

    Every request has at least one valid position (its own token, written into the
    region before this runs), and position 0 is in the first chunk, so every row's
    running max is finite after the first chunk: later chunks that are all masked for a
    row add exp(-inf) = 0 to it. Masked positions are multiplied by 0, so the region
    must hold finite values there (KVRegion is zero-initialised)."""
    B, H, D = q.shape
    _, _, bs, hkv, _ = layer_kv.shape
    group = H // hkv
    nb = tables.shape[1]
    per = chunk_blocks(B, layer_kv, CHUNK_BYTES if chunk_bytes is None else chunk_bytes)
    qg = q.reshape(B, hkv, group, D)
    keys, values = layer_kv[:, 0], layer_kv[:, 1]  # [NB, bs, Hkv, D] views

    def read(cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of these block columns as [B, Hkv, n * bs, D] in q's dtype."""
        k = keys[cols].flatten(1, 2).transpose(1, 2)
        v = values[cols].flatten(1, 2).transpose(1, 2)
        return k.to(q.dtype), v.to(q.dtype)

    if nb <= per:
        k, v = read(tables)
        # the mask in q's dtype: CUDA's fused kernels misread or refuse a float32 bias
        # beside bf16 queries (kvpush.model.attention.mask_as)
        m = mask if mask.dtype == q.dtype else mask.to(q.dtype)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=m, scale=scale)
        return o.reshape(B, H, D)
    qf = qg.float()
    run_max = torch.full((B, hkv, group, 1), float("-inf"), device=q.device)
    run_sum = torch.zeros((B, hkv, group, 1), device=q.device)
    acc = torch.zeros((B, hkv, group, D), device=q.device)
    for j in range(0, nb, per):
        k, v = read(tables[:, j : j + per])
        scores = torch.matmul(qf, k.float().transpose(-1, -2)).mul_(scale)
        scores.add_(mask[..., j * bs : (j + per) * bs])  # [B, Hkv, group, n * bs]
        new_max = torch.maximum(run_max, scores.amax(dim=-1, keepdim=True))
        rescale = torch.exp(run_max - new_max)  # 0 on the first chunk (-inf - finite)
        p = torch.exp(scores.sub_(new_max))
        run_sum = run_sum * rescale + p.sum(dim=-1, keepdim=True)
        acc = acc * rescale + torch.matmul(p, v.float())
        run_max = new_max
    return (acc / run_sum).to(q.dtype).reshape(B, H, D)
