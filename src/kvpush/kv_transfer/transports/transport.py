"""The KV transport contract: one-sided WRITE/READ between registered KV regions.

A transport belongs to one engine (``name``: the engine id). The engine registers its KV
region, publishes :meth:`KVTransport.metadata` over the side channel and adds the peers
it hears about. A transfer is posted with absolute addresses on both sides, checked
against our region and the peer's *as announced* (:class:`TransferPostError` before any
memory is touched), then polled with :meth:`KVTransport.state`; nothing blocks or spins:
the owning transfer thread calls :meth:`KVTransport.progress` between its waits.

A :class:`PreparedTransport` also prepares a descriptor list once (our region's, and
each peer's as announced: rows of equally spaced descriptors) and posts by indices into
two such lists, leaving the per-post descriptor building and matching out.

Implementations: :class:`~kvpush.kv_transfer.transports.nixl_transport.NixlTransport`
(NIXL over UCX) and ``kvpush_testing.inproc_transport.InProcTransport`` (memmove, tests).
"""

from __future__ import annotations

import abc
import enum
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

import msgspec
import numpy as np

Op = Literal["WRITE", "READ"]
Range = tuple[int, int]  # (absolute address, length in bytes)
#: ``count`` descriptors of ``length`` bytes, ``stride`` bytes apart from ``address``
Row = tuple[int, int, int, int]  # (address, length, stride, count)
METADATA_VERSION = 1


class XferState(enum.Enum):
    PENDING = "PENDING"
    DONE = "DONE"
    FAILED = "FAILED"


class TransferPostError(RuntimeError):
    """A post that could not be made (bad ranges, unknown peer, library refused)."""


class RegionInfo(msgspec.Struct, frozen=True):
    """One registered memory region: absolute base address, size, device ("cpu", "cuda:0")."""

    base: int
    nbytes: int
    device: str = "cpu"

    def contains(self, addr: int, length: int) -> bool:
        """Whether [addr, addr + length) lies inside the region (length > 0)."""
        return length > 0 and self.base <= addr and addr + length <= self.base + self.nbytes


class PeerMetadata(msgspec.Struct, frozen=True):
    """The envelope a transport publishes: who it is, its region, the library's own blob."""

    version: int
    kind: str  # "nixl" | "inproc": transports of different kinds cannot talk
    name: str
    region: RegionInfo
    agent: bytes = b""  # NIXL agent metadata; empty for the in-process transport


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(PeerMetadata)


def encode_metadata(meta: PeerMetadata) -> bytes:
    return _ENCODER.encode(meta)


def decode_metadata(blob: bytes, kind: str) -> PeerMetadata:
    """Parse and check a peer's metadata envelope; ValueError if unusable."""
    try:
        meta = _DECODER.decode(blob)
    except msgspec.DecodeError as exc:
        raise ValueError(f"bad transport metadata: {exc}") from exc
    if meta.version != METADATA_VERSION:
        raise ValueError(f"transport metadata version {meta.version} != {METADATA_VERSION}")
    if meta.kind != kind:
        raise ValueError(f"peer {meta.name!r} is a {meta.kind!r} transport, not {kind!r}")
    if meta.region.nbytes <= 0 or meta.region.base <= 0:
        raise ValueError(f"peer {meta.name!r} announced no region")
    return meta


@dataclass
class TransportStats:
    """Counters every transport keeps (read them for metrics; not thread-synchronized)."""

    posts: int = 0
    post_failures: int = 0
    done: int = 0
    failed: int = 0
    bytes_posted: int = 0
    descs_posted: int = 0
    last_post_s: float = 0.0  # wall time of the last successful post() call
    max_post_s: float = 0.0


