"""Receives: a decode instance's transfers into its blocks (its transfer thread).

The step loop states three facts per receive (commands.py): the leg was added
(``ReceiveAdded``: prefill's address, engine id and, pull, the lent block ids), its
blocks were allocated (``BlocksAllocated``: the registration, or the READ's blocks),
its request ended (``ReceiveEnded``). Everything between is this object's: the
handshake with prefill and the check of the request's params against prefill's Hello,
the lease, the registration and its re-sends (registrations.py), the lend's claim and
the READ (pull), the fence (fences.py), prefill's answers. The step loop hears back
one ``ReceiveOver`` per receive, once nothing of prefill's lands in its blocks any
more, and, before it, ``ReceiveFailing`` when the request must stop while KV may still
land (then it keeps the blocks until ``ReceiveOver``)::

    WAITING ──blocks, peer ready, params fit──▶ REGISTERED (push) ──PushDone──▶ over
       │                                    └─▶ CLAIMING (pull) ──claimed──▶ READING
       │                                             │ refused: over      │ READ ends:
       │ params misfit (client_error), peer                               ▼ over
       │ refused, lease, Abort, ReceiveEnded: over (nothing was sent to land);
       │ a full prefix hit, nothing to read: over once prefill is told
    REGISTERED ──lease, registration lost: ReceiveFailing; ReceiveEnded──▶ FENCED
    FENCED ──prefill's PushDone / AbortAck / Abort, its connection drops, timeout──▶ over
    READING ──prefill's Abort, peer refused: ReceiveFailing; ReceiveEnded──▶ DRAINING
    DRAINING ──our READ ends──▶ over

A claim prefill never answered is sent again, like a lost registration (a quarter lease
apart, ``MAX_CLAIM_RESENDS`` times), then given up (``Abort``, over): the two sides'
heartbeats keep each other's leases alive, so a lost claim would otherwise hold the
request and both sides' blocks for good.

A registered push is fenced, never simply dropped: a prefill that is frozen, not dead,
still finishes its WRITEs when it resumes (fences.py). Prefill's answers count only
from the instance the receive names.
"""

from __future__ import annotations

import enum
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.step_loop.state import block_ids_problem
from kvpush.kv_transfer.transfer_thread.fences import FenceKeeper
from kvpush.kv_transfer.transfer_thread.inflight import PostRead, TransfersInFlight
from kvpush.kv_transfer.transfer_thread.peers import PeerTable
from kvpush.kv_transfer.transfer_thread.registrations import (
    MAX_REGISTER_RESENDS,
    SentRegistrations,
)
from kvpush.kv_transfer.wire import messages as m

log = logging.getLogger("kvpush.kv_transfer.transfer_thread.worker")

#: Re-sends of a lend's claim prefill has not answered, before decode gives up.
MAX_CLAIM_RESENDS = MAX_REGISTER_RESENDS


class Phase(enum.Enum):
    WAITING = "waiting"  # added: its blocks and/or prefill's Hello awaited
    REGISTERED = "registered"  # push: the registration went out; WRITEs may land
    CLAIMING = "claiming"  # pull: the lend's claim went out; nothing posted yet
    READING = "reading"  # pull: our READ is posted
    FENCED = "fenced"  # push, failed or ended: prefill's word awaited (fences.py)
    DRAINING = "draining"  # pull, failed or ended: our READ still in flight


@dataclass
class Receive:
    tid: str
    address: str  # prefill's side channel
    engine_id: str
    remote_block_ids: list[int]
    phase: Phase = Phase.WAITING
    checked: bool = False  # the params fit prefill's Hello
    blocks: c.BlocksAllocated | None = None
    failed: str | None = None  # why, once the step loop was told (Failing / Ended)
    claimed_at: float = 0.0  # pull, CLAIMING: when the claim was last sent (monotonic)
    claims: int = 0  # pull: claims sent
    claim: int = 0  # pull: this receive's claim id (random; prefill echoes it)


