"""PullPrefill: the transfer thread's role on a pull prefill instance: its lends.

A finished request's blocks are lent (``Prefilled``: LENT) under a lease that any
peer's heartbeat listing the transfer renews. A lend is READ once, only while it is
live: decode claims it first (``PullClaim`` with a random claim id) and the answer
says yes to one claimer only, again to that claimer's repeat of its claim, and no to
everyone else, or to any claim once the lend has ended (read, aborted, expired: it is
no longer in the table). Once claimed only the claimer's ``PullDone`` or ``Abort`` ends
it. The step loop gets one ``Over`` per lend and frees the blocks then.
"""

from __future__ import annotations

import logging

from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.transfer_thread.context import RoleBase
from kvpush.kv_transfer.transfer_thread.table import Phase, Transfer
from kvpush.kv_transfer.wire import messages as m

log = logging.getLogger("kvpush.kv_transfer.transfer_thread.worker")


class PullPrefill(RoleBase):
    def begin(self, f: c.Begin) -> None:
        log.warning("ignored Begin of %s: a pull prefill's lend begins at Prefilled", f.tid)

    def blocks(self, f: c.BlocksReady) -> None:
        pass  # nothing is written: decode READs

    def prefilled(self, f: c.Prefilled) -> None:
        if self.ctx.table.get(f.tid) is None:
            self.ctx.table.add(Transfer(f.tid, Phase.LENT, lent_blocks=f.lent))

    def end(self, f: c.End) -> None:
        rec = self.ctx.table.get(f.tid)
        if rec is not None:  # the router gave up on it
            self.ctx.over(rec, c.Outcome.FAILED, f.why)

    def on_message(self, msg: m.Message, sender: str) -> None:
        ctx = self.ctx
        rec = ctx.table.get(getattr(msg, "transfer_id", ""))
        if isinstance(msg, m.PullClaim):
            ctx.send(sender, self._answer(rec, msg, sender))
        elif isinstance(msg, m.PullDone | m.Abort):
            if rec is not None and rec.claimer is not None and rec.claimer[0] != sender:
                ctx.count("messages_bad")  # a lend claimed by another decode
                return
            if isinstance(msg, m.Abort):
                ctx.count("aborts_received")
            if rec is not None:
                ok = isinstance(msg, m.PullDone) and msg.ok
                ctx.over(rec, c.Outcome.OK if ok else c.Outcome.FAILED,
                         None if ok else "decode gave up on the lend")
        else:
            log.warning("ignored a %s from %s: this instance lends KV (pull)",
                        type(msg).__name__, sender)

    def _answer(self, rec: Transfer | None, msg: m.PullClaim, sender: str) -> m.PullClaimed:
        tid, claim = msg.transfer_id, (sender, msg.claim)
        if rec is None:
            return m.PullClaimed(tid, False, "the lend has ended (its lease ran out, it "
                                 "was read or aborted) or never existed", msg.claim)
        if rec.claimer is None:
            rec.claimer = claim
        if rec.claimer != claim:
            return m.PullClaimed(tid, False, "the lend was claimed already", msg.claim)
        digests = self.ctx.digests  # --kv-digest: of every lent block, at its first claim
        if digests is not None and rec.peer_digest is None:
            rec.peer_digest = digests.of(rec.lent_blocks)
        return m.PullClaimed(tid, True, claim=msg.claim, kv_digest=rec.peer_digest,
                             kv_digest_alg=digests.algorithm if digests else "")

    def deadline(self, rec: Transfer) -> None:
        self.ctx.count("leases_expired")
        self.ctx.over(rec, c.Outcome.FAILED, "lease expired: decode never read the lend")
