"""PushPrefill: the transfer thread's role on a push prefill instance.

Each transfer starts with the step loop's ``Begin`` (the prompt a registration must
match) or with decode's ``PushRegister`` (EARLY: the leg has not come yet; a fixed
deadline). Blocks stated computed before the registration are kept and written the
moment it lands, mid-step included; after it, as they are stated. ``Prefilled`` hands
the transfer over (DRAINING): once every WRITE has landed decode gets ``PushDone`` with
token #1 and the step loop ``Over``. A registration is checked against the sender's
Hello and the prompt before anything is written; a bad one gets ``PushDone(ok=False)``.
Whatever ends a transfer early (decode's Abort, a lease, a bad registration, a full
hit, the step loop's End) ends it here; with WRITEs in flight the step loop hears
``Failing`` first and ``Over`` once they drained. Decode's ``Abort`` is answered
``AbortAck`` once none of our WRITEs for it is in flight, for any id.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.digest import MISSING
from kvpush.kv_transfer.params import block_ids_problem, chain_problem
from kvpush.kv_transfer.transfer_thread.context import RoleBase
from kvpush.kv_transfer.transfer_thread.table import Phase, Transfer
from kvpush.kv_transfer.wire import messages as m

log = logging.getLogger("kvpush.kv_transfer.transfer_thread.worker")

FULL_HIT = "decode has the whole prompt cached"


def registration_problem(reg: m.PushRegister, num_blocks: int, block_size: int,
                         own_prompt_tokens: int,
                         own_hashes: Sequence[bytes]) -> str | None:
    """Why prefill must not act on decode's registration (``num_blocks``: decode's
    region as its Hello announced it), or None."""
    problem = block_ids_problem(reg.block_ids, num_blocks, "registration")
    if problem:
        return problem
    if not 0 <= reg.skip_blocks <= len(reg.block_ids):
        return f"registration skips {reg.skip_blocks} of its {len(reg.block_ids)} blocks"
    if reg.num_prompt_tokens != own_prompt_tokens:
        return (f"decode's prompt has {reg.num_prompt_tokens} tokens, prefill's "
                f"{own_prompt_tokens}: the two did not tokenize the same prompt")
    needed = -(-reg.num_prompt_tokens // block_size)
    if not reg.full_hit and len(reg.block_ids) < needed:
        return (f"registration has {len(reg.block_ids)} blocks; "
                f"{reg.num_prompt_tokens} prompt tokens need {needed}")
    return chain_problem(reg.prompt_hashes, own_hashes, "decode's", "prefill's")


class PushPrefill(RoleBase):
    # ---- the step loop's facts ------------------------------------------------------
    def begin(self, f: c.Begin) -> None:
        ctx, tid = self.ctx, f.tid
        rec = ctx.table.get(tid)
        if rec is not None and rec.phase is not Phase.EARLY:
            log.error("transfer %s: begun twice (ignored)", tid)
            return
        why = ctx.table.ended(tid)
        if rec is None and why is not None:  # ended before its leg came (a replay too)
            ctx.events.append(c.Over(tid, c.Outcome.REJECTED,
                                     f"transfer {tid} already ended: {why}"))
            return
        reg = rec.reg if rec is not None else None
        new = Transfer(tid, Phase.WAITING, num_prompt_tokens=f.num_prompt_tokens,
                       prompt_hashes=f.prompt_hashes)
        if rec is not None:
            new.stamps = rec.stamps
        ctx.table.add(new)  # any peer's heartbeat renews it until decode registers
        if reg is not None:
            self._registered(new, reg)

    def blocks(self, f: c.BlocksReady) -> None:
        rec = self.ctx.table.get(f.tid)
        if rec is None or rec.phase is Phase.EARLY or rec.cancelled:
            if rec is not None or self.ctx.table.ended(f.tid) is not None:
                self.ctx.count("writes_refused")  # decode may have freed those blocks
            return
        if rec.phase is Phase.SENDING:
            self._write(rec, f)
            return
        last = rec.computed[-1] if rec.computed else None
        if (last is not None and last.first_block == f.first_block
                and last.blocks == f.blocks and last.layers.stop == f.layers.start):
            rec.computed[-1] = c.BlocksReady(f.tid, f.first_block, f.blocks,
                                             range(last.layers.start, f.layers.stop), f.ready)
        else:
            rec.computed.append(f)

    def prefilled(self, f: c.Prefilled) -> None:
        rec = self.ctx.table.get(f.tid)
        if rec is None or rec.phase not in (Phase.WAITING, Phase.SENDING):
            return  # ended already: the step loop has (or will have) its Over
        rec.done = f.done
        if rec.phase is Phase.SENDING:
            self._hand_over(rec)

    def end(self, f: c.End) -> None:
        """The leg is over on the step loop (or the router gave up). A transfer handed
        over is decode's to end (it waits for this KV); any other ends now."""
        ctx = self.ctx
        rec = ctx.table.get(f.tid)
        if rec is None:
            if ctx.table.ended(f.tid) is None:
                ctx.table.remember(f.tid, f.why)  # a later leg or registration is told
        elif rec.phase is Phase.EARLY:
            ctx.abort(rec, f.why)
            self._drop(rec, f.why)
        elif rec.phase is not Phase.DRAINING:
            rec.told = True
            self._end(rec, f.why)

    # ---- decode's messages ------------------------------------------------------------
    def on_message(self, msg: m.Message, sender: str) -> None:
        if isinstance(msg, m.PushRegister):
            self._on_register(msg)
        elif isinstance(msg, m.Abort):
            self._on_abort(msg, sender)
        else:
            log.warning("ignored a %s from %s: this instance sends KV by push",
                        type(msg).__name__, sender)

    def _on_register(self, reg: m.PushRegister) -> None:
        ctx, tid = self.ctx, reg.transfer_id
        rec = ctx.table.get(tid)
        if rec is None:
            why = ctx.table.ended(tid)
            if why is not None:  # prefill already gave up on it: tell decode at once
                ctx.send(reg.address, m.PushDone(tid, ok=False, error=why))
                return
            # the leg should come about when decode's did: a fixed deadline
            rec = ctx.table.add(Transfer(tid, Phase.EARLY, peer=reg.address, reg=reg))
            rec.stamp("p_reg")
            return
        rec.stamp("p_reg")
        ctx.table.renew(tid, reg.address)
        if rec.phase is Phase.WAITING:
            self._registered(rec, reg)  # (sent again, or while WRITEs drain: ignored)

    def _on_abort(self, ab: m.Abort, sender: str) -> None:
        """Decode gave up: no more WRITEs; AbortAck once those in flight drained."""
        ctx, tid = self.ctx, ab.transfer_id
        ctx.count("aborts_received")
        why = f"aborted by decode: {ab.reason}"
        rec = ctx.table.get(tid)
        if rec is None:  # before its leg (a later one is refused), or over already
            if ctx.table.ended(tid) is None:
                ctx.table.remember(tid, why)
            ctx.send(sender, m.AbortAck(tid))
        elif rec.phase is Phase.EARLY:
            ctx.send(sender, m.AbortAck(tid))
            self._drop(rec, why)
        elif not rec.handles:
            ctx.send(sender, m.AbortAck(tid))
            ctx.over(rec, c.Outcome.FAILED, why)
        else:
            if rec.phase is not Phase.DRAINING:
                ctx.failing(rec, why)
            rec.phase, rec.cancelled, rec.abort_ack = Phase.DRAINING, True, True
            rec.failed = rec.failed or why

    # ---- timers ----------------------------------------------------------------------
    def deadline(self, rec: Transfer) -> None:
        ctx = self.ctx
        ctx.count("leases_expired")
        if rec.phase is Phase.EARLY:  # decode waits for KV that will not come
            if ctx.peers.ready_peer(rec.peer) is not None:
                ctx.abort(rec, "lease expired")
            self._drop(rec, "lease expired: the request never reached prefill")
        elif rec.phase is Phase.DRAINING:  # its PushDone will say it failed
            rec.cancelled = True
            rec.failed = rec.failed or "lease expired: decode stopped answering"
        else:
            self._end(rec, "lease expired: decode stopped answering" if rec.reg
                      else "lease expired: decode never registered")

    def landed(self, rec: Transfer, ok: bool) -> None:
        """One of ``rec``'s WRITEs ended."""
        if not ok and not rec.failed:
            rec.failed = "WRITE failed to complete"
        if rec.phase is Phase.DRAINING and not rec.handles:
            self._finish(rec)

    # ---- inside -------------------------------------------------------------------------
    def _registered(self, rec: Transfer, reg: m.PushRegister) -> None:
        ctx = self.ctx
        peer = ctx.peers.ready_peer(reg.address)
        if peer is None:  # the Hello always precedes the registration on one socket
            self._end(rec, f"registration from unknown decode {reg.address}")
            return
        problem = registration_problem(reg, peer.hello.layout.num_blocks,
                                       ctx.settings.block_size, rec.num_prompt_tokens,
                                       rec.prompt_hashes)
        if problem:  # nothing is written: every block id and length is checked first
            log.warning("transfer %s: refused decode %s's registration: %s", rec.tid,
                        reg.address, problem)
            ctx.send(reg.address, m.PushDone(rec.tid, ok=False,
                                             error=f"invalid registration: {problem}"))
            self._end(rec, f"invalid registration: {problem}")
            return
        if reg.full_hit:  # decode computes the rest itself: nothing to send
            self._end(rec, FULL_HIT, c.Outcome.NOT_NEEDED)
            return
        rec.reg, rec.peer, rec.phase = reg, reg.address, Phase.SENDING
        ctx.table.lease(rec)
        if rec.computed:
            ctx.count("registrations_after_blocks")
        computed, rec.computed = rec.computed, []
        for f in computed:
            self._write(rec, f)
        if rec.done is not None:
            self._hand_over(rec)

    def _write(self, rec: Transfer, f: c.BlocksReady) -> None:
        """WRITE the stated blocks decode registered (past those it has cached) into
        its blocks, paired in order."""
        reg = rec.reg
        start = max(f.first_block, reg.skip_blocks)
        upto = min(f.first_block + len(f.blocks), len(reg.block_ids))
        if upto <= start or not f.layers or rec.failed:
            return
        ours = f.blocks[start - f.first_block:upto - f.first_block]
        error = self.ctx.post("WRITE", rec, ours, reg.block_ids[start:upto], f.layers,
                              f.ready)
        if error:
            rec.failed = error
        else:
            rec.stamp("p_last_post")
            if self.ctx.digests is not None:
                rec.sources.update(zip(range(start, upto), ours, strict=True))

    def _hand_over(self, rec: Transfer) -> None:
        rec.phase = Phase.DRAINING
        if not rec.handles:
            self._finish(rec)

    def _finish(self, rec: Transfer) -> None:
        """Every WRITE of ``rec`` has ended: tell decode, then the step loop."""
        ctx = self.ctx
        if rec.abort_ack:
            ctx.send(rec.peer, m.AbortAck(rec.tid))
        else:
            done = rec.done if rec.done is not None and not rec.failed else m.PushDone(
                rec.tid, ok=False, error=rec.failed or "prefill ended the transfer")
            done.num_descriptors, done.num_bytes = rec.num_descriptors, rec.num_bytes
            if done.ok and self.ctx.digests is not None:
                self._digest(rec, done)
            rec.stamp("p_done_sent")  # before: the peer may read it at once
            ctx.send(rec.peer, done)
        ctx.over(rec, c.Outcome.FAILED if rec.failed else c.Outcome.OK, rec.failed)

    def _digest(self, rec: Transfer, done: m.PushDone) -> None:
        """--kv-digest: the digest of each registered block from the first written
        (one never written gets ``MISSING``: decode's check fails on it)."""
        positions = range(rec.reg.skip_blocks, len(rec.reg.block_ids))
        wrote = [p for p in positions if p in rec.sources]
        got = dict(zip(wrote, self.ctx.digests.of([rec.sources[p] for p in wrote]),
                       strict=True))
        done.kv_digest = [got.get(p, MISSING) for p in positions]
        done.kv_digest_first = rec.reg.skip_blocks
        done.kv_digest_alg = self.ctx.digests.algorithm

    def _end(self, rec: Transfer, why: str,
             outcome: c.Outcome = c.Outcome.FAILED) -> None:
        """End ``rec`` before its hand-over: WRITEs in flight drain first (the step loop
        hears Failing now; decode gets PushDone(ok=False) then)."""
        ctx = self.ctx
        if rec.handles:
            ctx.failing(rec, why)
            rec.phase, rec.cancelled = Phase.DRAINING, True
            return
        if rec.phase is Phase.SENDING and ctx.peers.ready_peer(rec.peer) is not None:
            ctx.send(rec.peer, m.PushDone(rec.tid, ok=False, error=why))
        ctx.over(rec, outcome, why)

    def _drop(self, rec: Transfer, why: str) -> None:
        """Forget an early registration (no leg, nothing held)."""
        self.ctx.table.pop(rec.tid)
        self.ctx.table.remember(rec.tid, why)
