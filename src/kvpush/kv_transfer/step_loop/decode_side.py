"""DecodeReceiver: the decode side of KV transfer, owned by KVConnector (shared state in
context.py). It owns the transfers into this instance's blocks. Refusals are the
transfer thread's (peers.py: matched to the peer that sent them, they expire): each
``PeerRefused`` fails the transfers waiting on that peer, and a request for a peer still
refused gets its own ``PeerRefused`` at once.

A ``DecodeRecv`` per request: blocks are allocated when the scheduler can (prefix cache
first); push then registers them with prefill, pull has the transfer thread post the
READ.
When the KV is in, the request joins the running batch — with token #1 from prefill in
push mode, or recomputing the last prompt token in pull mode.

A request that ends while KV may still land in its blocks (our READ still posted;
prefill's WRITEs perhaps in flight or queued, prefill silent or told to stop) leaves its
blocks *fenced* (``QUARANTINED``, ``held``) out of the pool until the transfer is known
over: the READ's end (pull); prefill's answer, its connection dropping or the fence
timeout (push, see fences.py).
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
    block_ids_problem,
)
from kvpush.kv_transfer.transfer_thread.lend_claims import lend_ended
from kvpush.kv_transfer.wire import messages as m
from kvpush.sampling_params import MAX_TOP_LOGPROBS, SampledToken
from kvpush.scheduler.request import Request

log = logging.getLogger("kvpush.kv_transfer.step_loop.connector")


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
        address = p.remote_address
        if address in ctx.peers:  # known peer: check the params against it now (400)
            problem = self._peer_problem(address, p.remote_engine_id,
                                         p.remote_block_ids or [])
            if problem:
                raise RequestError(f"kv_transfer_params: {problem}", "kv_transfer_params")
        recv = DecodeRecv(tid, req.request_id, ctx.mode, address, p.remote_engine_id,
                          list(p.remote_block_ids or []),
                          lend_expires_ms=p.lend_expires_ms if ctx.mode == "pull" else None)
        self.recvs[tid] = recv
        ctx.by_request[req.request_id] = tid
        ctx.timeline.begin(tid, "d_added")
        ctx.timeline.await_first(req.request_id, tid)
        ctx.scheduler.add_remote_request(req)
        self.pending.append(tid)
        ctx.submit(c.EnsurePeer(address))
        ctx.submit(c.Track(tid, address))

    def finish(self, req: Request, tid: str, ok: bool, error: str | None) -> bool:
        """The decode leg ends; True: its blocks stay here, fenced."""
        ctx = self.ctx
        recv = self.recvs.get(tid)
        if recv is None or recv.state is RecvState.QUARANTINED:
            return False
        if ok or recv.state is RecvState.PENDING_BLOCKS:
            self._end_recv(recv, ok=ok, why=error)
            if not ok:
                ctx.submit(c.Send(recv.address, m.Abort(tid, error or "aborted")))
                ctx.counters["aborts_sent"] += 1
            return False
        # aborted while KV may be landing in its blocks: hold them until the peer is done
        recv.state = RecvState.QUARANTINED
        self._hold(recv, list(req.block_ids))
        if recv.mode == "push":
            ctx.submit(c.Send(recv.address, m.Abort(tid, error or "aborted")))
            ctx.counters["aborts_sent"] += 1
            self._fence(recv)
        return True

    def on_peer_refused(self, address: str, reason: str) -> None:
        for recv in [r for r in self.recvs.values() if r.address == address]:
            self._recv_gone(recv, reason)

    def on_abort(self, ab: m.Abort) -> None:
        recv = self.recvs.get(ab.transfer_id)
        if recv is not None:  # prefill gave up; nothing of its own is in flight any more
            self._recv_gone(recv, f"aborted by prefill: {ab.reason}")

    def on_lease_expired(self, tid: str) -> None:
        if tid in self.recvs:
            self._recv_gone(self.recvs[tid], "lease expired: prefill stopped answering",
                            silent=True)

    def on_worker_died(self, why: str, transport_closed: bool) -> bool:
        """The transfer thread died (thread_death.py): every receive fails now. Its
        blocks go back at once unless KV may still land in them: a push's (prefill
        WRITEs one-sidedly) or, if the transport did not close cleanly, a posted READ's;
        those stay fenced until ``release_dead_hold``. True: blocks are held."""
        self.pending.clear()
        for recv in list(self.recvs.values()):
            may_land = recv.mode == "push" or not transport_closed
            if recv.state is RecvState.QUARANTINED:
                if not may_land:  # our READ ended with the transport
                    self._end_recv(recv, ok=False)
            elif recv.state is RecvState.AWAITING_KV and may_land:
                self._recv_failed_fenced(recv, why)
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

    def _recv_gone(self, recv: DecodeRecv, why: str, silent: bool = False) -> None:
        """Prefill will send nothing more for ``recv``: end it. A READ of ours that may
        still land keeps the blocks fenced until it ends. ``silent``: prefill only
        stopped answering (lease), it has not said it is done: its push WRITEs may still
        land, so the blocks stay fenced too; otherwise a quarantined push is done."""
        if self._reading(recv) or (silent and recv.mode == "push" and recv.state in (
                RecvState.AWAITING_KV, RecvState.QUARANTINED)):
            if recv.state is not RecvState.QUARANTINED:
                self._recv_failed_fenced(recv, why)
        elif recv.state is RecvState.QUARANTINED:
            self._end_recv(recv, ok=False)
        else:
            self._recv_failed(recv, why)

    # ---- blocks, then the transfer ------------------------------------------------------
    def before_schedule(self) -> None:
        """Give pending decode-side transfers blocks, then register them (push) or have
        the transfer thread post their READ (pull)."""
        skipped: list[str] = []
        while self.pending:
            tid = self.pending[0]
            recv = self.recvs.get(tid)
            if recv is None:
                self.pending.popleft()
                continue
            if recv.address not in self.ctx.peers:
                skipped.append(self.pending.popleft())  # handshake still going
                continue
            problem = self._peer_problem(recv.address, recv.remote_engine_id,
                                         recv.remote_block_ids if recv.mode == "pull" else [])
            if problem:  # the request's kv_transfer_params do not fit: the client's mistake
                self.pending.popleft()
                self._recv_failed(recv, problem, client_error=True)
                continue
            late = lend_ended(recv)
            if late:  # never claimed, never READ: recompute or fail (the policy)
                self.pending.popleft()
                self._recv_failed(recv, late)
                continue
            req = self.ctx.scheduler.requests[recv.request_id]
            if not self.ctx.scheduler.allocate_remote(req):
                break
            self.pending.popleft()
            self._allocated(recv, req)
        self.pending.extendleft(reversed(skipped))
        self._stalled = bool(self.pending)

    def _peer_problem(self, address: str, engine_id: str, block_ids: list[int]) -> str | None:
        """Why the request's kv_transfer_params do not fit the prefill instance that
        answered at ``address`` (its engine id, role, region), or None."""
        peer = self.ctx.peers[address]
        if engine_id and peer.engine_id != engine_id:
            return (f"the instance at {address} is engine {peer.engine_id!r}, not "
                    f"remote_engine_id {engine_id!r}")
        if peer.role != "prefill":
            return f"the instance at {address} is a {peer.role} instance, not prefill"
        return block_ids_problem(block_ids, peer.num_blocks, "bad remote_block_ids")

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
            self.ctx.submit(c.Register(recv.tid, recv.address, m.PushRegister(
                recv.tid, self.ctx.engine_id, self.ctx.address, list(req.block_ids), skip, n,
                full_hit, hash_prompt_chain(req.prompt_token_ids, bs, req.block_hashes,
                                            req.params.cache_salt))))
            self.ctx.timeline.stamp(recv.tid, "d_registered")
            if full_hit:  # everything prefill could send is here already: compute the rest
                self._end_recv(recv, ok=True, why="full prefix hit on decode")
                self.ctx.scheduler.remote_kv_arrived(req.request_id, hit, None)
                return
            recv.state = RecvState.AWAITING_KV
            return
        # pull: READ prefill's blocks for tokens [hit, n - 1); the last token is recomputed
        last = -(-(n - 1) // bs)
        if skip >= last:
            self._end_recv(recv, ok=True, why="nothing to read")
            self.ctx.submit(c.Send(recv.address, m.PullDone(recv.tid)))
            self.ctx.scheduler.remote_kv_arrived(req.request_id, n - 1, None)
            return
        # posted by the transfer thread, which owns the transport (a failed post comes
        # back as ReadDone(ok=False)); the blocks count as read into until it ends
        recv.state = RecvState.AWAITING_KV
        # (prefill's block ids were checked against its Hello when the blocks were had:
        # _peer_problem; the transfer thread builds the descriptors)
        self.ctx.submit(c.PostRead(recv.tid, recv.address, req.block_ids[skip:last],
                                   recv.remote_block_ids[skip:last],
                                   range(self.ctx.layout.num_layers)))

    def _end_recv(self, recv: DecodeRecv, ok: bool, why: str | None = None,
                  untrack: bool = True) -> None:
        """``untrack=False``: prefill's answer ended it, and the transfer thread, which
        got that answer, has already dropped its lease and fence (worker.py)."""
        self.recvs.pop(recv.tid, None)
        self.ctx.by_request.pop(recv.request_id, None)
        if untrack:
            self.ctx.submit(c.Untrack(recv.tid))
        if recv.held:
            self.ctx.scheduler.release_blocks(recv.held)
            recv.held = []
        if not ok:
            self.ctx.counters["transfers_failed"] += 1

    def _recv_failed(self, recv: DecodeRecv, why: str, client_error: bool = False,
                     untrack: bool = True) -> None:
        """Remote KV will not come: fail the request or prefill it here (policy).
        ``client_error``: the request's own kv_transfer_params are wrong: it is refused
        as a bad request (HTTP 400, nothing has been sent yet) whatever the policy."""
        source = recv.remote_engine_id or recv.address
        msg = f"KV transfer {recv.tid} from prefill {source} failed: {why}"
        log.warning(msg)
        self._end_recv(recv, ok=False, untrack=untrack)
        self.ctx.record(TransferRecord(recv.tid, "decode", recv.mode, False, error=why))
        if recv.request_id not in self.ctx.scheduler.requests:
            return
        if client_error:
            self.ctx.actions.append(c.RejectRequest(recv.request_id, msg))
        elif self.ctx.cfg.load_failure_policy == "recompute":
            self.ctx.scheduler.remote_kv_failed(recv.request_id)
        else:
            self.ctx.actions.append(c.FailRequest(recv.request_id, msg))

    def _reading(self, recv: DecodeRecv) -> bool:
        """Whether our READ for ``recv`` may still be in flight (pull, posted, not ended):
        its bytes may still land in the request's blocks."""
        return recv.mode == "pull" and recv.state in (RecvState.AWAITING_KV,
                                                      RecvState.QUARANTINED)

    def _recv_failed_fenced(self, recv: DecodeRecv, why: str) -> None:
        """``_recv_failed`` for a transfer whose KV may still land: a pull whose READ is
        still in flight, or a push whose prefill has not said it is done (silent past
        its lease, or a registration it never saw). The request fails (or recomputes,
        in fresh blocks) now, but its blocks stay fenced out of the pool — pull: until
        the READ ends (``read_done``: done, failed, or the connection to prefill
        broken); push: until prefill answers or its connection drops or the fence
        times out (``_fence``) — so KV that lands late, from a prefill that was frozen
        and not dead, lands in no one else's blocks."""
        source = recv.remote_engine_id or recv.address
        msg = f"KV transfer {recv.tid} from prefill {source} failed: {why}"
        log.warning(msg)
        req = self.ctx.scheduler.requests.get(recv.request_id)
        if req is not None and recv.state is RecvState.AWAITING_KV:
            self._hold(recv, self.ctx.scheduler.detach_blocks(req))
        recv.state = RecvState.QUARANTINED
        self.ctx.by_request.pop(recv.request_id, None)
        if recv.mode == "push":
            self._fence(recv)
        else:
            self.ctx.submit(c.Untrack(recv.tid))  # counted failed when the READ ends
        self.ctx.record(TransferRecord(recv.tid, "decode", recv.mode, False, error=why))
        if req is None:
            return
        if self.ctx.cfg.load_failure_policy == "recompute":
            self.ctx.scheduler.remote_kv_failed(recv.request_id)
        else:
            self.ctx.actions.append(c.FailRequest(recv.request_id, msg))

    def _hold(self, recv: DecodeRecv, blocks: list[int]) -> None:
        """Keep ``blocks`` out of the pool for ``recv`` (freed by ``_end_recv``)."""
        recv.held = blocks

    @property
    def fenced_blocks(self) -> int:
        """Blocks held out of the pool for transfers that may still land in them."""
        return sum(len(recv.held) for recv in list(self.recvs.values()))

    def _fence(self, recv: DecodeRecv) -> None:
        """Push, QUARANTINED: its lease ends; the transfer thread watches prefill's
        connection and the fence timeout (fences.py) while prefill's answer is awaited."""
        self.ctx.counters["fences"] += 1
        self.ctx.submit(c.FenceTransfer(recv.tid, recv.address))

    def on_fence_released(self, tid: str, why: str) -> None:
        """The transfer thread gave up waiting for prefill: its connection dropped
        (``peer_gone``: the process ended) or the fence timed out (``timeout``)."""
        recv = self.recvs.get(tid)
        if recv is None or recv.state is not RecvState.QUARANTINED or recv.mode != "push":
            return
        if why == "timeout":
            self.ctx.counters["fence_timeouts"] += 1
            log.warning("transfer %s: prefill %s neither answered nor dropped its connection "
                        "within --fence-timeout (%s s): its %d fenced blocks go back to the "
                        "pool (should it still WRITE into them, later answers are wrong)",
                        tid, recv.remote_engine_id or recv.address, self.ctx.cfg.fence_timeout_s,
                        len(recv.held))
        else:
            self.ctx.counters["fences_peer_gone"] += 1
        self._end_recv(recv, ok=False)

    def _kv_arrived(self, recv: DecodeRecv, num_computed: int,
                    first: SampledToken | None, record: TransferRecord) -> None:
        self._end_recv(recv, ok=True, untrack=False)  # (on prefill's answer)
        self.ctx.counters["transfers_ok"] += 1
        record.transfer_s = time.perf_counter() - recv.t_start
        self.ctx.record(record)
        if recv.request_id in self.ctx.scheduler.remote_waiting:
            self.ctx.scheduler.remote_kv_arrived(recv.request_id, num_computed, first)
            if first is not None:
                self.ctx.actions.append(c.EmitFirstToken(recv.request_id))

    def on_push_done(self, done: m.PushDone) -> None:
        recv = self.recvs.get(done.transfer_id)
        if recv is None:
            return
        if recv.state is RecvState.QUARANTINED:
            self._end_recv(recv, ok=False, untrack=False)
            return
        if not done.ok:
            self._recv_failed(recv, done.error or "prefill reported a failure", untrack=False)
            return
        first = self._first_token(done)
        if first is None:
            self._recv_failed(recv, f"prefill sent an invalid first token "
                                    f"{done.first_token} (logprob {done.first_logprob}, top "
                                    f"{done.first_top_logprobs})", untrack=False)
            return
        req = self.ctx.scheduler.requests.get(recv.request_id)
        record = TransferRecord(recv.tid, "decode", "push", True, done.num_bytes,
                                done.num_descriptors)
        self._kv_arrived(recv, req.num_prompt_tokens, first, record)

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

    def on_read_done(self, done: c.ReadDone) -> None:
        recv = self.recvs.get(done.tid)
        if recv is None:
            return
        if recv.state is RecvState.QUARANTINED:
            self._end_recv(recv, ok=False, untrack=False)
            return
        if not done.ok:
            self._recv_failed(recv, done.error or "READ failed", untrack=False)
            return
        req = self.ctx.scheduler.requests[recv.request_id]
        record = TransferRecord(done.tid, "decode", "pull", True, done.num_bytes,
                                done.num_descriptors, done.post_s)
        self._kv_arrived(recv, req.num_prompt_tokens - 1, None, record)

    def on_registration_lost(self, tid: str, why: str) -> None:
        """Prefill never got our registration (the transfer thread sent it again, then
        told prefill Abort): fail the request; one may yet have arrived, so its blocks
        wait for prefill's word."""
        recv = self.recvs.get(tid)
        if recv is not None and recv.state is RecvState.AWAITING_KV:
            self._recv_failed_fenced(recv, why)

    def on_abort_ack(self, ack: m.AbortAck) -> None:
        recv = self.recvs.get(ack.transfer_id)
        if recv is not None and recv.state is RecvState.QUARANTINED:
            self._end_recv(recv, ok=False, untrack=False)
