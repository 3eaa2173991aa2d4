"""DecodeReceiver: the decode side of KV transfer, owned by KVConnector (shared state in
context.py). It owns the blocks of the transfers into this instance; the transfers
themselves are the transfer thread's (receives.py): the handshake with prefill and the
check of the request's params against its Hello, the lease, the registration (push),
the lend's claim and the READ (pull), the fence, prefill's answers.

A ``DecodeRecv`` per request, stated to the transfer thread once per fact: the leg was
added (``ReceiveAdded``); blocks are allocated when the scheduler can (prefix cache
first: ``BlocksAllocated``, with the registration in push mode, the READ's blocks in
pull mode); the request ended (``ReceiveEnded``). Back comes one ``ReceiveOver`` per
receive: the KV is in (the request joins the running batch, with token #1 from
prefill in push mode, recomputing the last prompt token in pull mode), or it will not
come (the request fails or is prefilled here: ``--kv-load-failure-policy``).

A request that ends while KV may still land in its blocks (its own end, or the
transfer thread's ``ReceiveFailing``: prefill silent past its lease, the registration
lost) leaves its blocks *fenced* (``QUARANTINED``, ``held``) out of the pool until the
``ReceiveOver`` that says nothing more lands. A receive the step loop is done with
before that (no blocks yet, a full prefix hit, nothing to read) waits for its
``ReceiveOver`` as ``ENDED``, holding nothing: its transfer id stays taken, so that a
leg reusing it never gets the last one's ``ReceiveOver``.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque

from kvpush.engine.outputs import RequestError
from kvpush.kv_cache.block_pool import hash_prompt_chain
from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.step_loop.context import TransferContext
from kvpush.kv_transfer.step_loop.state import (
    DecodeRecv,
    KVTransferParams,
    RecvState,
    TransferRecord,
)
from kvpush.kv_transfer.wire import messages as m
from kvpush.sampling_params import MAX_TOP_LOGPROBS, SampledToken
from kvpush.scheduler.request import Request

log = logging.getLogger("kvpush.kv_transfer.step_loop.connector")


def lend_ended(recv: DecodeRecv) -> str | None:
    """Pull: why prefill's lend is over by its signed end (lend_claims.py), or None."""
    if recv.lend_expires_ms is None:
        return None
    late_s = time.time() - recv.lend_expires_ms / 1000
    if late_s < 0:
        return None
    return (f"prefill's lend of this KV ended {late_s:.1f} s ago (the decode leg came too "
            "late): its blocks may hold another request's KV now")


