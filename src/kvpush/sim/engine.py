"""One simulated engine instance: inbox, scheduler and step loop (kvpush's semantics).

The step loop applies its inbox at every step boundary (commands and transfer events
wait for the step in flight, as in :class:`kvpush.engine.llm_engine.LLMEngine`), then
schedules like :class:`kvpush.scheduler.scheduler.Scheduler`: running requests first
(chunked prefill or one decode token each) under the token budget, then waiting ones in
arrival order while budget, sequence slots and free blocks last, with the prefix cache
consulted on admission (the last prompt token is always computed). A decode job whose
remote KV has landed waits in the same queue for a slot and budget, its blocks already
held. A step lasts what the
profile's step model says for its chunks, plus any work posted onto the step loop
(pull's READ post in vLLM).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvpush.sim.profile import InstanceLimits
from kvpush.sim.step_models import StepModel
from kvpush.sim.workload import SimRequest, Stage


@dataclass(eq=False)
class Job:
    """A request on one engine: P's leg (prefill, sample token #1, finish), D's
    (KV arrives from P, then decode) or a colocated one (prefill and decode)."""

    req: SimRequest
    max_outputs: int
    computed: int = 0
    outputs: int = 0
    blocks: int = 0          # blocks in its block table (cached prefix blocks included)
    owned: int = 0           # blocks it allocated (freed when it ends)
    hold: bool = False       # keep owned blocks after finishing (lent for a transfer)
    on_token: Callable[[Job, float], None] | None = None
    on_finish: Callable[[Job, float], None] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        """Tokens that must be computed before the next one can be sampled."""
        return self.req.prompt_len + self.outputs

    @property
    def prefilling(self) -> bool:
        return self.computed < self.req.prompt_len


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class EngineSim:
    def __init__(self, env: Any, name: str, step_model: StepModel,
                 limits: InstanceLimits, prefix_cache: dict[int, int] | None = None,
                 prefix_caching: bool = True) -> None:
        self.env = env
        self.name = name
        self.model = step_model
        self.limits = limits
        self.bs = limits.block_size
        self.free_blocks = limits.num_blocks
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self.inbox: list[Callable[[], None]] = []
        self.alloc_waiters: deque[Callable[[], bool]] = deque()
        self.prefix_caching = prefix_caching
        self.prefix_cache: dict[int, int] = dict(prefix_cache or {}) if prefix_caching else {}
        self.stall = 0.0
        self.busy_time = 0.0
        self.preemptions = 0
        self.step_hook: Callable[[list[tuple[Job, int]], float, float], None] | None = None
        self._wake = env.event()
        env.process(self._loop())

    # ---- inbox ---------------------------------------------------------------------
    def submit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the step loop at its next step boundary (at once when idle)."""
        self.inbox.append(fn)
        if not self._wake.triggered:
            self._wake.succeed()

    def submit_at(self, t: float, fn: Callable[[], None]) -> None:
        if t <= self.env.now:
            self.submit(fn)
            return
        ev = self.env.timeout(t - self.env.now)
        ev.callbacks.append(lambda _e: self.submit(fn))

    def add_stall(self, seconds: float) -> None:
        """Work done on the step loop itself (lengthens the next step)."""
        self.stall += seconds

    # ---- blocks and prefix cache ---------------------------------------------------
    def cached_tokens(self, req: SimRequest) -> int:
        """Prompt tokens this instance has in its prefix cache (whole blocks, never the
        last prompt token)."""
        if req.prefix_id is None:
            return 0
        hit = min(self.prefix_cache.get(req.prefix_id, 0), req.prefix_len)
        hit -= hit % self.bs
        return min(hit, ((req.prompt_len - 1) // self.bs) * self.bs)

    def remember_prefix(self, req: SimRequest) -> None:
        if req.prefix_id is not None and self.prefix_caching:
            full = req.prefix_len - req.prefix_len % self.bs
            self.prefix_cache[req.prefix_id] = max(self.prefix_cache.get(req.prefix_id, 0), full)

    def try_allocate(self, n: int) -> bool:
        if n > self.free_blocks:
            return False
        self.free_blocks -= n
        return True

    def release(self, n: int) -> None:
        self.free_blocks += n
        while self.alloc_waiters and self.alloc_waiters[0]():
            self.alloc_waiters.popleft()

    def when_allocated(self, fn: Callable[[], bool]) -> None:
        """Call ``fn`` (which allocates and returns True, or returns False) now, or again
        whenever blocks are freed, in order, until it succeeds."""
        if self.alloc_waiters or not fn():
            self.alloc_waiters.append(fn)

    # ---- requests ------------------------------------------------------------------
    def add(self, job: Job) -> None:
        self.waiting.append(job)

    def kv_landed(self, job: Job) -> None:
        """A job whose blocks and KV are in place (remote KV landed) waits for a sequence
        slot and token budget like any waiting request (vLLM: WAITING_FOR_REMOTE_KVS back
        to WAITING), without allocating its blocks again."""
        self.waiting.append(job)

    # ---- scheduling ----------------------------------------------------------------
    def _schedule(self) -> list[tuple[Job, int]]:
        plan: list[tuple[Job, int]] = []
        budget = self.limits.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            job = self.running[i]
            new = min(job.num_tokens - job.computed, budget)
            need = blocks_for(job.computed + new, self.bs) - job.blocks
            while need > self.free_blocks:  # preempt the newest, as kvpush does
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is job:
                    break
            if job.computed == 0 and job not in self.running:
                break  # job itself was preempted; everything after it already was
            if need > 0:
                self.free_blocks -= need
                job.blocks += need
                job.owned += need
            plan.append((job, new))
            budget -= new
            i += 1
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.limits.max_num_seqs):
            job = self.waiting[0]
            if job.blocks:  # remote KV landed: its blocks and computed tokens are in place
                done, held = job.computed, job.blocks
            else:
                done = self.cached_tokens(job.req)
                held = done // self.bs
            new = min(job.num_tokens - done, budget)
            need = blocks_for(done + new, self.bs) - held
            if need > self.free_blocks:
                break
            self.waiting.popleft()
            self.free_blocks -= need
            job.blocks, job.owned, job.computed = held + need, job.owned + need, done
            job.req.mark(Stage.PREFILL_STARTED, self.env.now)
            self.running.append(job)
            plan.append((job, new))
            budget -= new
        return plan

    def chunks(self, plan: list[tuple[Job, int]]) -> list[tuple[int, int, bool]]:
        """The step model's view of a plan: (new tokens, context, samples a token?). A
        chunk samples when it reaches the end of what is known (the prompt's last token,
        or a decode), as ``ScheduledChunk.sample`` does."""
        return [(n, j.computed, j.computed + n >= j.num_tokens) for j, n in plan]

    def _preempt(self, job: Job) -> None:
        """Preemption by recompute: free its blocks, back to the head of the queue."""
        self.release(job.owned)
        job.blocks = job.owned = job.computed = 0
        self.preemptions += 1
        self.waiting.appendleft(job)

    def _loop(self):  # a SimPy process
        env = self.env
        while True:
            while self.inbox:
                todo, self.inbox = self.inbox, []
                for fn in todo:
                    fn()
            plan = self._schedule()
            if not plan:
                if self.stall > 0:  # busy on the step loop with no batch to run
                    dt, self.stall = self.stall, 0.0
                    self.busy_time += dt
                    yield env.timeout(dt)
                    continue
                self._wake = env.event()
                yield self._wake
                continue
            dt = self.model.step_time(self.chunks(plan)) + self.stall
            self.stall = 0.0
            t0 = env.now
            if self.step_hook is not None:  # push times its WRITEs over the step
                self.step_hook(plan, t0, t0 + dt)
            self.busy_time += dt
            yield env.timeout(dt)
            self._complete(plan)

    def _complete(self, plan: list[tuple[Job, int]]) -> None:
        now = self.env.now
        for job, n in plan:
            was_prefilling = job.prefilling
            job.computed += n
            if job.computed < job.num_tokens:
                continue  # a chunk of a longer prefill
            if was_prefilling:
                self.remember_prefix(job.req)
            job.outputs += 1
            if job.on_token is not None:
                job.on_token(job, now)
            if job.outputs >= job.max_outputs:
                self.running.remove(job)
                if not job.hold:
                    self.release(job.owned)
                    job.owned = 0
                if job.on_finish is not None:
                    job.on_finish(job, now)
