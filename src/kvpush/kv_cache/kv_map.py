"""Which KV heads move between which tensor-parallel ranks of a prefill and a decode
instance, whether a pair can be served at all, and the descriptors that move them.

Rank r of an instance at TP n holds the KV heads ``config.tp_kv_heads(model, n, r)`` of
every block, in a region of its own (``kv_region.py``); the Hello lists each rank's heads,
region and transport agent (:class:`RankKV`). **The mapping** (:func:`head_map`): every
decode rank gets each KV head it holds from the *lowest* prefill rank that holds it;
neighbouring heads with the same (prefill rank, decode rank) make one :class:`Piece`.
The rank on the moving side posts each piece with its own registered region (push: the
prefill rank WRITEs, pull: the decode rank READs); nothing goes through rank 0. With a
model of 2 KV heads (H0, H1)::

    P TP 2 → D TP 1   p0 [H0] → d0 [H0 of H0,H1]    p1 [H1] → d0 [H1 of H0,H1]
    P TP 1 → D TP 2   p0 [H0 of H0,H1] → d0 [H0]    p0 [H1 of H0,H1] → d1 [H1]
    P TP 2 → D TP 2   p0 → d0, p1 → d1: whole blocks, as at TP 1
    1 KV head, P TP 2 → D TP 1: p0 [H0] → d0 (p1's replica is not read)

**Descriptors** (:func:`piece_descs`): a piece that is every head of its rank on both
sides moves whole blocks, one descriptor per layer per run of block ids consecutive on
both sides (any layout). Otherwise both regions must be head-major (``[layer, block,
K|V, head, token, dim]``): a head range of one block's K (or V) is then one contiguous
range on each side, so a piece costs one descriptor per layer, block and K|V, each a
whole block's worth of tokens of its heads (never one per token or per head).
A transport with prepared lists moves whole blocks by index instead: each region is one
list of a descriptor per (layer, block) (:func:`layer_rows`), and a post is the indices
of its layers' blocks on both sides (:func:`block_indices`).

**The check** (:func:`pair_problems`), at the handshake on both sides: the same model
KV heads, layers, block size, head size and dtype; each side's ranks cover every KV
head with equal shares that match its region; different shares need head-major on both.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpush.config import HEAD_MAJOR
from kvpush.kv_cache.kv_region import KVLayout

Range = tuple[int, int]  # (absolute address, length in bytes)


@dataclass(frozen=True)
class RankKV:
    """One tensor-parallel rank as its instance's Hello describes it."""

    rank: int
    heads_start: int  # its KV heads: [heads_start, heads_stop) of the model's
    heads_stop: int
    base_address: int  # of its KV region
    agent_metadata: bytes  # its transport's metadata (its own NIXL agent)

    @property
    def heads(self) -> range:
        return range(self.heads_start, self.heads_stop)


@dataclass(frozen=True)
class Piece:
    """KV heads ``heads`` go from prefill rank ``prefill`` to decode rank ``decode``."""

    prefill: int
    decode: int
    heads: range


def hello_ranks(hello: Any) -> list[RankKV]:
    """A Hello's ranks (``wire.messages.Hello``): its list at TP > 1, else its one rank
    holding every head of its layout."""
    if hello.ranks:
        return list(hello.ranks)
    return [RankKV(0, 0, hello.layout.num_kv_heads, hello.base_address,
                   hello.agent_metadata)]


def head_map(prefill: Sequence[range], decode: Sequence[range]) -> list[Piece]:
    """The pieces that give every decode rank its heads (``prefill[r]``, ``decode[r]``:
    rank r's KV heads), in decode-rank then head order (see the module's docstring).
    ValueError when a decode head is on no prefill rank."""
    pieces: list[Piece] = []
    for d, heads in enumerate(decode):
        for h in heads:
            p = next((p for p, held in enumerate(prefill) if h in held), None)
            if p is None:
                raise ValueError(f"KV head {h} of decode rank {d} is on no prefill rank")
            last = pieces[-1] if pieces else None
            if last is not None and (last.prefill, last.decode) == (p, d) \
                    and last.heads.stop == h:
                pieces[-1] = Piece(p, d, range(last.heads.start, h + 1))
            else:
                pieces.append(Piece(p, d, range(h, h + 1)))
    return pieces


