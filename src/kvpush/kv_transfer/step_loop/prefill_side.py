"""PrefillSender: the prefill side of KV transfer, owned by KVConnector (shared state in
context.py). It owns the blocks of the push sends and the pull lends.

Push: the transfer thread owns each push transfer (push_sends.py): decode's
registration, which blocks go where, the WRITEs, the lease and the PushDone. The step
loop states what happened, once each: the leg is added (``PushAdded``); the blocks a
step completes hold their KV for a layer group (``BlocksComputed``, from the runner's
layer hook while the forward pass goes on, ``layers_per_write`` layers per group: one
on CUDA, a third of the model on CPU by default); prefill is over with token #1
(``PushPrefilled``); or the leg ended otherwise (``PushEnded``). It gets back one
``WritesDone`` per transfer, once nothing of the thread's reads the blocks any more,
and frees them then. A registration that lands mid-step is matched on the transfer
thread at once: blocks already computed are written as it arrives, not after the step.

Pull: a finished request's blocks are lent (``lent``, stated ``Lent``) until the
transfer thread's ``LendOver``: decode's PullDone or Abort, or the lease's end.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from kvpush.engine.outputs import RequestError
from kvpush.kv_cache.block_pool import hash_prompt_chain
from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.step_loop.context import TransferContext
from kvpush.kv_transfer.step_loop.state import (
    PushSend,
    SendState,
    TransferRecord,
)
from kvpush.kv_transfer.transfer_thread.push_sends import FULL_HIT
from kvpush.kv_transfer.wire import messages as m
from kvpush.sampling_params import SampledToken
from kvpush.scheduler.request import Request
from kvpush.scheduler.scheduler import StepPlan

log = logging.getLogger("kvpush.kv_transfer.step_loop.connector")


def layers_per_write(configured: int, num_layers: int, cuda: bool) -> int:
    """Layers per WRITE of a push prefill step (``--push-layers-per-write``; 0: one on
    CUDA, a third of the layers on CPU), at most ``num_layers``."""
    if configured <= 0:
        configured = 1 if cuda else -(-num_layers // 3)
    return max(1, min(configured, num_layers))


class PrefillSender:
    def __init__(self, ctx: TransferContext, layers_per_write: int) -> None:
        self.ctx = ctx
        self.layers_per_write = layers_per_write
        self.sends: dict[str, PushSend] = {}  # tid -> push send (its blocks)
        self.lent: dict[str, list[int]] = {}  # pull: tid -> blocks lent to decode

    # ---- requests ---------------------------------------------------------------------
    def add(self, req: Request, tid: str) -> None:
        """A prefill leg (push or pull): prefill it, then send or lend its KV."""
        ctx = self.ctx
        if tid in self.sends or tid in self.lent:
            raise RequestError(f"transfer id {tid!r} is already in use", "kv_transfer_params")
        if ctx.mode == "push":
            reason = ctx.ended.get(tid)  # every replay, not just the first
            if reason is not None:
                raise RequestError(f"transfer {tid} already ended: {reason}",
                                   "kv_transfer_params")
            self.sends[tid] = PushSend(tid, req.request_id)
            chain = hash_prompt_chain(req.prompt_token_ids, ctx.block_size,
                                      req.block_hashes, req.params.cache_salt)
            # the full blocks' hashes are the scheduler's prefix-cache keys too: it finds
            # them here instead of hashing the prompt a second time
            req.block_hashes = chain[:req.num_prompt_tokens // ctx.block_size]
            ctx.submit(c.PushAdded(tid, req.num_prompt_tokens, chain))
        ctx.by_request[req.request_id] = tid
        ctx.timeline.begin(tid, "p_added")
        ctx.scheduler.add_request(req)

    def finish(self, req: Request, tid: str, ok: bool,
               error: str | None) -> tuple[bool, dict | None]:
        """The prefill leg ends: (keep its blocks, kv_transfer_params for the answer)."""
        ctx = self.ctx
        if ctx.dead is not None:  # nothing can be sent or lent: the scheduler frees
            return False, None
        ctx.timeline.stamp(tid, "p_first")
        send = self.sends.get(tid)
        if send is not None:
            return self._send_finished(send, req, ok, error), None
        if ctx.mode != "pull" or not ok:
            return False, None
        self.lent[tid] = list(req.block_ids)
        ctx.submit(c.Lent(tid))
        ctx.timeline.emit(tid)
        host, port = ctx.address.rsplit(":", 1)
        # the hash chain binds the lent KV to this prompt: decode READs only for the same
        hashes = hash_prompt_chain(req.prompt_token_ids, ctx.block_size, req.block_hashes,
                                   req.params.cache_salt)
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False, "transfer_id": tid,
            "remote_block_ids": list(req.block_ids), "remote_engine_id": ctx.engine_id,
            "remote_host": host, "remote_port": int(port),
            "remote_request_id": req.request_id, "tp_size": 1,
            "prompt_hashes": [h.hex() for h in hashes],
            # when the lend ends unless decode's heartbeats renew it: decode does not
            # claim it after that (lend_claims.py); the router signs it with the rest
            "lend_expires_ms": int((time.time() + ctx.cfg.lease_timeout_s) * 1000),
        }

    def _send_finished(self, send: PushSend, req: Request, ok: bool,
                       error: str | None) -> bool:
        """A push leg's request ends. True: its blocks stay here until WritesDone."""
        if send.state is SendState.OVER:  # the transfer ended first: nothing reads them
            self._forget(send)
            return False
        send.state, send.block_ids = SendState.HELD, list(req.block_ids)
        if not ok:
            self.ctx.submit(c.PushEnded(send.tid, error or "prefill request aborted"))
            return True
        n_blocks = -(-req.num_prompt_tokens // self.ctx.block_size)  # the partial one too
        self._state_blocks(send, req.block_ids, n_blocks, range(self.ctx.layout.num_layers),
                           self._ready())
        first = SampledToken(
            req.output_token_ids[0], req.output_logprobs[0] if req.output_logprobs else None,
            req.output_top_logprobs[0] if req.output_top_logprobs else None)
        top = [tuple(alt) for alt in first.top] if first.top is not None else None
        self.ctx.submit(c.PushPrefilled(send.tid, m.PushDone(
            send.tid, ok=True, first_token=first.token, first_logprob=first.logprob,
            first_top_logprobs=top)))
        return True

    def abort_transfer(self, tid: str, why: str) -> None:
        """The router gave up on ``tid``: release what is held for it now."""
        ctx = self.ctx
        send = self.sends.get(tid)
        if send is not None:
            if send.state is SendState.PREFILLING:
                ctx.actions.append(c.AbortRequest(send.request_id, why))
            else:  # the transfer thread decides (decode may be waiting for this KV)
                ctx.submit(c.PushEnded(tid, why))
            return
        if tid in self.lent:
            ctx.submit(c.LendEnded(tid))
            ctx.scheduler.release_blocks(self.lent.pop(tid))
        elif ctx.mode == "push":
            ctx.submit(c.PushEnded(tid, why))  # an early registration, or none yet
        ctx.remember_ended(tid, why)  # a leg that arrives later is refused

    def on_worker_died(self, why: str) -> bool:
        """The transfer thread died (thread_death.py): end every push send and free its
        blocks (our WRITEs, the only reader, ended with the transport), fail each leg
        still in the engine; lent blocks stay lent until ``release_dead_hold``. True:
        blocks are held."""
        ctx = self.ctx
        for send in list(self.sends.values()):
            ctx.counters["transfers_failed"] += 1
            ctx.record(TransferRecord(send.tid, "prefill", "push", False, error=why))
            ctx.timeline.emit(send.tid)
            ctx.remember_ended(send.tid, why)
            self._forget(send)
        for request_id in list(ctx.by_request):  # push and pull legs still prefilling
            if request_id in ctx.scheduler.requests:
                ctx.actions.append(c.FailRequest(request_id, why))
        return bool(self.lent)

    def release_dead_hold(self) -> None:
        """After the death, once no lease could still cover them: free the lent blocks."""
        for tid, blocks in self.lent.items():
            self.ctx.scheduler.release_blocks(blocks)
            self.ctx.counters["transfers_failed"] += 1
            log.info("transfer %s: its lent blocks go back to the pool", tid)
        self.lent.clear()

    # ---- push -------------------------------------------------------------------------
    def _state_blocks(self, send: PushSend, block_ids: list[int], upto: int, layers: range,
                      ready) -> None:
        """State blocks ``send.stated_blocks`` up to ``upto`` computed for ``layers``."""
        start = send.stated_blocks
        if upto > start:
            self.ctx.submit(c.BlocksComputed(send.tid, start, block_ids[start:upto], layers,
                                             ready))
            send.stated_blocks = upto

    def _ready(self):
        """On CUDA, an event recorded now: the transfer thread waits on it, so a WRITE
        never reads KV whose kernels are still queued (earlier steps included: a step
        that samples nothing never synchronized). None on CPU."""
        if not self.ctx.region.kv.is_cuda:
            return None
        ready = torch.cuda.Event(blocking=True)  # the waiting thread sleeps, not spins
        ready.record()
        return ready

    def layer_hook(self, plan: StepPlan) -> Callable[[int], None] | None:
        """States, per layer group, the full blocks this step completes for each push
        send (the transfer thread WRITEs those whose registration it has)."""
        if self.ctx.role != "prefill":
            return None
        for chunk in plan.chunks:
            tid = self.ctx.by_request.get(chunk.request_id)
            if tid is not None:
                self.ctx.timeline.stamp(tid, "p_step", first=True)
        if not self.sends:
            return None
        bs = self.ctx.block_size
        items: list[tuple[str, int, list[int]]] = []  # (tid, first block, our blocks)
        for chunk in plan.chunks:
            tid = self.ctx.by_request.get(chunk.request_id)
            send = self.sends.get(tid) if tid else None
            if send is None or send.state is not SendState.PREFILLING:
                continue
            upto = (chunk.start_pos + len(chunk.token_ids)) // bs
            if upto > send.stated_blocks:
                items.append((send.tid, send.stated_blocks,
                              chunk.block_ids[send.stated_blocks:upto]))
                send.stated_blocks = upto
        if not items:
            return None
        cuda = self.ctx.region.kv.is_cuda
        group, last = self.layers_per_write, self.ctx.layout.num_layers - 1
        first = 0  # the first layer of the group being computed

        def on_layer(layer: int) -> None:
            nonlocal first
            if (layer + 1) % group and layer != last:
                return  # mid-group: handed over with the group's last layer
            layers, first = range(first, layer + 1), layer + 1
            # the WRITE must not read the layers before the GPU wrote them: the transfer
            # thread waits on this event (CUDA), the forward pass goes on queueing
            ready = self._ready() if cuda else None
            # a wake-up only when a registered transfer can WRITE them now; else they
            # wait on the queue for the registration (which wakes the thread) or the
            # step's end, and the forward pass is not interrupted
            wake = self.ctx.worker.writes_wanted()
            for tid, first_block, blocks in items:
                self.ctx.submit(c.BlocksComputed(tid, first_block, blocks, layers, ready),
                                wake=wake)
            self.ctx.flush()  # the group's facts: one StepMessage

        return on_layer

    def on_preempt(self, req: Request, blocks: list[int]) -> bool:
        """A push sender losing its blocks keeps them out of the pool while WRITEs from
        them may be in flight (True: they are the connector's now); its blocks are
        stated again after the recompute."""
        tid = self.ctx.by_request.get(req.request_id)
        send = self.sends.get(tid) if tid else None
        if send is None or send.stated_blocks == 0 or send.state is SendState.OVER:
            return False
        send.retired.append(blocks)
        send.stated_blocks = 0
        return True

    def on_push_failing(self, tid: str, why: str) -> None:
        """The transfer thread ended ``tid`` while its WRITEs drain: stop the prefill
        (its blocks stay held until WritesDone)."""
        send = self.sends.get(tid)
        if send is not None and send.state is SendState.PREFILLING:
            self.ctx.actions.append(c.AbortRequest(send.request_id, why))

    def on_writes_done(self, ev: c.WritesDone) -> None:
        """The transfer thread is done with ``ev.tid``: nothing of it reads our blocks."""
        tid, failed = ev.tid, ev.failed
        send = self.sends.get(tid)
        if send is None:
            return
        ok = failed is None and send.state is SendState.HELD and not ev.prefill_not_needed
        if not ev.prefill_not_needed:
            self.ctx.counters["transfers_ok" if ok else "transfers_failed"] += 1
            self.ctx.record(TransferRecord(tid, "prefill", "push", ok, ev.num_bytes,
                                           ev.num_descriptors, ev.post_s, ev.elapsed_s,
                                           failed))
        self.ctx.timeline.emit(tid)
        self.ctx.remember_ended(tid, failed or (FULL_HIT if ev.prefill_not_needed
                                                else "done"))
        if send.state is SendState.PREFILLING:  # the request still runs: end it
            send.state = SendState.OVER
            self.ctx.actions.append(
                c.RejectRequest(send.request_id, "decode holds the whole prompt in its "
                                "prefix cache: nothing to prefill", "prefill_not_needed")
                if ev.prefill_not_needed
                else c.AbortRequest(send.request_id, failed or FULL_HIT))
            self._release_retired(send)  # (nothing reads them now)
            return
        self._forget(send)

    def _forget(self, send: PushSend) -> None:
        """Drop ``send``, freeing what the connector holds of it: its blocks kept past
        the finish (HELD) and those of a preempted run."""
        self.sends.pop(send.tid, None)
        if send.state is SendState.HELD:
            self.ctx.scheduler.release_blocks(send.block_ids)
        self._release_retired(send)

    def _release_retired(self, send: PushSend) -> None:
        for blocks in send.retired:
            self.ctx.scheduler.release_blocks(blocks)
        send.retired.clear()

    def on_lend_over(self, tid: str, ok: bool) -> None:
        """Decode read the lent blocks, gave up, or let the lease run out."""
        blocks = self.lent.pop(tid, None)
        if blocks is not None:
            self.ctx.scheduler.release_blocks(blocks)
            self.ctx.counters["transfers_ok" if ok else "transfers_failed"] += 1
