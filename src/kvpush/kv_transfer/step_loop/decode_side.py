"""DecodeSide: the step loop's part of a decode instance's receives, push and pull.

The leg is stated (``Begin``, naming its prefill); the scheduler gives it blocks as they
come free (prefix cache first) and they are stated (``BlocksReady``); when decode holds
everything prefill could send, it computes the rest itself at once (push with
``--prefix-hit-tail decode``; pull with nothing to read). ``Over`` ends the wait: the KV
is in (push: token #1 goes out now; pull: the last prompt token is recomputed), or the
request fails or is recomputed here (``--kv-load-failure-policy``), or is refused as a
400 (its params do not fit prefill). A request that ends while KV may still land keeps
its blocks out of the pool (fenced) until ``Over``; ``Failing`` makes it end now.
"""

from __future__ import annotations

import logging
import math

from kvpush.errors import RequestError
from kvpush.kv_cache.block_pool import hash_prompt_chain
from kvpush.kv_transfer import actions as a
from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.params import KVTransferParams
from kvpush.kv_transfer.step_loop.holds import Hold, Holds
from kvpush.kv_transfer.wire import messages as m
from kvpush.sampling_params import MAX_TOP_LOGPROBS, SampledToken
from kvpush.scheduler.request import Request

log = logging.getLogger("kvpush.kv_transfer.step_loop.connector")


class DecodeSide:
    def __init__(self, holds: Holds, vocab_size: int) -> None:
        self.holds, self.vocab_size = holds, vocab_size
        self.pull = holds.cfg.mode == "pull"

    def add(self, req: Request, p: KVTransferParams, tid: str) -> None:
        holds, bs = self.holds, self.holds.block_size
        lent: tuple[int, ...] = ()
        if self.pull:
            if p.remote_block_ids is None:
                raise RequestError("pull needs kv_transfer_params.remote_block_ids",
                                   "kv_transfer_params")
            tid = p.transfer_id or p.remote_request_id or tid
            n_needed = -(-(req.num_prompt_tokens - 1) // bs)
            if len(p.remote_block_ids) < n_needed:
                raise RequestError(
                    f"kv_transfer_params.remote_block_ids has {len(p.remote_block_ids)}"
                    f" blocks; the prompt needs {n_needed}", "kv_transfer_params")
            lent, chain = tuple(p.remote_block_ids), ()
        else:  # the registration binds our blocks to this prompt (hashed once)
            chain = tuple(hash_prompt_chain(req.prompt_token_ids, bs, req.block_hashes,
                                            req.params.cache_salt))
            req.block_hashes = list(chain[:req.num_prompt_tokens // bs])
        holds.take(tid, req.request_id)
        holds.timeline.begin(tid, "d_added")
        holds.timeline.await_first(req.request_id, tid)
        holds.scheduler.add_remote_request(req)
        holds.state(c.Begin(tid, req.num_prompt_tokens, chain, c.PeerRef(
            p.remote_address, p.remote_engine_id, lent,
            p.lend_expires_ms if self.pull else None)))

    def before_schedule(self) -> None:
        """State the blocks of the receives the scheduler could give blocks to now."""
        holds, bs = self.holds, self.holds.block_size
        for req in holds.scheduler.allocate_remote_pending():
            tid = holds.by_request[req.request_id]
            n, hit = req.num_prompt_tokens, req.num_computed_tokens
            skip = hit // bs
            if self.pull:  # READ tokens [hit, n - 1); the last one is recomputed
                local = skip >= -(-(n - 1) // bs)  # nothing to read
                computed = n - 1
            else:  # with every full block here, compute the tail here if configured to
                local = (holds.cfg.prefix_hit_tail == "decode" and skip > 0
                         and skip == (n - 1) // bs)
                computed = hit
            holds.state(c.BlocksReady(tid, skip, list(req.block_ids), full_hit=local))
            if local:  # prefill is told; the request runs from here
                holds.detach(holds.by_tid[tid])
                holds.scheduler.remote_kv_arrived(req.request_id, computed, None)

    def finish(self, req: Request, tid: str, hold: Hold, error: str | None) -> bool:
        """The request ends while its KV may still come; True: its blocks stay here,
        fenced, until Over."""
        self.holds.detach(hold)
        self.holds.state(c.End(tid, error or "aborted"))
        hold.blocks = list(req.block_ids)
        return bool(hold.blocks)

    def on_failing(self, hold: Hold, ev: c.Failing) -> None:
        """The KV will not come but may still land: the request ends (or recomputes in
        fresh blocks) now, its blocks stay fenced until Over."""
        rid = hold.request_id
        if rid is None:
            return
        req = self.holds.scheduler.requests.get(rid)
        self.holds.detach(hold)
        if req is not None:
            hold.blocks = self.holds.scheduler.detach_blocks(req)
            self._fail_or_recompute(rid, self._message(ev.tid, ev.why))

    def on_over(self, hold: Hold, ev: c.Over) -> None:
        rid = hold.request_id
        req = self.holds.scheduler.requests.get(rid) if rid is not None else None
        if req is None:
            return
        if ev.outcome is c.Outcome.REJECTED:
            self.holds.actions.append(a.RejectRequest(rid, self._message(ev.tid, ev.why)))
        elif ev.outcome is not c.Outcome.OK:
            self._fail_or_recompute(rid, self._message(ev.tid, ev.why))
        elif self.pull:
            self.holds.scheduler.remote_kv_arrived(rid, req.num_prompt_tokens - 1, None)
        else:
            first = self._first_token(ev.first)
            if first is None:
                done = ev.first
                self._fail_or_recompute(rid, self._message(
                    ev.tid, f"prefill sent an invalid first token {done.first_token} "
                            f"(logprob {done.first_logprob}, top {done.first_top_logprobs})"))
                return
            self.holds.scheduler.remote_kv_arrived(rid, req.num_prompt_tokens, first)
            self.holds.actions.append(a.EmitFirstToken(rid))

    def _message(self, tid: str, why: str | None) -> str:
        msg = f"KV transfer {tid} from prefill failed: {why or 'the transfer failed'}"
        log.warning(msg)
        return msg

    def _fail_or_recompute(self, rid: str, msg: str) -> None:
        if self.holds.cfg.load_failure_policy == "recompute":
            self.holds.scheduler.remote_kv_failed(rid)
        else:
            self.holds.actions.append(a.FailRequest(rid, msg))

    def _first_token(self, done: m.PushDone | None) -> SampledToken | None:
        """Token #1 as prefill sent it, None if any part of it is out of range."""
        if done is None:
            return None

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
