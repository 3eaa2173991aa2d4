"""Posts: the WRITEs and READs the transfer thread hands the transport.

Descriptors are built from block ids, layers and the two instances' Hellos; a post's
handle is kept on its record (``Transfer.handles``) and here until its completion is
seen (over cma the copy happens inside the post: the caller checks it at once). At
tensor parallelism a post is one per piece of ``kv_map.head_map`` (push: prefill rank to
decode rank, pull: the reverse), each made by our rank's own transport (rank r > 0: the
engine's proxy to that rank's process, ``transports[r]``) with its own region. A piece of
whole blocks on a :class:`PreparedTransport` is posted by index into the two regions'
prepared lists (``kv_map.layer_rows``; the transport prepares each once and keeps it
while the peer is known), with no descriptor built per post.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpush.kv_cache.kv_map import (
    RankKV,
    block_indices,
    head_map,
    hello_ranks,
    layer_rows,
    paired_runs,
    piece_descs,
)
from kvpush.kv_cache.kv_region import KVLayout
from kvpush.kv_transfer.transfer_thread.table import Transfer
from kvpush.kv_transfer.transports.transport import (
    KVTransport,
    Op,
    PreparedTransport,
    TransferPostError,
    XferState,
)
from kvpush.kv_transfer.wire import messages as m


@dataclass(frozen=True)
class _Indexed:
    """A piece as indices into the two regions' prepared lists (``kv_map.layer_rows``)."""

    transport: PreparedTransport
    local: list[int]
    remote: list[int]
    descriptors: int  # runs of blocks consecutive on both sides, times the layers


class Posts:
    def __init__(self, transport: KVTransport, own: m.Hello,
                 rank_transports: Sequence[KVTransport] = ()) -> None:
        self.transport = transport
        self.own = own
        self.transports = [transport, *rank_transports]  # by our tensor-parallel rank
        self.tids: dict[int, str] = {}  # handle -> transfer id
        self.inner: dict[int, tuple[KVTransport, int]] = {}  # handle -> its transport's
        self.agents: dict[tuple[int, bytes], str] = {}  # (our rank, peer metadata) -> name
        self.next_handle = 1

    def post(self, op: Op, rec: Transfer, peer: m.Hello | None, agent: str | None,
             local: Sequence[int], remote: Sequence[int], layers: range,
             ready: Any = None) -> list[int]:
        """Post ``op`` of our ``local`` blocks paired with the peer's ``remote`` ones for
        ``layers``, one post per rank piece; their handles (each also on ``rec``).
        TransferPostError says why nothing more was posted."""
        if peer is None or agent is None:
            side = "decode" if op == "WRITE" else "prefill"
            raise TransferPostError(f"no connection to the {side} instance at {rec.peer}")
        ours, theirs = hello_ranks(self.own), hello_ranks(peer)
        write = op == "WRITE"  # push: we are prefill (WRITE), pull: decode (READ)
        p_ranks, d_ranks = (ours, theirs) if write else (theirs, ours)
        try:  # (i, j): our rank, the peer's
            pieces = [((x.prefill, x.decode) if write else (x.decode, x.prefill), x.heads)
                      for x in head_map([r.heads for r in p_ranks], [r.heads for r in d_ranks])]
            posts = [(i, j, self._piece(i, h, ours[i], theirs[j], peer.layout, local,
                                        remote, layers)) for (i, j), h in pieces]
        except (IndexError, ValueError) as e:
            raise TransferPostError(f"{op} not posted: {e}") from None
        if ready is not None:  # CUDA: the layers' KV is in memory once this fires
            ready.synchronize()
        handles = []
        for i, j, piece in posts:
            transport, t0 = self.transports[i], time.perf_counter()
            try:
                name = agent if (i, j) == (0, 0) else self._agent(i, theirs[j].agent_metadata)
                if isinstance(piece, _Indexed):
                    inner, n_descs, n_bytes = self._post_indexed(
                        op, name, piece, ours[i], theirs[j], peer.layout)
                else:
                    mine, other = piece
                    inner = transport.post(op, name, mine, other)
                    n_descs, n_bytes = len(mine), sum(length for _, length in mine)
            except (TransferPostError, ValueError) as e:
                ranks = f" (our rank {i} to the peer's rank {j})" if i or j else ""
                raise TransferPostError(f"{op} failed to post{ranks}: {e}") from None
            rec.post_s += time.perf_counter() - t0
            rec.num_descriptors += n_descs
            rec.num_bytes += n_bytes
            handle, self.next_handle = self.next_handle, self.next_handle + 1
            self.inner[handle] = (transport, inner)
            rec.handles.add(handle)
            self.tids[handle] = rec.tid
            handles.append(handle)
        return handles

    def _piece(self, rank: int, heads: range, mine: RankKV, theirs: RankKV,
               layout: KVLayout, local: Sequence[int], remote: Sequence[int],
               layers: range) -> _Indexed | tuple[list, list]:
        """What posts one piece from our rank ``rank``: indices (whole blocks on a
        transport with prepared lists) or descriptors."""
        transport = self.transports[rank]
        if isinstance(transport, PreparedTransport) and heads == mine.heads == theirs.heads:
            if len(local) != len(remote):
                raise ValueError(f"{len(local)} local blocks but {len(remote)} remote")
            return _Indexed(transport, block_indices(self.own.layout, local, layers),
                            block_indices(layout, remote, layers),
                            len(paired_runs(local, remote)) * len(layers))
        return piece_descs(heads, mine, self.own.layout, local, theirs, layout, remote,
                           layers)

    def _post_indexed(self, op: Op, name: str, piece: _Indexed, mine: RankKV,
                      theirs: RankKV, layout: KVLayout) -> tuple[int, int, int]:
        """Post ``piece`` into the two regions' prepared lists: (inner handle,
        descriptors, bytes)."""
        inner = piece.transport.post_prepared(
            op, name, layer_rows(mine.base_address, self.own.layout), piece.local,
            layer_rows(theirs.base_address, layout), piece.remote)
        return inner, piece.descriptors, len(piece.local) * self.own.layout.block_bytes

    def _agent(self, rank: int, metadata: bytes) -> str:
        """Our rank ``rank``'s transport's name for the peer rank of ``metadata``."""
        key = (rank, metadata)
        if key not in self.agents:
            self.agents[key] = self.transports[rank].add_peer(metadata)
        return self.agents[key]

    def awaited(self) -> bool:
        return bool(self.tids)

    def state(self, handle: int) -> XferState:
        transport, inner = self.inner[handle]
        return transport.state(inner)

    def take(self, handle: int) -> str:
        """The ended transfer ``handle`` was for; its handle is released."""
        transport, inner = self.inner.pop(handle)
        transport.release(inner)
        return self.tids.pop(handle)

    def states(self) -> list[tuple[int, XferState]]:
        """Every post's state (checking progresses the transport); with none posted,
        the transport is progressed instead (its peers' connections)."""
        if not self.tids:
            self.transport.progress()
            return []
        return [(h, self.state(h)) for h in list(self.tids)]
