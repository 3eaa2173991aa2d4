"""The KV hand-off between a prefill and a decode engine: pull and push.

Pull (vLLM NixlConnector semantics): P prefills its ``max_tokens=1`` leg and keeps its
blocks; the router relays P's answer to D; at its next step boundary D allocates, sets up
and posts a READ (on its step loop when ``handoff.pull_post_on_step_loop``, else on its
transfer thread), the READ crosses the link, D notices it at a step boundary and
recomputes the last prompt token to sample token #1; PullDone lets P free.

Push: both legs at once; D allocates on arrival and registers (one side-channel
message); P WRITEs each newly completed block layer group by layer group
(``handoff.push_layers_per_write``) as its forward pass completes the group (writer
thread: post cost; link: bytes, serial), the last blocks when prefill ends, and sends
PushDone with token #1 once every WRITE is done; D appends token #1 at its next step
boundary (``handoff.push_token_with_kv``; else, as vLLM, D recomputes the last prompt
token once the KV has landed). In both modes a decode job whose KV has landed waits at D
for a sequence slot and token budget (:meth:`EngineSim.kv_landed`). Decode-side prefix
hits shrink the transfer to the blocks D lacks; P computes the prompt (its own prefix
cache permitting, only the tail), as kvpush's default ``--prefix-hit-tail prefill`` does.

Descriptors: one per layer per run of block ids consecutive on both sides; with
``fragmentation`` f in [0, 1], a run of n blocks splits into ``1 + f * (n - 1)`` runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpush.sim.engine import EngineSim, Job, blocks_for
from kvpush.sim.profile import Profile
from kvpush.sim.workload import SimRequest, Stage


def runs(blocks: int, fragmentation: float) -> int:
    """Runs of consecutive block ids a transfer of ``blocks`` blocks splits into."""
    return max(1, round(1 + fragmentation * (blocks - 1))) if blocks > 0 else 0


class LinkState(dict):
    """Serial resources as 'free at' times: writer threads, transfer threads, links."""

    def take(self, key: Any, start: float, duration: float) -> float:
        self[key] = max(start, self.get(key, 0.0)) + duration
        return self[key]


@dataclass(eq=False)
class PushXfer:
    req: SimRequest
    p: EngineSim
    d: EngineSim
    skip_blocks: int = 0
    registered_at: float | None = None
    #: (step start, step end, first block, end block) of blocks P's steps completed
    pieces: list[tuple[float, float, int, int]] = field(default_factory=list)
    done: float = 0.0
    prefill_done: float | None = None
    p_job: Job | None = None
    d_job: Job | None = None
    finalized: bool = False


class Handoff:
    """Drives the pull and push protocols between engines (one per simulated cluster)."""

    def __init__(self, env: Any, profile: Profile, fragmentation: float, emit) -> None:
        self.env = env
        self.profile = profile
        self.frag = fragmentation
        self.emit = emit  # emit(job, t): a token leaves D for the client
        self.res = LinkState()
        shape = profile.model
        self.layers = shape.num_layers
        self.block_layer_bytes = profile.instance.block_size * shape.kv_bytes_per_token \
            // shape.num_layers
        self.bs = profile.instance.block_size

    # ------------------------------------------------------------------------ pull
    def pull(self, req: SimRequest, p: EngineSim, d: EngineSim) -> None:
        ho = self.profile.handoff

        def p_done(job: Job, t: float) -> None:
            req.mark(Stage.PREFILL_DONE, t)
            relayed = t + ho.http_hop_s + ho.relay_s
            req.mark(Stage.RELAYED, relayed)
            d.submit_at(relayed + ho.http_hop_s, lambda: d_arrive(job))

        def d_arrive(p_job: Job) -> None:
            req.mark(Stage.DECODE_RECEIVED, self.env.now)
            hit = d.cached_tokens(req)
            total = blocks_for(req.prompt_len, self.bs)
            need = total - hit // self.bs

            def alloc() -> bool:
                if not d.try_allocate(need):
                    return False
                d_job = Job(req, req.output_len, computed=req.prompt_len - 1,
                            blocks=total, owned=need, on_token=self.emit,
                            on_finish=lambda j, t: d.remember_prefix(req))
                post_read(p_job, d_job, need)
                return True

            d.when_allocated(alloc)

        def post_read(p_job: Job, d_job: Job, nblocks: int) -> None:
            now = self.env.now
            req.mark(Stage.DECODE_ALLOCATED, now)
            tr = self.profile.transfer
            descs = self.layers * runs(nblocks, self.frag)
            nbytes = nblocks * self.block_layer_bytes * self.layers
            req.descs, req.transfer_bytes = descs, nbytes
            if nblocks == 0:
                done = now
            else:
                cost = tr.setup_s + tr.post_time(descs)
                if ho.pull_post_on_step_loop:
                    d.add_stall(cost)
                    posted = now + cost
                else:
                    posted = self.res.take(("xfer", d.name), now, cost)
                req.mark(Stage.TRANSFER_POSTED, posted)
                done = self.res.take(("link", p.name, d.name), posted,
                                     tr.wire_time(nbytes, descs)) + tr.latency_s
            req.mark(Stage.TRANSFER_DONE, done)
            d.submit_at(done, lambda: d.kv_landed(d_job))
            p.submit_at(done + ho.side_channel_s, lambda: self._free_p(p, p_job))

        p.submit(lambda: p.add(Job(req, 1, hold=True, on_finish=p_done)))

    def _free_p(self, p: EngineSim, job: Job) -> None:
        job.req.mark(Stage.NOTIFIED, self.env.now)  # PullDone reached P
        p.release(job.owned)

    # ------------------------------------------------------------------------ push
    def push_prefill_leg(self, xf: PushXfer) -> None:
        """P's leg has arrived at P (router -> P)."""
        p = xf.p

        def on_finish(job: Job, t: float) -> None:
            xf.req.mark(Stage.PREFILL_DONE, t)
            xf.prefill_done = t
            self._push_finalize(xf)

        def arrive() -> None:
            job = Job(xf.req, 1, hold=True, on_finish=on_finish)
            job.extra["push"] = xf
            xf.p_job = job
            p.add(job)

        xf.req.mark(Stage.PREFILL_RECEIVED, self.env.now)
        p.submit(arrive)

    def push_decode_leg(self, xf: PushXfer) -> None:
        """D's leg has arrived at D; runs at D's next step boundary."""
        d, req, ho = xf.d, xf.req, self.profile.handoff

        def arrive() -> None:
            req.mark(Stage.DECODE_RECEIVED, self.env.now)
            hit = d.cached_tokens(req)
            total = blocks_for(req.prompt_len, self.bs)
            need = total - hit // self.bs

            def alloc() -> bool:
                if not d.try_allocate(need):
                    return False
                now = self.env.now
                req.mark(Stage.DECODE_ALLOCATED, now)
                xf.skip_blocks = hit // self.bs
                # token #1 with PushDone (kvpush), or D recomputes the last prompt token
                carried = int(ho.push_token_with_kv)
                xf.d_job = Job(req, req.output_len, computed=req.prompt_len - 1 + carried,
                               outputs=carried, blocks=total, owned=need, on_token=self.emit,
                               on_finish=lambda j, t: d.remember_prefix(req))
                reg = now + ho.side_channel_s
                ev = self.env.timeout(ho.side_channel_s)
                ev.callbacks.append(lambda _e: self._registered(xf, reg))
                return True

            d.when_allocated(alloc)

        d.submit(arrive)

    def _registered(self, xf: PushXfer, t: float) -> None:
        xf.registered_at = t
        xf.req.mark(Stage.REGISTERED, t)
        self._pump(xf)
        self._push_finalize(xf)

    def on_prefill_step(self, plan: list[tuple[Job, int]], t0: float, t1: float) -> None:
        """P's step hook: queue the per-layer WRITEs of blocks this step completes."""
        for job, n in plan:
            xf = job.extra.get("push")
            if xf is None:
                continue
            # the whole blocks the chunk fills and, when it ends the prompt, the last
            # partial one; those D holds already are dropped in _pump
            after = job.computed + n
            end = -(-after // self.bs) if after >= job.req.prompt_len else after // self.bs
            if end > job.computed // self.bs:
                xf.pieces.append((t0, t1, job.computed // self.bs, end))
        for job, _ in plan:
            xf = job.extra.get("push")
            if xf is not None:
                self._pump(xf)

    def _pump(self, xf: PushXfer) -> None:
        if xf.registered_at is None:
            return
        tr = self.profile.transfer
        pieces, xf.pieces = xf.pieces, []
        for t0, t1, first, end in pieces:
            nblocks = end - max(first, xf.skip_blocks)  # D's prefix hit is not sent
            if nblocks <= 0:
                continue
            d_runs = runs(nblocks, self.frag)
            nbytes = nblocks * self.block_layer_bytes
            xf.req.descs += d_runs * self.layers
            xf.req.transfer_bytes += nbytes * self.layers
            group = min(self.profile.handoff.push_layers_per_write, self.layers)
            for first in range(0, self.layers, group):
                last = min(first + group, self.layers)  # one WRITE: layers [first, last)
                n = last - first
                ready = max(t0 + last / self.layers * (t1 - t0), xf.registered_at)
                posted = self.res.take(("writer", xf.p.name), ready, tr.post_time(n * d_runs))
                xf.req.stages[Stage.TRANSFER_POSTED] = posted
                end = self.res.take(("link", xf.p.name, xf.d.name), posted,
                                    tr.wire_time(n * nbytes, n * d_runs)) + tr.latency_s
                xf.done = max(xf.done, end)

    def _push_finalize(self, xf: PushXfer) -> None:
        if xf.finalized or xf.prefill_done is None:
            return
        p_job = xf.p_job
        if xf.registered_at is None:
            return  # P holds its blocks until D registers
        xf.finalized = True
        done = max(xf.done, xf.prefill_done, xf.registered_at)
        xf.req.mark(Stage.TRANSFER_DONE, done)
        xf.p.submit_at(done, lambda: xf.p.release(p_job.owned))
        d, d_job = xf.d, xf.d_job

        def notice() -> None:
            xf.req.mark(Stage.NOTIFIED, self.env.now)
            if not self.profile.handoff.push_token_with_kv:
                d.kv_landed(d_job)  # computes the last prompt token: token #1
                return
            self.emit(d_job, self.env.now)  # token #1 travelled with the notice
            if d_job.outputs >= d_job.max_outputs:
                d.release(d_job.owned)
                d.remember_prefix(xf.req)
            else:
                d.kv_landed(d_job)

        d.submit_at(done + self.profile.handoff.side_channel_s, notice)
