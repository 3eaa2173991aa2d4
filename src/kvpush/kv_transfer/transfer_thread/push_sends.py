"""PushSends: prefill's push transfers on the transfer thread, from the request's arrival
to the hand-over of their WRITEs (transfer thread of a push prefill instance).

The step loop states facts, once each; this object decides what they mean for the
transfer::

    PushAdded(tid, prompt)      the prefill leg is in the engine (its prompt's length and
                                hash chain: what a registration must match)
    BlocksComputed(tid, ...)    these prompt blocks hold KV for these layers now (from the
                                layer hook, one message per layer group; the last blocks,
                                partial one included, when prefill ends)
    PushPrefilled(tid, done)    prefill is over: send ``done`` (token #1) once all landed
    PushEnded(tid, why)         the step loop ended the leg (aborted, failed; or the
                                router gave up on the transfer)

and decode's ``PushRegister`` arrives here too, on the side channel. Each transfer::

    (registration first) EARLY ──PushAdded──┐
    AWAITING_REGISTRATION ──PushRegister────┴──▶ SENDING ──PushPrefilled──▶ handed to
      blocks computed are kept, to WRITE          blocks are written as     TransfersInFlight
      the moment the registration lands           they are computed         (drain, PushDone)

Whatever ends a transfer, the step loop hears it exactly once, as ``WritesDone``
(TransfersInFlight's when WRITEs were posted: once they drained), and frees the blocks
then; ``prefill_not_needed`` says decode has the whole prompt cached. A transfer ended
here before its hand-over with WRITEs still draining is told at once as well
(``PushFailing``), so that its prefill stops while they drain. A registration is
checked here, where the peers' Hellos are (``registration_problem``); a bad one gets
``PushDone(ok=False)`` and nothing is written. Ids of ended transfers are remembered
(boundedly): a registration for one is answered ``PushDone(ok=False)`` at once.
"""

from __future__ import annotations

import enum
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.step_loop.state import block_ids_problem, chain_problem
from kvpush.kv_transfer.transfer_thread.inflight import PostWrite, TransfersInFlight
from kvpush.kv_transfer.transfer_thread.peers import PeerTable
from kvpush.kv_transfer.wire import messages as m

log = logging.getLogger(__name__)

#: ended transfer ids remembered, to answer a late registration at once
MAX_ENDED_REMEMBERED = 4096

FULL_HIT = "decode has the whole prompt cached"


