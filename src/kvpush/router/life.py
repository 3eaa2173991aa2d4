"""How a routed request lives, said once: placement, legs, retries, migration, release,
outcome.

Lifecycle of one request (``RequestLife.run``)::

    place ──▶ legs ──▶ decode streams ──▶ finished (ok / error)
      │         │            │
      │         │            └─ decode lost ──▶ migrate: place again with the prompt
      │         │                               plus the tokens already made (at most
      │         │                               --migration-limit times), else 502
      │         └─ prefill lost before decode's first output ──▶ another prefill
      │                                            (or decode alone: fallback), else 502
      └─ no healthy decode (or prefill) ──▶ 503 naming the role

* **place** (:class:`Placement`): ``colocated`` (decode alone, the router's mode),
  ``local`` (decode's prefix cache holds most of the prompt; a decode that refuses it
  as full gets it back with a prefill leg, on another decode), ``fallback`` (no healthy
  prefill, ``--fallback-local-prefill``), else ``push`` or ``pull``.
* **legs**, each the engine's typed request to an instance (kvpush.router.senders):
  push sends prefill's and decode's at once under one transfer id and streams decode's
  outputs, prefill's draining in the background; pull runs prefill's first, then
  decode's with what prefill lent; local, colocated and fallback send decode's alone.
* **release**: a transfer whose decode refused, failed or was abandoned is dropped on
  prefill at once (``LegSender.release``), not at the end of its lease.
* **migration**: when the way to decode is lost (connection dropped, core died) the
  request continues elsewhere: the prompt plus every token made so far becomes the new
  prompt, ``max_tokens`` what is left, and the stream goes on from the next token. The
  text is made once for the whole request (one detokenizer, one set of stop strings),
  and usage counts the original prompt and every token once: the client sees one
  stream. A request with a grammar is not migrated (its matcher's state stays on the
  lost decode): it fails as before.
* **outcome**: ``ok``, ``error``, ``abort`` (client gone) or the status's
  (:func:`kvpush.router.job.outcome_for`); counted and logged once, when every part of
  the request (a push prefill leg may drain after the answer) is over (:class:`Book`).

Client-facing errors name no host, port or engine id; the log does, under the request id.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any

import msgspec

from kvpush.engine.output_processor import ChoiceTexts
from kvpush.engine.outputs import EngineOutput, FinishReason, RequestOutput
from kvpush.errors import RequestError
from kvpush.router.decide import Decision
from kvpush.router.job import RequestRecord, outcome_for
from kvpush.router.placement import Placement, fail
from kvpush.router.pool import Instance, Pool
from kvpush.router.redact import scrub
from kvpush.router.request_log import log_request
from kvpush.router.senders import Leg, LegSender
from kvpush.router.wire import LegKV, LegSigner, prefill_params, push_decode_params
from kvpush.server.errors import APIError

if TYPE_CHECKING:
    from kvpush.router.config import RouterConfig
    from kvpush.router.metrics import RouterMetrics
    from kvpush.sampling_params import SamplingParams

logger = logging.getLogger("kvpush.router")


class DecodeLost(Exception):
    """The way to the decode instance carrying the request is gone."""

    def __init__(self, inst: Instance, cause: str, why: str) -> None:
        super().__init__(why)
        self.inst, self.cause, self.why = inst, cause, why


class Book:
    """A request's accounting: its first byte, its parts, its one outcome, metric and
    log line. Shared by every path a request may take."""

    def __init__(self, cfg: RouterConfig, placement: Placement,
                 metrics: RouterMetrics) -> None:
        self.cfg = cfg
        self.placement = placement
        self.metrics = metrics

    def first_byte(self, job: RequestRecord) -> None:
        if job.first_byte is not None:
            return
        now = time.perf_counter()
        job.first_byte = now
        if job.d_sent is not None:
            job.d_first_byte_s = now - job.d_sent
            self.metrics.decode_first_byte_s.labels(job.mode).observe(job.d_first_byte_s)
        if job.stream:
            self.metrics.ttft_s.labels(job.mode).observe(now - job.arrival)

    def close(self, job: RequestRecord, outcome: str, status: int | None = None) -> None:
        """The client's answer is done (or abandoned): free what the request holds,
        count it. Idempotent."""
        if job.closed:
            return
        job.closed = True
        if status is not None:
            job.status = status
        elif not job.status:
            job.status = 200
        job.outcome = outcome
        self.placement.release_decode(job)
        if outcome == "abort" and job.p_task is not None and not job.p_task.done():
            job.p_task.cancel()  # the client is gone: so is the reason to prefill
        job.ended = time.perf_counter()
        r = job.route
        if r is not None:  # the cache-aware decision (none: refused before placement)
            self.metrics.decisions.labels(r.decision.value).inc()
            for role, n in (("decode", r.d_cached_tokens), ("prefill", r.p_cached_tokens)):
                if n is not None:
                    self.metrics.cached_tokens.labels(role).observe(n)
            self.metrics.prompt_tokens.observe(r.prompt_tokens)
        mode = job.mode or self.cfg.mode
        self.metrics.requests.labels(mode, job.outcome).inc()
        self.metrics.request_s.labels(mode, job.outcome).observe(job.ended - job.arrival)
        self.part_done(job)

    def prefill_done(self, job: RequestRecord, p: Instance, _leg: object = None) -> None:
        """Prefill's leg on ``p`` is over (a done callback of its task)."""
        self.placement.pool.release(p)
        self.part_done(job)

    @staticmethod
    def part_done(job: RequestRecord) -> None:
        job.parts -= 1
        if job.parts == 0:
            log_request(job)
            if job.on_done is not None:
                job.on_done()


