"""Posts: the WRITEs and READs the transfer thread hands the transport.

Descriptors are built from block ids, layers and the two instances' Hellos; a post's
handle is kept on its record (``Transfer.handles``) and here until its completion is
seen (over cma the copy happens inside the post: the caller checks it at once).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvpush.kv_transfer.transfer_thread.table import Transfer
from kvpush.kv_transfer.transports.transport import (
    KVTransport,
    Op,
    TransferPostError,
    XferState,
    layer_block_descs,
)
from kvpush.kv_transfer.wire import messages as m


class Posts:
    def __init__(self, transport: KVTransport, own: m.Hello) -> None:
        self.transport = transport
        self.own = own
        self.tids: dict[int, str] = {}  # handle -> transfer id

    def post(self, op: Op, rec: Transfer, peer: m.Hello | None, agent: str | None,
             local: Sequence[int], remote: Sequence[int], layers: range,
             ready: Any = None) -> int:
        """Post ``op`` of our ``local`` blocks paired with the peer's ``remote`` ones for
        ``layers``; its handle. TransferPostError says why nothing was posted."""
        if peer is None or agent is None:
            side = "decode" if op == "WRITE" else "prefill"
            raise TransferPostError(f"no connection to the {side} instance at {rec.peer}")
        try:
            ours, theirs = layer_block_descs(self.own.base_address, self.own.layout, local,
                                             peer.base_address, peer.layout, remote, layers)
        except (IndexError, ValueError) as e:
            raise TransferPostError(f"{op} not posted: {e}") from None
        if ready is not None:  # CUDA: the layers' KV is in memory once this fires
            ready.synchronize()
        t0 = time.perf_counter()
        try:
            handle = self.transport.post(op, agent, ours, theirs)
        except TransferPostError as e:
            raise TransferPostError(f"{op} failed to post: {e}") from None
        rec.post_s += time.perf_counter() - t0
        rec.num_descriptors += len(ours)
        rec.num_bytes += sum(length for _, length in ours)
        rec.handles.add(handle)
        self.tids[handle] = rec.tid
        return handle

    def awaited(self) -> bool:
        return bool(self.tids)

    def state(self, handle: int) -> XferState:
        return self.transport.state(handle)

    def take(self, handle: int) -> str:
        """The ended transfer ``handle`` was for; its handle is released."""
        self.transport.release(handle)
        return self.tids.pop(handle)

    def states(self) -> list[tuple[int, XferState]]:
        """Every post's state (checking progresses the transport); with none posted,
        the transport is progressed instead (its peers' connections)."""
        if not self.tids:
            self.transport.progress()
            return []
        return [(h, self.transport.state(h)) for h in list(self.tids)]