class KVTransport(abc.ABC):
    """One engine's endpoint for one-sided KV transfers (see module docstring)."""

    kind: str  # what the Hello announces (PeerMetadata.kind)
    name: str
    stats: TransportStats

    @abc.abstractmethod
    def register_region(self, base: int, nbytes: int, device: str = "cpu") -> None:
        """Register the engine's KV region (once, at start-up)."""

    @abc.abstractmethod
    def metadata(self) -> bytes:
        """What a peer needs to add us (after register_region)."""

    @abc.abstractmethod
    def add_peer(self, metadata: bytes) -> str:
        """Add (or refresh) a peer from its metadata; returns its name. Idempotent."""

    @abc.abstractmethod
    def remove_peer(self, peer: str) -> None:
        """Forget a peer; unknown names are ignored."""

    @abc.abstractmethod
    def post(self, op: Op, peer: str, local: Sequence[Range], remote: Sequence[Range]) -> int:
        """Post a transfer; returns a handle. ``local[i]`` is (absolute address in our
        region, length), ``remote[i]`` the same in the peer's, lengths pairwise equal;
        WRITE copies local→remote, READ remote→local. TransferPostError if it cannot."""

    @abc.abstractmethod
    def state(self, handle: int) -> XferState:
        """State of a posted transfer (also drives progress). KeyError if unknown."""

    @abc.abstractmethod
    def release(self, handle: int) -> None:
        """Free a handle. Release only DONE/FAILED transfers; a PENDING one is aborted."""

    @abc.abstractmethod
    def progress(self) -> None:
        """Drive the library's progress once (cheap; call it from the owning thread's loop)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything; the transport is unusable afterwards. Idempotent."""


class PreparedTransport(KVTransport):
    """A transport that posts by index into descriptor lists it prepared once."""

    @abc.abstractmethod
    def post_prepared(self, op: Op, peer: str, local: tuple[Row, ...],
                      local_idx: Sequence[int], remote: tuple[Row, ...],
                      remote_idx: Sequence[int]) -> int:
        """:meth:`KVTransport.post` of descriptor ``local_idx[i]`` of the list of our
        region's ``local`` rows paired with ``remote_idx[i]`` of the list of ``peer``'s
        ``remote`` rows (numbered row by row). A list is prepared on its first use and
        kept: one of ours and one per peer (other rows replace it; a peer's goes with
        the peer: :meth:`remove_peer`, new metadata; all with :meth:`close`).
        TransferPostError if a row leaves its region, an index its list, or the lengths
        of a pair differ. The stats count each index a descriptor (the library may merge
        neighbours contiguous on both sides)."""


@dataclass(frozen=True)
class Prepared:
    """What a transport keeps of one prepared list (the library's handle aside)."""

    peer: str | None
    rows: tuple[Row, ...]
    count: int  # descriptors in the list
    length: int  # their length when every row's is the same, else 0
    lengths: np.ndarray | None  # (count,) int64 when rows differ in length, else None


K = TypeVar("K")


class PreparedLists(Generic[K]):
    """A transport's prepared lists, ours (peer None) and one per peer, each with what
    the transport keeps of it (``K``: the library's handle, the expanded pairs)."""

    def __init__(self) -> None:
        self._lists: dict[str | None, tuple[Prepared, K]] = {}

    def get(self, peer: str | None, rows: tuple[Row, ...]) -> tuple[Prepared, K] | None:
        """``peer``'s list if it was prepared from ``rows``."""
        got = self._lists.get(peer)
        return got if got is not None and (got[0].rows is rows or got[0].rows == rows) \
            else None

    def add(self, info: Prepared, kept: K) -> K | None:
        """Keep a new list for ``info.peer``; what was kept of the one it replaced."""
        old = self.pop(info.peer)
        self._lists[info.peer] = (info, kept)
        return old

    def pop(self, peer: str | None) -> K | None:
        """Forget ``peer``'s list (None: ours); what was kept of it, if any."""
        got = self._lists.pop(peer, None)
        return None if got is None else got[1]

    def clear(self) -> list[K]:
        """Forget every list; what was kept of each."""
        kept = [k for _, k in self._lists.values()]
        self._lists.clear()
        return kept


def prepared_list(peer: str | None, rows: tuple[Row, ...], region: RegionInfo | None
                  ) -> Prepared:
    """Check ``rows`` against ``region`` (TransferPostError) and describe their list."""
    if region is None:
        raise TransferPostError("no region registered" if peer is None
                                else f"peer {peer!r} announced no region")
    if not rows:
        raise TransferPostError("a prepared list needs at least one row")
    for i, (addr, length, stride, count) in enumerate(rows):
        if length <= 0 or count <= 0 or stride < 0:
            raise TransferPostError(f"row {i} ({addr:#x}, {length}, {stride}, {count}) is "
                                    "empty or goes backwards")
        if not (region.contains(addr, length)
                and region.contains(addr + (count - 1) * stride, length)):
            raise TransferPostError(f"row {i} leaves the region [{region.base:#x}, "
                                    f"+{region.nbytes})")
    counts = [r[3] for r in rows]
    lengths = {r[1] for r in rows}
    per = None if len(lengths) == 1 else np.repeat([r[1] for r in rows], counts)
    return Prepared(peer, rows, sum(counts), lengths.pop() if per is None else 0, per)


