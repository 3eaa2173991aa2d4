"""Decode: the transfer thread's role on a decode instance: its receives, push and pull.

``Begin`` names the prefill instance; the thread handshakes with it and checks the
request's params against its Hello (a misfit is a 400). Once the blocks are allocated
(``BlocksReady``) and prefill is checked, push sends the registration (sent again when
prefill's heartbeat says it never came, a quarter lease apart, ``MAX_RESENDS`` times,
then given up); pull claims the lend (the claim sent again likewise) and READs it once
prefill says yes. The step loop hears one ``Over`` per receive, once nothing of
prefill's can land in its blocks any more, and ``Failing`` first when the request must
stop while it still can (prefill silent past the lease, the registration lost, prefill's
Abort while our READ runs). Because this thread knows what it sent, it decides what may
still land: a receive whose registration or claim never left ends at once; a registered
push is fenced (FENCED) until prefill answers (``PushDone``, ``AbortAck``, its
``Abort``), its connection drops, or ``--fence-timeout`` passes, repeating its Abort
each lease meanwhile (a prefill frozen, not dead, still WRITEs when it resumes); a
posted READ drains. Prefill's answers count only from the instance the receive names.
"""

from __future__ import annotations

import logging
import secrets
import time

from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.params import block_ids_problem
from kvpush.kv_transfer.transfer_thread.context import MAX_RESENDS, RoleBase
from kvpush.kv_transfer.transfer_thread.table import INF, Phase, Transfer
from kvpush.kv_transfer.wire import messages as m

log = logging.getLogger("kvpush.kv_transfer.transfer_thread.worker")


def lend_ended(expires_ms: int | None) -> str | None:
    """Pull: why prefill's lend is over by its signed end, or None."""
    if expires_ms is None:
        return None
    late_s = time.time() - expires_ms / 1000
    if late_s < 0:
        return None
    return (f"prefill's lend of this KV ended {late_s:.1f} s ago (the decode leg came too "
            "late): its blocks may hold another request's KV now")


