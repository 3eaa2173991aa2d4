"""PrefillSide: the step loop's part of a prefill instance's transfers.

Push: the leg is stated (``Begin``, with its prompt's hash chain, which also becomes
the scheduler's prefix-cache keys); the runner's layer hook states, per layer group
(:class:`WriteGroups`), the full blocks a step completes (``BlocksReady``: a group that
closes mid-step is handed over at once and the transfer thread WRITEs it if decode has
registered; the last group goes with the step's end); the finish states the rest with
token #1 (``Prefilled``) and keeps the blocks until ``Over``. A preempted push keeps its
old blocks too (WRITEs may read them) and states its blocks again.
Pull: the finished request's blocks are lent (``Prefilled``), its answer carries what
decode needs to READ them, and they go back on ``Over``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpush.kv_cache.block_pool import hash_prompt_chain
from kvpush.kv_transfer import actions as a
from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.params import KVTransferParams
from kvpush.kv_transfer.step_loop.holds import Hold, Holds
from kvpush.kv_transfer.wire import messages as m
from kvpush.sampling_params import SampledToken
from kvpush.scheduler.request import Request
from kvpush.scheduler.scheduler import StepPlan

#: ``--push-layers-per-write 0`` on CPU: a layer group closes mid-step at the first layer
#: boundary this long after the step began or the last group closed. Each mid-step
#: hand-off costs the step about 0.5 ms (a wake-up and the transfer thread's pass and
#: WRITE, Python under the GIL the step needs; docs/ARCHITECTURE.md "Push and the prefill
#: step"): at 50 ms a group that is 1%. A shorter step hands its KV over once, at its end.
AUTO_GROUP_S = 0.05


@dataclass(frozen=True)
class WriteGroups:
    """When a push prefill step hands a layer group's KV to the transfer thread: after
    every ``layers`` layers, or (``layers`` 0) at the first layer boundary ``min_s`` or
    more after the last hand-off. The group that ends with the last layer goes with the
    step's end (token #1 sampled), never on a wake-up of its own."""

    layers: int
    min_s: float = 0.0

    def closes(self, in_group: int, elapsed_s: float) -> bool:
        """Whether a group of ``in_group`` layers, computed in ``elapsed_s``, closes."""
        return in_group >= self.layers if self.layers else elapsed_s >= self.min_s


def write_groups(configured: int, num_layers: int, cuda: bool) -> WriteGroups:
    """The layer groups of ``--push-layers-per-write`` (``configured``; at most
    ``num_layers``). 0, auto: one layer on CUDA, where the step thread only queues
    kernels and each group's WRITE overlaps the layers still to compute; on CPU by
    compute time (:data:`AUTO_GROUP_S`)."""
    if configured > 0:
        return WriteGroups(min(configured, num_layers))
    return WriteGroups(1) if cuda else WriteGroups(0, AUTO_GROUP_S)


