"""The router as the front of kvpush engine cores: HTTP at the edge only.

:class:`ClusterEngine` is the EngineClient of the router's :class:`OpenAIFront`
(kvpush.server.app), the same front an instance serves with: it parses, applies chat
templates, tokenizes, checks, detokenizes (stop strings, logprobs) and formats. This
module places the request's legs and sends them as the engine's own typed requests to
the prefill and decode **engine cores** over their request planes
(kvpush.engine.core_link: ZMQ with CURVE keys from the cluster secret, msgspec); the
decode core's outputs come back the same way. No instance API process is on the path.

* push: a fresh transfer id; prefill's and decode's requests leave at once, decode's
  outputs stream to the client, prefill's drain in the background.
* pull: prefill's request first; decode's follows with the ``kv_transfer_params`` of
  prefill's last output.
* local (the cache-aware policy), colocated, fallback: decode's request alone.

Each request's ``kv_transfer_params`` are signed for the core they go to
(:class:`LegSigner`) and checked there, as on HTTP legs; a core is used only once its
request plane finished a CURVE handshake (it holds the cluster secret). When decode
refuses its request or the client goes away, prefill's request is cancelled (its core
aborts it) and prefill is told to release the transfer (``AbortTransfer``). The core
path serves only when every healthy instance has a request plane and the router has the
model's tokenizer; otherwise requests take the HTTP legs (kvpush.router.legs), as vLLM
instances need.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from kvpush.engine.core_link import RemoteCore
from kvpush.engine.outputs import FinishReason, RequestOutput
from kvpush.errors import RequestError
from kvpush.router.decide import Decision, Route
from kvpush.router.job import Job, outcome_for
from kvpush.router.pool import Instance
from kvpush.router.redact import scrub
from kvpush.router.wire import prefill_body, push_decode_params
from kvpush.server.errors import APIError

if TYPE_CHECKING:
    from kvpush.crypto.curve import CurveKeys
    from kvpush.router.legs import Legs
    from kvpush.sampling_params import SamplingParams
    from kvpush.server.protocol import Job as FrontJob

logger = logging.getLogger("kvpush.router")


class ClusterEngine:
    """The router's engine client: a request's legs on the cluster's engine cores."""

    def __init__(self, legs: Legs, keys: CurveKeys, tokenizer: Any) -> None:
        self.legs = legs
        self.pool = legs.pool
        self.cfg = legs.cfg
        self.tokenizer = tokenizer
        self._keys = keys
        #: one link per instance URL, to the request plane its /kv/info names
        self._cores: dict[str, RemoteCore] = {}
        #: links of instances that left the pool, closed once their requests are over
        self._leaving: set[RemoteCore] = set()
        self.pool.on_remove.append(self._forget)
        #: the router's jobs by request id, from the handler to ``generate``
        self.jobs: dict[str, Job] = {}

    # ---- which cores -------------------------------------------------------------------
    def core(self, inst: Instance) -> RemoteCore | None:
        """The link to ``inst``'s engine core (made on first sight of its request plane,
        remade when the address changes); None when it names none (vLLM)."""
        addr = (inst.info or {}).get("request_plane")
        if not isinstance(addr, str) or not addr:
            return None
        core = self._cores.get(inst.url)
        if core is not None and core.address == addr:
            return core
        if core is not None:
            core.close()
        core = RemoteCore(addr, self._keys, self.tokenizer)
        core.start()
        self._adopt(inst, core)
        return core

    def _adopt(self, inst: Instance, core: RemoteCore) -> None:
        """``core`` is ``inst``'s link: when its connection drops, the instance leaves
        the rotation at once (until a health check passes), as after a failed HTTP leg."""
        self._cores[inst.url] = core

        def lost(_why: str) -> None:
            if self._cores.get(inst.url) is core:
                self.pool.mark_failed(inst, "its engine core's connection was lost")

        core.on_lost = lost

    def serves(self) -> bool:
        """Whether requests can take the core path now: every healthy instance has a
        request plane whose core proved the secret (a CURVE handshake) and is connected;
        until then (a handshake in progress, a reconnection) they take the HTTP legs."""
        healthy = [i for i in self.pool.instances if i.healthy]
        return bool(healthy) and all(self.core(i) is not None and self.usable(i)
                                     for i in healthy)

    def usable(self, inst: Instance) -> bool:
        core = self._cores.get(inst.url)
        return core is not None and core.proven and core.health_problem() is None

    def close(self) -> None:
        cores = [*self._cores.values(), *self._leaving]
        self._cores, self._leaving = {}, set()
        for core in cores:
            core.close()

    def _forget(self, inst: Instance) -> None:
        """An instance left the pool (drained, its card gone): no new requests; its link
        closes once the requests in flight on it are over (they go on, as HTTP legs do)."""
        core = self._cores.pop(inst.url, None)
        if core is not None:
            self._leaving.add(core)
            self._close_idle()

    def _close_idle(self) -> None:
        for core in [c for c in self._leaving if not c.has_streams()]:
            self._leaving.discard(core)
            core.close()

    def note_stream(self, parsed: FrontJob) -> None:
        """The front parsed the request: whether its client streams (the router's TTFT
        counts streams only, as on the HTTP legs)."""
        job = self.jobs.get(parsed.request_id)
        if job is not None:
            job.stream = parsed.stream

    # ---- what OpenAIFront uses of its engine --------------------------------------------
    def health_problem(self) -> str | None:
        return None if self.pool.ready() else "no healthy prefill and decode instances"

    def kv_params(self, raw: object) -> None:
        if raw is not None:
            raise APIError("kv_transfer_params are cluster-internal: the router sets them "
                           "for each leg, and a client may not send its own",
                           status_code=403, param="kv_transfer_params",
                           code="kv_transfer_params_not_allowed")
        return None

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, kv_transfer_params: Any = None
                       ) -> AsyncIterator[RequestOutput]:
        job = self.jobs[request_id]
        if self.legs.policy is not None:
            job.route = Route(list(prompt_token_ids), cache_salt=params.cache_salt,
                              answer_tokens=params.max_tokens)  # (checked: at least 1)
        status, outcome = 200, "abort"
        try:
            async for out in self._place(job, prompt_token_ids, params):
                if out.finished:
                    failed = out.finish_reason is FinishReason.ERROR
                    outcome = "error" if failed else "ok"
                    if failed:
                        job.error = out.error
                yield out
        except RequestError as e:
            status, outcome = e.status_code, outcome_for(e.status_code)
            job.error = str(e)
            raise self._for_client(e) from None
        except APIError as e:
            status, outcome = e.status_code, outcome_for(e.status_code)
            job.error = e.message
            raise
        finally:
            await self.legs.close(job, outcome, status)
            if self._leaving:
                self._close_idle()

    def _for_client(self, e: RequestError) -> APIError:
        return APIError(scrub(str(e), self.pool.engine_ids()), param=e.param, code=e.code,
                        status_code=e.status_code)

    # ---- placement -----------------------------------------------------------------------
    def _decode_core(self, job: Job) -> tuple[Instance, RemoteCore]:
        """A decode instance whose core is connected now: one whose connection dropped
        leaves the rotation and another is picked (as an HTTP leg that cannot connect)."""
        tried: set[Instance] = set()
        while True:
            d = self.legs.pick_decode(job, tried)
            core = self._cores.get(d.url)
            if core is not None and self.usable(d):
                return d, core
            tried.add(d)
            self.pool.mark_failed(d, "its engine core is not connected")
            self.legs.metrics.retries.labels("decode").inc()

    def _place(self, job: Job, prompt: list[int], params: SamplingParams
                     ) -> AsyncIterator[RequestOutput]:
        legs, cfg = self.legs, self.cfg
        if cfg.mode == "colocated":
            job.mode = "colocated"
            if job.route is not None:
                job.route.decision = Decision.LOCAL
            return self._alone(job, prompt, params)
        if not self.pool.has_healthy("decode"):
            raise legs.unavailable(job, "decode")
        if legs.policy is not None and legs.policy.decide(job) is Decision.LOCAL:
            job.mode = "local"
            return self._alone(job, prompt, params)
        p = self.pool.pick("prefill", cost=legs.cost(job))
        if p is not None and not self.usable(p):
            self.pool.release(p)
            p = None
        if p is None:
            if not cfg.fallback_local_prefill:
                raise legs.unavailable(job, "prefill")
            job.mode, job.prefill = "fallback", None
            return self._alone(job, prompt, params)
        job.mode = cfg.mode
        if cfg.mode == "pull":
            return self._pull(job, p, prompt, params)
        return self._push(job, p, prompt, params)

    async def _alone(self, job: Job, prompt: list[int], params: SamplingParams
                     ) -> AsyncIterator[RequestOutput]:
        d, core = self._decode_core(job)
        tid = job.new_transfer_id()
        async for out in self._decode(job, core, tid, prompt, params, None):
            yield out

    async def _push(self, job: Job, p: Instance, prompt: list[int], params: SamplingParams
                    ) -> AsyncIterator[RequestOutput]:
        """Both requests at once. Prefill's core lost before decode's first output (its
        KV had not all landed): decode's request is withdrawn and the pair starts again
        with another prefill instance (or decode alone, with --fallback-local-prefill)."""
        legs = self.legs
        tried: set[Instance] = set()
        while True:
            try:
                d, d_core = self._decode_core(job)
            except BaseException:
                self.pool.release(p)
                raise
            p_core, tid, p_kv = self._prefill_leg(job, p)
            d_kv = legs.signer.sign(push_decode_params(p, tid), d, "decode", p)
            job.legs_sent = time.perf_counter()
            p_task = asyncio.create_task(self._prefill(job, p_core, tid, prompt, params, p_kv))
            job.p_task = p_task
            job.parts += 1
            p_task.add_done_callback(lambda _t, i=p: legs.prefill_done(job, i))
            outs = self._decode(job, d_core, tid, prompt, params, d_kv)
            finished = False
            try:
                first = asyncio.ensure_future(anext(outs, None))
                await asyncio.wait({first, p_task}, return_when=asyncio.FIRST_COMPLETED)
                if not first.done() and not p_core.connected:
                    first.cancel()
                    await asyncio.wait({first})
                    await outs.aclose()
                    other = self._retry_prefill(job, p, tried)
                    if other is None and not self.cfg.fallback_local_prefill:
                        logger.info("request %s: prefill's core was lost and no other "
                                    "prefill instance is healthy", job.rid)
                        raise legs.fail(job, 502, "the prefill instance failed and no "
                                        "other prefill instance is healthy",
                                        f"prefill instance {p.url}: its core was lost")
                    legs.release_decode(job)
                    if other is None:
                        job.mode, job.prefill = "fallback", None
                        async for out in self._alone(job, prompt, params):
                            yield out
                        return
                    p = other
                    continue
                out = await first
                while out is not None:
                    finished = out.finished and out.finish_reason is not FinishReason.ERROR
                    yield out
                    out = await anext(outs, None)
                return
            finally:
                await outs.aclose()
                if not finished:  # refused, failed or abandoned: the KV has no destination
                    p_task.cancel()
                    p_core.abort_transfer(tid)

    def _prefill_leg(self, job: Job, p: Instance) -> tuple[RemoteCore, str, dict[str, Any]]:
        """Prefill ``p`` takes the job under a new transfer id: its core, the id, and
        the leg's kv_transfer_params signed for it."""
        tid = job.new_transfer_id()
        job.prefill = p
        self.legs.picked(job, p)
        kv = self.legs.signer.sign(prefill_body({}, tid)["kv_transfer_params"], p, "prefill")
        return self._cores[p.url], tid, kv

    def _retry_prefill(self, job: Job, p: Instance, tried: set[Instance]) -> Instance | None:
        """Prefill ``p``'s core is gone (out of rotation since the drop: ``_adopt``);
        another prefill (None: none)."""
        tried.add(p)
        other = self.pool.pick("prefill", tried, cost=self.legs.cost(job))
        while other is not None and not self.usable(other):
            self.pool.release(other)
            tried.add(other)
            other = self.pool.pick("prefill", tried, cost=self.legs.cost(job))
        if other is not None:
            self.legs.metrics.retries.labels("prefill").inc()
            logger.info("request %s: prefill's core on %s was lost; starting again with "
                        "%s", job.rid, p.url, other.url)
        return other

    async def _pull(self, job: Job, p: Instance, prompt: list[int], params: SamplingParams
                    ) -> AsyncIterator[RequestOutput]:
        """Prefill's request, then decode's with what prefill lent. Prefill's core lost
        during its request: another prefill, a new transfer id (or decode alone, with
        --fallback-local-prefill)."""
        legs = self.legs
        tried: set[Instance] = set()
        while True:
            p_core, tid, p_kv = self._prefill_leg(job, p)
            job.legs_sent = time.perf_counter()
            try:
                last = await self._prefill(job, p_core, tid, prompt, params, p_kv,
                                           reraise=True)
            finally:
                self.pool.release(p)
            lent = None if last is None else last.kv_transfer_params
            if lent is not None and last is not None \
                    and last.finish_reason is not FinishReason.ERROR:
                break
            if not p_core.connected:
                other = self._retry_prefill(job, p, tried)
                if other is not None:
                    p = other
                    continue
                if self.cfg.fallback_local_prefill:
                    job.mode, job.prefill = "fallback", None
                    async for out in self._alone(job, prompt, params):
                        yield out
                    return
            why = (last.error if last is not None and last.error
                   else "it answered without kv_transfer_params")
            raise legs.fail(job, 502, "the prefill instance failed this request",
                            f"prefill instance {p.url}: {why}")
        finished = False
        try:
            d, d_core = self._decode_core(job)
            d_kv = legs.signer.sign(lent.to_wire(), d, "decode", p)
            async for out in self._decode(job, d_core, tid, prompt, params, d_kv):
                finished = out.finished and out.finish_reason is not FinishReason.ERROR
                yield out
        finally:
            if not finished:  # prefill's lent blocks have no reader
                p_core.abort_transfer(tid)

    async def _prefill(self, job: Job, core: RemoteCore, tid: str, prompt: list[int],
                       params: SamplingParams, kv: dict[str, Any], reraise: bool = False
                       ) -> RequestOutput | None:
        """Run prefill's request to its end: its last output (None: none came). A
        refusal is the job's answer when ``reraise`` (pull), else only logged (push:
        decode's outcome decides). Outcomes as the HTTP legs': ok, skipped (a full
        prefix hit on decode: nothing to compute), refused, error, cancelled."""
        t0 = time.perf_counter()
        last, outcome, error = None, "cancelled", None
        try:
            async for out in core.generate(tid, prompt, params, kv):
                last = out
            if last is None or last.finish_reason is FinishReason.ERROR:
                outcome, error = "error", last.error if last is not None else "no output"
            else:
                outcome = "ok"
        except RequestError as e:
            if job.mode == "push" and e.code == "prefill_not_needed":
                outcome = "skipped"
            else:
                outcome, error = "refused", f"{e.status_code}: {e}"
                if reraise:
                    raise
        finally:
            elapsed = time.perf_counter() - t0
            job.p_leg_s = elapsed
            job.p_outcome = outcome if error is None else f"{outcome}: {error}"
            self.legs.metrics.prefill_leg_s.labels(job.mode, outcome).observe(elapsed)
            if error is not None and job.mode == "push":
                logger.warning("request %s: prefill's request failed: %s", job.rid, error)
        return last

    async def _decode(self, job: Job, core: RemoteCore, tid: str, prompt: list[int],
                      params: SamplingParams, kv: dict[str, Any] | None
                      ) -> AsyncIterator[RequestOutput]:
        job.d_sent = time.perf_counter()
        first = True
        async for out in core.generate(tid, prompt, params, kv):
            if first:
                first = False
                self.legs.first_byte(job)
            if out.finish_reason is FinishReason.ERROR and not core.connected:
                # the core went away (killed, or silent past the heartbeats; its
                # instance left the rotation at the drop): the client's answer is a
                # 502, as when an HTTP leg's instance stops
                d = job.decode
                where = d.url if d is not None else core.address
                raise self.legs.fail(job, 502, "the decode instance stopped answering "
                                     "(its engine core's connection was lost)",
                                     f"decode instance {where}: {out.error}")
            if out.error:
                out.error = scrub(out.error, self.pool.engine_ids())
            yield out