class Receives:
    """``track(tid, address)`` / ``untrack(tid)``: the worker's leases; ``post`` hands an
    event to the step loop; ``stamp(tid, stage)``: the hand-off timeline;
    ``counters``: the worker's metrics dict."""

    def __init__(self, peers: PeerTable, inflight: TransfersInFlight,
                 registrations: SentRegistrations, fences: FenceKeeper,
                 post: Callable[[c.TransferEvent], None],
                 track: Callable[[str, str], None], untrack: Callable[[str], None],
                 stamp: Callable[[str, str], None], num_layers: int,
                 counters: dict[str, int]) -> None:
        self.peers, self.inflight = peers, inflight
        self.registrations, self.fences = registrations, fences
        self.post, self.track, self.untrack, self.stamp = post, track, untrack, stamp
        self.layers = range(num_layers)
        self.resend_after_s = registrations.resend_after_s
        self.counters = counters
        for key in ("fences", "fences_peer_gone", "fence_timeouts"):
            counters.setdefault(key, 0)
        self.recvs: dict[str, Receive] = {}

    # ---- the step loop's facts ----------------------------------------------------------
    def added(self, cmd: c.ReceiveAdded) -> None:
        if cmd.tid in self.recvs:  # (the step loop refuses a tid in use: a bug)
            log.warning("transfer %s: added twice; the second is ignored", cmd.tid)
            return
        r = self.recvs[cmd.tid] = Receive(cmd.tid, cmd.address, cmd.engine_id,
                                          list(cmd.remote_block_ids))
        self.track(r.tid, r.address)
        peer = self.peers.ensure(r.address)  # a refusal now ends it (peer_refused)
        if peer is not None and peer.ready and r.tid in self.recvs:
            self._check(r, peer.hello)

    def allocated(self, cmd: c.BlocksAllocated) -> None:
        r = self.recvs.get(cmd.tid)
        if r is None or r.phase is not Phase.WAITING:
            return  # over already (the step loop has or will have its ReceiveOver)
        r.blocks = cmd
        if r.checked:
            self._start(r)

    def ended_by_step_loop(self, tid: str, why: str) -> None:
        """The request ended: tell prefill; end the receive once nothing can land."""
        r = self.recvs.get(tid)
        if r is None or r.failed is not None:
            return  # over, or failed here first (the step loop was told)
        r.failed = why
        if r.phase is Phase.READING:  # the READ's end tells prefill (PullDone)
            r.phase = Phase.DRAINING
        elif self._abort(r, why):
            if r.phase is Phase.REGISTERED:
                self._fence(r)
            else:
                self._over(r, False, why)

    # ---- what prefill says --------------------------------------------------------------
    def _ours(self, tid: str, sender: str) -> Receive | None:
        r = self.recvs.get(tid)
        if r is not None and sender and sender != r.address:
            self.counters["messages_bad"] += 1  # another instance's word on our transfer
            return None
        return r

    def on_push_done(self, msg: m.PushDone, sender: str) -> None:
        r = self._ours(msg.transfer_id, sender)
        if r is None:
            return
        if r.phase is Phase.FENCED:
            self._over(r, False, r.failed)
        elif r.phase is Phase.REGISTERED:
            self._over(r, msg.ok, None if msg.ok else msg.error or
                       "prefill reported a failure", done=msg)

    def on_abort(self, msg: m.Abort, sender: str) -> None:
        r = self._ours(msg.transfer_id, sender)
        if r is None and self.recvs.get(msg.transfer_id) is not None:
            return  # another instance's word on our transfer
        self.counters["aborts_received"] += 1
        if r is None:
            return
        why = f"aborted by prefill: {msg.reason}"
        if r.phase is Phase.READING:
            self._failing(r, why, Phase.DRAINING)
        elif r.phase is not Phase.DRAINING:  # prefill has nothing of its own in flight
            self._over(r, False, r.failed or why)

    def on_abort_ack(self, msg: m.AbortAck, sender: str) -> None:
        r = self._ours(msg.transfer_id, sender)
        if r is not None and r.phase is Phase.FENCED:
            self._over(r, False, r.failed)

    def on_claimed(self, msg: m.PullClaimed, sender: str) -> None:
        """Prefill's answer to the lend's claim (lend_claims.py): READ, or give up."""
        r = self.recvs.get(msg.transfer_id)
        if (r is None or r.phase is not Phase.CLAIMING or sender != r.address
                or msg.claim != r.claim):
            return  # not ours, or the answer to an earlier receive's claim
        if not msg.ok:
            self._over(r, False, "prefill refused the READ: "
                       + (msg.error or "the lend has ended"))
            return
        r.phase = Phase.READING
        b = r.blocks
        self.inflight.post_read(PostRead(r.tid, r.address, b.local_blocks, b.remote_blocks,
                                         self.layers))

    # ---- what the transfer thread's other parts say ------------------------------------
    def on_notice(self, n: c.Notice) -> None:
        match n:
            case c.PeerReady(address, hello):
                for r in self._of(address):
                    if not r.checked:
                        self._check(r, hello)
            case c.PeerRefused(address, reason):
                for r in self._of(address):
                    if r.phase is Phase.READING:
                        self._failing(r, reason, Phase.DRAINING)
                    elif r.phase is not Phase.DRAINING:
                        self._over(r, False, r.failed or reason)
            case c.ReadDone(tid, ok, error, n_desc, n_bytes, post_s):
                r = self.recvs.get(tid)
                if r is not None and r.phase in (Phase.READING, Phase.DRAINING):
                    ok = ok and r.phase is Phase.READING
                    self._over(r, ok, None if ok else r.failed or error or "READ failed",
                               num_descriptors=n_desc, num_bytes=n_bytes, post_s=post_s)
            case c.RegistrationLost(tid, why):  # (prefill was sent Abort)
                self.counters["aborts_sent"] += 1
                r = self.recvs.get(tid)
                if r is not None and r.phase is Phase.REGISTERED:
                    self._failing(r, why, Phase.FENCED)
                    self._fence(r)
            case c.FenceReleased(tid, why):
                r = self.recvs.get(tid)
                if r is not None and r.phase is Phase.FENCED:
                    self._fence_released(r, why)

    def lease_expired(self, tid: str) -> bool:
        """The lease of ``tid`` ran out (the worker dropped it); False: not a receive."""
        r = self.recvs.get(tid)
        if r is None:
            return False
        why = "lease expired: prefill stopped answering"
        if r.phase in (Phase.DRAINING, Phase.FENCED):
            return True  # our READ still ends it (a fence has no lease)
        if not self._abort(r, "lease expired"):
            return True  # (the send found the peer refused: ended by that)
        if r.phase is Phase.REGISTERED:  # its WRITEs may still land: fence
            self._failing(r, why, Phase.FENCED)
            self._fence(r)
        elif r.phase is Phase.READING:
            self._failing(r, why, Phase.DRAINING)
        else:  # WAITING, CLAIMING: nothing was sent that could land
            peer = self.peers.get(r.address)
            if peer is not None and not peer.ready and peer.sent_hello and not peer.refused:
                log.error("transfer %s: no answer to the side-channel handshake from %s "
                          "(unreachable, not a kvpush instance, or it refuses our "
                          "messages: a different side-channel secret?)", tid, r.address)
            self._over(r, False, why)
        return True

    def shared(self) -> dict[str, set[str]]:
        """Prefill address -> the receives that involve it (a dying thread tells them)."""
        out: dict[str, set[str]] = {}
        for r in self.recvs.values():
            out.setdefault(r.address, set()).add(r.tid)
        return out

    # ---- steps ----------------------------------------------------------------------------
    def _of(self, address: str) -> list[Receive]:
        return [r for r in self.recvs.values() if r.address == address]

    def _check(self, r: Receive, hello: m.Hello) -> None:
        """The request's params against the prefill instance that answered."""
        problem = None
        if r.engine_id and hello.engine_id != r.engine_id:
            problem = (f"the instance at {r.address} is engine {hello.engine_id!r}, not "
                       f"remote_engine_id {r.engine_id!r}")
        elif hello.role != "prefill":
            problem = f"the instance at {r.address} is a {hello.role} instance, not prefill"
        else:
            problem = block_ids_problem(r.remote_block_ids, hello.num_blocks,
                                        "bad remote_block_ids")
        if problem is not None:
            self._over(r, False, f"kv_transfer_params: {problem}", client_error=True)
            return
        r.checked = True
        if r.blocks is not None:
            self._start(r)

    def _start(self, r: Receive) -> None:
        """Blocks allocated and prefill checked: register, or claim the lend."""
        b = r.blocks
        if b.register is not None:
            self.stamp(r.tid, "d_registered")
            if b.register.full_hit:  # prefill computes and sends nothing
                self.peers.send(r.address, b.register)
                self._over(r, True, None)
                return
            r.phase = Phase.REGISTERED
            self.registrations.register(r.tid, r.address, b.register, time.monotonic())
        elif not b.local_blocks:  # pull, nothing to read: the lend can go
            self.peers.send(r.address, m.PullDone(r.tid))
            self._over(r, True, None)
        else:
            r.phase = Phase.CLAIMING  # READ once prefill says the lend is live
            r.claim = secrets.randbits(63) or 1
            self._claim(r, time.monotonic())

    def _claim(self, r: Receive, now: float) -> None:
        r.claimed_at, r.claims = now, r.claims + 1
        self.peers.send(r.address, m.PullClaim(r.tid, r.claim))

    def claims_unanswered(self, now: float) -> None:
        """Claims with no answer a quarter lease on: sent again, or given up."""
        for r in [r for r in self.recvs.values() if r.phase is Phase.CLAIMING
                  and now - r.claimed_at >= self.resend_after_s]:
            if r.claims <= MAX_CLAIM_RESENDS:
                self._claim(r, now)
            elif self._abort(r, "claim unanswered"):
                self._over(r, False, f"prefill never answered the lend's claim (sent "
                                     f"{r.claims} times)")

    def _abort(self, r: Receive, why: str) -> bool:
        """Tell prefill; False: the send found the peer refused, which ended ``r``."""
        self.counters["aborts_sent"] += 1
        self.peers.send(r.address, m.Abort(r.tid, why))
        return self.recvs.get(r.tid) is r

    def _failing(self, r: Receive, why: str, phase: Phase) -> None:
        r.phase = phase
        if r.failed is None:
            r.failed = why
            self.post(c.ReceiveFailing(r.tid, why))

    def _fence(self, r: Receive) -> None:
        """Wait for prefill's word (fences.py); the lease ends: prefill may be frozen."""
        r.phase = Phase.FENCED
        self.untrack(r.tid)
        self.registrations.forget(r.tid)
        self.counters["fences"] += 1
        self.fences.fence(r.tid, r.address)  # (released at once if prefill is gone)

    def _fence_released(self, r: Receive, why: str) -> None:
        if why == "timeout":
            self.counters["fence_timeouts"] += 1
            log.warning("transfer %s: prefill %s neither answered nor dropped its "
                        "connection within --fence-timeout (%s s): its fenced blocks go "
                        "back to the pool (should it still WRITE into them, later answers "
                        "are wrong)", r.tid, r.engine_id or r.address,
                        self.fences.fence_timeout_s)
        else:
            self.counters["fences_peer_gone"] += 1
        self._over(r, False, r.failed or f"fence released: {why}")

    def _forget(self, r: Receive) -> None:
        self.recvs.pop(r.tid, None)
        self.untrack(r.tid)
        self.registrations.forget(r.tid)
        self.fences.drop(r.tid)

    def _over(self, r: Receive, ok: bool, why: str | None, done: m.PushDone | None = None,
              num_descriptors: int = 0, num_bytes: int = 0, post_s: float = 0.0,
              client_error: bool = False) -> None:
        if self.recvs.get(r.tid) is not r:
            return  # over already (a refusal can end it while it is being ended)
        self._forget(r)
        self.post(c.ReceiveOver(r.tid, ok, why, done, num_descriptors, num_bytes, post_s,
                                client_error))
