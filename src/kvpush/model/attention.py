"""Paged attention over the layer-major KV region, in plain torch.

The runner flattens a step's tokens into one batch of ``T`` tokens. Every token's K and
V are written to its slot (block id, offset). Then:

* decode tokens (one new token per request) are attended together: their block tables
  are padded into one ``[B, max_blocks]`` index, the KV gathered once per layer and one
  ``scaled_dot_product_attention`` call covers the whole group with a length mask;
* each prefill chunk is attended on its own: a chunk that starts at position 0 uses its
  fresh K/V and a causal mask; a chunk after cached or earlier-chunk tokens gathers its
  blocks and masks with the offset causal pattern.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    start: int  # index of the chunk's first token in the flat batch
    end: int
    start_pos: int  # sequence position of the first token
    block_ids: torch.Tensor | None  # None when start_pos == 0 (fresh K/V suffice)
    mask: torch.Tensor | None  # [q, ctx] bool, None when start_pos == 0


@dataclass
class AttentionMetadata:
    slot_blocks: torch.Tensor  # [T] block id of each token's KV slot
    slot_offsets: torch.Tensor  # [T] offset inside the block
    decode_idx: torch.Tensor | None = None  # [B] indices of decode tokens in the batch
    decode_tables: torch.Tensor | None = None  # [B, max_blocks]
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillSpan] = field(default_factory=list)


def build_metadata(
    chunks: list[tuple[int, int, list[int]]], block_size: int, device: str
) -> AttentionMetadata:
    """``chunks``: (start_pos, num_tokens, block_ids) per request, in batch order."""
    slot_blocks: list[int] = []
    slot_offsets: list[int] = []
    dec_idx: list[int] = []
    dec_tables: list[list[int]] = []
    dec_lens: list[int] = []
    prefills: list[PrefillSpan] = []
    t = 0
    for start_pos, n, block_ids in chunks:
        for p in range(start_pos, start_pos + n):
            slot_blocks.append(block_ids[p // block_size])
            slot_offsets.append(p % block_size)
        ctx = start_pos + n
        nb = -(-ctx // block_size)
        if n == 1:
            dec_idx.append(t)
            dec_tables.append(block_ids[:nb])
            dec_lens.append(ctx)
        elif start_pos == 0:
            prefills.append(PrefillSpan(t, t + n, 0, None, None))
        else:
            q_pos = torch.arange(start_pos, ctx).unsqueeze(1)
            k_pos = torch.arange(ctx).unsqueeze(0)
            prefills.append(
                PrefillSpan(
                    t,
                    t + n,
                    start_pos,
                    torch.tensor(block_ids[:nb], dtype=torch.long, device=device),
                    (k_pos <= q_pos).to(device),
                )
            )
        t += n
    md = AttentionMetadata(
        slot_blocks=torch.tensor(slot_blocks, dtype=torch.long, device=device),
        slot_offsets=torch.tensor(slot_offsets, dtype=torch.long, device=device),
        prefills=prefills,
    )
    if dec_idx:
        max_nb = max(len(tb) for tb in dec_tables)
        table = torch.zeros((len(dec_tables), max_nb), dtype=torch.long)
        for i, tb in enumerate(dec_tables):
            table[i, : len(tb)] = torch.tensor(tb, dtype=torch.long)
        lens = torch.tensor(dec_lens).unsqueeze(1)
        mask = torch.arange(max_nb * block_size).unsqueeze(0) < lens
        md.decode_idx = torch.tensor(dec_idx, dtype=torch.long, device=device)
        md.decode_tables = table.to(device)
        md.decode_mask = mask[:, None, None, :].to(device)
    return md


def _gather(layer_kv: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """layer_kv [NB, 2, bs, Hkv, D], table [..., nb] → K, V as [..., nb*bs, Hkv, D]."""
    kv = layer_kv[table]  # [..., nb, 2, bs, Hkv, D]
    shape = (*table.shape[:-1], table.shape[-1] * kv.shape[-3], kv.shape[-2], kv.shape[-1])
    return kv.select(-4, 0).reshape(shape), kv.select(-4, 1).reshape(shape)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    layer_kv: torch.Tensor,  # [NB, 2, bs, Hkv, D] view into the KV region
    md: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache and return attention output [T, H, D]."""
    layer_kv[md.slot_blocks, 0, md.slot_offsets] = k.to(layer_kv.dtype)
    layer_kv[md.slot_blocks, 1, md.slot_offsets] = v.to(layer_kv.dtype)
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
    if md.decode_idx is not None:
        kc, vc = _gather(layer_kv, md.decode_tables)  # [B, L, Hkv, D]
        qd = q[md.decode_idx].unsqueeze(2)  # [B, H, 1, D]
        o = F.scaled_dot_product_attention(
            qd,
            kc.transpose(1, 2).to(q.dtype),
            vc.transpose(1, 2).to(q.dtype),
            attn_mask=md.decode_mask,
            scale=scale,
            enable_gqa=gqa,
        )
        out[md.decode_idx] = o.squeeze(2)
    for span in md.prefills:
        qp = q[span.start : span.end].transpose(0, 1)  # [H, n, D]
        if span.block_ids is None:
            kp = k[span.start : span.end].transpose(0, 1)
            vp = v[span.start : span.end].transpose(0, 1)
            o = F.scaled_dot_product_attention(
                qp, kp, vp, is_causal=True, scale=scale, enable_gqa=gqa
            )
        else:
            ctx = span.mask.shape[1]
            kc, vc = _gather(layer_kv, span.block_ids)
            kp = kc[:ctx].transpose(0, 1).to(q.dtype)
            vp = vc[:ctx].transpose(0, 1).to(q.dtype)
            o = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=span.mask, scale=scale, enable_gqa=gqa
            )
        out[span.start : span.end] = o.transpose(0, 1)
    return out
