"""Paged attention over the layer-major KV region, in plain torch.

The runner flattens a step's tokens into one batch of ``T`` tokens. Every token's K and
V are written to its slot (block id, offset) in the KV region, which stays the one
source of truth (the KV transfer reads and writes it). Then:

* decode tokens (one new token per request) are attended together with one
  ``scaled_dot_product_attention`` call and a length mask. Their K/V come from a
  :class:`DecodeKVCache` when the runner has one: a dense ``[slot, kv_head, pos, dim]``
  copy of every decoding request's KV that is filled from the region once, when the
  request starts decoding, and then only appended to, so a decode step reads its context
  in place instead of re-gathering every block of every request per layer. Without it
  (or when it would not fit its memory cap) the block tables are padded into one
  ``[B, max_blocks]`` index and K and V gathered per layer, or, with the paged decode
  attention (``md.decode_paged``: the CUDA default), read through that index in bounded
  chunks by :mod:`kvpush.model.paged_decode`;
* each prefill chunk is attended on its own: a chunk that starts at position 0 uses its
  fresh K/V and a causal mask; a chunk after cached or earlier-chunk tokens gathers its
  blocks and masks with the offset causal pattern. On a CPU both run at padded lengths
  (:func:`~kvpush.model.shapes.padded_size` queries and keys, the padding after the
  real tokens, so the causal pattern keeps every real query off it): torch's CPU flash
  attention keeps a kernel per shape it meets, which every new prompt length grew.

Queries are grouped by KV head (``[B, Hkv, H/Hkv, D]`` for decodes) rather than using
``enable_gqa``, and every SDPA input is 4-D: 3-D inputs or GQA broadcasting send CPU
torch to its unfused math kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvpush.model.paged_decode import paged_decode_attention
from kvpush.model.shapes import padded_size


@dataclass
class PrefillSpan:
    start: int  # index of the chunk's first token in the flat batch
    end: int
    start_pos: int  # sequence position of the first token
    block_ids: torch.Tensor | None  # None when start_pos == 0 (fresh K/V suffice)
    # [padded q, padded ctx] additive float, None when start_pos == 0
    mask: torch.Tensor | None
    padded: int  # the query rows attention runs at (>= end - start)


@dataclass
class AttentionMetadata:
    slot_blocks: torch.Tensor  # [T] block id of each token's KV slot
    slot_offsets: torch.Tensor  # [T] offset inside the block
    decode_idx: torch.Tensor | None = None  # [B] indices of decode tokens in the batch
    decode_tables: torch.Tensor | None = None  # [B, max_blocks] (gather path)
    # [B, 1, 1, L] additive float mask (0 / -inf), rows in decode order (gather path)
    decode_mask: torch.Tensor | None = None
    prefills: list[PrefillSpan] = field(default_factory=list)
    # the decode tokens' block tables and context lengths, from which the gather
    # path's tensors are built on first use (build_gather_tables): a step the
    # DecodeKVCache serves never needs them
    decode_rows: list[list[int]] = field(default_factory=list)
    decode_lens: list[int] = field(default_factory=list)
    block_size: int = 0
    device: str | torch.device = "cpu"
    # DecodeKVCache path (set by DecodeKVCache.prepare)
    decode_cache: DecodeKVCache | None = None
    decode_slots: torch.Tensor | None = None  # [B] cache slot of each decode token
    decode_pos: torch.Tensor | None = None  # [B] position of each decode token
    decode_order: torch.Tensor | None = None  # [B] decode row held by slot s; None: same
    decode_len: int = 0  # attended length (max context of the decode tokens)
    # (first slot, end slot, attended length) of each group of consecutive slots
    decode_groups: list[tuple[int, int, int]] = field(default_factory=list)
    # decode through model/paged_decode.py (block tables, no dense copy) instead of
    # gathering whole contexts when there is no DecodeKVCache (set by the runner)
    decode_paged: bool = False
    # per group, its [b - a, 1, 1, n] length mask; None where every slot of the group
    # has the group's length (nothing to mask: SDPA runs without one)
    decode_group_masks: list[torch.Tensor | None] = field(default_factory=list)

    def build_gather_tables(self) -> None:
        """The gather path's padded block table and length mask (once per step)."""
        if self.decode_tables is not None or not self.decode_rows:
            return
        max_nb = max(len(tb) for tb in self.decode_rows)
        table = torch.zeros((len(self.decode_rows), max_nb), dtype=torch.long)
        for i, tb in enumerate(self.decode_rows):
            table[i, : len(tb)] = torch.tensor(tb, dtype=torch.long)
        self.decode_tables = table.to(self.device)
        self.decode_mask = length_mask(self.decode_lens, max_nb * self.block_size,
                                       self.device)


