"""The OpenAI-compatible HTTP server: ``build_app(engine) -> FastAPI``.

The engine is injected, so tests run the real app on a fake engine. Request handling:
parse (strictly, OpenAI error shapes) -> admit (a 429 past ``--max-waiting-requests``,
kvpush.server.admission) -> tokenize -> validate against the context ->
``engine.generate`` -> JSON body or SSE stream. A large body (or a chat with many
messages) is parsed and tokenized on a worker thread, never on the event loop
(kvpush.server.chat.INLINE_BODY_BYTES). Whatever way a request ends (finished,
client gone, server error), its engine generator is closed, which makes the engine abort
the request and free its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from kvpush import __version__
from kvpush.aio import within
from kvpush.config import EngineConfig
from kvpush.crypto.auth import ParamsSigner
from kvpush.engine.client import EngineClient, FrontEngine
from kvpush.engine.outputs import EngineStats, FinishReason, RequestOutput
from kvpush.server import chat
from kvpush.server.admin_key import protect
from kvpush.server.admission import (
    DEFAULT_MAX_WAITING_REQUESTS,
    WaitingBound,
    WaitingSlot,
    is_second_leg,
)
from kvpush.server.body_limit import BodyLimitMiddleware
from kvpush.server.errors import APIError, install_error_handlers, internal_error, to_api_error
from kvpush.server.formats import ChatFormat, CompletionFormat, Format
from kvpush.server.kv_abort import parse_abort, read_abort_body
from kvpush.server.member_view import MEMBER_PATHS, MemberViewMiddleware, MemberViews
from kvpush.server.metrics import RequestTimer, ServerMetrics
from kvpush.server.openapi import install_openapi, request_body
from kvpush.server.protocol import Job, ModelCard, ModelList, VersionResponse
from kvpush.server.prove import PROVE_PATH, ProveError, Prover

logger = logging.getLogger("kvpush.server")

T = TypeVar("T")

#: Largest request body accepted (413 above): a full 128k-token context as JSON token ids
#: is ~1 MiB, so this only stops abuse.
MAX_BODY_BYTES = 32 << 20


async def _wait_for_disconnect(receive: Receive) -> None:
    """Return when the client goes away (call only after the body has been read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(aw: Awaitable[T], receive: Receive) -> tuple[bool, T | None]:
    """Run ``aw`` but cancel it if the client disconnects first: (disconnected, result).

    A plain (non-streaming) handler is not cancelled by the server when its client goes
    away, so without this a long generation would run to the end for nobody.
    """
    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.wait({task, watcher})  # let the cancelled task clean up (abort)
    if task.cancelled():
        return True, None
    return False, task.result()


class EventStreamResponse(Response):
    """Server-sent events from an async generator of ready-made ``data: ...`` frames.

    Unlike Starlette's StreamingResponse this always closes the generator (so the engine
    request is aborted) however the response ends, and it notices a client that goes away
    both by ``http.disconnect`` (ASGI < 2.4 servers such as uvicorn) and by an OSError
    from ``send`` (ASGI 2.4).
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None], headers: dict[str, str]) -> None:
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def produce() -> None:
            try:
                await send({"type": "http.response.start", "status": self.status_code,
                            "headers": self.raw_headers})
                async for frame in self.events:
                    await send({"type": "http.response.body", "body": frame,
                                "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            finally:
                await self.events.aclose()

        producer = asyncio.ensure_future(produce())
        watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({producer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            producer.cancel()  # no-op when it already finished
            await asyncio.wait({producer, watcher})
        if not producer.cancelled():
            exc = producer.exception()
            if exc is not None and not isinstance(exc, OSError):  # OSError: client gone
                raise exc


def _outcome(out: RequestOutput) -> str:
    return "abort" if out.finish_reason is None else FinishReason(out.finish_reason).value


@dataclass(frozen=True)
class FrontSettings:
    """What the OpenAI front needs to know of the model it serves and of its place:
    an instance's come from its config; the router's from its decode instances."""

    model_name: str
    max_model_len: int
    vocab_size: int
    #: "both", "prefill", "decode" (an instance) or "router"
    role: str = "both"
    mode: str = "push"

    @classmethod
    def of(cls, cfg: EngineConfig) -> FrontSettings:
        kvt = cfg.kv_transfer
        return cls(cfg.served_model_name or Path(cfg.model.path).name,
                   cfg.scheduler.max_model_len, cfg.model.vocab_size,
                   kvt.role if kvt.enabled else "both", kvt.mode)


async def read_body_within(request: Request, timeout: float) -> bytes:
    """The request's body, within ``timeout`` seconds (else an APIError 408;
    ClientDisconnect when the client went away; past the body limit, the 413 of
    BodyLimitMiddleware)."""
    try:
        return await within(request.body(), timeout)
    except asyncio.TimeoutError:  # (3.10: not the builtin)
        raise APIError(f"the request body did not arrive within {timeout:g} s",
                       status_code=408, code="request_timeout") from None


def new_request_id(kind: Literal["completion", "chat"]) -> str:
    """A fresh request id, as vLLM's OpenAI server makes them (the answer's ``id``):
    ``chatcmpl-<hex>`` for chats, ``cmpl-<hex>`` for completions."""
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


class OpenAIFront:
    """The OpenAI request handlers over one FrontEngine: an instance's engine, or the
    router's cluster of engine cores (kvpush.router.front). ``gauges``: the
    engine's own (None: a front over many engines, the router)."""

    def __init__(self, engine: FrontEngine, settings: FrontSettings,
                 max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
                 body_timeout_s: float = 30.0,
                 gauges: Callable[[], EngineStats] | None = None) -> None:
        self.engine = engine
        self.body_timeout_s = body_timeout_s
        self.kv_role = settings.role
        self.kv_mode = settings.mode
        self.waiting = WaitingBound(max_waiting_requests)
        self.model_name = settings.model_name
        self.max_model_len = settings.max_model_len
        self.token_texts = chat.TokenTexts(engine.tokenizer)
        self.metrics = ServerMetrics(gauges,
                                     lambda: engine.health_problem() is None,
                                     self.model_name)
        self.metrics.register_waiting(self.waiting)
        self.created = int(time.time())
        self.executor = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1),
                                           thread_name_prefix="kvpush-tokenize")
        self.prompts = chat.PromptBuilder(engine.tokenizer, self.model_name,
                                          self.max_model_len, settings.vocab_size,
                                          self.executor, getattr(engine, "grammars", None))
        #: called with each request once parsed and tokenized, before it is generated
        #: (the router notes whether its client streams)
        self.on_job: Callable[[Job], None] | None = None

    @staticmethod
    def _request_id(request: Request, kind: Literal["completion", "chat"]) -> str:
        """The client's X-Request-Id (the router sends the same one to prefill and decode
        servers), or a fresh one (:func:`new_request_id`)."""
        rid = request.headers.get("x-request-id")
        if rid is None:
            return new_request_id(kind)
        rid = rid.strip()
        if not rid or len(rid) > 256 or not rid.isprintable():
            raise APIError("the X-Request-Id header must be 1 to 256 printable characters",
                           param="X-Request-Id")
        return rid

    # ------------------------------------------------------------------- generation

    async def handle(self, request: Request, kind: Literal["completion", "chat"]) -> Response:
        arrival = time.perf_counter()
        try:
            body = await read_body_within(request, self.body_timeout_s)
        except ClientDisconnect:
            return Response(status_code=499)
        except APIError as err:
            self.metrics.count("rejected")
            return err.response()
        return await self.serve(request, kind, body, arrival)

    async def tokens(self, request: Request,
                     answer: Callable[[bytes], Awaitable[BaseModel]]) -> Response:
        """``/tokenize`` or ``/detokenize``: the body read, ``answer`` (PromptBuilder's
        tokenize or detokenize) as JSON, or an OpenAI error body."""
        try:
            result = await answer(await read_body_within(request, self.body_timeout_s))
        except ClientDisconnect:
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001 - every error becomes an OpenAI body
            err = to_api_error(exc)
            if err is None:
                logger.exception("error serving %s", request.url.path)
                err = internal_error()
            return err.response()
        return JSONResponse(result.model_dump(mode="json"))

    async def serve(self, request: Request, kind: Literal["completion", "chat"],
                    body: bytes, arrival: float, request_id: str | None = None) -> Response:
        """Answer a request whose body has been read: parse, admit, tokenize, generate,
        format. ``request_id``: the id to run it under (default: the client's
        X-Request-Id or a fresh one)."""
        job: Job | None = None
        gen: AsyncIterator[RequestOutput] | None = None
        timer: RequestTimer | None = None
        slot: WaitingSlot | None = None
        handed_over = False
        try:
            req = await self.prompts.parse(kind, body)
            rid = request_id or self._request_id(request, kind)
            # checked once and typed here (a 400, or a 403 unsigned), handed on as is
            kv = self.engine.kv_params(req.kv_transfer_params)
            # admitted (or refused with a 429) before any tokenizing or allocating
            slot = self.waiting.admit(exempt=is_second_leg(self.kv_role, self.kv_mode, kv))
            job = await self.prompts.job(req, rid, arrival, len(body))
            if self.on_job is not None:
                self.on_job(job)
            problem = self.engine.health_problem()
            if problem is not None:
                raise APIError(f"this instance cannot serve requests: {problem}",
                               status_code=503, code="unavailable")
            fmt: Format
            if kind == "chat":
                fmt = ChatFormat(job, self.model_name, self.token_texts)
            else:
                fmt = CompletionFormat(job, self.model_name, self.token_texts)
            gen = aiter(self.engine.generate(job.request_id, job.prompt_ids, job.params, kv))
            timer = RequestTimer(self.metrics, arrival, len(job.prompt_ids))

            # Wait for the first output before answering: the engine refuses requests by
            # raising RequestError there, and a refusal must be a plain 4xx, not an error
            # event inside a 200 stream.
            async def first_output() -> RequestOutput | None:
                return await anext(gen, None)

            gone, first = await unless_disconnected(first_output(), request.receive)
            slot.release()  # no longer waiting: generating (or ended)
            if gone:
                timer.finish("abort", time.perf_counter())
                return Response(status_code=499)
            if job.stream:
                handed_over = True
                events = self._events(job, fmt, gen, first, timer)
                return EventStreamResponse(events, {"X-Request-Id": job.request_id})
            gone, result = await unless_disconnected(
                self._collect(fmt, gen, first, timer), request.receive)
            if gone:
                timer.finish("abort", time.perf_counter())
                return Response(status_code=499)
            assert result is not None
            return JSONResponse(result, headers={"X-Request-Id": job.request_id})
        except Exception as exc:  # noqa: BLE001 - every error becomes an OpenAI body
            err = to_api_error(exc)
            if err is None:
                logger.exception("error serving %s request %s", kind,
                                 job.request_id if job else "?")
                err = internal_error()
            outcome = "error" if err.status_code >= 500 else "rejected"
            if timer is not None:
                timer.finish(outcome, time.perf_counter())  # no-op if already counted
            else:
                self.metrics.count(outcome)
            headers = {"X-Request-Id": job.request_id} if job else {}
            if err.status_code == 429:
                headers["Retry-After"] = "1"
            return err.response(headers=headers or None)
        finally:
            if slot is not None:
                slot.release()
            if gen is not None and not handed_over:
                await self._close(gen, job.request_id if job else "")

    @staticmethod
    async def _close(gen: AsyncIterator[RequestOutput], request_id: str) -> None:
        """Close the engine stream: the engine aborts the request if it is unfinished.

        No extra ``engine.abort(request_id)`` on top: with ids that clients choose
        (X-Request-Id), a retry under the same id may already be queued behind this one,
        and a late abort would kill it.
        """
        aclose = getattr(gen, "aclose", None)
        if aclose is None:
            return
        try:
            await aclose()
        except Exception:  # noqa: BLE001
            logger.warning("closing the engine stream of %s failed", request_id,
                           exc_info=True)

    async def _collect(self, fmt: Format, gen: AsyncIterator[RequestOutput],
                       first: RequestOutput | None, timer: RequestTimer) -> dict[str, Any]:
        out, last = first, None
        while out is not None:  # to the stream's end: every choice of the request
            timer.on_output(len(out.new_token_ids), time.perf_counter(), out)
            fmt.add(out)
            last = out
            if out.finish_reason is FinishReason.ERROR:
                break
            out = await anext(gen, None)
        failed = last is not None and last.finish_reason is FinishReason.ERROR
        if not fmt.done:
            fmt.abort_open()
        outcome = _outcome(last) if last is not None and (fmt.done or failed) else "abort"
        out = last
        if outcome == "error":
            timer.finish("error", time.perf_counter())
            raise APIError(f"the engine failed this request: {out.error or 'unknown error'}"
                           if out else "the engine failed this request", status_code=500)
        timer.finish(outcome, time.perf_counter())
        return fmt.response()

    async def _events(self, job: Job, fmt: Format, gen: AsyncIterator[RequestOutput],
                      first: RequestOutput | None, timer: RequestTimer
                      ) -> AsyncGenerator[bytes, None]:
        outcome = "abort"
        try:
            for frame in fmt.stream_start():
                yield frame
            out, last = first, None
            while out is not None:  # to the stream's end: every choice of the request
                timer.on_output(len(out.new_token_ids), time.perf_counter(), out)
                chunk = fmt.stream_chunk(out)
                if chunk is not None:
                    yield chunk
                last = out
                if out.finish_reason is FinishReason.ERROR:
                    break
                out = await anext(gen, None)
            out = last
            failed = out is not None and out.finish_reason is FinishReason.ERROR
            if out is None or not (fmt.done or failed):  # ended before its choices did
                yield fmt.stream_finish("abort")
            else:
                outcome = _outcome(out)
                if outcome == "error":
                    yield fmt.error_frame(APIError(
                        f"the engine failed this request: {out.error or 'unknown error'}",
                        status_code=500))
                    yield b"data: [DONE]\n\n"
                    return
            if job.include_usage:
                yield fmt.usage_chunk()
            yield b"data: [DONE]\n\n"
        except Exception as exc:  # noqa: BLE001 - the status line has gone: report in-band
            outcome = "error"
            err = to_api_error(exc)
            if err is None:
                logger.exception("error while streaming request %s", job.request_id)
                err = internal_error()
            yield fmt.error_frame(err)
            yield b"data: [DONE]\n\n"
        finally:
            timer.finish(outcome, time.perf_counter())
            await self._close(gen, job.request_id)


