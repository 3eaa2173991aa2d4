"""Which KV heads move between the tensor-parallel ranks of a prefill and a decode
instance (kv_cache/kv_map.py, issue 52.3): the mapping, the descriptors that move a
head slice (checked by moving real bytes with them), and the handshake's check of a
pair, which refuses what it cannot serve with the reason on both sides."""

from __future__ import annotations

import ctypes
import dataclasses

import pytest
import torch

from kvpush.config import HEAD_MAJOR, LAYER_MAJOR
from kvpush.kv_cache.kv_map import Piece, RankKV, head_map, hello_ranks, piece_descs
from kvpush.kv_cache.kv_region import KVLayout
from kvpush.kv_transfer.wire import messages as m

L, B, T, D = 3, 8, 4, 2  # layers, blocks, tokens a block, head size


def layout(heads: int, name: str = HEAD_MAJOR, blocks: int = B) -> KVLayout:
    block_bytes = 2 * T * heads * D * 4
    return KVLayout(name, L, blocks, T, heads, D, "float32", block_bytes,
                    block_bytes * blocks)


def split(n: int, hkv: int) -> list[range]:
    """Each rank's KV heads at TP n (config.tp_kv_heads)."""
    return [range(r * hkv // n, r * hkv // n + max(1, hkv // n)) for r in range(n)]


# ---- the mapping ----------------------------------------------------------------------
def test_head_map_is_the_documented_one():
    two = 2  # KV heads
    # P TP 2 -> D TP 1: each prefill rank's head lands at its offset on decode rank 0
    assert head_map(split(2, two), split(1, two)) == [Piece(0, 0, range(0, 1)),
                                                      Piece(1, 0, range(1, 2))]
    # P TP 1 -> D TP 2: prefill rank 0 feeds both decode ranks
    assert head_map(split(1, two), split(2, two)) == [Piece(0, 0, range(0, 1)),
                                                      Piece(0, 1, range(1, 2))]
    # equal TP: rank to rank, every head of each
    assert head_map(split(2, two), split(2, two)) == [Piece(0, 0, range(0, 1)),
                                                      Piece(1, 1, range(1, 2))]
    assert head_map(split(1, 8), split(1, 8)) == [Piece(0, 0, range(0, 8))]
    # 8 heads, P TP 2 -> D TP 4: each decode rank reads half of one prefill rank
    assert head_map(split(2, 8), split(4, 8)) == [
        Piece(0, 0, range(0, 2)), Piece(0, 1, range(2, 4)), Piece(1, 2, range(4, 6)),
        Piece(1, 3, range(6, 8))]
    # P TP 4 -> D TP 1: four pieces into decode rank 0
    assert head_map(split(4, 8), split(1, 8)) == [
        Piece(p, 0, range(2 * p, 2 * p + 2)) for p in range(4)]
    # replicated (1 KV head, prefill TP 2): the lowest rank holding it is read
    assert split(2, 1) == [range(0, 1), range(0, 1)]
    assert head_map(split(2, 1), split(1, 1)) == [Piece(0, 0, range(0, 1))]
    assert head_map(split(1, 1), split(2, 1)) == [Piece(0, 0, range(0, 1)),
                                                  Piece(0, 1, range(0, 1))]
    with pytest.raises(ValueError, match="KV head 1 of decode rank 0 is on no prefill rank"):
        head_map([range(0, 1)], [range(0, 2)])


# ---- the descriptors, on real bytes ---------------------------------------------------
def _regions(kv: torch.Tensor, n: int, name: str = HEAD_MAJOR):
    """Rank regions of the logical kv [L, B, 2, T, H, D] at TP n: (storage, RankKV)."""
    out = []
    for r, heads in enumerate(split(n, kv.shape[4])):
        part = kv[:, :, :, :, heads.start:heads.stop]
        storage = (part.transpose(3, 4) if name == HEAD_MAJOR else part).contiguous()
        out.append((storage, RankKV(r, heads.start, heads.stop, storage.data_ptr(), b"")))
    return out


def _logical(storage: torch.Tensor, name: str = HEAD_MAJOR) -> torch.Tensor:
    return storage.transpose(3, 4) if name == HEAD_MAJOR else storage


@pytest.mark.parametrize("p_tp, d_tp, hkv", [(2, 1, 2), (1, 2, 2), (2, 2, 2), (1, 1, 2),
                                             (2, 4, 8), (4, 1, 8), (2, 1, 1)])
@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_pieces_move_exactly_the_heads(p_tp, d_tp, hkv, op):
    """Prefill's blocks [1, 2, 3, 6] land in decode's [4, 5, 0, 7] with every head where
    decode keeps it, whoever posts (push: prefill's ranks WRITE, pull: decode's READ)."""
    torch.manual_seed(0)
    src = torch.randn(L, B, 2, T, hkv, D)
    p_regions = _regions(src, p_tp)
    d_regions = _regions(torch.zeros_like(src), d_tp)
    p_blocks, d_blocks = [1, 2, 3, 6], [4, 5, 0, 7]
    p_lay, d_lay = layout(len(p_regions[0][1].heads)), layout(len(d_regions[0][1].heads))
    count = 0
    for piece in head_map([r.heads for _, r in p_regions], [r.heads for _, r in d_regions]):
        p_rank, d_rank = p_regions[piece.prefill][1], d_regions[piece.decode][1]
        if op == "WRITE":  # prefill's rank builds them, ours first
            src_d, dst_d = piece_descs(piece.heads, p_rank, p_lay, p_blocks, d_rank, d_lay,
                                       d_blocks, range(L))
        else:  # decode's rank builds them: ours (the destination) first
            dst_d, src_d = piece_descs(piece.heads, d_rank, d_lay, d_blocks, p_rank, p_lay,
                                       p_blocks, range(L))
        whole = piece.heads == p_rank.heads == d_rank.heads
        # whole blocks: one per layer and run ([1,2]->[4,5], [3]->[0], [6]->[7]);
        # a head slice: one per layer, block and K|V
        assert len(src_d) == L * (3 if whole else 2 * len(p_blocks))
        for (s, n), (t, k) in zip(src_d, dst_d):
            assert n == k and n % (T * D * 4) == 0
            ctypes.memmove(t, s, n)
        count += len(src_d)
    got = torch.cat([_logical(s) for s, _ in d_regions], dim=4) if hkv >= d_tp else \
        _logical(d_regions[0][0])
    for pb, db in zip(p_blocks, d_blocks):
        assert torch.equal(got[:, db], src[:, pb]), (pb, db)
    if hkv < d_tp:  # replicated: every decode rank got the head
        for s, _ in d_regions:
            for pb, db in zip(p_blocks, d_blocks):
                assert torch.equal(_logical(s)[:, db], src[:, pb])
    untouched = [b for b in range(B) if b not in d_blocks]
    assert not got[:, untouched].any()
    assert count


def test_piece_descs_refuse_what_they_cannot_move():
    kv = torch.zeros(L, B, 2, T, 2, D)
    (_, p0), (_, p1) = _regions(kv, 2)
    ((_, d0),) = _regions(kv, 1)
    with pytest.raises(ValueError, match="not on both ranks"):
        piece_descs(range(0, 2), p0, layout(1), [0], d0, layout(2), [0], range(L))
    with pytest.raises(ValueError, match="head-major"):
        piece_descs(range(1, 2), p1, layout(1, LAYER_MAJOR), [0], d0,
                    layout(2, LAYER_MAJOR), [0], range(L))
    with pytest.raises(IndexError):
        piece_descs(range(1, 2), p1, layout(1), [B], d0, layout(2), [0], range(L))
    # a layer-major region moves whole blocks between equal shares
    ((_, whole),) = _regions(kv, 1, LAYER_MAJOR)
    ours, theirs = piece_descs(range(0, 2), whole, layout(2, LAYER_MAJOR), [0, 1], whole,
                               layout(2, LAYER_MAJOR), [2, 3], range(L))
    assert len(ours) == L and ours[0][1] == theirs[0][1] == 2 * layout(2).block_bytes


# ---- the handshake's check ------------------------------------------------------------
def hello(role: str, tp: int, hkv: int = 2, name: str = HEAD_MAJOR, **kw) -> m.Hello:
    heads = split(tp, hkv)
    ranks = [RankKV(r, h.start, h.stop, 4096 * (r + 1), f"{role}{r}".encode())
             for r, h in enumerate(heads)] if tp > 1 else []
    return m.Hello(version=m.PROTOCOL_VERSION, engine_id=role, role=role,
                   address=f"{role}:1", transport="nixl", agent_metadata=b"", model="x",
                   kv_transfer="push", base_address=4096,
                   layout=layout(len(heads[0]), name), tensor_parallel_size=tp,
                   model_kv_heads=hkv, ranks=ranks, **kw)


def both_ways(a: m.Hello, b: m.Hello) -> tuple[list[str], list[str]]:
    return m.compatibility_problems(a, b), m.compatibility_problems(b, a)


@pytest.mark.parametrize("p_tp, d_tp", [(2, 1), (1, 2), (2, 2), (1, 1)])
def test_pairs_served(p_tp, d_tp):
    assert both_ways(hello("prefill", p_tp), hello("decode", d_tp)) == ([], [])
    assert both_ways(hello("prefill", p_tp, 1), hello("decode", d_tp, 1)) == ([], [])
    assert [r.rank for r in hello_ranks(hello("prefill", p_tp))] == list(range(p_tp))


def test_pairs_refused_with_the_reason_on_both_sides():
    # different shares of the heads with the layer-major layout: no slice is contiguous
    mine, theirs = both_ways(hello("prefill", 2, name=LAYER_MAJOR),
                             hello("decode", 1, name=LAYER_MAJOR))
    assert mine == [f"tensor parallelism 1 (the peer, 2 KV heads a rank) and 2 (this "
                    f"instance, 1 a rank): different shares of the KV heads need the "
                    f"{HEAD_MAJOR} layout on both, not {LAYER_MAJOR}"]
    assert "tensor parallelism 2 (the peer, 1 KV heads a rank) and 1" in theirs[0]
    # equal TP with layer-major stays served
    assert both_ways(hello("prefill", 2, name=LAYER_MAJOR),
                     hello("decode", 2, name=LAYER_MAJOR)) == ([], [])
    # the models' KV heads differ
    mine, theirs = both_ways(hello("prefill", 2, 4), hello("decode", 1, 2))
    assert "the model's KV heads: peer has 2, this instance 4" in mine
    assert "the model's KV heads: peer has 4, this instance 2" in theirs
    # a peer whose ranks do not cover the model's heads, or disagree with its region
    bad = hello("decode", 2)
    bad.ranks[1] = dataclasses.replace(bad.ranks[1], heads_start=0, heads_stop=1)
    assert both_ways(hello("prefill", 1), bad)[0] == [
        "the peer's ranks hold KV heads [0] of the model's 2"]
    assert both_ways(hello("prefill", 1), bad)[1] == [
        "this instance's ranks hold KV heads [0] of the model's 2"]
    short = hello("decode", 2)
    short.ranks.pop()
    assert both_ways(hello("prefill", 1), short)[0] == [
        "the peer announces tensor parallelism 2 with 1 ranks"]
    wide = hello("decode", 1)
    wide.layout = layout(1)
    assert both_ways(hello("prefill", 1), wide)[0] == [
        "the peer's ranks hold KV heads [0] of the model's 2"]
    assert both_ways(hello("prefill", 1, name=LAYER_MAJOR), hello("decode", 1))[0] == [
        f"layout: peer has {HEAD_MAJOR!r}, this instance {LAYER_MAJOR!r}"]
