"""InProcTransport: the KV transport between engines that live in one process (tests).

Semantics match :class:`~kvpush.kv_transfer.transports.nixl_transport.NixlTransport` (same
validation, same metadata envelope, same states), but a transfer is a
``ctypes.memmove`` between the two regions, so protocol tests with two or more engines
run deterministically in milliseconds.

Peers find each other through a class-level registry (name -> region) filled by
:meth:`InProcTransport.register_region` and emptied by :meth:`InProcTransport.close`;
a post to a peer that has closed (or re-registered a different region) fails.

Timing: without a delay a transfer is copied inside ``post`` and is DONE at once. With
``FaultPlan.transfer_delay_s`` the bytes are copied when the delay has passed and the
transfer is next looked at (:meth:`state` or :meth:`progress`); until then the target
is untouched, which also models "the source must stay stable until DONE". A transfer
failed by ``FaultPlan.fail_transfers`` writes nothing and ends FAILED (at its due time).

Prepared lists (``prepare``/``post_prepared``) are expanded into (address, length)
arrays once; a post by indices takes its pairs from them and goes on as ``post``.

Thread-safe (one lock per instance, one for the registry).
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from kvpush.kv_transfer.transports.transport import (
    METADATA_VERSION,
    Op,
    PeerMetadata,
    Prepared,
    PreparedLists,
    PreparedTransport,
    Range,
    RegionInfo,
    Row,
    TransferPostError,
    TransportStats,
    XferState,
    check_prepared,
    decode_metadata,
    encode_metadata,
    prepared_list,
    validate_post,
)
from kvpush_testing.faults import FaultPlan

KIND = "inproc"


@dataclass
class _Xfer:
    """One posted in-process transfer."""

    op: str
    peer: str
    peer_region: RegionInfo
    local: np.ndarray  # (N, 2) int64: address, length
    remote: np.ndarray
    due: float  # time.monotonic() at which it completes
    fail: bool  # injected failure: ends FAILED, writes nothing
    corrupt: bool = False  # injected: one byte of what lands is changed
    state: XferState = XferState.PENDING


def _expand(rows: tuple[Row, ...]) -> np.ndarray:
    parts = [np.stack([addr + stride * np.arange(count, dtype=np.int64),
                       np.full(count, length, dtype=np.int64)], axis=1)
             for addr, length, stride, count in rows]
    return np.concatenate(parts)


class InProcTransport(PreparedTransport):
    """memmove-based transport between engines of one process, with fault injection."""

    kind = KIND
    _registry: ClassVar[dict[str, RegionInfo]] = {}
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, name: str, faults: FaultPlan | None = None):
        self.name = name
        self.faults = faults
        self.stats = TransportStats()
        self._region: RegionInfo | None = None
        self._peers: dict[str, RegionInfo] = {}
        self._xfers: dict[int, _Xfer] = {}
        #: each with its descriptors as (N, 2) int64 (address, length)
        self._lists: PreparedLists[np.ndarray] = PreparedLists()
        self._next_handle = 1
        self._lock = threading.Lock()
        self._closed = False

    # -- set-up -----------------------------------------------------------------------

    def register_region(self, base: int, nbytes: int, device: str = "cpu") -> None:
        """Register our region and publish it in the process-wide registry."""
        if device != "cpu":
            raise ValueError("InProcTransport only moves host memory")
        if base <= 0 or nbytes <= 0:
            raise ValueError("empty region")
        with self._lock:
            if self._region is not None:
                raise RuntimeError(f"{self.name}: region already registered")
            with self._registry_lock:
                if self.name in self._registry:
                    raise ValueError(f"an in-process transport named {self.name!r} exists")
                self._region = RegionInfo(base, nbytes, device)
                self._registry[self.name] = self._region

    def metadata(self) -> bytes:
        """Our metadata envelope (name and region)."""
        if self._region is None:
            raise RuntimeError(f"{self.name}: register_region first")
        return encode_metadata(PeerMetadata(METADATA_VERSION, KIND, self.name, self._region))

    def add_peer(self, metadata: bytes) -> str:
        """Remember a peer's region from its metadata; returns its name."""
        meta = decode_metadata(metadata, KIND)
        with self._lock:
            if self._peers.get(meta.name) != meta.region:
                self._lists.pop(meta.name)
            self._peers[meta.name] = meta.region
        return meta.name

    def remove_peer(self, peer: str) -> None:
        """Forget a peer (transfers already posted still finish)."""
        with self._lock:
            self._peers.pop(peer, None)
            self._lists.pop(peer)

    # -- transfers --------------------------------------------------------------------

    def post(self, op: Op, peer: str, local: Sequence[Range], remote: Sequence[Range]) -> int:
        """Validate and post a transfer (see KVTransport.post)."""
        return self._post(op, peer, lambda region: validate_post(op, local, remote,
                                                                 self._region, region))

    def post_prepared(self, op: Op, peer: str, local: tuple[Row, ...],
                      local_idx: Sequence[int], remote: tuple[Row, ...],
                      remote_idx: Sequence[int]) -> int:
        """Post by index into prepared lists (see PreparedTransport.post_prepared)."""
        def pairs(region: RegionInfo) -> tuple[np.ndarray, np.ndarray]:
            mine, lpairs = self._prepared(None, local, self._region)
            theirs, rpairs = self._prepared(peer, remote, region)
            check_prepared(op, mine, local_idx, theirs, remote_idx)
            return lpairs[list(local_idx)], rpairs[list(remote_idx)]
        return self._post(op, peer, pairs)

    def _prepared(self, peer: str | None, rows: tuple[Row, ...],
                  region: RegionInfo | None) -> tuple[Prepared, np.ndarray]:
        got = self._lists.get(peer, rows)
        if got is None:
            got = (prepared_list(peer, rows, region), _expand(rows))
            self._lists.add(*got)
        return got

    def _post(self, op: Op, peer: str,
              pairs: Callable[[RegionInfo], tuple[np.ndarray, np.ndarray]]) -> int:
        """Post the (local, remote) pairs ``pairs`` gives for the peer's region."""
        t0 = time.perf_counter()
        with self._lock:
            try:
                if self._closed:
                    raise TransferPostError(f"{self.name}: transport closed")
                if self.faults is not None and self.faults.take_post_failure():
                    raise TransferPostError(f"{self.name}: injected post failure")
                peer_region = self._peers.get(peer)
                if peer_region is None:
                    raise TransferPostError(f"{self.name}: unknown peer {peer!r}")
                loc, rem = pairs(peer_region)
                with self._registry_lock:
                    if self._registry.get(peer) != peer_region:
                        raise TransferPostError(f"{self.name}: peer {peer!r} is gone")
            except TransferPostError:
                self.stats.post_failures += 1
                raise
            delay = self.faults.transfer_delay() if self.faults is not None else 0.0
            fail = self.faults.take_transfer_failure() if self.faults is not None else False
            corrupt = not fail and self.faults is not None and self.faults.take_corruption()
            handle = self._next_handle
            self._next_handle += 1
            xfer = _Xfer(op, peer, peer_region, loc, rem, time.monotonic() + delay, fail,
                         corrupt)
            self._xfers[handle] = xfer
            self.stats.posts += 1
            self.stats.descs_posted += len(loc)
            self.stats.bytes_posted += int(loc[:, 1].sum())
            if delay <= 0:
                self._complete(xfer)
            dt = time.perf_counter() - t0
            self.stats.last_post_s = dt
            self.stats.max_post_s = max(self.stats.max_post_s, dt)
            return handle

    def state(self, handle: int) -> XferState:
        """State of a transfer; completes it if its delay has passed."""
        with self._lock:
            xfer = self._xfers[handle]
            if xfer.state is XferState.PENDING and time.monotonic() >= xfer.due:
                self._complete(xfer)
            return xfer.state

    def release(self, handle: int) -> None:
        """Forget a transfer; a PENDING one is aborted (it will never write)."""
        with self._lock:
            self._xfers.pop(handle, None)

    def progress(self) -> None:
        """Complete every transfer whose delay has passed."""
        with self._lock:
            now = time.monotonic()
            for xfer in self._xfers.values():
                if xfer.state is XferState.PENDING and now >= xfer.due:
                    self._complete(xfer)

    def close(self) -> None:
        """Abort pending transfers and leave the registry."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._xfers.clear()
            self._peers.clear()
            self._lists.clear()
            with self._registry_lock:
                if self._region is not None and self._registry.get(self.name) == self._region:
                    del self._registry[self.name]

    # -- internals (lock held) --------------------------------------------------------

    def _complete(self, xfer: _Xfer) -> None:
        """Copy the bytes (or fail) and set the final state."""
        with self._registry_lock:
            alive = self._registry.get(xfer.peer) == xfer.peer_region
        if xfer.fail or not alive or self._closed:
            xfer.state = XferState.FAILED
            self.stats.failed += 1
            return
        if xfer.op == "WRITE":
            pairs = zip(xfer.remote[:, 0].tolist(), xfer.local[:, 0].tolist())
        else:
            pairs = zip(xfer.local[:, 0].tolist(), xfer.remote[:, 0].tolist())
        dsts = []
        for (dst, src), n in zip(pairs, xfer.local[:, 1].tolist()):
            ctypes.memmove(dst, src, n)
            dsts.append(dst)
        if xfer.corrupt and dsts:  # one byte changed in flight
            byte = ctypes.c_ubyte.from_address(dsts[0])
            byte.value ^= 0xFF
        xfer.state = XferState.DONE
        self.stats.done += 1