def build_app(engine: EngineClient, *, max_body_bytes: int = MAX_BODY_BYTES,
              api_key: str | None = None,
              max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
              body_timeout_s: float = 30.0, admin_key: str | None = None,
              advertise_url: str | None = None, chat_template: str | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``; its lifespan starts and shuts down the engine.

    With ``api_key`` every path but ``/health`` and ``/metrics`` needs ``Authorization:
    Bearer <key>`` (see kvpush.server.auth); ``/metrics`` needs ``admin_key``, and is
    closed with an API key but no admin key (kvpush.server.admin_key). More than
    ``max_waiting_requests`` requests without a first output yet are refused with a 429
    (0: no bound; see kvpush.server.admission).
    A request body must be in within ``body_timeout_s`` of its headers, else 408 (the
    header deadline and the connection bound are the door's: kvpush.server.door).
    With the cluster secret, ``POST /kv/prove`` answers routers' challenges for this
    server's own URLs (``advertise_url`` among them; kvpush.server.prove).
    ``chat_template`` (``--chat-template``) is told in ``/kv/info``: a router in front of
    the engine cores renders chats with it.
    """
    server = OpenAIFront(engine, FrontSettings.of(engine.config), max_waiting_requests,
                         body_timeout_s, gauges=engine.stats)
    cfg = engine.config
    #: /kv/abort's check (kv_abort.py): the router's signature, where params are signed
    secret_ = cfg.kv_transfer.side_channel_secret
    abort_signer = (ParamsSigner(secret_)
                    if secret_ is not None and cfg.kv_transfer.params_signed else None)
    secret = cfg.kv_transfer.side_channel_secret
    prover = Prover(secret, advertise_url) if secret else None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            try:
                await engine.shutdown()
            finally:
                server.executor.shutdown(wait=False, cancel_futures=True)

    # no max_body_size: Starlette's limit answers text/plain (BodyLimitMiddleware: JSON)
    app = FastAPI(title="kvpush", summary="OpenAI-compatible LLM serving", lifespan=lifespan)
    app.state.server = server
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, limit=max_body_bytes)
    protect(app, api_key, admin_key, on_reject=server.metrics.count_auth_rejected,
            member_paths=MEMBER_PATHS)
    member_views = MemberViews(secret, api_key, admin_key)
    app.add_middleware(MemberViewMiddleware, views=member_views,
                       on_reject=server.metrics.count_auth_rejected)
    server.metrics.register_kv_stats(engine.kv_stats)
    engine.set_transfer_sink(server.metrics.observe_transfer)
    engine.set_stats_sink(server.metrics.observe_engine)  # every front's requests

    @app.post("/v1/completions", summary="Text completion (OpenAI legacy API)",
              openapi_extra=request_body("CompletionRequest"))
    async def completions(request: Request) -> Response:
        return await server.handle(request, "completion")

    @app.post("/v1/chat/completions", summary="Chat completion",
              openapi_extra=request_body("ChatCompletionRequest"))
    async def chat_completions(request: Request) -> Response:
        return await server.handle(request, "chat")

    @app.post("/tokenize", summary="Token ids of a prompt or a chat (vLLM's)",
              openapi_extra=request_body("TokenizeRequest"))
    async def tokenize(request: Request) -> Response:
        return await server.tokens(request, server.prompts.tokenize)

    @app.post("/detokenize", summary="Text of token ids (vLLM's)",
              openapi_extra=request_body("DetokenizeRequest"))
    async def detokenize(request: Request) -> Response:
        return await server.tokens(request, server.prompts.detokenize)

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=server.model_name, created=server.created,
                                         root=str(engine.config.model.path),
                                         max_model_len=server.max_model_len)])

    @app.get("/health")
    async def health() -> Response:
        problem = engine.health_problem() or engine.starting()
        if problem is None:
            return JSONResponse({"status": "ok"})
        return APIError(problem, status_code=503, code="unhealthy").response()

    @app.get("/kv/info", summary="KV identity: engine id, role, transfer mode, layout, blocks")
    async def kv_info(request: Request) -> Response:
        try:
            info = member_views.kv_info(await engine.kv_info(), request.scope)
        except Exception as exc:  # noqa: BLE001 - the core is gone or failed the call
            err = to_api_error(exc) or APIError(f"no KV info: {exc}", status_code=503)
            return err.response()
        if chat_template is not None:
            info = msgspec.structs.replace(info, chat_template=chat_template)
        return Response(msgspec.json.encode(info), media_type="application/json")

    @app.post(PROVE_PATH, summary="Prove to a router that this instance holds the cluster "
                                  "secret (a challenge: nonce and URL)",
              openapi_extra=request_body("KVProveRequest"))
    async def kv_prove(request: Request) -> Response:
        if prover is None:
            return APIError("this instance holds no cluster secret: it cannot prove "
                            "membership", status_code=404).response()
        try:
            proof = await prover.answer(await request.body(), request.scope.get("server"),
                                        engine.kv_info)
        except ProveError as e:
            return APIError(str(e), status_code=e.status).response()
        except Exception as exc:  # noqa: BLE001 - the core is gone or failed the call
            err = to_api_error(exc) or APIError(f"no KV info: {exc}", status_code=503)
            return err.response()
        return JSONResponse(proof)

    @app.get("/kv/cache_blocks",
             summary="Every block hash in the prefix cache, as of KV event batch seq")
    async def kv_cache_blocks() -> Response:
        snap = await engine.kv_cache_blocks()
        # up to num_blocks hashes: encoded off the event loop
        data = None if snap is None else await asyncio.to_thread(
            lambda: msgspec.json.encode(snap))
        if data is None:
            return APIError("this instance publishes no KV cache events (prefix caching "
                            "is off)", status_code=404).response()
        return Response(data, media_type="application/json")

    @app.post("/kv/abort", summary="Release what a prefill instance holds for a transfer",
              openapi_extra=request_body("KVAbortRequest"))
    async def kv_abort(request: Request) -> Response:
        if server.kv_role == "both":
            return APIError("this instance takes no part in KV transfers",
                            status_code=404).response()
        kvt = engine.config.kv_transfer  # (P/D roles: the config names the engine id)
        tid = parse_abort(await read_abort_body(request), abort_signer, kvt.role,
                          kvt.engine_id)
        engine.abort_transfer(tid)
        return JSONResponse({"transfer_id": tid, "status": "aborting"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=server.metrics.content_type)

    install_openapi(app)
    return app