def registration_problem(reg: m.PushRegister, num_blocks: int, block_size: int,
                         own_prompt_tokens: int | None,
                         own_hashes: Sequence[bytes] | None = None) -> str | None:
    """Why prefill must not act on decode's registration, or None.

    ``num_blocks``: decode's region as its Hello announced it; ``own_prompt_tokens``:
    the prompt length prefill has for the request (None while unknown); ``own_hashes``:
    the hash chain of prefill's prompt (``hash_prompt_chain``), compared with the one
    decode registered so that prefill writes KV only into blocks meant for its prompt.
    """
    problem = block_ids_problem(reg.block_ids, num_blocks, "registration")
    if problem:
        return problem
    if not 0 <= reg.skip_blocks <= len(reg.block_ids):
        return (f"registration skips {reg.skip_blocks} of its {len(reg.block_ids)} "
                "blocks")
    if reg.num_prompt_tokens < 1:
        return f"registration has num_prompt_tokens {reg.num_prompt_tokens}"
    if own_prompt_tokens is not None and reg.num_prompt_tokens != own_prompt_tokens:
        return (f"decode's prompt has {reg.num_prompt_tokens} tokens, prefill's "
                f"{own_prompt_tokens}: the two did not tokenize the same prompt")
    needed = -(-reg.num_prompt_tokens // block_size)
    if not reg.full_hit and len(reg.block_ids) < needed:
        return (f"registration has {len(reg.block_ids)} blocks; "
                f"{reg.num_prompt_tokens} prompt tokens need {needed}")
    if own_hashes is not None:
        return chain_problem(reg.prompt_hashes, own_hashes, "decode's", "prefill's")
    return None


class OutState(enum.Enum):
    EARLY = "early"  # a registration, no request yet (fixed deadline)
    AWAITING_REGISTRATION = "awaiting_registration"
    SENDING = "sending"


@dataclass
class Outgoing:
    """One push transfer of this prefill instance, until its WRITEs are handed over."""

    tid: str
    state: OutState
    num_prompt_tokens: int | None = None
    prompt_hashes: list[bytes] | None = None
    reg: m.PushRegister | None = None
    #: blocks computed before the registration: WRITten when it lands
    computed: list[c.BlocksComputed] = field(default_factory=list)
    done: m.PushDone | None = None  # prefill over: what decode gets once all landed


class PushSends:
    """The push transfers of one prefill instance (see the module docstring)."""

    def __init__(self, peers: PeerTable, inflight: TransfersInFlight,
                 send: Callable[[str, m.Message], None],
                 post_event: Callable[[c.TransferEvent], None],
                 track: Callable[[str, str | None, bool], None],
                 untrack: Callable[[str], None], block_size: int,
                 counters: dict[str, int]) -> None:
        self.peers, self.inflight, self.send, self.post_event = peers, inflight, send, post_event
        self.track, self.untrack = track, untrack
        self.block_size = block_size
        self.counters = counters
        counters.setdefault("registrations_after_blocks", 0)
        self.out: dict[str, Outgoing] = {}
        self.ended: OrderedDict[str, str] = OrderedDict()  # tid -> why
        #: transfers in SENDING (registered, prefill not over): the step loop reads it
        #: to know whether mid-step facts are worth a wake-up (TransferWorker.writes_wanted)
        self.sending = 0

    # ---- the step loop's facts ---------------------------------------------------------
    def added(self, cmd: c.PushAdded) -> None:
        tid = cmd.tid
        o = self.out.get(tid)
        if o is not None and o.state is not OutState.EARLY:  # (the step loop refuses
            log.error("transfer %s: added twice (ignored)", tid)  # a duplicate first)
            return
        why = self._ended_why(tid)
        if why is not None:  # ended here before its leg came (decode's abort, a lease)
            self.post_event(c.WritesDone(tid, f"transfer {tid} already ended: {why}"))
            return
        reg = o.reg if o is not None else None
        self.out[tid] = Outgoing(tid, OutState.AWAITING_REGISTRATION, cmd.num_prompt_tokens,
                                 list(cmd.prompt_hashes))
        if reg is None:
            self.track(tid, None, True)  # any peer's heartbeat renews it until D registers
        else:
            self._registered(self.out[tid], reg)

    def computed(self, cmd: c.BlocksComputed) -> None:
        o = self.out.get(cmd.tid)
        if o is None or o.state is OutState.EARLY:
            if cmd.tid in self.inflight.aborted:
                self.counters["writes_refused"] += 1
            return
        if o.state is OutState.SENDING:
            self._write(o, cmd)
            return
        last = o.computed[-1] if o.computed else None
        if (last is not None and last.first_block == cmd.first_block
                and last.local_blocks == cmd.local_blocks
                and last.layers.stop == cmd.layers.start):  # the next layer group
            o.computed[-1] = c.BlocksComputed(cmd.tid, cmd.first_block, cmd.local_blocks,
                                              range(last.layers.start, cmd.layers.stop),
                                              cmd.ready)
        else:
            o.computed.append(cmd)

    def prefilled(self, tid: str, done: m.PushDone) -> None:
        o = self.out.get(tid)
        if o is None or o.state is OutState.EARLY:
            return  # ended already: the step loop has (or will have) its WritesDone
        o.done = done
        if o.state is OutState.SENDING:
            self._hand_over(o)

    def ended_by_step_loop(self, tid: str, why: str) -> None:
        """PushEnded: the leg is over on the step loop (or the router gave up). A
        registered transfer whose prefill finished is decode's to end (it waits for
        this KV); any other ends now."""
        o = self.out.get(tid)
        if o is None:  # handed over (decode decides), over, or not come yet
            if tid not in self.inflight.writes and tid not in self.inflight.aborted:
                self._remember(tid, why)  # a later registration is told at once
            return
        if o.state is OutState.EARLY:
            self._abort(o.reg.address, tid, why)
            self._drop(o, why)
            return
        self._end(tid, o, why)

    # ---- decode's messages -------------------------------------------------------------
    def on_register(self, reg: m.PushRegister) -> None:
        tid = reg.transfer_id
        o = self.out.get(tid)
        if o is None and tid in self.inflight.writes:
            return  # (sent again) its WRITEs drain: decode gets PushDone / AbortAck then
        if o is None:
            why = self._ended_why(tid)
            if why is not None:  # prefill already gave up on it: tell decode at once
                self.send(reg.address, m.PushDone(tid, ok=False, error=why))
                return
            # the request has not arrived yet; it should come about when decode's did,
            # so this wait has a fixed deadline (decode's heartbeats do not extend it)
            self.out[tid] = Outgoing(tid, OutState.EARLY, reg=reg)
            self.track(tid, reg.address, False)
            return
        if o.reg is None:
            self._registered(o, reg)

    def on_abort(self, ab: m.Abort, sender: str) -> None:
        """Decode gave up on ``ab.transfer_id``: no more WRITEs; AbortAck once those in
        flight drained (at once when none are, or the id is unknown)."""
        tid = ab.transfer_id
        o = self._pop(tid)
        why = f"aborted by decode: {ab.reason}"
        if o is not None:
            self.untrack(tid)
            self._remember(tid, why)
            if o.state is OutState.EARLY:
                self.send(sender, m.AbortAck(tid))
                return
            if tid not in self.inflight.writes:
                self.send(sender, m.AbortAck(tid))
                self.inflight.remember_aborted(tid)
                self.post_event(c.WritesDone(tid, why))
                return
            self.post_event(c.PushFailing(tid, why))  # WRITEs drain first
        elif tid not in self.inflight.writes:  # before its leg (a later one is refused)
            self._remember(tid, why)
        self.inflight.writes_aborted(tid, sender)  # drains, AbortAck, WritesDone

    def lease_expired(self, tid: str) -> bool:
        """``tid``'s lease ran out (the worker popped it). True: a push transfer of
        ours, ended here (the step loop hears it as WritesDone)."""
        o = self.out.get(tid)
        if o is None:  # handed over: its WRITEs drain, and its PushDone says it failed
            return self.inflight.lease_expired(tid, "lease expired: decode stopped "
                                               "answering")
        if o.state is OutState.EARLY:  # decode waits for KV that will not come
            peer = self.peers.get(o.reg.address)
            if peer is not None and peer.ready:
                self._abort(o.reg.address, tid, "lease expired")
            self._drop(o, "lease expired: the request never reached prefill")
            return True
        why = ("lease expired: decode stopped answering" if o.reg is not None
               else "lease expired: decode never registered")
        self._end(tid, o, why)
        return True

    def abandon(self, tid: str, why: str) -> None:
        """Handling a fact about ``tid`` raised (a bug): end the transfer anyway, so
        that the step loop still gets its WritesDone and frees the blocks (a second one,
        for a transfer already over, finds nothing there). No PushFailing: the error
        may be the transport's, and the thread's death, if it follows, fails the leg."""
        o = self._pop(tid)
        if o is not None:
            self.untrack(tid)
        self._remember(tid, why)
        if tid in self.inflight.writes:
            self.inflight.end_writes(tid, why)  # WritesDone once they drained
            return
        self.inflight.remember_aborted(tid)
        self.post_event(c.WritesDone(tid, why))

    # ---- inside -------------------------------------------------------------------------
    def _abort(self, address: str, tid: str, why: str) -> None:
        self.counters["aborts_sent"] += 1
        self.send(address, m.Abort(tid, why))

    def _registered(self, o: Outgoing, reg: m.PushRegister) -> None:
        tid = o.tid
        peer = self.peers.get(reg.address)
        hello = peer.hello if peer is not None and peer.ready else None
        if hello is None:  # the Hello always precedes the registration on one socket
            self._end(tid, o, f"registration from unknown decode {reg.address}")
            return
        problem = registration_problem(reg, hello.num_blocks, self.block_size,
                                       o.num_prompt_tokens, o.prompt_hashes)
        if problem:  # nothing is written: every block id and length is checked first
            log.warning("transfer %s: refused decode %s's registration: %s", tid,
                        reg.address, problem)
            self.send(reg.address, m.PushDone(tid, ok=False,
                                              error=f"invalid registration: {problem}"))
            self._end(tid, o, f"invalid registration: {problem}")
            return
        if reg.full_hit:  # decode computes the rest itself: nothing to send
            self._end(tid, o, FULL_HIT, not_needed=True)
            return
        o.reg, o.state = reg, OutState.SENDING
        self.sending += 1
        self.track(tid, reg.address, True)
        if o.computed:
            self.counters["registrations_after_blocks"] += 1
        computed, o.computed = o.computed, []
        for cmd in computed:
            self._write(o, cmd)
        if o.done is not None:
            self._hand_over(o)

    def _write(self, o: Outgoing, cmd: c.BlocksComputed) -> None:
        """WRITE the computed blocks decode registered (past those it has cached) into
        its blocks, paired in order."""
        reg = o.reg
        start = max(cmd.first_block, reg.skip_blocks)
        upto = min(cmd.first_block + len(cmd.local_blocks), len(reg.block_ids))
        if upto <= start or not cmd.layers:
            return
        local = cmd.local_blocks[start - cmd.first_block:upto - cmd.first_block]
        self.inflight.post_write(PostWrite(o.tid, reg.address, local,
                                           reg.block_ids[start:upto], cmd.layers, cmd.ready))

    def _hand_over(self, o: Outgoing) -> None:
        """Prefill is over and decode registered: TransfersInFlight sends the PushDone
        once every WRITE landed, and tells the step loop (WritesDone)."""
        self._pop(o.tid)
        self.inflight.finalize(o.tid, o.reg.address, o.done)

    def _end(self, tid: str, o: Outgoing | None, why: str, not_needed: bool = False) -> None:
        """End a transfer before its hand-over: WRITEs in flight drain first (decode gets
        PushDone(ok=False) then); the step loop hears it as WritesDone."""
        if o is not None:
            self._pop(tid)
            self.untrack(tid)
        self._remember(tid, why)
        if tid in self.inflight.writes:  # the prefill stops now, its blocks wait
            self.post_event(c.PushFailing(tid, why))
            self.inflight.end_writes(tid, why)
            return
        if o is not None and o.state is OutState.SENDING:  # (nothing of ours in flight)
            peer = self.peers.get(o.reg.address)
            if peer is not None and peer.ready:
                self.send(o.reg.address, m.PushDone(tid, ok=False, error=why))
        self.inflight.remember_aborted(tid)
        self.post_event(c.WritesDone(tid, None if not_needed else why,
                                     prefill_not_needed=not_needed))

    def _drop(self, o: Outgoing, why: str) -> None:
        """Forget an early registration (no request, nothing held)."""
        self._pop(o.tid)
        self.untrack(o.tid)
        self._remember(o.tid, why)

    def _pop(self, tid: str) -> Outgoing | None:
        o = self.out.pop(tid, None)
        if o is not None and o.state is OutState.SENDING:
            self.sending -= 1
        return o

    def _ended_why(self, tid: str) -> str | None:
        """Why ``tid`` ended here, if it did: ended before its hand-over (``ended``), or
        its WRITEs over (``TransfersInFlight.aborted``: done, or aborted by decode)."""
        why = self.ended.get(tid)
        if why is None and tid in self.inflight.aborted:
            why = "this transfer already ended"
        return why

    def _remember(self, tid: str, why: str) -> None:
        self.ended[tid] = why
        self.ended.move_to_end(tid)
        while len(self.ended) > MAX_ENDED_REMEMBERED:
            self.ended.popitem(last=False)