class PrefillSide:
    def __init__(self, holds: Holds, address: str, engine_id: str, num_layers: int,
                 cuda: bool, flush: Callable[[], None],
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.holds, self.address, self.engine_id = holds, address, engine_id
        self.num_layers, self.cuda, self.flush, self.clock = num_layers, cuda, flush, clock
        self.push = holds.cfg.mode == "push"
        self.groups = write_groups(holds.cfg.push_layers_per_write, num_layers, cuda)

    def add(self, req: Request, tid: str) -> None:
        holds, bs = self.holds, self.holds.block_size
        holds.take(tid, req.request_id)
        if self.push:
            chain = hash_prompt_chain(req.prompt_token_ids, bs, req.block_hashes,
                                      req.params.cache_salt)
            req.block_hashes = chain[:req.num_prompt_tokens // bs]  # hashed once
            holds.state(c.Begin(tid, req.num_prompt_tokens, tuple(chain)))
        holds.timeline.begin(tid, "p_added")
        holds.scheduler.add_request(req)

    def finish(self, req: Request, tid: str, hold: Hold, ok: bool,
               error: str | None) -> tuple[bool, KVTransferParams | None]:
        """The leg ends: (keep its blocks, kv_transfer_params for the answer)."""
        holds = self.holds
        holds.timeline.stamp(tid, "p_first")
        holds.detach(hold)
        if self.push:
            hold.blocks += req.block_ids  # WRITEs may read them until Over
            if not ok:
                holds.state(c.End(tid, error or "prefill request aborted"))
                return True, None
            n_blocks = -(-req.num_prompt_tokens // holds.block_size)  # the partial one too
            self._state(tid, hold, req.block_ids, n_blocks, range(self.num_layers))
            first = SampledToken(
                req.output_token_ids[0],
                req.output_logprobs[0] if req.output_logprobs else None,
                req.output_top_logprobs[0] if req.output_top_logprobs else None)
            top = [tuple(alt) for alt in first.top] if first.top is not None else None
            holds.state(c.Prefilled(tid, m.PushDone(
                tid, ok=True, first_token=first.token, first_logprob=first.logprob,
                first_top_logprobs=top)))
            return True, None
        if not ok:
            holds.over(tid)
            return False, None
        hold.blocks = list(req.block_ids)
        holds.state(c.Prefilled(tid, lent=tuple(req.block_ids)))
        holds.timeline.emit(tid)
        return True, self._lend_answer(req, tid)

    def _lend_answer(self, req: Request, tid: str) -> KVTransferParams:
        host, port = self.address.rsplit(":", 1)
        # the hash chain binds the lent KV to this prompt: decode READs only for the same
        hashes = hash_prompt_chain(req.prompt_token_ids, self.holds.block_size,
                                   req.block_hashes, req.params.cache_salt)
        return KVTransferParams(
            do_remote_prefill=True, transfer_id=tid, remote_host=host,
            remote_port=int(port), remote_engine_id=self.engine_id,
            remote_request_id=req.request_id, remote_block_ids=list(req.block_ids),
            prompt_hashes=hashes,
            # decode does not claim the lend after this (the router signs it with the rest)
            lend_expires_ms=int((time.time() + self.holds.cfg.lease_timeout_s) * 1000))

    def abort_transfer(self, tid: str, why: str) -> None:
        """The router gave up on ``tid``: a running leg is aborted (its finish ends the
        transfer); anything else is the transfer thread's to end."""
        hold = self.holds.by_tid.get(tid)
        if hold is not None and hold.request_id is not None:
            self.holds.actions.append(a.AbortRequest(hold.request_id, why))
        else:
            self.holds.state(c.End(tid, why))

    def _state(self, tid: str, hold: Hold, blocks: list[int], upto: int, layers: range,
               ready=None) -> None:
        if upto > hold.stated:
            self.holds.state(c.BlocksReady(tid, hold.stated, blocks[hold.stated:upto],
                                           layers, ready or self._ready()))
            hold.stated = upto

    def _ready(self):
        """On CUDA, an event recorded now (the transfer thread waits on it before it
        posts: a WRITE never reads KV whose kernels are still queued); None on CPU."""
        if not self.cuda:
            return None
        ready = torch.cuda.Event(blocking=True)  # the waiting thread sleeps, not spins
        ready.record()
        return ready

    def layer_hook(self, plan: StepPlan) -> Callable[[int], None] | None:
        """States, per layer group (:class:`WriteGroups`), the full blocks this step
        completes for each push."""
        holds, bs = self.holds, self.holds.block_size
        for chunk in plan.chunks:
            tid = holds.by_request.get(chunk.request_id)
            if tid is not None:
                holds.timeline.stamp(tid, "p_step", first=True)
        if not self.push:
            return None
        items: list[tuple[str, int, list[int]]] = []  # (tid, first block, our blocks)
        for chunk in plan.chunks:
            found = holds.of_request(chunk.request_id)
            if found is None:
                continue
            tid, hold = found
            upto = (chunk.start_pos + len(chunk.token_ids)) // bs
            if upto > hold.stated:
                items.append((tid, hold.stated, chunk.block_ids[hold.stated:upto]))
                hold.stated = upto
        if not items:
            return None
        groups, last, clock = self.groups, self.num_layers - 1, self.clock
        first, since = 0, clock()  # the group being computed: its first layer, its start

        def on_layer(layer: int) -> None:
            nonlocal first, since
            if layer != last and not groups.closes(layer + 1 - first, clock() - since):
                return  # mid-group: handed over with the group's last layer
            layers, first = range(first, layer + 1), layer + 1
            ready = self._ready()  # the forward pass goes on queueing (CUDA)
            for tid, first_block, blocks in items:
                holds.state(c.BlocksReady(tid, first_block, blocks, layers, ready))
            if layer != last:
                self.flush()  # the group's facts: one StepMessage, one wake-up
                since = clock()

        return on_layer

    def on_preempt(self, req: Request, blocks: list[int]) -> bool:
        """A push losing its blocks keeps them while WRITEs from them may be in flight
        (True: they are the connector's now); they are stated again after the
        recompute."""
        found = self.holds.of_request(req.request_id)
        if not self.push or found is None or found[1].stated == 0:
            return False
        found[1].blocks += blocks
        found[1].stated = 0
        return True

    def on_failing(self, hold: Hold, ev: c.Failing) -> None:
        if hold.request_id is not None:  # its finish keeps the blocks until Over
            self.holds.actions.append(a.AbortRequest(hold.request_id, ev.why))

    def on_over(self, hold: Hold, ev: c.Over) -> None:
        """The transfer ended while (or after) the leg ran; its blocks are back."""
        rid = hold.request_id
        if rid is not None and rid in self.holds.scheduler.requests:
            if ev.outcome is c.Outcome.NOT_NEEDED:
                self.holds.actions.append(a.RejectRequest(
                    rid, "decode holds the whole prompt in its prefix cache: nothing to "
                    "prefill", "prefill_not_needed"))
            elif ev.outcome is c.Outcome.REJECTED:
                self.holds.actions.append(a.RejectRequest(rid, ev.why or "rejected"))
            else:
                self.holds.actions.append(a.AbortRequest(rid, ev.why or "transfer ended"))
        self.holds.timeline.emit(ev.tid)
