"""Context: what the transfer thread's role objects share (all on that thread).

The records, peers, posts, side channel, counters, clock and the events of the running
pass. ``over`` and ``failing`` alone make events: each transfer gets at most one
``Failing`` and exactly one ``Over``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.digest import BlockDigests
from kvpush.kv_transfer.record import TransferCounters, TransferRecord
from kvpush.kv_transfer.transfer_thread.peers import PeerTable
from kvpush.kv_transfer.transfer_thread.posts import Posts
from kvpush.kv_transfer.transfer_thread.table import Table, Transfer
from kvpush.kv_transfer.transports.transport import Op, TransferPostError, XferState
from kvpush.kv_transfer.wire import messages as m

log = logging.getLogger("kvpush.kv_transfer.transfer_thread.worker")

MAX_RESENDS = 3  # of a registration or a claim prefill did not get, before giving up


@dataclass(frozen=True)
class Settings:
    """The transfer thread's share of the instance's frozen config."""

    lease_s: float
    heartbeat_s: float
    fence_s: float = 300.0
    block_size: int = 16

    @property
    def resend_s(self) -> float:
        """How long an unanswered registration or claim waits before it goes again."""
        return self.lease_s / 4


@dataclass
class Context:
    hello: m.Hello  # ours
    settings: Settings
    table: Table
    peers: PeerTable
    posts: Posts
    channel: object  # wire.side_channel.SideChannel (or a test's)
    clock: Callable[[], float]
    counters: TransferCounters = field(default_factory=TransferCounters)
    events: list[c.Event] = field(default_factory=list)
    dirty: bool = False  # the counters changed since the last update
    #: the role's handler of a post of ``rec`` that ended (ok or not)
    on_landed: Callable[[Transfer, bool], None] = lambda rec, ok: None
    #: --kv-digest: our region's block digests (None: off)
    digests: BlockDigests | None = None

    def digest_problem(self, rec: Transfer, want: list[bytes] | None, sent: bool,
                       algorithm: str, ours: Sequence[int], first: int) -> str | None:
        """--kv-digest on decode: why the KV in our blocks ``ours`` (prompt blocks
        ``first`` on) is not what prefill's digests ``want`` (by ``algorithm``) say, or
        None. A failed check is counted and logged."""
        from kvpush.kv_transfer.digest import mismatch_reason, mismatches, unusable

        why = unusable(sent, algorithm)
        if why is None:
            bad = mismatches(want, self.digests.of(ours, algorithm))
            if not bad:
                return None
            why = mismatch_reason(bad, first, len(ours))
        self.count("digest_mismatches")
        log.error("transfer %s from %s: %s", rec.tid, rec.peer, why)
        return why

    @property
    def role(self) -> str:
        return self.hello.role

    @property
    def mode(self) -> str:
        return self.hello.kv_transfer

    def count(self, name: str, n: int = 1) -> None:
        setattr(self.counters, name, getattr(self.counters, name) + n)
        self.dirty = True

    def send(self, address: str | None, msg: m.Message) -> None:
        if address:
            self.peers.send(address, msg)

    def post(self, op: Op, rec: Transfer, local: Sequence[int], remote: Sequence[int],
             layers: range, ready: Any = None) -> str | None:
        """Post ``op`` for ``rec`` to its peer and check it at once (over cma the copy
        is done inside the post); None, or why nothing was posted."""
        peer = self.peers.ready_peer(rec.peer)
        try:
            handles = self.posts.post(op, rec, peer.hello if peer else None,
                                      peer.agent if peer else None, local, remote, layers,
                                      ready)
        except TransferPostError as e:
            return str(e)
        for handle in handles:
            self.check(handle)
        return None

    def check(self, handle: int, state: XferState | None = None) -> None:
        """End ``handle``'s post if it is no longer pending."""
        state = self.posts.state(handle) if state is None else state
        if state is XferState.PENDING:
            return
        rec = self.table.get(self.posts.take(handle))
        if rec is not None and handle in rec.handles:
            rec.handles.discard(handle)
            self.on_landed(rec, state is XferState.DONE)

    def abort(self, rec: Transfer, why: str) -> bool:
        """Tell ``rec``'s peer; False: the send found the peer refused, which ended
        ``rec`` (decode)."""
        self.count("aborts_sent")
        self.send(rec.peer, m.Abort(rec.tid, why))
        return self.table.get(rec.tid) is rec

    def failing(self, rec: Transfer, why: str) -> None:
        """The step loop must end ``rec``'s request now (once; not if it knows already)."""
        rec.failed = rec.failed or why
        if not rec.told:
            rec.told = True
            self.events.append(c.Failing(rec.tid, why))

    def over(self, rec: Transfer, outcome: c.Outcome, why: str | None = None,
             first: m.PushDone | None = None, counted: bool = True) -> None:
        """End ``rec``: it leaves the table (its id is remembered) and the step loop
        gets its one Over. ``counted``: a transfer that moved KV, or should have (not a
        full hit); each is recorded too, but a lend (decode has the figures)."""
        if self.table.get(rec.tid) is not rec:
            return  # over already
        self.table.pop(rec.tid)
        self.table.remember(rec.tid, why or "done")
        ok = outcome is c.Outcome.OK
        entry = None
        if counted and outcome is not c.Outcome.NOT_NEEDED:
            self.count("transfers_ok" if ok else "transfers_failed")
            if self.mode == "push" or self.role == "decode":
                if ok and first is not None:  # decode: prefill's figures
                    n_desc, n_bytes = first.num_descriptors, first.num_bytes
                else:
                    n_desc, n_bytes = rec.num_descriptors, rec.num_bytes
                entry = TransferRecord(rec.tid, self.role, self.mode, ok, n_bytes, n_desc,
                                       rec.post_s, time.perf_counter() - rec.started, why)
        self.events.append(c.Over(rec.tid, outcome, why, first, entry,
                                  tuple(rec.stamps.items())))


class RoleBase:
    """What every role object hears (the worker routes to it); these defaults ignore
    what a role has no use for (only decode's receives wait on peers' heartbeats,
    handshakes and connections)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def resend(self, rec: Transfer) -> None:
        pass

    def landed(self, rec: Transfer, ok: bool) -> None:
        pass

    def on_heartbeat(self, hb: m.Heartbeat, sender: str) -> None:
        pass

    def on_peer_ready(self, address: str, hello: m.Hello) -> None:
        pass

    def on_peer_refused(self, address: str, reason: str) -> None:
        pass

    def on_peer_dropped(self, address: str) -> None:
        pass
