"""One client request through the pool: the prefill and decode legs.

* push: a fresh transfer id; both legs sent at once — prefill gets the prompt with
  ``do_remote_decode``, decode gets it with prefill's identity (from its /kv/info) — and
  decode's answer goes back to the client as it comes. The prefill leg drains in the
  background; decode's outcome decides the client's answer.
* pull: prefill first, then decode with the ``kv_transfer_params`` prefill answered.
* colocated / fallback: one leg, to a decode (or role=both) instance, as the client sent
  it (fallback: without ``kv_transfer_params``, so decode prefills locally).

Both legs carry the transfer id as ``X-Request-Id`` (vLLM matches push legs by it). A
leg that hits a connection error takes the instance out of rotation at once, and is sent
again elsewhere where that is safe: a decode leg that could not connect (any mode); a
prefill leg that failed in pull mode; in push mode, a prefill leg that failed before
decode answered (decode's leg is cancelled and the pair starts again with a new transfer
id). Every wait on an instance is bounded (kvpush.router.config: the wait for an answer
to start, then each read of a stream) and ends at once when a health check fails on that
instance (kvpush.router.watch); a client that goes away cancels everything still
running, which closes the connections, which makes the instances abort the request and
free its blocks.

Client-facing errors say "the decode instance" and name no host, port or engine id; the
router's log names them, with the request id the client has as ``X-Request-Id``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any, cast

import httpx
from fastapi.responses import Response

from kvpush.router.config import RouterConfig
from kvpush.router.decide import Decision
from kvpush.router.job import Job, PrefillResult
from kvpush.router.placement import fail
from kvpush.router.pool import Instance, describe_error
from kvpush.router.redact import scrub
from kvpush.router.watch import LegLost, LegWatch
from kvpush.router.wire import (
    AnswerTooLarge,
    ErrorFrames,
    FrameTooLong,
    LegSigner,
    prefill_body,
    push_decode_params,
    read_answer,
    relay_error,
)
from kvpush.server.errors import APIError

if TYPE_CHECKING:
    from kvpush.router.life import Book

logger = logging.getLogger("kvpush.router")

#: the request can never have reached the instance: safe to send it elsewhere
NEVER_SENT = (httpx.ConnectError, httpx.ConnectTimeout)
#: the instance went away (or never answered): it leaves the rotation
CONNECTION_LOST = (httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadError,
                   httpx.WriteError, httpx.RemoteProtocolError)


class Legs:
    def __init__(self, cfg: RouterConfig, book: Book, client: httpx.AsyncClient,
                 signer: LegSigner) -> None:
        self.cfg = cfg
        self.book = book
        self.placement = book.placement
        self.pool = book.placement.pool
        self.metrics = book.metrics
        self.client = client
        self.signer = signer
        self._background: set[asyncio.Task] = set()  # fire-and-forget aborts

    # ------------------------------------------------------------------ entry point

    async def dispatch(self, job: Job) -> Response | httpx.Response:
        """A ready answer, or decode's open streaming answer (200) to relay."""
        if self.cfg.mode == "colocated":
            job.mode = "colocated"
            if job.route is not None:
                job.route.decision = Decision.LOCAL  # there is no other way here
            return await self._single(job, job.body)
        if not self.pool.has_healthy("decode"):
            raise self.placement.unavailable(job, "decode")
        if self.placement.local(job):
            local = await self._local(job)
            if local is not None:
                return local
        p = self.placement.pick("prefill", job)
        if p is None:
            if not self.cfg.fallback_local_prefill:
                raise self.placement.unavailable(job, "prefill")
            return await self._fallback(job)
        job.mode = self.cfg.mode
        if self.cfg.mode == "pull":
            return await self._pull(job, p)
        return await self._push(job, p)

    # ------------------------------------------------------------------ paths

    async def _local(self, job: Job) -> Response | httpx.Response | None:
        """Decode alone computes what its prefix cache lacks (the cache-aware policy's
        ``local``). None when decode refused it (429/503: full) and a prefill instance
        is healthy: the caller sends it with a prefill leg instead, to another decode
        if one is healthy (the same one would most likely refuse its leg too)."""
        job.mode = "local"
        body = {k: v for k, v in job.body.items() if k != "kv_transfer_params"}
        result = await self._single(job, body)
        if (isinstance(result, Response) and result.status_code in (429, 503)
                and self.pool.has_healthy("prefill") and job.route is not None):
            logger.info("request %s: decode refused the local prefill (HTTP %d); sending "
                        "it with a prefill leg", job.rid, result.status_code)
            job.route.local_refused = True
            job.d_refused = job.decode
            job.route.decision = Decision.REMOTE
            job.mode = self.cfg.mode
            return None
        return result

    async def _single(self, job: Job, body: dict[str, Any]) -> Response | httpx.Response:
        d = self.placement.pick_decode(job)
        return await self._decode_leg(job, d, body, job.new_transfer_id())

    async def _fallback(self, job: Job) -> Response | httpx.Response:
        job.mode = "fallback"
        job.prefill = None
        body = {k: v for k, v in job.body.items() if k != "kv_transfer_params"}
        return await self._single(job, body)

    async def _pull(self, job: Job, p: Instance) -> Response | httpx.Response:
        tried: set[Instance] = set()
        while True:
            tid = job.new_transfer_id()
            job.legs_sent = time.perf_counter()
            try:
                r = await self._prefill_leg(
                    job, p, self._signed_prefill_body(job, p, tid), tid)
            finally:
                self.pool.release(p)
            if r.never_sent or r.lost:
                tried.add(p)
                other = self.placement.pick("prefill", job, tried)
                if other is not None:
                    self.metrics.retries.labels("prefill").inc()
                    p = other
                    continue
                if self.cfg.fallback_local_prefill:
                    return await self._fallback(job)
                raise fail(job, 502, f"the prefill instance failed ({r.error}) and no "
                                 "other prefill instance is healthy",
                                 f"prefill instance {p.url} failed: {r.error}")
            if r.timed_out:
                raise fail(job, 504, f"the prefill instance did not answer ({r.error})",
                                 f"prefill instance {p.url} timed out: {r.error}")
            assert r.status is not None
            if r.status != 200:
                return relay_error(r.status, r.content, "prefill", p, job.rid,
                                   self.pool.engine_ids())
            try:
                kv = json.loads(r.content).get("kv_transfer_params")
            except (ValueError, AttributeError):
                kv = None
            if not isinstance(kv, dict):
                raise fail(job, 502, "the prefill instance answered without "
                                 "kv_transfer_params (is it a prefill instance in pull "
                                 "mode?)", f"prefill instance {p.url} answered without "
                                 "kv_transfer_params")
            d = self.placement.pick_decode(job)
            return await self._decode_leg(job, d, {**job.body, "kv_transfer_params": kv}, tid)

    async def _push(self, job: Job, p: Instance) -> Response | httpx.Response:
        tried: set[Instance] = set()
        while True:
            try:
                d = self.placement.pick_decode(job)
            except APIError:
                self.pool.release(p)
                raise
            tid = job.new_transfer_id()
            job.prefill = p
            d_body = {**job.body, "kv_transfer_params": push_decode_params(p, tid)}
            job.legs_sent = time.perf_counter()
            p_task = asyncio.create_task(
                self._prefill_leg(job, p, self._signed_prefill_body(job, p, tid), tid))
            job.p_task = p_task
            job.parts += 1
            p_task.add_done_callback(functools.partial(self.book.prefill_done, job, p))
            d_task = asyncio.create_task(self._decode_leg(job, d, d_body, tid))
            try:
                await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
                pr = p_task.result() if p_task.done() else None
                if not d_task.done() and pr is not None and (pr.never_sent or pr.lost):
                    # Prefill is gone before decode answered (a kvpush decode answers once
                    # it has token #1, so the KV had not all landed): decode would wait
                    # for it until its lease ends. Start again with another prefill
                    # instance, or let decode prefill locally.
                    tried.add(p)
                    other = self.placement.pick("prefill", job, tried)
                    if other is not None or self.cfg.fallback_local_prefill:
                        logger.info("request %s: prefill leg on %s failed before decode "
                                    "answered; starting again %s", job.rid, p.url,
                                    f"with {other.url}" if other else "without prefill")
                        await _cancel(d_task)
                        await self.close_upstream(job)  # releases the decode instance
                        if other is None:
                            return await self._fallback(job)
                        self.metrics.retries.labels("prefill").inc()
                        p = other
                        continue
                    logger.info("request %s: prefill leg on %s failed and no other prefill "
                                "instance is healthy; decode decides", job.rid, p.url)
                result = d_task.result() if d_task.done() else await d_task
                if isinstance(result, Response) and result.status_code != 200:
                    p_task.cancel()  # decode refused it: prefill's KV has no destination
                return result
            except BaseException:
                # client gone, or decode's leg failed without an answer: the KV has no
                # destination, so prefill's leg goes too
                p_task.cancel()
                await _cancel(d_task)
                await self.close_upstream(job)
                raise

    def _signed_prefill_body(self, job: Job, p: Instance, tid: str) -> dict[str, Any]:
        """The prefill leg's body, its params signed for ``p`` (vLLM with kvpush's
        connector checks them: LegSigner). They name no decode instance: in push a
        decode leg that cannot connect goes to another decode under the same id."""
        body = prefill_body(job.body, tid)
        body["kv_transfer_params"] = self.signer.sign(body["kv_transfer_params"], p,
                                                      "prefill")
        return body

    # ------------------------------------------------------------------ legs

    async def _prefill_leg(self, job: Job, p: Instance, body: dict[str, Any],
                           tid: str) -> PrefillResult:
        """Send and read a prefill leg; never raises (but for cancellation). The caller
        releases ``p``."""
        t0 = time.perf_counter()
        r = PrefillResult()
        outcome = "cancelled"
        try:
            req = self.client.build_request("POST", p.url + job.path, json=body,
                                            headers={"X-Request-Id": tid})
            with LegWatch(p.watches, "prefill leg"):  # nothing comes before prefill ends
                resp = await self.client.send(req, stream=True)
                try:
                    r.content = await read_answer(resp, self.cfg.max_answer_bytes)
                finally:
                    await resp.aclose()
            r.status = resp.status_code
            r.content_type = resp.headers.get("content-type")
            outcome = "ok" if resp.status_code == 200 else "http_error"
            if resp.status_code != 200:
                text = r.content[:300].decode("utf-8", "replace")
                r.error = f"HTTP {resp.status_code}: {text}"
        except CONNECTION_LOST as e:
            r.error = describe_error(e)
            r.never_sent = isinstance(e, NEVER_SENT)
            r.lost = not r.never_sent
            outcome = "connection_error"
            self.pool.mark_failed(p, f"prefill leg: {r.error}")
        except httpx.TimeoutException as e:
            r.error, r.timed_out, outcome = describe_error(e), True, "timeout"
        except httpx.HTTPError as e:  # e.g. a malformed answer
            r.error, r.lost, outcome = describe_error(e), True, "connection_error"
        except AnswerTooLarge as e:  # a broken (or hostile) instance: as malformed
            r.error, r.lost, outcome = str(e), True, "connection_error"
        except LegLost as e:  # a health check failed on it meanwhile: out of rotation
            r.error, r.lost, outcome = e.reason, True, "connection_error"
        finally:
            elapsed = time.perf_counter() - t0
            if job.prefill is p:
                job.p_leg_s = elapsed
                job.p_outcome = outcome if r.error is None else f"{outcome}: {r.error}"
            self.metrics.prefill_leg_s.labels(job.mode, outcome).observe(elapsed)
            if r.error is not None and job.mode == "push":
                logger.warning("request %s: prefill leg on %s failed: %s", job.rid, p.url,
                               r.error)
        return r

    async def _decode_leg(self, job: Job, d: Instance, body: dict[str, Any],
                          tid: str) -> Response | httpx.Response:
        """Send the decode leg, to another decode instance if it cannot connect."""
        tried: set[Instance] = set()
        while True:
            try:
                return await self._send_decode(job, d, body, tid)
            except NEVER_SENT as e:
                tried.add(d)
                why = describe_error(e)
                self.pool.mark_failed(d, f"decode leg: {why}")
                if not any(i.healthy and i not in tried for i in self.pool.by_role["decode"]):
                    raise fail(job, 502, f"the decode instance could not be reached "
                               f"({why}) and no other decode instance is healthy",
                               f"decode instance {d.url} unreachable: {why}") from None
                self.metrics.retries.labels("decode").inc()
                d = self.placement.pick_decode(job, tried)

    async def _send_decode(self, job: Job, d: Instance, body: dict[str, Any],
                           tid: str) -> Response | httpx.Response:
        """One decode leg on ``d`` (held by the job: Legs.close releases it), its
        ``kv_transfer_params`` signed for ``d`` (a retry elsewhere signs them anew)."""
        kv = body.get("kv_transfer_params")
        if kv is not None:
            body = {**body, "kv_transfer_params": self.signer.sign(kv, d, "decode",
                                                                   job.prefill)}
        req = self.client.build_request("POST", d.url + job.path, json=body,
                                        headers={"X-Request-Id": tid})
        job.d_sent = time.perf_counter()
        try:
            with LegWatch(d.watches, "decode's answer"):
                resp = await self.client.send(req, stream=True)
        except NEVER_SENT:
            raise
        except BaseException as e:
            err = self._decode_failure(job, d, e)
            if err is e:
                raise
            raise err from e
        job.upstream = resp
        if resp.status_code == 200 and job.stream:
            return resp  # the relay owns it now; Legs.close() closes it
        self.book.first_byte(job)
        try:
            with LegWatch(d.watches, "decode's answer", self.cfg.request_timeout_s):
                content = await read_answer(resp, self.cfg.max_answer_bytes)
        except BaseException as e:
            err = self._decode_failure(job, d, e)
            if err is e:
                raise
            raise err from e
        finally:
            await self.close_upstream(job)
        if resp.status_code != 200:
            return relay_error(resp.status_code, content, "decode", d, job.rid,
                               self.pool.engine_ids(), resp.headers.get("retry-after"))
        return Response(content, status_code=200,
                        media_type=resp.headers.get("content-type", "application/json"))

    def _decode_failure(self, job: Job, d: Instance, e: BaseException) -> BaseException:
        """The client's error for a decode leg that failed with ``e`` (cancellation and
        the like go through as they are)."""
        where = f"decode instance {d.url} ({d.engine_id})"
        if isinstance(e, LegLost):
            return fail(job, 504 if e.timed_out else 502, e.reason, f"{where}: {e.reason}")
        if isinstance(e, CONNECTION_LOST):
            why = describe_error(e)
            self.pool.mark_failed(d, f"decode leg: {why}")
            return fail(job, 502, f"the decode instance failed during the request: "
                              f"{why}", f"{where} failed during the request: {why}")
        if isinstance(e, httpx.TimeoutException):
            return fail(job, 504, f"the decode instance did not answer in time: "
                              f"{describe_error(e)}", f"{where} timed out: {describe_error(e)}")
        if isinstance(e, httpx.HTTPError):
            return fail(job, 502, f"the decode instance failed: {describe_error(e)}",
                              f"{where} failed: {describe_error(e)}")
        if isinstance(e, (AnswerTooLarge, FrameTooLong)):  # its message names no internals
            return fail(job, 502, f"the decode instance's answer was cut: {e}",
                              f"{where}: answer cut: {e}")
        return e

    # ------------------------------------------------------------------ streaming relay

    async def relay(self, job: Job, resp: httpx.Response):  # -> AsyncGenerator[bytes]
        """Decode's SSE answer, frame by frame as it comes (error frames scrubbed). Each
        read is bounded: the first by ``first_byte_timeout_s``, the others by
        ``request_timeout_s``; a failed health check of decode ends it at once."""
        d = job.decode
        assert d is not None
        frames = ErrorFrames(self.pool.engine_ids(), self.cfg.max_frame_bytes)
        chunks = cast("AsyncGenerator[bytes, None]", resp.aiter_bytes())
        try:
            while True:
                wait = (self.cfg.first_byte_timeout_s if job.first_byte is None
                        else self.cfg.request_timeout_s)
                with LegWatch(d.watches, "decode's stream", wait):
                    chunk = await anext(chunks, None)
                if chunk is None:
                    break
                self.book.first_byte(job)  # (the first chunk's; Book keeps the first)
                out = frames.feed(chunk)
                if out:
                    yield out
            out = frames.flush()
            if out:
                yield out
            if frames.errors:
                job.error = job.error or f"decode reported an error in its stream: " \
                                         f"{frames.errors[0]}"
            job.outcome = "error" if job.error else "ok"
        except (httpx.HTTPError, OSError, LegLost, FrameTooLong) as e:
            err = self._decode_failure(job, d, e)
            job.outcome, job.error = "error", str(err)
            if isinstance(err, APIError):
                err.message = scrub(err.message, self.pool.engine_ids())
                yield b"data: " + json.dumps(err.body()).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"
        finally:
            try:
                await chunks.aclose()
            except Exception:  # noqa: BLE001 - closing a broken stream
                logger.debug("closing decode's stream of %s failed", job.rid, exc_info=True)
            # a client that hangs up once [DONE] reached it got the whole answer
            done = frames.done and not frames.errors and not job.error
            await self.close(job, job.outcome or ("ok" if done else "abort"))

    # ------------------------------------------------------------------ the end

    async def close_upstream(self, job: Job) -> None:
        resp, job.upstream = job.upstream, None
        try:
            if resp is not None:
                await resp.aclose()
        except Exception:  # noqa: BLE001 - closing a broken connection
            logger.debug("closing decode's answer of %s failed", job.rid, exc_info=True)
        finally:
            self.placement.release_decode(job)

    async def close(self, job: Job, outcome: str, status: int | None = None) -> None:
        """The client's answer is done (or abandoned): decode's answer closed, the
        request counted (kvpush.router.life.Book). Idempotent."""
        if job.closed:
            return
        await self.close_upstream(job)
        self.book.close(job, outcome, status)


async def _cancel(task: asyncio.Task) -> None:
    """Cancel a task and wait until it has cleaned up (its own outcome is dropped; the
    caller's cancellation still propagates)."""
    task.cancel()
    await asyncio.wait({task})
