"""Scheduler: continuous batching with chunked prefill, prefix caching and preemption.

Each call to :meth:`Scheduler.schedule` makes one :class:`StepPlan` under a token budget
(``max_num_batched_tokens``):

1. running requests first, in arrival order: a decode takes 1 token, an unfinished
   prefill takes its next chunk. When a request needs a block and none is free, the
   newest running request is preempted (its blocks freed; it is recomputed later),
   repeatedly, possibly the request itself;
2. then waiting requests (preempted ones at the front), while budget, blocks and the
   ``max_num_seqs`` cap allow; each first looks up its full prompt blocks in the prefix
   cache and only computes the rest. At least the last prompt token is always computed,
   so the step that finishes the prompt produces logits to sample from.

After the runner executes the plan, :meth:`Scheduler.update_after_step` advances
``num_computed_tokens``, registers newly full blocks in the prefix cache and appends
sampled tokens. Finishing and aborting free every block of the request at once.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvpush.config import CacheConfig, SchedulerConfig
from kvpush.grammar import Grammar
from kvpush.kv_cache.block_pool import BlockPool, hash_block_tokens
from kvpush.sampling_params import SampledToken, SamplingParams
from kvpush.scheduler.request import Request, RequestState


def _append_token(req: Request, sampled: SampledToken) -> None:
    """Every token a request gets, sampled here or token #1 sent with the KV: its
    grammar (if any) advances by it too."""
    req.output_token_ids.append(sampled.token)
    if req.grammar is not None:
        req.grammar.consume(sampled.token)
    if sampled.logprob is not None:
        req.output_logprobs.append(sampled.logprob)
    if sampled.top is not None:
        req.output_top_logprobs.append(sampled.top)


@dataclass
class ScheduledChunk:
    """Tokens of one request to run this step (plain data for the runner)."""

    request_id: str
    token_ids: list[int]
    start_pos: int  # position of token_ids[0] in the sequence
    block_ids: list[int]  # the request's whole block table (covers start_pos+len)
    sample: bool  # True when the chunk ends at the last known token: sample the next
    params: SamplingParams
    generator: torch.Generator | None = None
    #: (prompt ids, output ids so far) for a sampling chunk whose params penalize
    #: repeats (the request's own lists: read during the step, appended after it)
    history: tuple[list[int], list[int]] | None = None
    #: a sampling chunk's structured-output state: the sampler masks its row by it
    grammar: Grammar | None = None


@dataclass
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, sched: SchedulerConfig, cache: CacheConfig):
        self.config = sched
        self.block_size = cache.block_size
        self.pool = BlockPool(cache.num_blocks, cache.enable_prefix_caching,
                              cache.shuffle_free_blocks)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # decode side of P/D: requests whose prompt KV comes from a prefill instance,
        # waiting for blocks (in arrival order), then for their KV
        self.remote_pending: deque[Request] = deque()
        self.remote_waiting: dict[str, Request] = {}
        #: the last allocate_remote_pending could not serve the head of the queue, and
        #: nothing freed blocks since (no spinning)
        self._remote_stalled = False
        self.requests: dict[str, Request] = {}
        # set by the KV connector: returns True when it takes over a preempted request's
        # blocks (KV being sent from them must not be overwritten)
        #: called with a request being preempted and its blocks; True: the callee (the
        #: KV connector) takes the blocks and gives them back with release_blocks
        self.on_preempt: Callable[[Request, list[int]], bool] | None = None
        self.num_preemptions = 0
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0

    # ---- intake ------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def add_remote_request(self, req: Request) -> None:
        """A request whose prompt KV will come from a prefill instance. The KV connector
        gives it blocks with :meth:`allocate_remote` and releases it with
        :meth:`remote_kv_arrived` (or fails it)."""
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        req.state = RequestState.WAITING_FOR_REMOTE_KV
        self.requests[req.request_id] = req
        self.remote_pending.append(req)
        self._remote_stalled = False

    def has_remote_pending(self) -> bool:
        """Whether allocate_remote_pending could give blocks now."""
        return bool(self.remote_pending) and not self._remote_stalled

    def allocate_remote_pending(self) -> list[Request]:
        """Blocks for the waiting remote-KV requests, in arrival order, while blocks and
        the seq cap allow; the requests that got theirs."""
        got = []
        while self.remote_pending:
            req = self.remote_pending[0]
            if not self.allocate_remote(req):
                break
            self.remote_pending.popleft()
            got.append(req)
        self._remote_stalled = bool(self.remote_pending)
        return got

    def has_work(self) -> bool:
        """Whether step() would compute anything (remote-KV waits are not work)."""
        return bool(self.waiting or self.running)

    def can_allocate_remote(self) -> bool:
        return len(self.running) + len(self.remote_waiting) < self.config.max_num_seqs

    def allocate_remote(self, req: Request) -> bool:
        """Blocks for the whole prompt of a remote-KV request, reusing cached prefix
        blocks; False (nothing taken) when blocks or the seq cap do not allow it yet."""
        if not self.can_allocate_remote():
            return False
        if self._admit(req, budget=req.num_tokens) == 0:
            return False
        self.remote_waiting[req.request_id] = req
        return True

    def remote_kv_arrived(
        self, request_id: str, num_computed: int, first: SampledToken | None
    ) -> Request:
        """The request's KV up to ``num_computed`` tokens is in its blocks: it runs from
        here. ``first`` is token #1 (and its logprobs) when prefill sent it along."""
        req = self.remote_waiting.pop(request_id)
        req.num_computed_tokens = num_computed
        if first is not None:
            _append_token(req, first)
        self._cache_full_blocks(req)
        req.state = RequestState.RUNNING
        self.running.append(req)
        return req

    def remote_kv_failed(self, request_id: str) -> Request:
        """Give up on remote KV and prefill locally: the request queues like a new one
        (its blocks are freed; the prefix cache may still hold part of its prompt)."""
        req = self.remote_waiting.pop(request_id, None) or self.requests[request_id]
        with contextlib.suppress(ValueError):
            self.remote_pending.remove(req)
        if req.block_ids:
            self.pool.free(req.block_ids)
            req.block_ids = []
        req.num_computed_tokens = 0
        req.num_registered_blocks = 0
        req.state = RequestState.WAITING
        self.waiting.appendleft(req)
        return req

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- planning ----------------------------------------------------------------
    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        scheduled: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            need = self._blocks_for(req.num_computed_tokens + num_new) - len(req.block_ids)
            while need > self.pool.num_free:
                victim = self.running.pop()
                self._preempt(victim)
                plan.preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.state is not RequestState.RUNNING:
                break  # req itself was preempted; everything after it already was too
            if need > 0:
                req.block_ids.extend(self.pool.allocate(need))
            plan.chunks.append(self._chunk(req, num_new))
            scheduled.append(req)
            budget -= num_new
            i += 1

        if not plan.preempted:
            while (
                self.waiting
                and budget > 0
                and len(self.running) < self.config.max_num_seqs
            ):
                req = self.waiting[0]
                num_new = self._admit(req, budget)
                if num_new == 0:
                    break
                self.waiting.popleft()
                req.state = RequestState.RUNNING
                self.running.append(req)
                plan.chunks.append(self._chunk(req, num_new))
                budget -= num_new
            if not self.running and self.waiting and self._unfork_waiting():
                return self.schedule()  # (once: no waiting request holds blocks now)
        return plan

    def _unfork_waiting(self) -> bool:
        """Nothing runs that could free blocks and the waiting cannot start: the forked
        choices give up the prompt blocks they share (they start afresh, from the prefix
        cache where it holds them), so no fork waits forever. Whether any did."""
        forks = [r for r in self.waiting if r.block_ids]
        for req in forks:
            self.pool.free(self.detach_blocks(req))
            req.num_computed_tokens = 0
        return bool(forks)

    def _admit(self, req: Request, budget: int) -> int:
        """Give a waiting request its cached prefix and new blocks; 0 if it cannot run.
        A forked choice (:meth:`fork`) comes holding its request's prompt blocks."""
        tokens = req.all_token_ids
        bs = self.block_size
        held = bool(req.block_ids)
        if held:
            hit, num_computed = req.block_ids, req.num_computed_tokens
        else:
            self._extend_hashes(req, len(tokens))
            max_hit_blocks = (len(tokens) - 1) // bs  # always compute the last token
            hit = self.pool.lookup(req.block_hashes[:max_hit_blocks])
            num_computed = len(hit) * bs
        num_new = len(tokens) - num_computed
        if num_new > budget:
            if not self.config.enable_chunked_prefill:
                return 0
            num_new = budget
        need = self._blocks_for(num_computed + num_new) - len(hit)
        reclaimed = 0 if held else sum(1 for b in hit if self.pool.ref_counts[b] == 0)
        if need > self.pool.num_free - reclaimed:
            return 0
        if not held:
            self.pool.touch(hit)
            req.num_registered_blocks = len(hit)
        req.block_ids = hit + self.pool.allocate(need)
        req.num_computed_tokens = num_computed
        if req.num_preemptions == 0 and not held:
            req.num_cached_tokens = num_computed
            self.prefix_hit_tokens += num_computed
            self.prefix_query_tokens += len(tokens)
        if req.first_token_time is None:  # the last admission before token #1 (vLLM's)
            req.scheduled_time = time.perf_counter()
        return num_new

    def fork(self, parent: Request, child: Request) -> None:
        """Queue ``child``, another choice of ``parent``'s prompt, once the parent's
        prompt KV is complete (computed or received): it shares, by reference, every
        parent block that holds prompt tokens before the last one, and computes the
        rest of the prompt (at most one block) itself, so it samples its own token #1
        and writes only blocks of its own. It goes first among the waiting."""
        k = (parent.num_prompt_tokens - 1) // self.block_size
        shared = parent.block_ids[:k]
        assert len(shared) == k and child.prompt_token_ids == parent.prompt_token_ids
        self.pool.touch(shared)
        child.block_ids = list(shared)
        child.block_hashes = parent.block_hashes[:k]
        child.num_computed_tokens = k * self.block_size
        child.num_registered_blocks = min(k, parent.num_registered_blocks)
        child.state = RequestState.WAITING
        self.requests[child.request_id] = child
        self.waiting.appendleft(child)

    def _chunk(self, req: Request, num_new: int) -> ScheduledChunk:
        start = req.num_computed_tokens
        end = start + num_new
        sample = end == req.num_tokens
        return ScheduledChunk(
            request_id=req.request_id,
            token_ids=req.tokens_slice(start, end),
            start_pos=start,
            block_ids=list(req.block_ids),
            sample=sample,
            params=req.params,
            generator=req.generator,
            history=((req.prompt_token_ids, req.output_token_ids)
                     if sample and req.params.penalized else None),
            grammar=req.grammar if sample else None,
        )

    def _extend_hashes(self, req: Request, upto_tokens: int) -> None:
        bs = self.block_size
        while (len(req.block_hashes) + 1) * bs <= upto_tokens:
            j = len(req.block_hashes)
            parent = req.block_hashes[-1] if j else None
            req.block_hashes.append(
                hash_block_tokens(parent, req.tokens_slice(j * bs, (j + 1) * bs),
                                  req.params.cache_salt)
            )

    def _preempt(self, req: Request) -> None:
        blocks = self.detach_blocks(req)
        if self.on_preempt is None or not self.on_preempt(req, blocks):
            self.pool.free(blocks)
        req.num_computed_tokens = 0
        req.state = RequestState.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- results -----------------------------------------------------------------
    def update_after_step(
        self, plan: StepPlan, sampled: dict[str, SampledToken]
    ) -> list[Request]:
        """Advance computed counts and append sampled tokens; returns requests that got a
        new token (the engine checks their stop conditions)."""
        got_token: list[Request] = []
        for chunk in plan.chunks:
            req = self.requests.get(chunk.request_id)
            if req is None or req.state is not RequestState.RUNNING:
                continue  # aborted while the step ran
            req.num_computed_tokens = chunk.start_pos + len(chunk.token_ids)
            self._cache_full_blocks(req)
            if chunk.sample:
                _append_token(req, sampled[chunk.request_id])
                got_token.append(req)
        return got_token

    def _cache_full_blocks(self, req: Request) -> None:
        if not self.pool.enable_prefix_caching:
            return
        self._extend_hashes(req, req.num_computed_tokens)
        n_full = req.num_computed_tokens // self.block_size
        for j in range(req.num_registered_blocks, n_full):
            self.pool.cache_full_block(req.block_ids[j], req.block_hashes[j])
        req.num_registered_blocks = max(req.num_registered_blocks, n_full)

    # ---- block ownership (the KV connector's side of it) ------------------------------
    def detach_blocks(self, req: Request) -> list[int]:
        """Hand ``req``'s blocks to the caller — the KV connector, for a transfer that
        may still write or read them — and leave the request none. The caller gives
        them back with :meth:`release_blocks`."""
        blocks, req.block_ids = req.block_ids, []
        req.num_registered_blocks = 0
        return blocks

    def release_blocks(self, blocks: list[int]) -> None:
        """Give back blocks handed over by :meth:`detach_blocks`, ``finish(...,
        keep_blocks=True)`` or ``on_preempt``."""
        self.pool.free(blocks)
        self._remote_stalled = False

    # ---- ending ------------------------------------------------------------------
    def finish(
        self, request_id: str, state: RequestState, keep_blocks: bool = False
    ) -> Request | None:
        """End a request in any state (finished, aborted, failed) and free its blocks —
        unless ``keep_blocks``: then they go to the caller (the KV connector, lending
        them to a transfer), which took their ids before and gives them back with
        :meth:`release_blocks`. Either way the request holds none after."""
        assert state.finished
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        elif self.remote_waiting.pop(request_id, None) is None:
            with contextlib.suppress(ValueError):
                self.waiting.remove(req)
            with contextlib.suppress(ValueError):
                self.remote_pending.remove(req)
        self._remote_stalled = False
        blocks = self.detach_blocks(req)
        if blocks and not keep_blocks:
            self.pool.free(blocks)
        req.state = state
        return req
