"""Decode side of KV transfer, mixed into KVConnector (it uses the connector's state).

A ``DecodeRecv`` per request: blocks are allocated when the scheduler can (prefix cache
first); push then registers them with prefill, pull posts the READ on the step loop.
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

from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer import messages as m
from kvpush.kv_transfer.state import (
    MAX_REGISTER_RESENDS,
    DecodeRecv,
    RecvState,
    TransferRecord,
    block_ids_problem,
)
from kvpush.sampling_params import MAX_TOP_LOGPROBS, SampledToken
from kvpush.scheduler.request import Request

log = logging.getLogger("kvpush.kv_transfer.connector")


class DecodeSide:
    def before_schedule(self) -> None:
        """Give pending decode-side transfers blocks, register them (push) or post their
        READ (pull, on this thread as the baseline does)."""
        skipped: list[str] = []
        while self.pending:
            tid = self.pending[0]
            recv = self.recvs.get(tid)
            if recv is None:
                self.pending.popleft()
                continue
            if recv.address in self.refused:
                self.pending.popleft()
                self._recv_failed(recv, self.refused[recv.address])
                continue
            if recv.address not in self.peers:
                skipped.append(self.pending.popleft())  # handshake still going
                continue
            problem = self._peer_problem(recv.address, recv.remote_engine_id,
                                         recv.remote_block_ids if recv.mode == "pull" else [])
            if problem:  # the request's kv_transfer_params do not fit: the client's mistake
                self.pending.popleft()
                self._recv_failed(recv, problem, client_error=True)
                continue
            req = self.scheduler.requests[recv.request_id]
            if not self.scheduler.allocate_remote(req):
                break
            self.pending.popleft()
            self._allocated(recv, req)
        self.pending.extendleft(reversed(skipped))
        self._stalled = bool(self.pending)

    def _peer_problem(self, address: str, engine_id: str, block_ids: list[int]) -> str | None:
        """Why the request's kv_transfer_params do not fit the prefill instance that
        answered at ``address`` (its engine id, role, region), or None."""
        peer = self.peers[address]
        if engine_id and peer.engine_id != engine_id:
            return (f"the instance at {address} is engine {peer.engine_id!r}, not "
                    f"remote_engine_id {engine_id!r}")
        if peer.role != "prefill":
            return f"the instance at {address} is a {peer.role} instance, not prefill"
        return block_ids_problem(block_ids, peer.num_blocks, "bad remote_block_ids")

    def _allocated(self, recv: DecodeRecv, req: Request) -> None:
        bs = self.block_size
        n = req.num_prompt_tokens
        hit = req.num_computed_tokens
        skip = hit // bs
        if recv.mode == "push":
            # decode holds every full block prefill could send: compute the tail here
            # only when configured to (else prefill writes just the tail block)
            full_hit = (self.cfg.prefix_hit_tail == "decode" and skip > 0
                        and skip == (n - 1) // bs)
            recv.register = m.PushRegister(
                recv.tid, self.engine_id, self.address, list(req.block_ids), skip, n, full_hit)
            recv.registered_at = time.monotonic()
            self.worker.submit(c.Send(recv.address, recv.register))
            self.timeline.stamp(recv.tid, "d_registered")
            if full_hit:  # everything prefill could send is here already: compute the rest
                self._end_recv(recv, ok=True, why="full prefix hit on decode")
                self.scheduler.remote_kv_arrived(req.request_id, hit, None)
                return
            recv.state = RecvState.AWAITING_KV
            return
        # pull: READ prefill's blocks for tokens [hit, n - 1); the last token is recomputed
        last = -(-(n - 1) // bs)
        try:
            local, remote = self._descs(req.block_ids[skip:last],
                                        recv.remote_block_ids[skip:last], recv.address,
                                        range(self.layout.num_layers))
        except (IndexError, ValueError) as e:  # block ids outside prefill's region
            self.worker.submit(c.Send(recv.address, m.PullDone(recv.tid, ok=False)))
            self._recv_failed(recv, f"bad remote_block_ids: {e}")
            return
        if not local:
            self._end_recv(recv, ok=True, why="nothing to read")
            self.worker.submit(c.Send(recv.address, m.PullDone(recv.tid)))
            self.scheduler.remote_kv_arrived(req.request_id, n - 1, None)
            return
        # posted by the transfer thread, which owns the transport (a failed post comes
        # back as ReadDone(ok=False)); the blocks count as read into until it ends
        recv.state = RecvState.AWAITING_KV
        self.worker.submit(c.PostRead(recv.tid, recv.address, local, remote))

    def _end_recv(self, recv: DecodeRecv, ok: bool, why: str | None = None) -> None:
        self.recvs.pop(recv.tid, None)
        self.by_request.pop(recv.request_id, None)
        self.worker.submit(c.Untrack(recv.tid))
        if recv.held:
            self.scheduler.release_blocks(recv.held)
            recv.held = []
        if not ok:
            self.counters["transfers_failed"] += 1

    def _recv_failed(self, recv: DecodeRecv, why: str, client_error: bool = False) -> None:
        """Remote KV will not come: fail the request or prefill it here (policy).
        ``client_error``: the request's own kv_transfer_params are wrong: it is refused
        as a bad request (HTTP 400, nothing has been sent yet) whatever the policy."""
        source = recv.remote_engine_id or recv.address
        msg = f"KV transfer {recv.tid} from prefill {source} failed: {why}"
        log.warning(msg)
        self._end_recv(recv, ok=False)
        self._record(TransferRecord(recv.tid, "decode", recv.mode, False, error=why))
        if recv.request_id not in self.scheduler.requests:
            return
        if client_error:
            self.actions.append(c.RejectRequest(recv.request_id, msg))
        elif self.cfg.load_failure_policy == "recompute":
            self.scheduler.remote_kv_failed(recv.request_id)
        else:
            self.actions.append(c.FailRequest(recv.request_id, msg))

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
        req = self.scheduler.requests.get(recv.request_id)
        if req is not None and recv.state is RecvState.AWAITING_KV:
            self._hold(recv, self.scheduler.detach_blocks(req))
        recv.state = RecvState.QUARANTINED
        self.by_request.pop(recv.request_id, None)
        if recv.mode == "push":
            self._fence(recv)
        else:
            self.worker.submit(c.Untrack(recv.tid))  # counted failed when the READ ends
        self._record(TransferRecord(recv.tid, "decode", recv.mode, False, error=why))
        if req is None:
            return
        if self.cfg.load_failure_policy == "recompute":
            self.scheduler.remote_kv_failed(recv.request_id)
        else:
            self.actions.append(c.FailRequest(recv.request_id, msg))

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
        self.counters["fences"] += 1
        self.worker.submit(c.FenceTransfer(recv.tid, recv.address))

    def _on_fence_released(self, tid: str, why: str) -> None:
        """The transfer thread gave up waiting for prefill: its connection dropped
        (``peer_gone``: the process ended) or the fence timed out (``timeout``)."""
        recv = self.recvs.get(tid)
        if recv is None or recv.state is not RecvState.QUARANTINED or recv.mode != "push":
            return
        if why == "timeout":
            self.counters["fence_timeouts"] += 1
            log.warning("transfer %s: prefill %s neither answered nor dropped its connection "
                        "within --fence-timeout (%s s): its %d fenced blocks go back to the "
                        "pool (should it still WRITE into them, later answers are wrong)",
                        tid, recv.remote_engine_id or recv.address, self.cfg.fence_timeout_s,
                        len(recv.held))
        else:
            self.counters["fences_peer_gone"] += 1
        self._end_recv(recv, ok=False)

    def _kv_arrived(self, recv: DecodeRecv, num_computed: int,
                    first: SampledToken | None, record: TransferRecord) -> None:
        self._end_recv(recv, ok=True)
        self.counters["transfers_ok"] += 1
        record.transfer_s = time.perf_counter() - recv.t_start
        self._record(record)
        if recv.request_id in self.scheduler.remote_waiting:
            self.scheduler.remote_kv_arrived(recv.request_id, num_computed, first)
            if first is not None:
                self.actions.append(c.EmitFirstToken(recv.request_id))

    def _on_push_done(self, done: m.PushDone) -> None:
        recv = self.recvs.get(done.transfer_id)
        if recv is None:
            return
        if recv.state is RecvState.QUARANTINED:
            self._end_recv(recv, ok=False)
            return
        if not done.ok:
            self._recv_failed(recv, done.error or "prefill reported a failure")
            return
        first = self._first_token(done)
        if first is None:
            self._recv_failed(recv, f"prefill sent an invalid first token "
                                    f"{done.first_token} (logprob {done.first_logprob}, top "
                                    f"{done.first_top_logprobs})")
            return
        req = self.scheduler.requests.get(recv.request_id)
        record = TransferRecord(recv.tid, "decode", "push", True, done.num_bytes,
                                done.num_descriptors)
        self._kv_arrived(recv, req.num_prompt_tokens, first, record)

    def _first_token(self, done: m.PushDone) -> SampledToken | None:
        """Token #1 as prefill sent it, None if any part of it is out of range."""
        def valid(token: int, lp: float | None) -> bool:
            return 0 <= token < self.vocab_size and (
                lp is None or (math.isfinite(lp) and lp <= 0))

        top = done.first_top_logprobs
        if not valid(done.first_token, done.first_logprob) or top is not None and (
                len(top) > MAX_TOP_LOGPROBS or not all(valid(t, lp) for t, lp in top)):
            return None
        return SampledToken(done.first_token, done.first_logprob,
                            tuple((int(t), float(lp)) for t, lp in top)
                            if top is not None else None)

    def _on_read_done(self, done: c.ReadDone) -> None:
        recv = self.recvs.get(done.tid)
        if recv is None:
            return
        if recv.state is RecvState.QUARANTINED:
            self._end_recv(recv, ok=False)
            return
        if not done.ok:
            self._recv_failed(recv, done.error or "READ failed")
            return
        req = self.scheduler.requests[recv.request_id]
        record = TransferRecord(done.tid, "decode", "pull", True, done.num_bytes,
                                done.num_descriptors, done.post_s)
        self._kv_arrived(recv, req.num_prompt_tokens - 1, None, record)

    def _on_awaiting_registration(self, tids: list[str]) -> None:
        """Prefill has no registration for these: re-send ours (it was lost)."""
        for tid in tids:
            recv = self.recvs.get(tid)
            if recv is None or recv.register is None or recv.state is not RecvState.AWAITING_KV:
                continue
            # a registration may just be slow: re-send at most every quarter lease
            now = time.monotonic()
            if now - recv.registered_at < self.cfg.lease_timeout_s / 4:
                continue
            recv.registered_at = now
            recv.resends += 1
            if recv.resends > MAX_REGISTER_RESENDS:
                why = f"registration lost {MAX_REGISTER_RESENDS + 1} times"
                self.worker.submit(c.Send(recv.address, m.Abort(tid, why)))
                self._recv_failed_fenced(recv, why)  # one may yet arrive: wait for P
            else:
                self.worker.submit(c.Send(recv.address, recv.register))

    def _on_abort_ack(self, ack: m.AbortAck) -> None:
        recv = self.recvs.get(ack.transfer_id)
        if recv is not None and recv.state is RecvState.QUARANTINED:
            self._end_recv(recv, ok=False)