class DecodeReceiver:
    def __init__(self, ctx: TransferContext) -> None:
        self.ctx = ctx
        self.recvs: dict[str, DecodeRecv] = {}  # tid -> transfer into our blocks
        self.pending: deque[str] = deque()  # tids waiting for blocks
        self._stalled = False

    def has_pending_work(self) -> bool:
        """Whether before_schedule() could make progress now (no spinning: after a pass
        that could not, this stays False until an event or a finish changes things)."""
        return bool(self.pending) and not self._stalled

    def unstall(self) -> None:
        """Something changed (an event, a finish): blocks may be had now."""
        self._stalled = False

    # ---- requests ---------------------------------------------------------------------
    def add(self, req: Request, p: KVTransferParams, tid: str) -> None:
        """A decode leg whose KV comes from prefill (push: registered; pull: READ)."""
        ctx = self.ctx
        if ctx.mode == "pull":
            if p.remote_block_ids is None:
                raise RequestError("pull needs kv_transfer_params.remote_block_ids",
                                   "kv_transfer_params")
            tid = p.transfer_id or p.remote_request_id or tid
            n_needed = -(-(req.num_prompt_tokens - 1) // ctx.block_size)
            if len(p.remote_block_ids) < n_needed:
                raise RequestError(
                    f"kv_transfer_params.remote_block_ids has {len(p.remote_block_ids)}"
                    f" blocks; the prompt needs {n_needed}", "kv_transfer_params")
        if tid in self.recvs:
            raise RequestError(f"transfer id {tid!r} is already in use", "kv_transfer_params")
        remote_blocks = list(p.remote_block_ids or []) if ctx.mode == "pull" else []
        recv = DecodeRecv(tid, req.request_id, ctx.mode, p.remote_address,
                          p.remote_engine_id, remote_blocks,
                          lend_expires_ms=p.lend_expires_ms if ctx.mode == "pull" else None)
        self.recvs[tid] = recv
        ctx.by_request[req.request_id] = tid
        ctx.timeline.begin(tid, "d_added")
        ctx.timeline.await_first(req.request_id, tid)
        ctx.scheduler.add_remote_request(req)
        self.pending.append(tid)
        # the transfer thread handshakes with prefill and checks the params against it
        ctx.submit(c.ReceiveAdded(tid, recv.address, recv.remote_engine_id, remote_blocks))

    def finish(self, req: Request, tid: str, ok: bool, error: str | None) -> bool:
        """The decode leg ends; True: its blocks stay here, fenced until ReceiveOver."""
        recv = self.recvs.get(tid)
        if recv is None or recv.state in (RecvState.QUARANTINED, RecvState.ENDED):
            return False
        self.ctx.submit(c.ReceiveEnded(tid, error or "aborted"))
        if recv.state is RecvState.PENDING_BLOCKS:
            self._end_recv(recv, ok=ok, over=False)
            return False
        # KV may be landing in its blocks: hold them until the transfer thread says not
        recv.state = RecvState.QUARANTINED
        recv.held = list(req.block_ids)
        return True

    def on_worker_died(self, why: str, transport_closed: bool) -> bool:
        """The transfer thread died (thread_death.py): every receive fails now. Its
        blocks go back at once unless KV may still land in them: a push's (prefill
        WRITEs one-sidedly) or, if the transport did not close cleanly, a posted READ's;
        those stay fenced until ``release_dead_hold``. True: blocks are held."""
        self.pending.clear()
        for recv in list(self.recvs.values()):
            may_land = recv.mode == "push" or not transport_closed
            if recv.state is RecvState.ENDED:  # no ReceiveOver will come
                self.recvs.pop(recv.tid, None)
            elif recv.state is RecvState.QUARANTINED:
                if not may_land:  # our READ ended with the transport
                    self._end_recv(recv, ok=False)
            elif recv.state is RecvState.AWAITING_KV and may_land:
                self._recv_failing(recv, why)
            else:
                self._recv_failed(recv, why)
        return bool(self.recvs)

    def release_dead_hold(self) -> None:
        """After the death, once the fence timeout has passed: free the fenced blocks."""
        for recv in list(self.recvs.values()):
            if recv.state is RecvState.QUARANTINED:
                log.warning("transfer %s: %d blocks fenced when the transfer thread died "
                            "go back to the pool", recv.tid, len(recv.held))
                self._end_recv(recv, ok=False)

    # ---- blocks, then the transfer ------------------------------------------------------
    def before_schedule(self) -> None:
        """Give pending receives blocks; the transfer thread registers them (push) or
        READs into them (pull) once prefill has answered its handshake."""
        while self.pending:
            tid = self.pending[0]
            recv = self.recvs.get(tid)
            if recv is None or recv.state is not RecvState.PENDING_BLOCKS:
                self.pending.popleft()
                continue
            late = lend_ended(recv)
            if late:  # never claimed, never READ: recompute or fail (the policy)
                self.pending.popleft()
                self.ctx.submit(c.ReceiveEnded(tid, late))
                self._recv_failed(recv, late, over=False)
                continue
            req = self.ctx.scheduler.requests[recv.request_id]
            if not self.ctx.scheduler.allocate_remote(req):
                break
            self.pending.popleft()
            self._allocated(recv, req)
        self._stalled = bool(self.pending)

    def _allocated(self, recv: DecodeRecv, req: Request) -> None:
        bs = self.ctx.block_size
        n = req.num_prompt_tokens
        hit = req.num_computed_tokens
        skip = hit // bs
        if recv.mode == "push":
            # decode holds every full block prefill could send: compute the tail here
            # only when configured to (else prefill writes just the tail block)
            full_hit = (self.ctx.cfg.prefix_hit_tail == "decode" and skip > 0
                        and skip == (n - 1) // bs)
            self.ctx.submit(c.BlocksAllocated(recv.tid, register=m.PushRegister(
                recv.tid, self.ctx.engine_id, self.ctx.address, list(req.block_ids), skip, n,
                full_hit, hash_prompt_chain(req.prompt_token_ids, bs, req.block_hashes,
                                            req.params.cache_salt))))
            if full_hit:  # everything prefill could send is here already: compute the rest
                self._end_recv(recv, ok=True, over=False)
                self.ctx.scheduler.remote_kv_arrived(req.request_id, hit, None)
                return
            recv.state = RecvState.AWAITING_KV
            return
        # pull: READ prefill's blocks for tokens [hit, n - 1); the last token is recomputed
        last = -(-(n - 1) // bs)
        if skip >= last:  # nothing to read: prefill is told the lend can go
            self.ctx.submit(c.BlocksAllocated(recv.tid))
            self._end_recv(recv, ok=True, over=False)
            self.ctx.scheduler.remote_kv_arrived(req.request_id, n - 1, None)
            return
        recv.state = RecvState.AWAITING_KV
        self.ctx.submit(c.BlocksAllocated(recv.tid, local_blocks=req.block_ids[skip:last],
                                          remote_blocks=recv.remote_block_ids[skip:last]))

    def _end_recv(self, recv: DecodeRecv, ok: bool, over: bool = True) -> None:
        """The step loop is done with ``recv``: its held blocks go back. ``over``: the
        transfer thread is done too (its ReceiveOver came, or it died); else the
        receive waits for that as ``ENDED``."""
        if over:
            self.recvs.pop(recv.tid, None)
        else:
            recv.state = RecvState.ENDED
        self.ctx.by_request.pop(recv.request_id, None)
        if recv.held:
            self.ctx.scheduler.release_blocks(recv.held)
            recv.held = []
        if not ok:
            self.ctx.counters["transfers_failed"] += 1

    def _fail_message(self, recv: DecodeRecv, why: str) -> str:
        source = recv.remote_engine_id or recv.address
        msg = f"KV transfer {recv.tid} from prefill {source} failed: {why}"
        log.warning(msg)
        self.ctx.record(TransferRecord(recv.tid, "decode", recv.mode, False, error=why))
        return msg

    def _recv_failed(self, recv: DecodeRecv, why: str, client_error: bool = False,
                     over: bool = True) -> None:
        """Remote KV will not come: fail the request or prefill it here (policy).
        ``client_error``: the request's own kv_transfer_params are wrong: it is refused
        as a bad request (HTTP 400, nothing has been sent yet) whatever the policy."""
        msg = self._fail_message(recv, why)
        self._end_recv(recv, ok=False, over=over)
        if recv.request_id not in self.ctx.scheduler.requests:
            return
        if client_error:
            self.ctx.actions.append(c.RejectRequest(recv.request_id, msg))
        else:
            self._fail_or_recompute(recv, msg)

    def _recv_failing(self, recv: DecodeRecv, why: str) -> None:
        """``_recv_failed`` for a receive whose KV may still land: the request fails
        (or recomputes, in fresh blocks) now, but its blocks stay fenced out of the pool
        until ``ReceiveOver`` (or, after a death, the dead hold), so that KV that lands
        late, from a prefill that was frozen and not dead, lands in no one else's
        blocks."""
        msg = self._fail_message(recv, why)
        req = self.ctx.scheduler.requests.get(recv.request_id)
        if req is not None and recv.state is RecvState.AWAITING_KV:
            recv.held = self.ctx.scheduler.detach_blocks(req)
        recv.state = RecvState.QUARANTINED
        self.ctx.by_request.pop(recv.request_id, None)
        if req is not None:
            self._fail_or_recompute(recv, msg)

    def _fail_or_recompute(self, recv: DecodeRecv, msg: str) -> None:
        """The request's remote KV will not come: --kv-load-failure-policy decides."""
        if self.ctx.cfg.load_failure_policy == "recompute":
            self.ctx.scheduler.remote_kv_failed(recv.request_id)
        else:
            self.ctx.actions.append(c.FailRequest(recv.request_id, msg))

    @property
    def fenced_blocks(self) -> int:
        """Blocks held out of the pool for transfers that may still land in them."""
        return sum(len(recv.held) for recv in list(self.recvs.values()))

    # ---- the transfer thread's word ------------------------------------------------------
    def on_failing(self, tid: str, why: str) -> None:
        recv = self.recvs.get(tid)
        if recv is not None and recv.state in (RecvState.PENDING_BLOCKS,
                                               RecvState.AWAITING_KV):
            self._recv_failing(recv, why)

    def on_over(self, ev: c.ReceiveOver) -> None:
        """Nothing of prefill's lands in the receive's blocks any more."""
        recv = self.recvs.get(ev.tid)
        if recv is None:
            return
        if recv.state is RecvState.ENDED:  # (the step loop was done with it)
            self.recvs.pop(ev.tid)
        elif recv.state is RecvState.QUARANTINED:  # the request ended already
            self._end_recv(recv, ok=False)
        elif not ev.ok:
            self._recv_failed(recv, ev.why or "the transfer failed", ev.client_error)
        elif recv.mode == "pull":
            req = self.ctx.scheduler.requests[recv.request_id]
            self._kv_arrived(recv, req.num_prompt_tokens - 1, None, TransferRecord(
                ev.tid, "decode", "pull", True, ev.num_bytes, ev.num_descriptors, ev.post_s))
        else:
            done = ev.done
            first = self._first_token(done)
            if first is None:
                self._recv_failed(recv, f"prefill sent an invalid first token "
                                        f"{done.first_token} (logprob {done.first_logprob}, "
                                        f"top {done.first_top_logprobs})")
                return
            req = self.ctx.scheduler.requests.get(recv.request_id)
            self._kv_arrived(recv, req.num_prompt_tokens, first, TransferRecord(
                ev.tid, "decode", "push", True, done.num_bytes, done.num_descriptors))

    def _kv_arrived(self, recv: DecodeRecv, num_computed: int,
                    first: SampledToken | None, record: TransferRecord) -> None:
        self._end_recv(recv, ok=True)
        self.ctx.counters["transfers_ok"] += 1
        record.transfer_s = time.perf_counter() - recv.t_start
        self.ctx.record(record)
        if recv.request_id in self.ctx.scheduler.remote_waiting:
            self.ctx.scheduler.remote_kv_arrived(recv.request_id, num_computed, first)
            if first is not None:
                self.ctx.actions.append(c.EmitFirstToken(recv.request_id))

    def _first_token(self, done: m.PushDone) -> SampledToken | None:
        """Token #1 as prefill sent it, None if any part of it is out of range."""
        def valid(token: int, lp: float | None) -> bool:
            return 0 <= token < self.ctx.vocab_size and (
                lp is None or (math.isfinite(lp) and lp <= 0))

        top = done.first_top_logprobs
        if not valid(done.first_token, done.first_logprob) or top is not None and (
                len(top) > MAX_TOP_LOGPROBS or not all(valid(t, lp) for t, lp in top)):
            return None
        return SampledToken(done.first_token, done.first_logprob,
                            tuple((int(t), float(lp)) for t, lp in top)
                            if top is not None else None)
