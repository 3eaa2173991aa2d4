"""Leases: how long the transfer thread keeps a transfer without word from its peer.

Each transfer that waits on a peer has a lease: a deadline (``timeout_s`` from now)
that the peer's heartbeats renew, or any message about the transfer. A lease is bound
to the peer that renews it (its side-channel address) or, unbound, renewed by any
peer's heartbeat (a prefill's early push transfers and pull lends: it does not know
yet which decode will come). A lease that is not renewable keeps its first deadline
(early registrations). What an expired lease means is the transfer's owner's to say
(push_sends.py, receives.py, the worker for lends); this table only keeps time.

The heartbeat a transfer thread sends each peer (``heartbeat``) lists the transfers it
shares with that peer, and the unbound ones to every peer, so that the other side
renews its own leases on them; the unbound ones are also listed as *awaiting
registration* (a push decode sends its registration again for those it has).
Same thread as the worker.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from kvpush.kv_transfer.wire import messages as m


@dataclass
class Lease:
    deadline: float
    address: str | None  # peer that renews it; None: any peer
    renewable: bool = True  # False: a fixed deadline, heartbeats do not extend it


class Leases:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.by_tid: dict[str, Lease] = {}

    def track(self, tid: str, address: str | None, renewable: bool = True) -> None:
        self.by_tid[tid] = Lease(time.monotonic() + self.timeout_s, address, renewable)

    def untrack(self, tid: str) -> None:
        self.by_tid.pop(tid, None)

    def renew(self, tid: str, sender: str = "") -> None:
        """A message about ``tid`` from ``sender``: renew its lease, if it is the peer
        the lease is bound to (an unbound lease: any peer's)."""
        lease = self.by_tid.get(tid)
        if lease is not None and lease.renewable and (
                not sender or lease.address is None or lease.address == sender):
            lease.deadline = time.monotonic() + self.timeout_s

    def next_deadline(self) -> float | None:
        return min((lease.deadline for lease in self.by_tid.values()), default=None)

    def take_expired(self, now: float) -> list[str]:
        """The transfers whose lease ran out by ``now``, their leases dropped."""
        expired = [tid for tid, lease in self.by_tid.items() if lease.deadline <= now]
        for tid in expired:
            del self.by_tid[tid]
        return expired

    def addresses(self) -> set[str]:
        """The peers bound leases wait on (busy: never dropped as idle)."""
        return {lease.address for lease in self.by_tid.values() if lease.address}

    def heartbeats(self, engine_id: str, also: Iterable[tuple[str, str]],
                   ready: Iterable[str]) -> list[tuple[str, m.Heartbeat]]:
        """The heartbeat for each of the ``ready`` peers that shares a transfer with us:
        the leases bound to it, ``also`` (transfer id, address: WRITEs in flight) and
        every unbound lease."""
        by_peer: dict[str, list[str]] = {}
        unbound: list[str] = []
        for tid, lease in self.by_tid.items():
            if lease.address is None:
                unbound.append(tid)
            else:
                by_peer.setdefault(lease.address, []).append(tid)
        for tid, address in also:
            by_peer.setdefault(address, []).append(tid)
        out = []
        for address in ready:
            tids = by_peer.get(address, []) + unbound
            if tids:
                out.append((address, m.Heartbeat(engine_id, sorted(set(tids)),
                                                 sorted(unbound))))
        return out