def check_prepared(op: str, local: Prepared, local_idx: Sequence[int], remote: Prepared,
                   remote_idx: Sequence[int]) -> int:
    """Check a post by indices (else TransferPostError); returns its bytes. Builtins
    only: right after a step numpy's calls cost ~20x their warm time (post_cold.py)."""
    if op not in ("WRITE", "READ"):
        raise TransferPostError(f"unknown op {op!r}")
    n = len(local_idx)
    if n != len(remote_idx):
        raise TransferPostError(f"{n} local indices but {len(remote_idx)} remote")
    if n == 0:
        raise TransferPostError("empty transfer")
    for side, idx, lst in (("local", local_idx, local), ("remote", remote_idx, remote)):
        if min(idx) < 0 or max(idx) >= lst.count:
            raise TransferPostError(f"{side} index out of its list of {lst.count}")
    if local.lengths is None and remote.lengths is None:
        if local.length != remote.length:
            raise TransferPostError(f"local length {local.length} != remote {remote.length}")
        return n * local.length
    loc = local.lengths[list(local_idx)] if local.lengths is not None \
        else np.full(n, local.length)
    rem = remote.lengths[list(remote_idx)] if remote.lengths is not None \
        else np.full(n, remote.length)
    if (loc != rem).any():
        i = int(np.argmax(loc != rem))
        raise TransferPostError(f"pair {i}: local length {loc[i]} != remote {rem[i]}")
    return int(loc.sum())


def validate_post(op: str, local: Sequence[Range], remote: Sequence[Range],
                  local_region: RegionInfo | None,
                  remote_region: RegionInfo | None) -> tuple[np.ndarray, np.ndarray]:
    """Check a post against :meth:`KVTransport.post`'s contract and both regions (else
    TransferPostError); returns (local, remote) as int64 arrays of shape (N, 2)."""
    if op not in ("WRITE", "READ"):
        raise TransferPostError(f"unknown op {op!r}")
    if local_region is None:
        raise TransferPostError("no region registered")
    if remote_region is None:
        raise TransferPostError("peer announced no region")
    if len(local) != len(remote):
        raise TransferPostError(f"{len(local)} local ranges but {len(remote)} remote ranges")
    if len(local) == 0:
        raise TransferPostError("empty transfer")
    loc, rem = _pairs(local), _pairs(remote)
    if (loc[:, 1] <= 0).any():
        raise TransferPostError("range lengths must be > 0")
    limit = 1 << 62  # below this, address + length cannot overflow int64
    if ((loc >= limit) | (rem >= limit) | (loc[:, :1] < 0) | (rem[:, :1] < 0)).any():
        raise TransferPostError("address or length out of range")
    if (loc[:, 1] != rem[:, 1]).any():
        i = int(np.argmax(loc[:, 1] != rem[:, 1]))
        raise TransferPostError(f"range {i}: local length {loc[i, 1]} != remote {rem[i, 1]}")
    for side, arr, region in (("local", loc, local_region), ("remote", rem, remote_region)):
        bad = (arr[:, 0] < region.base) | (arr[:, 0] + arr[:, 1] > region.base + region.nbytes)
        if bad.any():
            i = int(np.argmax(bad))
            raise TransferPostError(f"{side} range {i} [{arr[i, 0]:#x}, +{arr[i, 1]}) is "
                                    f"outside the {side} region [{region.base:#x}, "
                                    f"+{region.nbytes})")
    return loc, rem


def _pairs(ranges: Sequence[Range]) -> np.ndarray:
    """(N, 2) int64 array of (address, length) pairs; TransferPostError if malformed."""
    try:
        if isinstance(ranges, np.ndarray):
            arr = ranges.astype(np.int64, copy=False)
        elif sum(map(len, ranges)) != 2 * len(ranges):
            raise ValueError("not all ranges are pairs")
        else:  # fromiter on the flattened pairs beats asarray on a list of tuples
            flat = itertools.chain.from_iterable(ranges)
            arr = np.fromiter(flat, dtype=np.int64, count=2 * len(ranges))
        arr = arr.reshape(-1, 2)
    except (ValueError, TypeError, OverflowError) as exc:
        raise TransferPostError(f"ranges must be (address, length) pairs: {exc}") from exc
    if len(arr) != len(ranges):
        raise TransferPostError("ranges must be (address, length) pairs")
    return arr