def _side_problem(side: str, tp: int, kv_heads: int, ranks: Sequence[RankKV],
                  layout: KVLayout) -> str | None:
    if tp < 1 or (tp > 1 and len(ranks) != tp) or (tp == 1 and len(ranks) != 1):
        return f"{side} announces tensor parallelism {tp} with {len(ranks)} ranks"
    held: set[int] = set()
    for r in ranks:
        if not 0 <= r.heads_start < r.heads_stop <= kv_heads:
            return f"{side}'s rank {r.rank} holds KV heads {list(r.heads)} of {kv_heads}"
        if len(r.heads) != layout.num_kv_heads:
            return (f"{side}'s rank {r.rank} holds {len(r.heads)} KV heads but its region "
                    f"{layout.num_kv_heads}")
        held.update(r.heads)
    if len(held) != kv_heads:
        return f"{side}'s ranks hold KV heads {sorted(held)} of the model's {kv_heads}"
    return None


#: layout fields both instances must share at any tensor parallelism
_SAME = ("num_layers", "block_size", "head_dim", "dtype")


def pair_problems(mine: Any, theirs: Any) -> list[str]:
    """Why KV cannot move between the instances of these two Hellos (none: it can).
    ``model_kv_heads`` 0 (a peer that does not say) counts as its layout's heads."""
    problems = []
    a, b = mine.layout, theirs.layout
    problems += [f"{f}: peer has {getattr(b, f)!r}, this instance {getattr(a, f)!r}"
                 for f in _SAME if getattr(a, f) != getattr(b, f)]
    heads = [h.model_kv_heads or h.layout.num_kv_heads for h in (mine, theirs)]
    if heads[0] != heads[1]:
        problems.append(f"the model's KV heads: peer has {heads[1]}, this instance "
                        f"{heads[0]}")
    for side, h, kv in (("this instance", mine, heads[0]), ("the peer", theirs, heads[1])):
        problem = _side_problem(side, h.tensor_parallel_size, kv, hello_ranks(h), h.layout)
        if problem:
            problems.append(problem)
    if problems:
        return problems
    shares = (f"tensor parallelism {theirs.tensor_parallel_size} (the peer, "
              f"{b.num_kv_heads} KV heads a rank) and {mine.tensor_parallel_size} (this "
              f"instance, {a.num_kv_heads} a rank)")
    if a.layout != b.layout:
        problems.append(f"layout: peer has {b.layout!r}, this instance {a.layout!r}")
    elif a.num_kv_heads != b.num_kv_heads and a.layout != HEAD_MAJOR:
        problems.append(f"{shares}: different shares of the KV heads need the "
                        f"{HEAD_MAJOR} layout on both, not {a.layout}")
    elif a.block_bytes * b.num_kv_heads != b.block_bytes * a.num_kv_heads:
        problems.append(f"block bytes a KV head differ: the peer's {b.block_bytes} for "
                        f"{b.num_kv_heads} heads, this instance's {a.block_bytes} for "
                        f"{a.num_kv_heads}")
    return problems