def build_metadata(
    chunks: list[tuple[int, int, list[int]]], block_size: int, device: str
) -> AttentionMetadata:
    """``chunks``: (start_pos, num_tokens, block_ids) per request, in batch order."""
    on_cpu = torch.device(device).type == "cpu"

    def pad(n: int) -> int:
        return padded_size(n) if on_cpu else n

    slot_blocks: list[int] = []
    slot_offsets: list[int] = []
    dec_idx: list[int] = []
    dec_tables: list[list[int]] = []
    dec_lens: list[int] = []
    prefills: list[PrefillSpan] = []
    t = 0
    for start_pos, n, block_ids in chunks:
        if n == 1:
            slot_blocks.append(block_ids[start_pos // block_size])
            slot_offsets.append(start_pos % block_size)
        else:
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
            prefills.append(PrefillSpan(t, t + n, 0, None, None, pad(n)))
        else:
            # padded queries sit after the real ones and padded keys after the context:
            # the causal pattern keeps every real query off the padding, and every
            # padded query still sees a key (no row of -inf only)
            q_pos = torch.arange(start_pos, start_pos + pad(n)).unsqueeze(1)
            k_pos = torch.arange(pad(ctx)).unsqueeze(0)
            # additive float mask: SDPA would convert a bool one in every layer
            mask = torch.zeros((pad(n), pad(ctx))).masked_fill_(k_pos > q_pos,
                                                                float("-inf"))
            prefills.append(
                PrefillSpan(
                    t,
                    t + n,
                    start_pos,
                    torch.tensor(block_ids[:nb], dtype=torch.long, device=device),
                    mask.to(device),
                    pad(n),
                )
            )
        t += n
    md = AttentionMetadata(
        slot_blocks=torch.tensor(slot_blocks, dtype=torch.long, device=device),
        slot_offsets=torch.tensor(slot_offsets, dtype=torch.long, device=device),
        prefills=prefills,
    )
    if dec_idx:
        md.decode_idx = torch.tensor(dec_idx, dtype=torch.long, device=device)
        md.decode_rows, md.decode_lens = dec_tables, dec_lens
        md.block_size, md.device = block_size, device
    return md


def mask_as(mask: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """An additive mask in the query's dtype (0 and -inf are exact in every dtype).

    SDPA accepts a float32 mask beside bf16 queries, but on CUDA its fused kernels take
    a bias only in the query's dtype: the memory-efficient one raises ("invalid dtype for
    bias"), and cuDNN, which torch prefers on Hopper (H100/H200), reads the float32
    buffer as bf16 and returns wrong values without an error (pytorch/pytorch#191612).
    The masks are built in float32 (the dtype is not known there) and converted once per
    step by the first layer that uses them."""
    if mask is None or mask.dtype == q.dtype:
        return mask
    return mask.to(q.dtype)


def length_mask(lens: list[int], width: int, device) -> torch.Tensor:
    """[B, 1, 1, width] additive mask: 0 where position < lens[b], -inf elsewhere."""
    keep = torch.arange(width).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)
    mask = torch.zeros(keep.shape).masked_fill_(~keep, float("-inf"))
    return mask[:, None, None, :].to(device)


@dataclass
class _Entry:
    slot: int
    length: int  # positions [0, length) hold the request's K/V
    blocks: list[int]  # the block ids covering [0, length)


def _group_bounds(n: int) -> list[tuple[int, int]]:
    """Split slots [0, n) into at most 4 contiguous groups of at least 4 slots."""
    k = max(1, min(4, n // 4))
    size = -(-n // k)
    return [(a, min(n, a + size)) for a in range(0, n, size)]


def _padded_cost(lengths: list[int]) -> int:
    """Positions attended (valid or masked) when ``lengths`` are the slots in order."""
    return sum((b - a) * max(lengths[a:b]) for a, b in _group_bounds(len(lengths)))


class DecodeKVCache:
    """Dense copies of decoding requests' K/V, so decode attention reads them in place.

    ``buf[layer, 0|1, slot, kv_head, pos, dim]`` (in the model's dtype, holding exactly
    the values of the KV region, i.e. rounded through the region's dtype). A request
    gets a slot the first step it decodes, filled from the region; each later step only
    appends the new token's K/V (written by :func:`paged_attention`, next to the region
    write). Slots are kept compact (0..B-1), and attention runs over up to four groups
    of consecutive slots, each only as long as its longest member; when sorting the
    slots by length would cut the padded positions enough to pay for the copy within a
    few steps, the slots are reordered.

    An entry is reused only when the request decoded in the immediately preceding
    forward, at the previous position, over the same blocks; anything else (a prefill
    chunk, a step without the request, preemption, abort, a failed step) drops it and
    the next decode refills from the region. ``max_bytes`` caps the buffer; a step that
    would need more falls back to gathering from the region.

    Masked positions are still multiplied (0 * NaN is NaN), so every slot attention
    reads must hold finite values past its entry's length: ``clean[s]`` records that
    slot ``s`` is finite throughout; a slot is zeroed once, when first used.

    :meth:`reserve` allocates and touches ``max_bytes`` once (at start-up); every buffer
    shape is then a view of that storage. Without it a new shape is a fresh allocation,
    whose pages the kernel faults in as the step that needed it fills them, so on CPU a
    burst of first decodes pays for the page faults inside that step (docs/MEASURED.md).
    """

    #: reorder when the padded positions saved over this many steps exceed the copy
    PAYBACK_STEPS = 8

    def __init__(
        self,
        region: torch.Tensor,
        block_size: int,
        dtype: torch.dtype,
        max_bytes: int,
        max_slots: int = 256,
        max_len: int = 0,
    ):
        self.region = region  # [L, NB, 2, bs, Hkv, D]
        self.block_size = block_size
        self.dtype = dtype
        self.max_bytes = max_bytes
        self.max_slots = max_slots  # the most requests that decode together
        self.max_len = max_len  # the longest a request gets (0: unknown)
        self.entries: dict[str, _Entry] = {}
        self.buf: torch.Tensor | None = None
        self.storage: torch.Tensor | None = None  # set by reserve()
        self.clean: list[bool] = []
        self.num_reorders = 0
        L, _, _, _, hkv, d = region.shape
        self._per_slot_pos = 2 * L * hkv * d * torch.empty((), dtype=dtype).element_size()

    def reset(self) -> None:
        self.entries.clear()
        self.buf = None
        self.clean = []

    @property
    def nbytes(self) -> int:
        return 0 if self.buf is None else self.buf.numel() * self.buf.element_size()

    def reserve(self) -> None:
        """Allocate ``max_bytes`` of storage and touch every page of it now (zeros), so
        that growing the buffer later costs the copy of the entries it keeps, never
        page faults inside a step. Calling it again re-reserves at the current cap."""
        self.reset()
        self.storage = None
        elem = torch.empty((), dtype=self.dtype).element_size()
        # no shape is ever larger than max_slots x max_len positions
        usable = self.max_bytes
        if self.max_len:
            usable = min(usable, self.max_slots * self.max_len * self._per_slot_pos)
        if usable >= elem:
            self.storage = torch.zeros(usable // elem, dtype=self.dtype,
                                       device=self.region.device)

    def _new_shape(self, slots: int, length: int, want: int) -> tuple[int, int] | None:
        """(slots, length) of the buffer this step needs: the current one when it holds
        ``slots`` x ``length``, else a new one. A new one aims at ``want`` positions (the
        longest the current requests can grow to) and then at as many slots as fit
        under ``max_bytes`` (up to ``max_slots``), so that it rarely has to grow again:
        slots nobody uses are never touched, so cost no memory. When that does not fit
        it settles for less headroom, but not for none: None then, and the gather path
        serves this step."""
        buf = self.buf
        if buf is not None and slots <= buf.shape[2] and length <= buf.shape[4]:
            return buf.shape[2], buf.shape[4]
        per = self._per_slot_pos

        def round64(n: int) -> int:
            return -(-n // 64) * 64

        lengths = [round64(max(want, length)), round64(length + 64)]
        if self.max_len:
            lengths = [max(length, min(n, self.max_len)) for n in lengths]
        # always some headroom in both: a buffer that fits only this step would be
        # reallocated (all of it copied) every step, which is worse than gathering
        roomy = min(self.max_slots, max(2 * slots, 8))
        some = max(slots, min(self.max_slots, slots + max(2, slots // 4)))
        for need_slots in (roomy, some):  # slot headroom first, then length headroom
            for n in lengths:
                fit = self.max_bytes // (n * per)
                if fit >= need_slots:
                    return max(slots, min(fit, self.max_slots)), n
        return None

    def _realloc(self, shape: tuple[int, int], moves: list[tuple[int, int, int]]) -> None:
        """New buffer of ``shape``; each (old slot, new slot, length) is carried over:
        positions [0, length) copied slot by slot (no gathered temporary), the rest of
        the new slot zeroed."""
        L, _, _, _, hkv, d = self.region.shape
        new_s, new_l = shape
        dims = (L, 2, new_s, hkv, new_l, d)
        numel = math.prod(dims)
        if self.storage is not None and numel <= self.storage.numel():
            # the old buffer is a view of the same storage: take the kept entries out
            # before the new view's layout overwrites them
            kept = [(b, n, self.buf[:, :, a, :, :n].clone()) for a, b, n in moves]
            new = self.storage[:numel].view(dims)
        else:
            kept = [(b, n, self.buf[:, :, a, :, :n]) for a, b, n in moves]
            new = torch.empty(dims, dtype=self.dtype, device=self.region.device)
        clean = [False] * new_s
        for b, n, src in kept:
            new[:, :, b, :, :n].copy_(src)
            new[:, :, b, :, n:].zero_()
            clean[b] = True
        self.buf, self.clean = new, clean

    def _fill(self, slot: int, length: int, blocks: list[int]) -> None:
        if length == 0:
            return
        bs = self.block_size
        nb = -(-length // bs)
        ids = torch.tensor(blocks[:nb], dtype=torch.long, device=self.region.device)
        L, _, _, _, hkv, d = self.region.shape
        # one layer at a time, so that its gathered blocks (a few MB) stay in cache
        # through the reorder and the copy into the buffer: all layers at once moved
        # every byte through memory three times (docs/MEASURED.md)
        for layer in range(L):
            src = self.region[layer, ids]  # [nb, 2, bs, Hkv, D]
            src = src.permute(1, 3, 0, 2, 4).reshape(2, hkv, nb * bs, d)
            self.buf[layer, :, slot, :, :length] = src[:, :, :length]

    def _move(self, moves: list[tuple[int, int, int]], keep_len: int) -> None:
        """Copy slots (src, dst, length): one slot at a time when no destination is also
        a source, else all at once through a gathered copy of [0, keep_len)."""
        buf = self.buf
        was = list(self.clean)
        if {a for a, _, _ in moves} & {b for _, b, _ in moves}:
            s = torch.tensor([a for a, _, _ in moves], dtype=torch.long, device=buf.device)
            d = torch.tensor([b for _, b, _ in moves], dtype=torch.long, device=buf.device)
            buf[:, :, d, :, :keep_len] = buf[:, :, s, :, :keep_len]  # gathers first
            for a, b, _ in moves:
                self.clean[b] = was[a] and was[b]
        else:
            for a, b, n in moves:
                buf[:, :, b, :, :n] = buf[:, :, a, :, :n]
                # [0, n) is valid data; the rest of b is as finite as it was
    def prepare(
        self,
        md: AttentionMetadata,
        decodes: list[tuple[str, int, list[int]]],
        bounds: list[int] | None = None,
    ) -> None:
        """Called once per forward with the step's decode chunks (request id, position,
        block ids), in decode order, and optionally the most positions each request
        can reach (to size the buffer once). Sets md's cache fields, or leaves md on the
        gather path when the cache cannot hold this step."""
        old = self.entries
        self.entries = {}
        if not decodes:
            return
        bs = self.block_size
        B = len(decodes)
        kept: dict[str, _Entry] = {}
        for rid, pos, blocks in decodes:
            e = old.get(rid)
            if e is not None and e.length == pos and blocks[: len(e.blocks)] == e.blocks:
                kept[rid] = e
        max_len = max(pos + 1 for _, pos, _ in decodes)
        keep_len = max((e.length for e in kept.values()), default=0)
        shape = self._new_shape(B, max_len, max(bounds) if bounds else 0)
        if shape is None:
            self.reset()
            return  # too big for the cap: gather this step, refill later
        # where each decode goes: kept entries stay (those at slots >= B move down into
        # free slots), new ones take the remaining free slots
        used = {e.slot for e in kept.values()}
        free = [s for s in range(B) if s not in used]
        target: dict[str, int] = {}
        for rid, _, _ in decodes:
            e = kept.get(rid)
            if e is not None and e.slot < B:
                target[rid] = e.slot
        for rid, _, _ in decodes:
            if rid not in target:
                target[rid] = free.pop(0)
        pos_of = {rid: pos for rid, pos, _ in decodes}
        by_slot = sorted(target, key=target.__getitem__)
        cost = _padded_cost([pos_of[r] + 1 for r in by_slot])
        ranked = sorted(target, key=lambda r: -pos_of[r])
        saving = cost - _padded_cost([pos_of[r] + 1 for r in ranked])
        # reordering copies each moved slot's [0, keep_len) twice (gather, then put)
        moved = sum(1 for r, e in kept.items() if e.slot != ranked.index(r))
        if saving * self.PAYBACK_STEPS > 2 * moved * keep_len:
            target = {r: i for i, r in enumerate(ranked)}
            self.num_reorders += 1
        if self.buf is None or shape != (self.buf.shape[2], self.buf.shape[4]):
            self._realloc(shape, [(e.slot, target[r], e.length) for r, e in kept.items()])
        else:
            moves = [(e.slot, target[r], e.length) for r, e in kept.items() if e.slot != target[r]]
            if moves:
                self._move(moves, keep_len)
        for rid, pos, blocks in decodes:
            slot = target[rid]
            e = kept.get(rid)
            if e is None:
                e = _Entry(slot, pos, [])
                self._fill(slot, pos, blocks)
            e.slot = slot
            if not self.clean[slot]:
                self.buf[:, :, slot, :, pos:].zero_()
                self.clean[slot] = True
            e.length = pos + 1
            e.blocks = blocks[: -(-(pos + 1) // bs)]
            self.entries[rid] = e
        slots = [target[rid] for rid, _, _ in decodes]
        order = [0] * B
        for row, s in enumerate(slots):
            order[s] = row
        lens = [pos_of[decodes[r][0]] + 1 for r in order]  # slot order
        dev = self.region.device
        md.decode_cache = self
        md.decode_slots = torch.tensor(slots, dtype=torch.long, device=dev)
        md.decode_pos = torch.tensor([p for _, p, _ in decodes], dtype=torch.long, device=dev)
        if order != list(range(B)):
            md.decode_order = torch.tensor(order, dtype=torch.long, device=dev)
        md.decode_len = max_len
        md.decode_groups = [(a, b, max(lens[a:b])) for a, b in _group_bounds(B)]
        md.decode_group_masks = [
            None if min(lens[a:b]) == n else length_mask(lens[a:b], n, dev)
            for a, b, n in md.decode_groups
        ]


def _gather(layer_kv: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """layer_kv [NB, 2, bs, Hkv, D], table [..., nb] → K, V as [..., nb*bs, Hkv, D]
    (one copy each: K and V are gathered separately so the block and in-block dims
    merge without a second copy)."""
    k = layer_kv[:, 0][table]  # [..., nb, bs, Hkv, D], contiguous
    v = layer_kv[:, 1][table]
    nd = table.dim() - 1
    return k.flatten(nd, nd + 1), v.flatten(nd, nd + 1)


def _decode_attention(
    q: torch.Tensor,  # [B, H, D] the decode tokens only, in decode order
    kv_new: torch.Tensor,  # [B, 2, Hkv, D] their K and V, in the region's dtype
    layer_kv: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    layer: int | None,
    hkv: int,
    group: int,
) -> torch.Tensor:
    B, H, D = q.shape
    cache = md.decode_cache
    if cache is not None and layer is not None:
        buf = cache.buf[layer]  # [2, S, Hkv, P, D]
        # K and V of every decode token in one write (both advanced indices move to
        # the front: [B, 2, Hkv, D]), holding exactly what the region holds
        buf[:, md.decode_slots, :, md.decode_pos] = (
            kv_new if kv_new.dtype == buf.dtype else kv_new.to(buf.dtype))
        kb = buf[0, :B, :, : md.decode_len]  # [B, Hkv, L, D] views
        vb = buf[1, :B, :, : md.decode_len]
        if md.decode_order is not None:
            q = q[md.decode_order]  # slot order
        q = q.reshape(B, hkv, group, D)
        masks = md.decode_group_masks = [mask_as(m, q) for m in md.decode_group_masks]
        if len(md.decode_groups) == 1:
            o = F.scaled_dot_product_attention(q, kb, vb, attn_mask=masks[0], scale=scale)
        else:  # each group only as long as its longest member
            o = torch.cat([
                F.scaled_dot_product_attention(
                    q[a:b], kb[a:b, :, :n], vb[a:b, :, :n], attn_mask=m, scale=scale,
                )
                for (a, b, n), m in zip(md.decode_groups, masks, strict=True)
            ])
        o = o.reshape(B, H, D)
        return o if md.decode_order is None else o[md.decode_slots]
    md.build_gather_tables()
    md.decode_mask = mask_as(md.decode_mask, q)
    if md.decode_paged:
        return paged_decode_attention(q, layer_kv, md.decode_tables, md.decode_mask, scale)
    kc, vc = _gather(layer_kv, md.decode_tables)  # [B, L, Hkv, D]
    o = F.scaled_dot_product_attention(
        q.reshape(B, hkv, group, D),
        kc.transpose(1, 2).to(q.dtype),
        vc.transpose(1, 2).to(q.dtype),
        attn_mask=md.decode_mask,
        scale=scale,
    )
    return o.reshape(B, H, D)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    kv_new: torch.Tensor,  # [T, 2, Hkv, D] this step's K (rotated) and V
    layer_kv: torch.Tensor,  # [NB, 2, bs, Hkv, D] view into the KV region
    md: AttentionMetadata,
    scale: float,
    layer: int | None = None,  # needed for the DecodeKVCache path
) -> torch.Tensor:
    """Write this step's K/V into the cache and return attention output [T, H, D]."""
    kv_model = kv_new  # a fresh prefill attends K/V before the region's rounding
    if kv_new.dtype != layer_kv.dtype:
        kv_new = kv_new.to(layer_kv.dtype)
    # K and V of every token in one write: the two advanced indices around the K|V
    # slice move to the front, so the target is [T, 2, Hkv, D] like kv_new
    layer_kv[md.slot_blocks, :, md.slot_offsets] = kv_new
    T, H, D = q.shape
    hkv = kv_new.shape[2]
    group = H // hkv
    if md.decode_idx is not None and not md.prefills:
        # decode-only step: token i is decode i, no index/scatter needed
        return _decode_attention(q, kv_new, layer_kv, md, scale, layer, hkv, group)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if md.decode_idx is not None:
        idx = md.decode_idx
        out[idx] = _decode_attention(q[idx], kv_new[idx], layer_kv, md, scale, layer, hkv,
                                     group)
    gqa = group != 1
    k, v = kv_model[:, 0], kv_model[:, 1]
    for span in md.prefills:
        n = span.end - span.start
        qp = _rows(q[span.start : span.end], span.padded)  # [1, H, padded, D]
        if span.block_ids is None:
            kp = _rows(k[span.start : span.end], span.padded)
            vp = _rows(v[span.start : span.end], span.padded)
            o = F.scaled_dot_product_attention(
                qp, kp, vp, is_causal=True, scale=scale, enable_gqa=gqa
            )
        else:
            span.mask = mask_as(span.mask, q)
            ctx, width = span.start_pos + n, span.mask.shape[1]
            kc, vc = _gather(layer_kv, span.block_ids)
            kp = _rows(kc[:ctx].to(q.dtype), width)
            vp = _rows(vc[:ctx].to(q.dtype), width)
            o = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=span.mask, scale=scale, enable_gqa=gqa
            )
        out[span.start : span.end] = o[0, :, :n].transpose(0, 1)
    return out


def _rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` ([n, H, D]) as SDPA's [1, H, rows, D], zero rows after the n real ones."""
    if x.shape[0] < rows:
        x = F.pad(x, (0, 0, 0, 0, 0, rows - x.shape[0]))
    return x.transpose(0, 1).unsqueeze(0)
