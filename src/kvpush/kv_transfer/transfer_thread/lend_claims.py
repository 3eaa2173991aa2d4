"""LendClaims: a pull lend is READ once, only while it is live (issue 40, finding 2).

Prefill lends a finished request's blocks under a lease; when the lease ends it frees
them and they go to other requests. A decode leg that arrived late (a slow hop, a
replayed set) used to READ them anyway: another prompt's KV, answered and cached. So
decode asks first, and prefill, which alone knows whether the lend is live, answers.
Both halves run on the transfer thread (no step-loop round trip)::

    decode                                   prefill
    CLAIMING ─────── PullClaim(tid) ──────▶  lend tracked (its lease) and not claimed?
                                             ├─ yes: CLAIMED by the sender; PullClaimed(ok)
       ◀──────────────── PullClaimed ────────┴─ no: PullClaimed(ok=False, why)
    ok: READING, the READ is posted (receives.py)
    refused, or the receive ends first: ReceiveOver(ok=False, why): the request
    recomputes or fails (--kv-load-failure-policy); nothing is read or cached

A lend is claimed once: another claim (a replay, a retry elsewhere, a decode restarted
on the same address) is refused, while the claimer's own claim, sent again with its
claim id because the answer was lost, is answered again; once claimed only a PullDone
or Abort from its claimer's address ends it (``from_claimer``). Each answer echoes the claim id,
and decode takes only the answer to its own receive's claim: a late answer to an
earlier receive of the same transfer id is ignored. A lend
that ended (read, aborted, expired) has no lease any more, so every later claim is
refused as well: nothing has to be remembered for that. Prefill's answer also carries
``lend_expires_ms`` (signed by the router with the rest): decode does not even ask once
it has passed (decode_side.py, ``lend_ended``).
"""

from __future__ import annotations

from collections.abc import Callable

from kvpush.kv_transfer.wire import messages as m


class LendClaims:
    """Prefill's half: which decode claimed each live lend (decode's half is
    receives.py's CLAIMING phase)."""

    def __init__(self, send: Callable[[str, m.Message], None]) -> None:
        self._send = send
        #: tid -> (the claimer's address, its claim id)
        self.claimed: dict[str, tuple[str, int]] = {}

    def claim(self, msg: m.PullClaim, sender: str, live: bool) -> None:
        """Answer decode's claim: ``live``: the lend is tracked (its lease runs)."""
        tid, claim = msg.transfer_id, (sender, msg.claim)
        if not live:
            answer = m.PullClaimed(tid, False, "the lend has ended (its lease ran out, it "
                                   "was read or aborted) or never existed", msg.claim)
        elif self.claimed.setdefault(tid, claim) != claim:
            answer = m.PullClaimed(tid, False, "the lend was claimed already", msg.claim)
        else:
            answer = m.PullClaimed(tid, True, claim=msg.claim)
        self._send(sender, answer)

    def from_claimer(self, tid: str, sender: str) -> bool:
        """Whether a PullDone / Abort for ``tid`` from ``sender`` may end the lend: not
        when another decode claimed it."""
        claimer = self.claimed.get(tid)
        return claimer is None or not sender or claimer[0] == sender

    def forget(self, tid: str) -> None:
        """The lend ended (read, aborted, its lease ran out)."""
        self.claimed.pop(tid, None)