class RequestLife:
    """Every routed request's life over one :class:`LegSender`."""

    def __init__(self, cfg: RouterConfig, book: Book, sender: LegSender,
                 signer: LegSigner, tokenizer: Any) -> None:
        self.cfg = cfg
        self.book = book
        self.placement: Placement = book.placement
        self.pool: Pool = book.placement.pool
        self.metrics = book.metrics
        self.sender = sender
        self.signer = signer
        self.tokenizer = tokenizer

    async def run(self, job: RequestRecord, prompt: list[int], params: SamplingParams
                  ) -> AsyncIterator[RequestOutput]:
        """The request's text outputs, however many legs and instances carried it."""
        status, outcome = 200, "abort"
        try:
            async for out in self._migrating(job, prompt, params):
                if out.finished:
                    failed = out.finish_reason is FinishReason.ERROR
                    outcome = "error" if failed else "ok"
                    if failed:
                        job.error = out.error
                yield out
        except RequestError as e:
            status, outcome = e.status_code, outcome_for(e.status_code)
            job.error = str(e)
            raise APIError(scrub(str(e), self.pool.engine_ids()), param=e.param,
                           code=e.code, status_code=e.status_code) from None
        except APIError as e:
            status, outcome = e.status_code, outcome_for(e.status_code)
            job.error = e.message
            raise
        finally:
            self.book.close(job, outcome, status)

    # ---- migration -----------------------------------------------------------------
    async def _migrating(self, job: RequestRecord, prompt: list[int], params: SamplingParams
                         ) -> AsyncIterator[RequestOutput]:
        text = ChoiceTexts(job.rid, self.tokenizer, params)
        made: list[int] = []  # every token the client's stream has been given
        first_token_time: float | None = None
        while True:
            leg_params = params
            if made:
                leg_params = dataclasses.replace(params,
                                                 max_tokens=params.max_tokens - len(made))
            outs = self._placed(job, prompt + made, leg_params)
            try:
                async for out in outs:
                    made += out.new_token_ids
                    first_token_time = first_token_time or out.first_token_time
                    out.num_prompt_tokens = len(prompt)
                    out.num_output_tokens = len(made)
                    out.first_token_time = first_token_time
                    res = text.process(out)
                    if res is None:
                        continue  # a choice a stop string ended (of n > 1)
                    yield res
                    if text.done:
                        return
                return
            except DecodeLost as lost:
                self._may_migrate(job, lost, len(made), params)
            finally:
                await outs.aclose()

    def _may_migrate(self, job: RequestRecord, lost: DecodeLost, made: int,
                     params: SamplingParams) -> None:
        """Raise the client's error unless the request may go on on another decode."""
        where = f"decode instance {lost.inst.url} ({lost.inst.engine_id}): {lost.why}"
        said = ("the decode instance stopped answering ("
                + ("its engine core died)" if lost.cause == "core_died"
                   else "its connection was lost)"))
        if job.migrations >= self.cfg.migration_limit:
            limit = self.cfg.migration_limit
            raise fail(job, 502, said, f"{where}; not migrated (--migration-limit {limit}: "
                       f"{job.migrations} so far)")
        if params.structured is not None or params.n > 1:
            raise fail(job, 502, said, f"{where}; not migrated: a guided request's grammar "
                       "state, or an n > 1 request's choices, were there")
        if not self.pool.has_healthy("decode"):
            raise fail(job, 502, f"{said} and no other decode instance is healthy",
                       f"{where}; no decode left")
        job.migrations += 1
        self.metrics.migrations.labels(lost.cause).inc()
        logger.warning("request %s: %s; migrating it with %d token(s) made (migration %d)",
                       job.rid, where, made, job.migrations)

    # ---- placement -----------------------------------------------------------------
    def _placed(self, job: RequestRecord, prompt: list[int], params: SamplingParams
                ) -> AsyncGenerator[EngineOutput, None]:
        """Decode's outputs, its legs placed now."""
        cfg = self.cfg
        self.placement.route(job, prompt, params)
        if cfg.mode == "colocated":
            job.mode = "colocated"
            if job.route is not None:
                job.route.decision = Decision.LOCAL
            return self._alone(job, prompt, params)
        if not self.pool.has_healthy("decode"):
            raise self.placement.unavailable(job, "decode")
        if self.placement.local(job):
            job.mode = "local"
            return self._local(job, prompt, params)
        return self._remote(job, prompt, params)

    def _remote(self, job: RequestRecord, prompt: list[int], params: SamplingParams
                ) -> AsyncGenerator[EngineOutput, None]:
        """Decode's outputs with a prefill leg (push or pull), or decode alone when no
        prefill is healthy and --fallback-local-prefill allows it."""
        p = self._pick_prefill(job, set())
        if p is None:
            if not self.cfg.fallback_local_prefill:
                raise self.placement.unavailable(job, "prefill")
            return self._fallback(job, prompt, params)
        job.mode = self.cfg.mode
        if self.cfg.mode == "pull":
            return self._pull(job, p, prompt, params)
        return self._push(job, p, prompt, params)

    def _pick_prefill(self, job: RequestRecord, tried: set[Instance]) -> Instance | None:
        """A prefill instance a leg can leave for now, not one of ``tried``."""
        while True:
            p = self.placement.pick("prefill", job, tried)
            if p is None or self._usable(p):
                return p
            self.pool.release(p)
            tried.add(p)

    def _pick_decode(self, job: RequestRecord) -> Instance:
        """A decode instance a leg can leave for now."""
        tried: set[Instance] = set()
        while True:
            d = self.placement.pick_decode(job, tried)
            if self._usable(d):
                return d
            tried.add(d)

    def _usable(self, inst: Instance) -> bool:
        """Whether a leg can leave for ``inst`` now. One whose way is gone leaves the
        rotation (the leg goes to another: a retry); one still handshaking is only
        passed over."""
        if self.sender.usable(inst):
            return True
        if not self.sender.handshaking(inst):
            self.pool.mark_failed(inst, "its engine core is not connected")
            self.metrics.retries.labels(inst.role).inc()
        return False

    def _retry_prefill(self, job: RequestRecord, p: Instance, tried: set[Instance]
                       ) -> Instance | None:
        """Prefill ``p`` was lost: another prefill instance (None: none)."""
        tried.add(p)
        other = self._pick_prefill(job, tried)
        if other is not None:
            self.metrics.retries.labels("prefill").inc()
            logger.info("request %s: prefill on %s was lost; starting again with %s",
                        job.rid, p.url, other.url)
        return other

    # ---- legs ------------------------------------------------------------------------
    async def _alone(self, job: RequestRecord, prompt: list[int], params: SamplingParams
                     ) -> AsyncGenerator[EngineOutput, None]:
        d = self._pick_decode(job)
        async for out in self._decode(job, d, job.new_transfer_id(), prompt, params, None):
            yield out

    async def _local(self, job: RequestRecord, prompt: list[int], params: SamplingParams
                     ) -> AsyncGenerator[EngineOutput, None]:
        """Decode alone computes what its prefix cache lacks. A decode that refuses it
        as full (429 or 503 before any output) while a prefill is healthy gets the
        request with a prefill leg instead, on another decode where one is healthy (the
        same one would most likely refuse that leg too)."""
        outs = self._alone(job, prompt, params)
        try:
            first = await anext(outs, None)
        except RequestError as e:
            await outs.aclose()
            if e.status_code not in (429, 503) or not self.pool.has_healthy("prefill") \
                    or job.route is None:
                raise
            logger.info("request %s: decode refused the local prefill (%d); sending it "
                        "with a prefill leg", job.rid, e.status_code)
            job.route.local_refused = True
            job.route.decision = Decision.REMOTE
            job.d_refused = job.decode
            outs = self._remote(job, prompt, params)
            first = await anext(outs, None)
        try:
            while first is not None:
                yield first
                first = await anext(outs, None)
        finally:
            await outs.aclose()

    def _fallback(self, job: RequestRecord, prompt: list[int], params: SamplingParams
                  ) -> AsyncGenerator[EngineOutput, None]:
        job.mode, job.prefill = "fallback", None
        return self._alone(job, prompt, params)

    def _prefill_kv(self, job: RequestRecord, p: Instance) -> tuple[str, LegKV]:
        tid = job.new_transfer_id()
        job.prefill = p
        return tid, self.signer.sign(prefill_params(tid), p, "prefill")

    async def _push(self, job: RequestRecord, p: Instance, prompt: list[int], params: SamplingParams
                    ) -> AsyncGenerator[EngineOutput, None]:
        """Both legs at once. Prefill lost before decode's first output (its KV had not
        all landed): decode's leg is withdrawn and the pair starts again with another
        prefill instance (or decode alone, with --fallback-local-prefill)."""
        tried: set[Instance] = set()
        while True:
            try:
                d = self._pick_decode(job)
            except BaseException:
                self.pool.release(p)
                raise
            tid, p_kv = self._prefill_kv(job, p)
            d_kv = self.signer.sign(push_decode_params(p, tid), d, "decode", p)
            job.legs_sent = time.perf_counter()
            p_task = asyncio.create_task(self._prefill(job, p, tid, prompt, params, p_kv))
            job.p_task = p_task
            job.parts += 1
            p_task.add_done_callback(functools.partial(self.book.prefill_done, job, p))
            outs = self._decode(job, d, tid, prompt, params, d_kv)
            finished = False
            try:
                first = asyncio.ensure_future(anext(outs, None))
                await asyncio.wait({first, p_task}, return_when=asyncio.FIRST_COMPLETED)
                if not first.done() and self.sender.lost(p) is not None:
                    first.cancel()
                    await asyncio.wait({first})
                    await outs.aclose()
                    other = self._retry_prefill(job, p, tried)
                    if other is None and not self.cfg.fallback_local_prefill:
                        raise fail(job, 502, "the prefill instance failed and no other "
                                   "prefill instance is healthy",
                                   f"prefill instance {p.url}: its way was lost")
                    self.placement.release_decode(job)
                    if other is None:
                        async for alone in self._fallback(job, prompt, params):
                            yield alone
                        return
                    p = other
                    continue
                out: EngineOutput | None = await first
                while out is not None:
                    finished = out.finished and out.finish_reason is not FinishReason.ERROR
                    yield out
                    out = await anext(outs, None)
                return
            finally:
                await outs.aclose()
                if not finished:  # refused, failed or abandoned: the KV has no reader
                    p_task.cancel()
                    self.sender.release(p, tid)

    async def _pull(self, job: RequestRecord, p: Instance, prompt: list[int], params: SamplingParams
                    ) -> AsyncGenerator[EngineOutput, None]:
        """Prefill's leg, then decode's with what prefill lent. Prefill lost during its
        leg: another prefill, a new transfer id (or decode alone, with
        --fallback-local-prefill)."""
        tried: set[Instance] = set()
        while True:
            tid, p_kv = self._prefill_kv(job, p)
            job.legs_sent = time.perf_counter()
            try:
                last = await self._prefill(job, p, tid, prompt, params, p_kv, reraise=True)
            finally:
                self.pool.release(p)
            lent = None if last is None else last.kv_transfer_params
            if lent is not None and last is not None \
                    and last.finish_reason is not FinishReason.ERROR:
                break
            if self.sender.lost(p) is not None:
                other = self._retry_prefill(job, p, tried)
                if other is not None:
                    p = other
                    continue
                if self.cfg.fallback_local_prefill:
                    async for out in self._fallback(job, prompt, params):
                        yield out
                    return
            why = (last.failure.message if last is not None and last.failure
                   else "it answered without kv_transfer_params")
            raise fail(job, 502, "the prefill instance failed this request: "
                       + scrub(why, self.pool.engine_ids()), f"prefill instance {p.url}: {why}")
        finished = False
        try:
            d = self._pick_decode(job)
            d_kv = self.signer.sign(lent.to_wire(), d, "decode", p)
            async for out in self._decode(job, d, tid, prompt, params, d_kv):
                finished = out.finished and out.finish_reason is not FinishReason.ERROR
                yield out
        finally:
            if not finished:  # prefill's lent blocks have no reader
                self.sender.release(p, tid)

    async def _prefill(self, job: RequestRecord, p: Instance, tid: str, prompt: list[int],
                       params: SamplingParams, kv: LegKV, reraise: bool = False
                       ) -> EngineOutput | None:
        """Run prefill's leg to its end: its last output (None: none came). A refusal is
        the request's answer when ``reraise`` (pull), else only logged (push: decode's
        outcome decides). Outcomes: ok, skipped (a full prefix hit on decode: nothing to
        compute), refused, error, cancelled."""
        t0 = time.perf_counter()
        last, outcome, error = None, "cancelled", None
        try:
            async for out in self.sender.stream(Leg(p, tid, prompt, params, kv)):
                last = out
            if last is None or last.finish_reason is FinishReason.ERROR:
                outcome = "error"
                error = last.failure.message if last is not None and last.failure \
                    else "no output"
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
            self.metrics.prefill_leg_s.labels(job.mode, outcome).observe(elapsed)
            if error is not None and job.mode == "push":
                logger.warning("request %s: prefill's leg failed: %s", job.rid, error)
        return last

    async def _decode(self, job: RequestRecord, d: Instance, tid: str, prompt: list[int],
                      params: SamplingParams, kv: LegKV | None
                      ) -> AsyncGenerator[EngineOutput, None]:
        """Decode's outputs; DecodeLost when its way is gone (the instance left the
        rotation at the drop)."""
        job.d_sent = time.perf_counter()
        async for out in self.sender.stream(Leg(d, tid, prompt, params, kv)):
            self.book.first_byte(job)
            if out.failure is not None:
                lost = self.sender.lost(d)
                if lost is not None:
                    raise DecodeLost(d, lost.cause, f"{lost.why} ({out.failure.message})")
                out.failure = msgspec.structs.replace(
                    out.failure, message=scrub(out.failure.message, self.pool.engine_ids()))
            yield out