def paired_runs(local_blocks: Sequence[int],
                remote_blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    """Runs where both sides are consecutive: [(local_first, remote_first, count), ...]."""
    if len(local_blocks) != len(remote_blocks):
        raise ValueError(f"{len(local_blocks)} local blocks but {len(remote_blocks)} remote")
    runs: list[tuple[int, int, int]] = []
    for lb, rb in zip(local_blocks, remote_blocks):
        if runs:
            lf, rf, n = runs[-1]
            if lb == lf + n and rb == rf + n:
                runs[-1] = (lf, rf, n + 1)
                continue
        runs.append((lb, rb, 1))
    return runs


def layer_block_descs(local_base: int, local_layout: KVLayout, local_blocks: Sequence[int],
                      remote_base: int, remote_layout: KVLayout, remote_blocks: Sequence[int],
                      layers: Sequence[int]) -> tuple[list[Range], list[Range]]:
    """(local, remote) descriptors of ``layers`` for blocks paired by index: one per layer
    per :func:`paired_runs` run, layer by layer. The layouts must agree on block_bytes."""
    if local_layout.block_bytes != remote_layout.block_bytes:
        raise ValueError(f"block bytes differ: local {local_layout.block_bytes}, "
                         f"remote {remote_layout.block_bytes}")
    runs = paired_runs(local_blocks, remote_blocks)
    local: list[Range] = []
    remote: list[Range] = []
    for layer in layers:
        for lf, rf, n in runs:
            loff, llen = local_layout.range_of(layer, lf, n)
            roff, rlen = remote_layout.range_of(layer, rf, n)
            local.append((local_base + loff, llen))
            remote.append((remote_base + roff, rlen))
    return local, remote


@functools.lru_cache(maxsize=64)
def layer_rows(base: int, layout: KVLayout) -> tuple[tuple[int, int, int, int], ...]:
    """A region's prepared-list rows: one a layer, a descriptor a block, so that
    descriptor ``layer * num_blocks + block`` is that layer of that block."""
    return tuple((base + layout.range_of(layer, 0, 1)[0], layout.block_bytes,
                  layout.block_bytes, layout.num_blocks) for layer in range(layout.num_layers))


def block_indices(layout: KVLayout, blocks: Sequence[int], layers: range) -> list[int]:
    """The :func:`layer_rows` indices of ``blocks`` in ``layers``, layer by layer,
    blocks in their order; ValueError if a block or layer is out of range. Builtins
    only: on the transfer thread right after a step numpy's calls cost ~20x their warm
    time (``benchmarks/post_cold.py``)."""
    if blocks and (min(blocks) < 0 or max(blocks) >= layout.num_blocks):
        raise ValueError(f"block ids out of range [0, {layout.num_blocks})")
    if layers.step != 1 or layers.start < 0 or layers.stop > layout.num_layers:
        raise ValueError(f"layers {layers} out of range [0, {layout.num_layers})")
    n = layout.num_blocks
    return [layer * n + block for layer in layers for block in blocks]


def piece_descs(heads: range, local: RankKV, local_layout: KVLayout,
                local_blocks: Sequence[int], remote: RankKV, remote_layout: KVLayout,
                remote_blocks: Sequence[int],
                layers: Sequence[int]) -> tuple[list[Range], list[Range]]:
    """(local, remote) descriptors that move KV heads ``heads`` of ``layers`` between
    ``local``'s blocks and ``remote``'s, paired by index (the module's docstring)."""
    if heads == local.heads and heads == remote.heads:
        return layer_block_descs(local.base_address, local_layout, local_blocks,
                                 remote.base_address, remote_layout, remote_blocks, layers)
    if len(local_blocks) != len(remote_blocks):
        raise ValueError(f"{len(local_blocks)} local blocks but {len(remote_blocks)} remote")
    if not (heads.start >= max(local.heads_start, remote.heads_start)
            and heads.stop <= min(local.heads_stop, remote.heads_stop)):
        raise ValueError(f"KV heads {list(heads)} are not on both ranks")
    if local_layout.layout != HEAD_MAJOR or remote_layout.layout != HEAD_MAJOR:
        raise ValueError(f"a head slice needs the {HEAD_MAJOR} layout on both sides")
    out: tuple[list[Range], list[Range]] = ([], [])
    for side, (rank, lay, blocks) in enumerate(((local, local_layout, local_blocks),
                                                (remote, remote_layout, remote_blocks))):
        head_bytes = lay.block_bytes // (2 * lay.num_kv_heads)  # one head of K (or V)
        start = rank.base_address + (heads.start - rank.heads_start) * head_bytes
        length, half = len(heads) * head_bytes, lay.block_bytes // 2
        descs = out[side]
        for layer in layers:
            for block in blocks:
                offset = start + lay.range_of(layer, block, 1)[0]
                descs.append((offset, length))
                descs.append((offset + half, length))
    return out
