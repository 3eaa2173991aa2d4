"""LendClaims: a pull lend is READ once, only while it is live (issue 40, finding 2).

Prefill lends a finished request's blocks under a lease; when the lease ends it frees
them and they go to other requests. A decode leg that arrived late (a slow hop, a
replayed set) used to READ them anyway: another prompt's KV, answered and cached. So
decode asks first, and prefill, which alone knows whether the lend is live, answers.
Both halves run on the transfer thread (no step-loop round trip)::

    decode                                   prefill
    PostRead(tid) ── PullClaim(tid) ──────▶  lend tracked (its lease) and not claimed?
       PENDING                               ├─ yes: CLAIMED by the sender; PullClaimed(ok)
       ◀──────────────── PullClaimed ────────┴─ no: PullClaimed(ok=False, why)
    ok: the READ is posted (inflight.post_read)
    refused, or the transfer ends first: ReadDone(ok=False, why): the request
    recomputes or fails (--kv-load-failure-policy); nothing is read or cached

A lend is claimed once: a second claim (a replay, a retry elsewhere) is refused, and
once claimed only its claimer's PullDone or Abort ends it (``from_claimer``). A lend
that ended (read, aborted, expired) has no lease any more, so every later claim is
refused as well: nothing has to be remembered for that. Prefill's answer also carries
``lend_expires_ms`` (signed by the router with the rest): decode does not even ask once
it has passed (decode_side.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.step_loop.state import DecodeRecv
from kvpush.kv_transfer.wire import messages as m


@dataclass(frozen=True, slots=True)
class PendingClaim:
    read: c.PostRead  # posted once prefill says yes


class LendClaims:
    def __init__(self, send: Callable[[str, m.Message], None],
                 post_event: Callable[[c.Event], None]) -> None:
        self._send = send
        self._post_event = post_event
        self.pending: dict[str, PendingClaim] = {}  # decode: tid -> its READ
        self.claimed: dict[str, str] = {}  # prefill: tid -> the claimer's address

    # ---- decode -----------------------------------------------------------------------
    def request(self, read: c.PostRead) -> None:
        """Ask prefill for the lend before ``read`` is posted."""
        self.pending[read.tid] = PendingClaim(read)
        self._send(read.address, m.PullClaim(read.tid))

    def answered(self, msg: m.PullClaimed, sender: str) -> c.PostRead | None:
        """Prefill's answer: the READ to post now, or None (refused: the step loop is
        told; from another sender, or for no claim of ours: ignored)."""
        pending = self.pending.get(msg.transfer_id)
        if pending is None or pending.read.address != sender:
            return None
        del self.pending[msg.transfer_id]
        if msg.ok:
            return pending.read
        self._post_event(c.ReadDone(msg.transfer_id, False, error=(
            f"prefill refused the READ: {msg.error or 'the lend has ended'}")))
        return None

    # ---- prefill ----------------------------------------------------------------------
    def claim(self, msg: m.PullClaim, sender: str, live: bool) -> None:
        """Answer decode's claim: ``live``: the lend is tracked (its lease runs)."""
        tid = msg.transfer_id
        if not live:
            answer = m.PullClaimed(tid, False, "the lend has ended (its lease ran out, it "
                                   "was read or aborted) or never existed")
        elif tid in self.claimed:
            answer = m.PullClaimed(tid, False, "the lend was claimed already")
        else:
            self.claimed[tid] = sender
            answer = m.PullClaimed(tid, True)
        self._send(sender, answer)

    def from_claimer(self, tid: str, sender: str) -> bool:
        """Whether a PullDone / Abort for ``tid`` from ``sender`` may end the lend: not
        when another decode claimed it."""
        claimer = self.claimed.get(tid)
        return claimer is None or not sender or claimer == sender

    def forget(self, tid: str) -> None:
        """The transfer ended here (untracked: done, failed, its lease ran out). A claim
        still unanswered ends its READ unposted, so blocks held for it are freed."""
        self.claimed.pop(tid, None)
        if self.pending.pop(tid, None) is not None:
            self._post_event(c.ReadDone(tid, False, error="the transfer ended before "
                                        "prefill answered the lend's claim"))


def lend_ended(recv: DecodeRecv) -> str | None:
    """Pull: why prefill's lend is over by its signed end (lend_claims.py), or None."""
    if recv.lend_expires_ms is None:
        return None
    late_s = time.time() - recv.lend_expires_ms / 1000
    if late_s < 0:
        return None
    return (f"prefill's lend of this KV ended {late_s:.1f} s ago (the decode leg came too "
            "late): its blocks may hold another request's KV now")
