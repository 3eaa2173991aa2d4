"""PrefillSender: the prefill side of KV transfer, owned by KVConnector (shared state in
context.py). It owns the push sends, the pull lends and the registrations that came
before their request.

Push: a ``PushSend`` per request waits for decode's registration, then WRITEs each
layer's newly completed full blocks from the runner's layer hook while the forward pass
goes on (``layers_per_write`` layers per WRITE: one on CUDA, a third of the model on CPU
by default), the rest when prefill ends, and asks the transfer thread to send ``PushDone``
(token #1) once every WRITE completed; its blocks are freed on ``writes_done``.

Decode's registration usually lands a few milliseconds after prefill's step for the
request began (both legs leave the router together), so the step loop would see it only
after that step, and a prompt prefilled in one step would have all of its KV written
after the forward pass, on the path to token #1. The transfer thread therefore also
puts each registration on the ``worker.registrations`` queue and posts a
``RegistrationsArrived`` event that carries nothing. The layer hook drains the queue
mid-step, at the end of a layer group (on the step-loop thread, where all connector
state lives), writes the layers already computed at once and the rest group by group;
what it did not apply, the step loop applies on the event (``apply_registrations``).
Each registration is applied once.
Pull: a finished request's blocks are lent (``lent``) until decode's ``PullDone`` or the
lease ends.
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
    registration_problem,
)
from kvpush.kv_transfer.wire import messages as m
from kvpush.sampling_params import SampledToken
from kvpush.scheduler.request import Request
from kvpush.scheduler.scheduler import ScheduledChunk, StepPlan

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
        self.sends: dict[str, PushSend] = {}  # tid -> push transfer
        self.lent: dict[str, list[int]] = {}  # pull: tid -> blocks lent to decode
        self.early_regs: dict[str, m.PushRegister] = {}  # registrations before the request
        self._step_writes: list[tuple[PushSend, list[int], list[int]]] = []
        #: registrations taken off the transfer thread's queue, not applied yet
        self._hints: dict[str, m.PushRegister] = {}

    # ---- requests ---------------------------------------------------------------------
    def add(self, req: Request, tid: str) -> None:
        """A prefill leg (push or pull): prefill it, then send or lend its KV."""
        ctx = self.ctx
        if tid in self.sends or tid in self.lent:
            raise RequestError(f"transfer id {tid!r} is already in use", "kv_transfer_params")
        reg = None
        if ctx.mode == "push":
            reason = ctx.ended.get(tid)  # every replay, not just the first
            if reason is not None:
                raise RequestError(f"transfer {tid} already ended: {reason}",
                                   "kv_transfer_params")
            reg = self.early_regs.pop(tid, None)
            if reg is not None and reg.full_hit:  # nothing for prefill to do
                ctx.submit(c.Untrack(tid))
                ctx.remember_ended(tid, "decode has the whole prompt cached")
                raise RequestError(
                    "decode holds the whole prompt in its prefix cache: nothing to "
                    "prefill", "kv_transfer_params", "prefill_not_needed")
            self.sends[tid] = PushSend(
                tid, req.request_id,
                prompt_hashes=hash_prompt_chain(req.prompt_token_ids, ctx.block_size,
                                                salt=req.params.cache_salt))
        ctx.by_request[req.request_id] = tid
        ctx.timeline.begin(tid, "p_added")
        ctx.scheduler.add_request(req)  # before a registration may abort it
        if ctx.mode == "push":
            if reg is not None:
                self._registered(self.sends[tid], reg)
            else:
                ctx.submit(c.Track(tid, None))

    def finish(self, req: Request, tid: str, ok: bool,
               error: str | None) -> tuple[bool, dict | None]:
        """The prefill leg ends: (keep its blocks, kv_transfer_params for the answer)."""
        ctx = self.ctx
        if ctx.dead is not None:  # nothing can be sent or lent: the scheduler frees
            return False, None
        ctx.timeline.stamp(tid, "p_first")
        send = self.sends.get(tid)
        if send is not None:
            if not ok:
                return self._send_aborted(send, req, error or "prefill request aborted"), None
            send.finished = True
            send.block_ids = list(req.block_ids)
            send.num_prompt_tokens = req.num_prompt_tokens
            send.first = SampledToken(
                req.output_token_ids[0], req.output_logprobs[0] if req.output_logprobs else None,
                req.output_top_logprobs[0] if req.output_top_logprobs else None)
            if send.state is SendState.SENDING:
                self._flush(send, final=True)
            return True, None
        if ctx.mode != "pull" or not ok:
            return False, None
        self.lent[tid] = list(req.block_ids)
        ctx.submit(c.Track(tid, None))
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

    def abort_transfer(self, tid: str, why: str) -> None:
        """The router gave up on ``tid``: release what is held for it now."""
        ctx = self.ctx
        send = self.sends.get(tid)
        if send is not None:
            if send.request_id in ctx.scheduler.requests:
                ctx.actions.append(c.AbortRequest(send.request_id, why))
            elif send.state is SendState.AWAITING_REGISTRATION:
                self._drop_send(send, why)
            return  # registered: decode is waiting for this KV and decides
        if tid in self.lent:
            ctx.submit(c.Untrack(tid))
            ctx.scheduler.release_blocks(self.lent.pop(tid))
        elif tid in self.early_regs:
            reg = self.early_regs.pop(tid)
            ctx.submit(c.Untrack(tid))
            ctx.submit(c.Send(reg.address, m.Abort(tid, why)))
        ctx.remember_ended(tid, why)  # a leg that arrives later is refused

    def on_abort(self, ab: m.Abort) -> None:
        """Decode gave up on one of ours: stop. The transfer thread has already
        cancelled its WRITEs as the Abort arrived (acknowledging once they drained):
        a sending transfer ends with its ``WritesDone``."""
        ctx, tid = self.ctx, ab.transfer_id
        if tid in self.sends:
            send = self.sends[tid]
            if send.state in (SendState.SENDING, SendState.DRAINING) and send.reg:
                if send.request_id in ctx.scheduler.requests:
                    ctx.actions.append(c.AbortRequest(send.request_id,
                                                      f"decode: {ab.reason}"))
                return
            self._drop_send(send, f"aborted by decode: {ab.reason}")
        elif tid in self.early_regs:  # (the transfer thread has sent the AbortAck)
            self.early_regs.pop(tid)
            ctx.submit(c.Untrack(tid))
            ctx.remember_ended(tid, f"aborted by decode: {ab.reason}")
        elif tid in self.lent:
            self.on_pull_done(m.PullDone(tid, ok=False), from_peer=False)

    def on_lease_expired(self, tid: str) -> None:
        ctx = self.ctx
        if tid in self.sends:
            send = self.sends[tid]
            if send.state is SendState.DRAINING:
                return  # the WRITEs' own completion (or failure) ends it
            if send.state is SendState.SENDING and send.request_id in ctx.scheduler.requests:
                # per-layer WRITEs may be in flight: abort the prefill; finish() drains
                # them (DRAINING) before its blocks are freed
                ctx.actions.append(c.AbortRequest(send.request_id,
                                                  "lease expired: decode stopped answering"))
                return
            self._drop_send(send, "lease expired: decode never registered")
        elif tid in self.early_regs:
            del self.early_regs[tid]
            ctx.remember_ended(tid, "lease expired: the request never reached prefill")
        elif tid in self.lent:
            ctx.scheduler.release_blocks(self.lent.pop(tid))

    def on_worker_died(self, why: str) -> bool:
        """The transfer thread died (thread_death.py): end every push send and free its
        blocks (our WRITEs, the only reader, ended with the transport), fail each leg
        still in the engine, drop the early registrations; lent blocks stay lent until
        ``release_dead_hold``. True: blocks are held."""
        ctx = self.ctx
        for send in list(self.sends.values()):
            del self.sends[send.tid]
            ctx.counters["transfers_failed"] += 1
            ctx.record(TransferRecord(send.tid, "prefill", "push", False, error=why))
            ctx.timeline.emit(send.tid)
            ctx.remember_ended(send.tid, why)
            if send.request_id not in ctx.scheduler.requests and (
                    send.finished or send.state is SendState.DRAINING):
                ctx.scheduler.release_blocks(send.block_ids)  # kept past its finish
            for blocks in send.retired:
                ctx.scheduler.release_blocks(blocks)
            send.retired.clear()
        for request_id in list(ctx.by_request):  # push and pull legs still prefilling
            if request_id in ctx.scheduler.requests:
                ctx.actions.append(c.FailRequest(request_id, why))
        for tid in self.early_regs:
            ctx.remember_ended(tid, why)
        self.early_regs.clear()
        self._take_hints()
        self._hints.clear()
        return bool(self.lent)

    def release_dead_hold(self) -> None:
        """After the death, once no lease could still cover them: free the lent blocks."""
        for tid, blocks in self.lent.items():
            self.ctx.scheduler.release_blocks(blocks)
            self.ctx.counters["transfers_failed"] += 1
            log.info("transfer %s: its lent blocks go back to the pool", tid)
        self.lent.clear()

    # ---- push -------------------------------------------------------------------------
    def _registered(self, send: PushSend, reg: m.PushRegister) -> None:
        peer = self.ctx.peers.get(reg.address)
        if peer is None:  # the Hello always precedes the registration on one socket
            self._drop_send(send, f"registration from unknown decode {reg.address}")
            return
        req = self.ctx.scheduler.requests.get(send.request_id)
        own = send.num_prompt_tokens if send.finished else (
            req.num_prompt_tokens if req is not None else None)
        problem = registration_problem(reg, peer.num_blocks, self.ctx.block_size, own,
                                       send.prompt_hashes)
        if problem:  # nothing is written: every block id and length is checked first
            log.warning("transfer %s: refused decode %s's registration: %s", send.tid,
                        reg.address, problem)
            self.ctx.submit(c.Send(reg.address, m.PushDone(
                send.tid, ok=False, error=f"invalid registration: {problem}")))
            self._drop_send(send, f"invalid registration: {problem}")
            return
        send.reg = reg
        send.state = SendState.SENDING
        self.ctx.submit(c.Track(send.tid, reg.address))
        if reg.full_hit:
            self._drop_send(send, "decode has the whole prompt cached")
            return
        if send.finished:
            self._flush(send, final=True)
        elif req is not None:
            # blocks computed before the registration arrived go now, every layer
            self._post_blocks(send, req.block_ids, req.num_computed_tokens // self.ctx.block_size,
                              range(self.ctx.layout.num_layers))

    def _post_blocks(self, send: PushSend, block_ids: list[int], upto: int, layers) -> None:
        reg = send.reg
        start = max(send.written_blocks, reg.skip_blocks)
        upto = min(upto, len(reg.block_ids), len(block_ids))
        if upto <= start:
            return
        self.ctx.submit(c.PostWrite(send.tid, reg.address, block_ids[start:upto],
                                    reg.block_ids[start:upto], layers, self._ready()))
        send.written_blocks = upto

    def _ready(self):
        """On CUDA, an event recorded now: the transfer thread waits on it, so a WRITE
        never reads KV whose kernels are still queued (earlier steps included: a step
        that samples nothing never synchronized). None on CPU."""
        if not self.ctx.region.kv.is_cuda:
            return None
        ready = torch.cuda.Event(blocking=True)  # the waiting thread sleeps, not spins
        ready.record()
        return ready

    def _flush(self, send: PushSend, final: bool) -> None:
        """Prefill done: WRITE what is left (partial last block included), then PushDone."""
        n_blocks = -(-send.num_prompt_tokens // self.ctx.block_size)
        self._post_blocks(send, send.block_ids, n_blocks, range(self.ctx.layout.num_layers))
        send.state = SendState.DRAINING
        first = send.first
        top = [tuple(alt) for alt in first.top] if first.top is not None else None
        self.ctx.submit(c.Finalize(send.tid, send.reg.address,
                           m.PushDone(send.tid, ok=True, first_token=first.token,
                                      first_logprob=first.logprob, first_top_logprobs=top)))

    def layer_hook(self, plan: StepPlan) -> Callable[[int], None] | None:
        """Per-layer WRITE of the blocks this step completes, for registered push sends
        and for those whose registration arrives while the step runs."""
        self._step_writes = []
        if self.ctx.role != "prefill":
            return None
        for chunk in plan.chunks:
            tid = self.ctx.by_request.get(chunk.request_id)
            if tid is not None:
                self.ctx.timeline.stamp(tid, "p_step", first=True)
        if not self.sends:
            return None
        waiting: list[tuple[PushSend, ScheduledChunk]] = []
        for chunk in plan.chunks:
            tid = self.ctx.by_request.get(chunk.request_id)
            send = self.sends.get(tid) if tid else None
            if send is None:
                continue
            if send.state is SendState.SENDING:
                self._add_step_write(send, chunk)
            elif send.state is SendState.AWAITING_REGISTRATION and not send.finished:
                waiting.append((send, chunk))
        if not self._step_writes and not waiting:
            return None
        cuda = self.ctx.region.kv.is_cuda
        hints = self._hints
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
            for send, local_blocks, remote_blocks in self._step_writes:
                self.ctx.submit(c.PostWrite(send.tid, send.reg.address, local_blocks,
                                            remote_blocks, layers, ready))
            if waiting:
                self._take_hints()
            if waiting and hints:
                for item in [w for w in waiting if w[0].tid in hints]:
                    waiting.remove(item)  # one try: else the step loop applies it
                    if self._register_mid_step(*item, hints[item[0].tid], layer, ready):
                        del hints[item[0].tid]
            self.ctx.flush()  # the group's WRITEs: one StepMessage, one wake-up

        return on_layer

    def _take_hints(self) -> None:
        """Move the registrations the transfer thread queued into ``_hints``."""
        regs = self.ctx.worker.registrations
        while not regs.empty():
            reg = regs.get_nowait()
            self._hints[reg.transfer_id] = reg

    def _add_step_write(self, send: PushSend, chunk: ScheduledChunk) -> tuple | None:
        """Note the blocks ``chunk`` completes for the layer hook to WRITE, layer by layer."""
        reg = send.reg
        start = max(send.written_blocks, reg.skip_blocks)
        upto = min((chunk.start_pos + len(chunk.token_ids)) // self.ctx.block_size,
                   len(reg.block_ids))
        if upto <= start:
            return None
        item = (send, chunk.block_ids[start:upto], reg.block_ids[start:upto])
        self._step_writes.append(item)
        send.written_blocks = upto
        return item

    def _register_mid_step(self, send: PushSend, chunk: ScheduledChunk,
                           reg: m.PushRegister, layer: int, ready=None) -> bool:
        """Apply a registration that arrived during this step, after ``layer``: blocks of
        earlier steps go now (every layer), this step's blocks now for layers up to
        ``layer`` and from the hook for the rest. A registration that needs more than
        that (a full hit, an unknown peer, a problem) waits for the step loop. True:
        applied."""
        peer = self.ctx.peers.get(reg.address)
        req = self.ctx.scheduler.requests.get(send.request_id)
        if (reg.full_hit or peer is None or req is None or send.reg is not None
                or registration_problem(reg, peer.num_blocks, self.ctx.block_size,
                                        req.num_prompt_tokens, send.prompt_hashes)):
            return False  # the step loop applies it between steps
        self.ctx.counters["registrations_mid_step"] += 1
        self._registered(send, reg)  # posts the blocks of earlier steps
        item = self._add_step_write(send, chunk)
        if item is not None:
            self.ctx.submit(c.PostWrite(send.tid, reg.address, item[1], item[2],
                                        range(layer + 1), ready))
        return True

    def on_preempt(self, req: Request, blocks: list[int]) -> bool:
        """A push sender losing its blocks keeps them out of the pool while WRITEs from
        them may be in flight (True: they are the connector's now); its blocks are
        written again after the recompute."""
        tid = self.ctx.by_request.get(req.request_id)
        send = self.sends.get(tid) if tid else None
        if send is None or send.written_blocks == 0:
            return False
        send.retired.append(blocks)
        send.written_blocks = 0
        return True

    def _send_aborted(self, send: PushSend, req: Request, why: str) -> bool:
        if send.state is SendState.SENDING:  # WRITEs may be in flight: drain, then tell D
            send.block_ids = list(req.block_ids)
            send.state = SendState.DRAINING
            self.ctx.submit(c.Finalize(send.tid, send.reg.address,
                               m.PushDone(send.tid, ok=False, error=why)))
            return True
        self._drop_send(send, why, free=False)
        return False

    def _drop_send(self, send: PushSend, why: str, free: bool = True) -> None:
        """End a push send that has nothing in flight; frees what it holds."""
        self.sends.pop(send.tid, None)
        self.ctx.timeline.emit(send.tid)
        self.ctx.submit(c.Untrack(send.tid))
        self.ctx.remember_ended(send.tid, why)
        if send.request_id in self.ctx.scheduler.requests:
            self.ctx.actions.append(c.AbortRequest(send.request_id, why))
        elif free and send.finished:
            self.ctx.scheduler.release_blocks(send.block_ids)
        for blocks in send.retired:
            self.ctx.scheduler.release_blocks(blocks)
        send.retired.clear()

    def apply_registrations(self) -> None:
        """Apply every registration the transfer thread queued that no layer hook took."""
        self._take_hints()
        hints, self._hints = self._hints, {}
        for reg in hints.values():
            self.on_register(reg)

    def on_register(self, reg: m.PushRegister) -> None:
        send = self.sends.get(reg.transfer_id)
        if send is None:
            why = self.ctx.ended.get(reg.transfer_id)
            if why is not None:  # prefill already gave up on it: tell decode at once
                self.ctx.submit(c.Send(reg.address,
                                   m.PushDone(reg.transfer_id, ok=False, error=why)))
                return
            # the request has not arrived yet; it should come about when decode's did, so
            # this wait has a fixed deadline (decode's heartbeats do not extend it)
            self.early_regs[reg.transfer_id] = reg
            self.ctx.submit(c.Track(reg.transfer_id, reg.address, False))
            return
        if send.reg is None:
            self._registered(send, reg)

    def on_writes_done(self, ev: c.WritesDone) -> None:
        tid, failed = ev.tid, ev.failed
        send = self.sends.pop(tid, None)
        if send is None:
            return
        # (its lease went with the WritesDone, on the transfer thread: no Untrack)
        ok = failed is None and send.finished
        self.ctx.counters["transfers_ok" if ok else "transfers_failed"] += 1
        self.ctx.record(TransferRecord(tid, "prefill", "push", ok, ev.num_bytes,
                                    ev.num_descriptors, ev.post_s, ev.elapsed_s, failed))
        self.ctx.timeline.emit(tid)
        self.ctx.remember_ended(tid, failed or "done")
        self.ctx.scheduler.release_blocks(send.block_ids)
        for blocks in send.retired:
            self.ctx.scheduler.release_blocks(blocks)

    def on_pull_done(self, done: m.PullDone, from_peer: bool = True) -> None:
        """Decode read the lent blocks (or gave up). ``from_peer``: its PullDone, on
        which the transfer thread already dropped the lease."""
        blocks = self.lent.pop(done.transfer_id, None)
        if blocks is not None:
            if not from_peer:
                self.ctx.submit(c.Untrack(done.transfer_id))
            self.ctx.scheduler.release_blocks(blocks)
            self.ctx.counters["transfers_ok" if done.ok else "transfers_failed"] += 1