class Decode(RoleBase):
    # ---- the step loop's facts --------------------------------------------------------
    def begin(self, f: c.Begin) -> None:
        ctx = self.ctx
        if ctx.table.get(f.tid) is not None:  # (the step loop refuses an id in use)
            log.warning("transfer %s: begun twice; the second is ignored", f.tid)
            return
        p = f.peer
        rec = ctx.table.add(Transfer(
            f.tid, Phase.WAITING, peer=p.address, peer_engine=p.engine_id,
            num_prompt_tokens=f.num_prompt_tokens, prompt_hashes=f.prompt_hashes,
            lent_blocks=p.lent_blocks, lend_expires_ms=p.lend_expires_ms))
        peer = ctx.peers.ensure(p.address)  # a refusal ends it now (peer_refused)
        if peer is not None and peer.ready and ctx.table.get(f.tid) is rec:
            self._check(rec, peer.hello)

    def blocks(self, f: c.BlocksReady) -> None:
        rec = self.ctx.table.get(f.tid)
        if rec is not None and rec.phase is Phase.WAITING and rec.blocks is None:
            rec.blocks = f
            if rec.checked:
                self._start(rec)

    def prefilled(self, f: c.Prefilled) -> None:
        log.warning("ignored Prefilled of %s: this instance decodes", f.tid)

    def end(self, f: c.End) -> None:
        """The request ended: tell prefill; end the receive once nothing can land."""
        ctx = self.ctx
        rec = ctx.table.get(f.tid)
        if rec is None or rec.told:
            return  # over, or failed here first (the step loop was told)
        rec.told, rec.failed = True, f.why
        if rec.phase is Phase.READING:  # the READ's end tells prefill (PullDone)
            rec.phase, rec.deadline = Phase.DRAINING, INF
        elif ctx.abort(rec, f.why):
            if rec.phase is Phase.REGISTERED:
                self._fence(rec)
            else:
                ctx.over(rec, c.Outcome.FAILED, f.why)

    # ---- what prefill says --------------------------------------------------------------
    def on_message(self, msg: m.Message, sender: str) -> None:
        ctx = self.ctx
        tid = getattr(msg, "transfer_id", "")
        rec = ctx.table.get(tid)
        if rec is not None and sender and sender != rec.peer:
            ctx.count("messages_bad")  # another instance's word on our transfer
            return
        if isinstance(msg, m.Abort):
            ctx.count("aborts_received")
        if rec is None:
            return
        if isinstance(msg, m.PushDone):
            rec.stamp("d_done")
            if rec.phase is Phase.FENCED:
                ctx.over(rec, c.Outcome.FAILED, rec.failed)
            elif rec.phase is Phase.REGISTERED:
                bad = self._push_digest_problem(rec, msg) if msg.ok else None
                if bad is not None:
                    ctx.over(rec, c.Outcome.FAILED, bad)
                elif msg.ok:
                    ctx.over(rec, c.Outcome.OK, first=msg)
                else:
                    ctx.over(rec, c.Outcome.FAILED, msg.error or "prefill reported a failure")
        elif isinstance(msg, m.AbortAck):
            if rec.phase is Phase.FENCED:
                ctx.over(rec, c.Outcome.FAILED, rec.failed)
        elif isinstance(msg, m.Abort):
            why = f"aborted by prefill: {msg.reason}"
            if rec.phase is Phase.READING:
                self._draining(rec, why)
            elif rec.phase is not Phase.DRAINING:  # prefill has nothing in flight
                ctx.over(rec, c.Outcome.FAILED, rec.failed or why)
        elif (isinstance(msg, m.PullClaimed) and rec.phase is Phase.CLAIMING
              and msg.claim == rec.claim):  # (else: the answer to an earlier claim)
            self._claimed(rec, msg)

    def on_heartbeat(self, hb: m.Heartbeat, sender: str) -> None:
        """Prefill lists the registrations it has not got: send ours again (a quarter
        lease apart at most), or give up."""
        ctx, now = self.ctx, self.ctx.clock()
        for tid in hb.awaiting_registration:
            rec = ctx.table.get(tid)
            if (rec is None or rec.phase is not Phase.REGISTERED or rec.peer != sender
                    or now - rec.sent_at < ctx.settings.resend_s):
                continue  # not ours, not its, or just sent: it may only be slow
            if rec.sends <= MAX_RESENDS:
                rec.sends, rec.sent_at = rec.sends + 1, now
                ctx.send(rec.peer, rec.reg)
                continue
            why = f"registration lost {rec.sends} times"
            ctx.abort(rec, why)
            ctx.failing(rec, why)
            self._fence(rec)

    def on_peer_ready(self, address: str, hello: m.Hello) -> None:
        for rec in self._of(address):
            if rec.phase is Phase.WAITING and not rec.checked:
                self._check(rec, hello)

    def on_peer_refused(self, address: str, reason: str) -> None:
        for rec in self._of(address):
            if rec.phase is Phase.READING:
                self._draining(rec, reason)
            elif rec.phase is not Phase.DRAINING:
                self.ctx.over(rec, c.Outcome.FAILED, rec.failed or reason)

    def on_peer_dropped(self, address: str) -> None:
        """Our connection to prefill dropped: its process ended (or it went silent past
        the ZMTP heartbeats): nothing more of it lands in fenced blocks."""
        fenced = [rec for rec in self._of(address) if rec.phase is Phase.FENCED]
        for rec in fenced:
            self._release(rec, "peer_gone")
        if fenced:  # what is still queued for it must not reach it should it come back
            self.ctx.channel.forget(address)

    # ---- timers and posts ---------------------------------------------------------------
    def deadline(self, rec: Transfer) -> None:
        ctx = self.ctx
        if rec.phase is Phase.FENCED:
            self._release(rec, "timeout")
            return
        if rec.phase is Phase.DRAINING:
            return  # our READ ends it
        ctx.count("leases_expired")
        why = "lease expired: prefill stopped answering"
        if not ctx.abort(rec, "lease expired"):
            return  # (the send found the peer refused: ended by that)
        if rec.phase is Phase.REGISTERED:  # its WRITEs may still land
            ctx.failing(rec, why)
            self._fence(rec)
        elif rec.phase is Phase.READING:
            self._draining(rec, why)
        else:  # WAITING, CLAIMING: nothing was sent that could land
            peer = ctx.peers.get(rec.peer)
            if peer is not None and not peer.ready and peer.sent_hello and not peer.refused:
                log.error("transfer %s: no answer to the side-channel handshake from %s "
                          "(unreachable, not a kvpush instance, or it refuses our "
                          "messages: a different side-channel secret?)", rec.tid, rec.peer)
            ctx.over(rec, c.Outcome.FAILED, why)

    def resend(self, rec: Transfer) -> None:
        ctx = self.ctx
        if rec.phase is Phase.FENCED:  # the last Abort may have been lost: again
            ctx.table.resend(rec, ctx.settings.lease_s)
            if ctx.peers.ready_peer(rec.peer) is not None:
                ctx.send(rec.peer, m.Abort(rec.tid, "lease expired"))
        elif rec.phase is Phase.CLAIMING:
            if rec.sends <= MAX_RESENDS:
                self._claim(rec)
            elif ctx.abort(rec, "claim unanswered"):
                ctx.over(rec, c.Outcome.FAILED, f"prefill never answered the lend's claim "
                                                f"(sent {rec.sends} times)")

    def landed(self, rec: Transfer, ok: bool) -> None:
        """Our READ ended: prefill is told (PullDone), then the step loop."""
        rec.stamp("d_read_done")
        self.ctx.send(rec.peer, m.PullDone(rec.tid, ok=ok))
        bad = self._pull_digest_problem(rec) if rec.phase is Phase.READING and ok else None
        if bad is not None:
            self.ctx.over(rec, c.Outcome.FAILED, bad)
        elif rec.phase is Phase.READING and ok:
            self.ctx.over(rec, c.Outcome.OK)
        else:
            self.ctx.over(rec, c.Outcome.FAILED, rec.failed or "READ failed")

    # ---- steps ----------------------------------------------------------------------------
    def _of(self, address: str) -> list[Transfer]:
        return [rec for rec in self.ctx.table if rec.peer == address]

    def _check(self, rec: Transfer, hello: m.Hello) -> None:
        """The request's params against the prefill instance that answered."""
        if rec.peer_engine and hello.engine_id != rec.peer_engine:
            problem = (f"the instance at {rec.peer} is engine {hello.engine_id!r}, not "
                       f"remote_engine_id {rec.peer_engine!r}")
        elif hello.role != "prefill":
            problem = f"the instance at {rec.peer} is a {hello.role} instance, not prefill"
        else:
            problem = block_ids_problem(rec.lent_blocks, hello.layout.num_blocks,
                                        "bad remote_block_ids")
        if problem is not None:
            self.ctx.over(rec, c.Outcome.REJECTED, f"kv_transfer_params: {problem}")
            return
        rec.checked = True
        if rec.blocks is not None:
            self._start(rec)

    def _start(self, rec: Transfer) -> None:
        """Blocks allocated and prefill checked: register, or claim the lend."""
        ctx, b = self.ctx, rec.blocks
        if ctx.mode == "push":
            rec.stamp("d_registered")
            rec.reg = m.PushRegister(rec.tid, ctx.hello.engine_id, ctx.hello.address,
                                     list(b.blocks), b.first_block, rec.num_prompt_tokens,
                                     b.full_hit, list(rec.prompt_hashes))
            ctx.send(rec.peer, rec.reg)
            if b.full_hit:  # prefill computes and sends nothing
                ctx.over(rec, c.Outcome.OK, counted=False)
                return
            rec.phase, rec.sends, rec.sent_at = Phase.REGISTERED, 1, ctx.clock()
        elif b.full_hit:  # pull, nothing to read: the lend can go
            ctx.send(rec.peer, m.PullDone(rec.tid))
            ctx.over(rec, c.Outcome.OK, counted=False)
        elif (late := lend_ended(rec.lend_expires_ms)) is not None:
            ctx.over(rec, c.Outcome.FAILED, late)  # never claimed, never READ
        else:
            rec.phase, rec.claim = Phase.CLAIMING, secrets.randbits(63) or 1
            self._claim(rec)

    def _claim(self, rec: Transfer) -> None:
        rec.sends += 1
        self.ctx.table.resend(rec, self.ctx.settings.resend_s)
        self.ctx.send(rec.peer, m.PullClaim(rec.tid, rec.claim))

    def _claimed(self, rec: Transfer, msg: m.PullClaimed) -> None:
        """Prefill's answer to the lend's claim: READ, or give up."""
        ctx = self.ctx
        if not msg.ok:
            ctx.over(rec, c.Outcome.FAILED, "prefill refused the READ: "
                     + (msg.error or "the lend has ended"))
            return
        rec.phase, rec.resend_at = Phase.READING, INF
        b, last = rec.blocks, self._read_end(rec)
        rec.peer_digest, rec.peer_digest_alg = msg.kv_digest, msg.kv_digest_alg
        rec.stamp("d_read_post")
        error = ctx.post("READ", rec, b.blocks[b.first_block:last],
                         rec.lent_blocks[b.first_block:last], range(ctx.hello.layout.num_layers))
        if error is not None:
            ctx.send(rec.peer, m.PullDone(rec.tid, ok=False))
            ctx.over(rec, c.Outcome.FAILED, error)

    def _push_digest_problem(self, rec: Transfer, done: m.PushDone) -> str | None:
        """--kv-digest: prefill's digests against what our registered blocks hold."""
        if self.ctx.digests is None:
            return None
        first = rec.reg.skip_blocks
        want = done.kv_digest if done.kv_digest_first == first else None
        return self.ctx.digest_problem(rec, want, done.kv_digest is not None,
                                       done.kv_digest_alg, rec.reg.block_ids[first:], first)

    def _pull_digest_problem(self, rec: Transfer) -> str | None:
        """--kv-digest: the lend's digests against the blocks our READ filled."""
        if self.ctx.digests is None:
            return None
        b = rec.blocks
        first, last = b.first_block, self._read_end(rec)
        lent = rec.peer_digest
        want = lent[first:last] if lent is not None and len(lent) == len(
            rec.lent_blocks) else None
        return self.ctx.digest_problem(rec, want, lent is not None, rec.peer_digest_alg,
                                       b.blocks[first:last], first)

    def _read_end(self, rec: Transfer) -> int:
        """Pull: the prompt blocks our READ fills end here (the last token is
        recomputed)."""
        return -(-(rec.num_prompt_tokens - 1) // self.ctx.settings.block_size)

    def _draining(self, rec: Transfer, why: str) -> None:
        """Our READ still runs: the request fails now, the blocks wait for its end."""
        rec.phase, rec.deadline = Phase.DRAINING, INF
        self.ctx.failing(rec, why)

    def _fence(self, rec: Transfer) -> None:
        """Wait for prefill's word: its lease no longer ends it (it may be frozen)."""
        ctx = self.ctx
        rec.phase = Phase.FENCED
        ctx.count("fences")
        if ctx.channel.peer_gone(rec.peer):  # prefill's process has ended already
            self._release(rec, "peer_gone")
            ctx.channel.forget(rec.peer)
            return
        ctx.table.lease(rec, ctx.settings.fence_s)
        ctx.table.resend(rec, ctx.settings.lease_s)

    def _release(self, rec: Transfer, why: str) -> None:
        ctx = self.ctx
        if why == "timeout":
            ctx.count("fence_timeouts")
            log.warning("transfer %s: prefill %s neither answered nor dropped its connection "
                        "within --fence-timeout (%s s): its fenced blocks go back to the pool",
                        rec.tid, rec.peer_engine or rec.peer, ctx.settings.fence_s)
        else:
            ctx.count("fences_peer_gone")
            log.info("transfer %s: prefill %s is gone: its fenced blocks are freed", rec.tid,
                     rec.peer)
        ctx.over(rec, c.Outcome.FAILED, rec.failed or f"fence released: {why}")
