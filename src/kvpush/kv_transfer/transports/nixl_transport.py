"""NixlTransport: the KV transport over NIXL (UCX backend), between processes or hosts.

One NIXL agent per engine, named after the engine id, **without NIXL's progress thread**
(it busy-spins a core per idle agent). ``transfer()`` and ``check_xfer_state()`` progress
the initiator; the target of a WRITE must progress too while a new initiator connects
(else that first transfer stays PROC forever), so the owner calls
:meth:`~NixlTransport.progress` every few ms while it has peers. Over cma (one host;
docs/MEASURED.md) ``post()`` does the copy and returns it DONE, blocking its thread (GIL
released) meanwhile: post from the transfer thread, never the step loop. Each descriptor
has a fixed cost, nearly all UCX's: coalesce small pieces.

Prepared lists (:class:`~kvpush.kv_transfer.transports.transport.PreparedTransport`):
``prep_xfer_dlist`` of strided rows (NIXL's Nx5 form: one row a layer, a descriptor a
block), once for our region and once per peer; a post is ``make_prepped_xfer`` with two
index arrays, which NIXL merges where neighbours are contiguous on both sides. A peer's
list is released with the peer, ours at :meth:`~NixlTransport.close`.

Relied on (nixl 1.5.1): ``add_remote_agent`` returns the name as *bytes*; adding the same
metadata twice is fine; a WRITE's target needs no initiator metadata. NIXL notifications
are not used. UCX's CUDA transports need a CUDA context current on the calling thread
(vllm-project/vllm#36475), so each agent call first binds the region's device. Set
``UCX_NET_DEVICES`` (``lo`` on one host) and ``NIXL_LOG_LEVEL=WARN``; ``nixl`` is imported
only when a NixlTransport is created.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

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

logger = logging.getLogger(__name__)

KIND = "nixl"


def nixl_mem(device: str) -> tuple[str, int]:
    """NIXL memory type and device id of a torch device string ("cpu", "cuda:1")."""
    if device == "cpu":
        return "DRAM", 0
    if device == "cuda" or device.startswith("cuda:"):
        return "VRAM", 0 if device == "cuda" else int(device[5:])
    raise ValueError(f"unsupported device {device!r}")


@dataclass
class _Xfer:
    handle: Any  # nixl_xfer_handle
    state: XferState


class NixlTransport(PreparedTransport):
    """KV transport over a NIXL agent without progress thread. Thread-safe (one lock
    around every agent call), meant to be used from one transfer thread."""

    kind = KIND

    def __init__(self, name: str, backends: Sequence[str] = ("UCX",)):
        from nixl._api import nixl_agent, nixl_agent_config  # lazy: optional dependency
        self.name = name
        self.stats = TransportStats()
        self._backends = list(backends)
        self._agent = nixl_agent(
            name, nixl_agent_config(enable_prog_thread=False, backends=self._backends))
        self._lock = threading.Lock()
        self._bound = threading.local()  # threads that have the region's CUDA device
        self._region: RegionInfo | None = None
        self._mem: tuple[str, int] = ("DRAM", 0)
        self._reg_descs: Any = None
        self._peers: dict[str, PeerMetadata] = {}
        self._xfers: dict[int, _Xfer] = {}
        self._lists: PreparedLists[Any] = PreparedLists()  # nixl_prepped_dlist_handle
        self._leaked: list[Any] = []  # library handles whose release failed
        self._next_handle = 1
        self._closed = False

    def register_region(self, base: int, nbytes: int, device: str = "cpu") -> None:
        """Register our KV region with NIXL (DRAM for cpu, VRAM for cuda)."""
        if base <= 0 or nbytes <= 0:
            raise ValueError("empty region")
        mem_type, dev_id = nixl_mem(device)
        with self._lock:
            if self._region is not None:
                raise RuntimeError(f"{self.name}: region already registered")
            self._mem = (mem_type, dev_id)
            self._bind_device()
            self._reg_descs = self._agent.register_memory(
                [(base, nbytes, dev_id, "")], mem_type, backends=self._backends)
            self._region = RegionInfo(base, nbytes, device)

    def metadata(self) -> bytes:
        """Our envelope: name, region, and NIXL's agent metadata (with the registration)."""
        with self._lock:
            if self._region is None:
                raise RuntimeError(f"{self.name}: register_region first")
            md = self._agent.get_agent_metadata()
        return encode_metadata(PeerMetadata(METADATA_VERSION, KIND, self.name, self._region, md))

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's NIXL metadata and start connecting; returns its name. New metadata
        under a known name (the peer restarted) replaces the old agent."""
        meta = decode_metadata(metadata, KIND)
        if meta.name == self.name:
            raise ValueError(f"{self.name}: cannot add ourselves as a peer")
        with self._lock:
            old = self._peers.get(meta.name)
            if old == meta:
                return meta.name
            if old is not None:
                self._remove_locked(meta.name)
            self._bind_device()
            loaded = self._agent.add_remote_agent(meta.agent)
            loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if loaded != meta.name:
                self._agent.remove_remote_agent(loaded)
                raise ValueError(f"metadata for {meta.name!r} carries agent {loaded!r}")
            self._peers[meta.name] = meta
            try:  # start UCX wire-up now so the first post does not pay for it
                self._agent.make_connection(meta.name, self._backends)
            except Exception as exc:  # the first post will connect then
                logger.warning("%s: make_connection(%s) failed: %s", self.name, meta.name, exc)
        return meta.name

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            self._remove_locked(peer)

    def peer_region(self, peer: str) -> RegionInfo:
        """The KV region a peer announced; KeyError if the peer is unknown."""
        with self._lock:
            return self._peers[peer].region

    def _remove_locked(self, peer: str) -> None:
        if self._peers.pop(peer, None) is None:
            return
        self._release_list(self._lists.pop(peer))
        try:
            self._agent.remove_remote_agent(peer)
        except Exception as exc:  # already gone in the library
            logger.warning("%s: remove_remote_agent(%s): %s", self.name, peer, exc)

    def post(self, op: Op, peer: str, local: Sequence[Range], remote: Sequence[Range]) -> int:
        """Validate, create and start a transfer (over cma: blocks for the copy)."""
        return self._timed(lambda: self._post_locked(op, peer, local, remote))

    def post_prepared(self, op: Op, peer: str, local: tuple[Row, ...],
                      local_idx: Sequence[int], remote: tuple[Row, ...],
                      remote_idx: Sequence[int]) -> int:
        """Check and start a transfer by index between our list of ``local`` rows and
        ``peer``'s of ``remote`` rows, each prepared on first use (over cma: blocks for
        the copy)."""
        return self._timed(lambda: self._post_prepared_locked(op, peer, local, local_idx,
                                                              remote, remote_idx))

    def _timed(self, post: Callable[[], int]) -> int:
        """Run ``post`` under the lock, counting it in the stats."""
        t0 = time.perf_counter()
        with self._lock:
            try:
                handle = post()
            except TransferPostError:
                self.stats.post_failures += 1
                raise
            self.stats.last_post_s = dt = time.perf_counter() - t0
            self.stats.max_post_s = max(self.stats.max_post_s, dt)
            return handle

    def _post_locked(self, op: Op, peer: str, local: Sequence[Range],
                     remote: Sequence[Range]) -> int:
        meta = self._open_peer(peer)
        loc, rem = validate_post(op, local, remote, self._region, meta.region)
        self._bind_device()
        peer_mem, peer_dev = nixl_mem(meta.region.device)
        ldesc = np.empty((len(loc), 3), dtype=np.uint64)
        ldesc[:, :2] = loc
        ldesc[:, 2] = self._mem[1]
        rdesc = np.empty((len(rem), 3), dtype=np.uint64)
        rdesc[:, :2] = rem
        rdesc[:, 2] = peer_dev
        agent = self._agent
        return self._start(op, peer, lambda: agent.initialize_xfer(
            op, agent.get_xfer_descs(ldesc, self._mem[0]),
            agent.get_xfer_descs(rdesc, peer_mem), peer, b"", self._backends),
            len(loc), int(loc[:, 1].sum()))

    def _post_prepared_locked(self, op: Op, peer: str, local: tuple[Row, ...],
                              local_idx: Sequence[int], remote: tuple[Row, ...],
                              remote_idx: Sequence[int]) -> int:
        meta = self._open_peer(peer)
        mine, lh = self._prepared(None, local, self._region, self._mem)
        theirs, rh = self._prepared(peer, remote, meta.region, nixl_mem(meta.region.device))
        nbytes = check_prepared(op, mine, local_idx, theirs, remote_idx)
        self._bind_device()
        agent = self._agent
        return self._start(op, peer, lambda: agent.make_prepped_xfer(
            op, lh, local_idx, rh, remote_idx, b"", self._backends),
            len(local_idx), nbytes)

    def _prepared(self, peer: str | None, rows: tuple[Row, ...], region: RegionInfo | None,
                  mem: tuple[str, int]) -> tuple[Prepared, Any]:
        """``peer``'s prepared list of ``rows`` (None: ours), prepared now if it is not."""
        got = self._lists.get(peer, rows)
        if got is not None:
            return got
        info = prepared_list(peer, rows, region)
        arr = np.array([(a, n, mem[1], stride, count) for a, n, stride, count in rows],
                       dtype=np.uint64)
        self._bind_device()
        try:
            dlist = self._agent.prep_xfer_dlist(peer or "NIXL_INIT_AGENT", arr, mem[0],
                                                self._backends)
        except Exception as exc:  # the library refused the rows
            whose = "ours" if peer is None else repr(peer) + "'s"
            raise TransferPostError(f"{self.name}: preparing {whose} list failed: "
                                    f"{exc!r}") from exc
        self._release_list(self._lists.add(info, dlist))
        return info, dlist

    def _open_peer(self, peer: str) -> PeerMetadata:
        if self._closed:
            raise TransferPostError(f"{self.name}: transport closed")
        meta = self._peers.get(peer)
        if meta is None:
            raise TransferPostError(f"{self.name}: unknown peer {peer!r}")
        return meta

    def _start(self, op: Op, peer: str, make: Callable[[], Any], descs: int,
               nbytes: int) -> int:
        """Create the library's transfer with ``make`` and start it; our handle."""
        xh = None
        try:
            xh = make()
            status = self._agent.transfer(xh)
        except Exception as exc:  # every library error is a failed post
            self._release_lib(xh)
            raise TransferPostError(f"{self.name}: {op} to {peer!r} failed: {exc!r}") from exc
        if status == "ERR":
            self._release_lib(xh)
            raise TransferPostError(f"{self.name}: {op} to {peer!r} refused by NIXL")
        handle = self._next_handle
        self._next_handle += 1
        state = XferState.DONE if status == "DONE" else XferState.PENDING
        self._xfers[handle] = _Xfer(xh, state)
        self.stats.posts += 1
        self.stats.descs_posted += descs
        self.stats.bytes_posted += nbytes
        if state is XferState.DONE:
            self.stats.done += 1
        return handle

    def state(self, handle: int) -> XferState:
        with self._lock:
            xfer = self._xfers[handle]
            if xfer.state is XferState.PENDING:
                self._bind_device()
                try:
                    status = self._agent.check_xfer_state(xfer.handle)
                except Exception as exc:  # e.g. peer disconnected
                    logger.warning("%s: transfer %d failed: %r", self.name, handle, exc)
                    status = "ERR"
                if status == "DONE":
                    xfer.state = XferState.DONE
                    self.stats.done += 1
                elif status == "ERR":
                    xfer.state = XferState.FAILED
                    self.stats.failed += 1
            return xfer.state

    def release(self, handle: int) -> None:
        with self._lock:
            xfer = self._xfers.pop(handle, None)
            if xfer is not None:
                self._release_lib(xfer.handle)

    def progress(self) -> None:
        """Progress the UCX worker (``get_new_notifs``); also retries failed releases."""
        with self._lock:
            if self._closed:
                return
            self._bind_device()
            self._agent.get_new_notifs()  # progresses; notifications are not used
            leaked, self._leaked = self._leaked, []
            for xh in leaked:
                self._release_lib(xh)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for xfer in self._xfers.values():
                self._release_lib(xfer.handle)
            self._xfers.clear()
            for peer in list(self._peers):
                self._remove_locked(peer)
            for dlist in self._lists.clear():
                self._release_list(dlist)
            for xh in self._leaked:
                self._release_lib(xh, keep=False)
            self._leaked.clear()
            if self._reg_descs is not None:
                try:
                    self._agent.deregister_memory(self._reg_descs, backends=self._backends)
                except Exception as exc:  # shutting down anyway
                    logger.warning("%s: deregister_memory: %r", self.name, exc)
                self._reg_descs = None
            self._agent = None

    def _bind_device(self) -> None:
        """With a VRAM region, make its device current on the calling thread (once)."""
        if self._mem[0] != "VRAM" or getattr(self._bound, "device", None) == self._mem[1]:
            return
        import torch
        torch.cuda.set_device(self._mem[1])
        self._bound.device = self._mem[1]

    def _release_list(self, dlist: Any) -> None:
        """Release a prepared list's library handle (None: nothing)."""
        if dlist is None:
            return
        try:
            dlist.release()
        except Exception as exc:  # the library keeps it until the agent goes
            logger.warning("%s: release of a prepared list failed: %r", self.name, exc)

    def _release_lib(self, xh: Any, keep: bool = True) -> None:
        """Release a library handle; if NIXL refuses (still active), retry later."""
        if xh is None:
            return
        try:
            xh.release()
        except Exception as exc:  # transfer could not be cancelled yet
            logger.warning("%s: release of a transfer failed: %r", self.name, exc)
            if keep:
                self._leaked.append(xh)
