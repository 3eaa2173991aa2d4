"""The router's OpenAI-compatible front: ``build_app(router) -> FastAPI``.

``POST /v1/completions`` and ``/v1/chat/completions`` (streaming and not) go through
:class:`kvpush.router.legs.Legs`; ``GET /v1/models`` is a healthy decode instance's;
``/health`` says whether the router can serve; ``/router/instances`` shows the pool;
``/metrics`` is Prometheus.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect
from starlette.types import Message, Receive, Scope, Send

from kvpush import __version__
from kvpush.aio import within
from kvpush.router.cache_policy import CachePolicy, load_model_tokenizer
from kvpush.router.config import RouterConfig
from kvpush.router.core_front import STARTING_WAIT_S, CoreFront
from kvpush.router.intake import (
    RETRY_AFTER_S,
    Admission,
    check_encodable,
    full_error,
    load_body,
    read_body_within,
)
from kvpush.router.job import Job, outcome_for
from kvpush.router.legs import Legs
from kvpush.router.life import Book
from kvpush.router.metrics import RouterMetrics
from kvpush.router.placement import Placement
from kvpush.router.pool import CHECKS_AT_ONCE, Instance, Pool, describe_error
from kvpush.router.prompts import PromptTokenizer, TokenizerState
from kvpush.router.redact import scrub
from kvpush.router.stopping import cancel_and_wait
from kvpush.router.wire import (
    AnswerTooLarge,
    LegSigner,
    client_kv_params_problem,
    read_answer,
    relay_error,
)
from kvpush.server.admin_key import ADMIN_PATHS, protect
from kvpush.server.app import EventStreamResponse, new_request_id, unless_disconnected
from kvpush.server.auth import auth_header
from kvpush.server.door import uvicorn_options
from kvpush.server.errors import APIError, install_error_handlers, internal_error, to_api_error
from kvpush.server.metrics import auth_rejected_counter
from kvpush.server.openapi import install_openapi, request_body
from kvpush.server.protocol import VersionResponse

if TYPE_CHECKING:
    from kvpush.router.discover import EtcdLink

logger = logging.getLogger("kvpush.router")

#: the router's operator views: an instance's, and the instance list with its load
ROUTER_ADMIN_PATHS = ADMIN_PATHS | {"/router/instances"}

#: Idle keep-alive connections to instances are dropped before the instances' own
#: keep-alive timeout (uvicorn's default is 5 s, in kvpush and vLLM alike), so the router
#: never sends on a connection the instance is closing at that moment.
KEEPALIVE_EXPIRY_S = 3.0

#: how long /health waits for the engine cores' links (made when the tokenizer has
#: loaded) before it says "starting"
HEALTH_WAIT_S = 1.0

#: bodies larger than this are parsed on a worker thread (a 21 MB body took 0.4 s)
INLINE_PARSE_BYTES = 1 << 20


@dataclass(frozen=True)
class RoutingState:
    """How the router routes now (``/health``'s ``routing``): its ``--policy`` when that
    needs no tokenizer; with cache-aware, ``cache-aware``, ``blind`` (degraded: no
    tokenizer) or ``starting`` (the tokenizer is still loading; /health is 503)."""

    routing: str
    why: str

    @property
    def starting(self) -> bool:
        return self.routing == "starting"

    @property
    def degraded(self) -> bool:
        return self.routing == "blind"

#: --discover: how long start-up waits for the first view of etcd before serving without
#: it (the router then answers /health, 503 until it has usable instances)
FIRST_VIEW_S = 5.0


class Router:
    """The pool, the shared HTTP client and the health loop of one router."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.pool = Pool(cfg)
        self.metrics = RouterMetrics(self.pool)
        self.auth_rejected = auth_rejected_counter(self.metrics.registry,
                                                   "kvpush_router_auth_rejected")
        self.admission = Admission(cfg.max_outstanding_requests)
        self.metrics.track_outstanding(lambda: self.admission.outstanding,
                                       cfg.max_outstanding_requests)
        self.client: httpx.AsyncClient | None = None
        #: the health checks' own client: a flood of instances to check never queues in
        #: the legs' connection pool (Pool.check bounds how many run at once)
        self.health_client: httpx.AsyncClient | None = None
        self.placement = Placement(self.pool)
        self.book = Book(cfg, self.placement, self.metrics)
        self.signer = LegSigner(cfg.keys)
        self.legs: Legs | None = None
        #: the cache-aware policy's tokenizer and KV index (--policy cache-aware)
        self.cache: CachePolicy | None = None
        self._health: asyncio.Task | None = None
        #: --discover: the etcd watch that adds and drops instances (kvpush.router.discover)
        self.discovery: EtcdLink | None = None
        self._joins: set[asyncio.Task] = set()
        #: the front over the engine cores (kvpush.router.core_front)
        self.cores = CoreFront(cfg, self.book, self.signer)
        #: the model's tokenizer (the cache-aware policy's, or loaded for the front)
        self.tokenizer: PromptTokenizer | None = None
        self._tokenizer_load: asyncio.Task | None = None

    def make_client(self) -> httpx.AsyncClient:
        c = self.cfg
        limits = httpx.Limits(max_connections=c.max_connections,
                              max_keepalive_connections=min(256, c.max_connections),
                              keepalive_expiry=KEEPALIVE_EXPIRY_S)
        # router -> instance traffic is internal: no proxies from the environment
        transport = httpx.AsyncHTTPTransport(limits=limits, trust_env=False)
        return httpx.AsyncClient(
            # every wait but connecting: the bound of an answer's start (each later read
            # of a stream has its own, shorter bound: Legs.relay)
            timeout=httpx.Timeout(c.first_byte_timeout_s, connect=c.connect_timeout_s),
            transport=transport, trust_env=False,
            headers=auth_header(c.api_key),  # legs, /kv/abort, /v1/models (proven instances)
        )

    def make_health_client(self) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=2 * CHECKS_AT_ONCE,
                              max_keepalive_connections=2 * CHECKS_AT_ONCE,
                              keepalive_expiry=KEEPALIVE_EXPIRY_S)
        return httpx.AsyncClient(
            timeout=httpx.Timeout(self.cfg.health_timeout_s),
            transport=httpx.AsyncHTTPTransport(limits=limits, trust_env=False),
            # no API key by default: an instance gets it only once it has proved that it
            # holds the cluster secret (Pool.check adds it to /kv/info then)
            trust_env=False)

    async def start(self, wait: bool = True) -> None:
        """Open the clients, wait for the instances (see Pool.wait_ready; raises
        RouterConfigError / RouterStartupError), start the health loop."""
        self.client = self.make_client()
        self.health_client = self.make_health_client()
        self.legs = Legs(self.cfg, self.book, self.client, self.signer)
        try:
            if self.cfg.discover is not None:
                await self._start_discovery()
                wait = False  # instances come and go: serve now, /health says when ready
            if wait:
                await self.pool.wait_ready(self.health_client, self.cfg.startup_timeout_s)
            else:
                await self.pool.check_all(self.health_client)
        except BaseException:
            if self.discovery is not None:  # (cut short in its first-view wait: Ctrl-C)
                await self.discovery.close()
                self.discovery = None
            for task in list(self._joins):  # checks of joined instances, on this client
                task.cancel()
            await self.client.aclose()
            await self.health_client.aclose()
            raise
        if self.cfg.policy == "cache-aware":
            self.cache = self.placement.cache = CachePolicy(self.cfg, self.pool, self.metrics,
                                                        self.client)
            self.cache.start()
            self.tokenizer = self.cache.tokenizer
        else:  # for the front over the engine cores (kvpush instances)
            self.tokenizer = PromptTokenizer(self.cfg.tokenizer)
            self._tokenizer_load = asyncio.create_task(
                load_model_tokenizer(self.tokenizer, self.cfg, self.pool, self.client),
                name="kvpush-tokenizer-load")
        self._health = asyncio.create_task(self.pool.health_loop(self.health_client),
                                           name="kvpush-health-loop")
        if wait and self.cores.wanted():  # serving from the start: tokenizer and links
            why = await self.cores_ready(self.cfg.startup_timeout_s)
            if why is not None:
                logger.warning("not serving yet: %s (requests wait for it, then 503)", why)

    def tokenizer_loading(self) -> asyncio.Task | None:
        """The model tokenizer's load, while it runs (the cache-aware policy's, or the
        front's)."""
        return self.cache.loading if self.cache is not None else self._tokenizer_load

    async def cores_ready(self, timeout: float = STARTING_WAIT_S) -> str | None:
        """Why requests cannot take the engine cores yet (waiting at most ``timeout``
        s for the tokenizer and the links), or None."""
        return await self.cores.ready(self.tokenizer, self.tokenizer_loading(), timeout)

    def routing_state(self) -> RoutingState:
        """Whether the router routes as configured: a cache-aware router is starting
        until its tokenizer has loaded (or failed to: then it runs degraded, blind)."""
        if self.cfg.policy != "cache-aware":
            return RoutingState(self.cfg.policy, "the configured policy")
        if self.cache is None:
            return RoutingState("starting", "the cache-aware policy is not started yet")
        tok = self.cache.tokenizer
        if tok.state is TokenizerState.READY:
            return RoutingState("cache-aware", f"tokenizer {tok.source} loaded")
        if tok.state is TokenizerState.FAILED:
            return RoutingState("blind", f"no tokenizer ({tok.why}): requests are routed "
                                "round-robin with a prefill leg each, without the prefix "
                                "caches")
        return RoutingState("starting", f"loading the tokenizer {tok.source or ''}".strip())

    async def wait_routing(self, timeout: float) -> RoutingState:
        """Wait (at most ``timeout`` s) until the router routes as configured or is
        known to run degraded; logs which, loudly when degraded."""
        if self.cache is not None and self.cache.loading is not None:
            with suppress(asyncio.TimeoutError):
                await within(asyncio.shield(self.cache.loading), timeout)
        state = self.routing_state()
        if state.degraded:
            logger.warning("ROUTER DEGRADED: %s", state.why)
        elif state.starting:
            logger.warning("the tokenizer has not loaded within %g s; /health answers 503 "
                           "until it has", timeout)
        else:
            logger.info("ready: %s routing (%s)", state.routing, state.why)
        return state

    async def _start_discovery(self) -> None:
        """Watch the etcd prefix; each instance that joins is checked at once."""
        from kvpush.router.discover import EtcdLink

        assert self.cfg.discover is not None

        def on_join(inst: Instance) -> None:
            assert self.health_client is not None
            task = asyncio.create_task(self.pool.check(self.health_client, inst))
            self._joins.add(task)
            task.add_done_callback(self._joins.discard)

        self.discovery = EtcdLink(self.cfg.discover, self.pool, self.cfg.mode, on_join,
                                  self.cfg.max_instances)
        self.discovery.start()
        # the first view, if etcd answers soon; else the router starts with what it has
        # (the static instances, or none: /health 503) and the link catches up
        try:
            await within(self.discovery.synced.wait(),
                         min(FIRST_VIEW_S, self.cfg.startup_timeout_s))
        except asyncio.TimeoutError:  # (3.10: not the builtin)
            logger.warning("no view of %s yet: starting without it", self.cfg.discover)
        if self._joins:
            await asyncio.wait(set(self._joins), timeout=self.cfg.health_timeout_s * 2)

    def for_client(self, err: APIError) -> APIError:
        """``err`` as a client may see it: no internal address or engine id (the log has
        them)."""
        err.message = scrub(err.message, self.pool.engine_ids())
        return err

    async def close(self) -> None:
        if self.discovery is not None:
            await self.discovery.close()
            self.discovery = None
        await cancel_and_wait(list(self._joins), "checks of joined instances")
        await cancel_and_wait([self._health], "the health loop")
        await self.cores.close()
        await cancel_and_wait([self._tokenizer_load], "the tokenizer's load")
        if self.cache is not None:
            await self.cache.close()
            self.cache = None
        if self.client is not None:
            await self.client.aclose()
        if self.health_client is not None:
            await self.health_client.aclose()
        self._health = None


class RelayStream(EventStreamResponse):
    """Decode's SSE answer relayed to the client; ``on_close`` runs however it ends (even
    when the client leaves before the first frame, when the generator never started)."""

    def __init__(self, events: AsyncGenerator[bytes, None], headers: dict[str, str],
                 on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(events, headers)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        held: list[Message] = []

        async def send_joined(message: Message) -> None:
            # the headers wait for the first chunk: both are written in one loop turn,
            # and the door's transport sends them as one segment
            if message["type"] == "http.response.start":
                held.append(message)
                return
            if held:
                await send(held.pop())
            await send(message)

        try:
            await super().__call__(scope, receive, send_joined)
        finally:
            await self.on_close()


async def _handle(router: Router, request: Request,
                  kind: Literal["completion", "chat"]) -> Response:
    arrival = time.perf_counter()
    legs = router.legs
    assert legs is not None
    # the body first (within its deadline), then a place: a slow client holds its own
    # connection, never one of the --max-outstanding-requests places
    try:
        raw = await read_body_within(request, router.cfg.body_timeout_s)
    except ClientDisconnect:
        router.metrics.requests.labels(router.cfg.mode, "abort").inc()
        return Response(status_code=499)
    except APIError as err:  # 413, 408
        router.metrics.requests.labels(router.cfg.mode, outcome_for(err.status_code)).inc()
        return err.response(headers={"Connection": "close"})
    if not router.admission.enter():
        router.metrics.requests.labels(router.cfg.mode, "overloaded").inc()
        return full_error(router.admission.limit).response(
            headers={"Retry-After": str(RETRY_AFTER_S)})
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    job = Job(rid=new_request_id(kind), kind=kind, path=path, body={}, stream=False,
              arrival=arrival, client_rid=request.headers.get("x-request-id"),
              on_done=router.admission.leave)
    if router.cores.wanted():  # kvpush instances: over their engine cores only
        why = await router.cores_ready()
        if why is None:
            return await router.cores.serve(request, kind, raw, job)
        router.book.close(job, "unavailable", 503)
        return APIError(f"the router is starting: {why}", status_code=503,
                        code="starting").response(
            headers={"X-Request-Id": job.rid, "Retry-After": str(RETRY_AFTER_S)})
    headers = {"X-Request-Id": job.rid}
    try:
        big = len(raw) > INLINE_PARSE_BYTES  # ~20 ms a MB: off the event loop
        loop = asyncio.get_running_loop()
        body = await loop.run_in_executor(None, load_body, raw) if big else load_body(raw)
        refused = client_kv_params_problem(body)
        if refused:
            raise APIError(refused, status_code=403, param="kv_transfer_params",
                           code="kv_transfer_params_not_allowed")
        if router.cache is not None:  # a prompt too long to route: refused by its size
            router.cache.check_size(kind, body)
        if big:
            await loop.run_in_executor(None, check_encodable, body)
        else:
            check_encodable(body)
        job.body, job.stream = body, body.get("stream") is True
        if router.cache is not None:
            await router.cache.plan(job, len(raw))
        gone, result = await unless_disconnected(legs.dispatch(job), request.receive)
    except Exception as exc:  # noqa: BLE001 - every error becomes an OpenAI body
        error = to_api_error(exc)
        if error is None:
            logger.exception("error routing request %s", job.rid)
            error = internal_error()
        job.error = error.message
        await legs.close(job, outcome_for(error.status_code), error.status_code)
        return router.for_client(error).response(headers=headers)
    if gone:
        await legs.close(job, "abort", 499)
        return Response(status_code=499)
    if isinstance(result, httpx.Response):
        return RelayStream(legs.relay(job, result), headers,
                           on_close=lambda: legs.close(job, "abort", 200))
    assert isinstance(result, Response)
    result.headers["X-Request-Id"] = job.rid
    await legs.close(job, outcome_for(result.status_code), result.status_code)
    return result


def build_app(router: Router, *, manage: bool = True, wait: bool = True) -> FastAPI:
    """The FastAPI app of ``router``. With ``manage`` its lifespan starts the router
    (``wait``: until the instances are usable, see Pool.wait_ready; else after one round
    of checks) and closes it; without, the caller does (the CLI waits for the instances
    before uvicorn binds its port)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not manage:
            yield
            return
        await router.start(wait=wait)
        try:
            yield
        finally:
            await router.close()

    # no max_body_size: Starlette's limit answers text/plain; the handlers read bodies
    # through kvpush.router.intake.read_body (an OpenAI-style 413) and no other route
    # reads one
    app = FastAPI(title="kvpush router", summary="OpenAI-compatible P/D router",
                  lifespan=lifespan)
    app.state.router = router
    install_error_handlers(app)
    protect(app, router.cfg.api_key, router.cfg.admin_key, ROUTER_ADMIN_PATHS,
            on_reject=lambda reason: router.auth_rejected.labels(reason).inc())

    @app.post("/v1/completions", summary="Text completion, through prefill and decode",
              openapi_extra=request_body("CompletionRequest"))
    async def completions(request: Request) -> Response:
        return await _handle(router, request, "completion")

    @app.post("/v1/chat/completions", summary="Chat completion, through prefill and decode",
              openapi_extra=request_body("ChatCompletionRequest"))
    async def chat_completions(request: Request) -> Response:
        return await _handle(router, request, "chat")

    async def from_decode(path: str, what: str, body: bytes | None = None) -> Response:
        """The first healthy decode instance's answer to ``path`` (GET; POST of ``body``
        when given), relayed."""
        assert router.client is not None
        tried = []
        for inst in router.pool.by_role["decode"]:
            if not inst.healthy:
                continue
            req = router.client.build_request(
                "GET" if body is None else "POST", inst.url + path, content=body,
                headers=None if body is None else {"Content-Type": "application/json"},
                timeout=router.cfg.health_timeout_s)
            try:
                r = await router.client.send(req, stream=True)
                try:
                    content = await read_answer(r, router.cfg.max_answer_bytes)
                finally:
                    await r.aclose()
            except (httpx.HTTPError, AnswerTooLarge) as e:
                tried.append(f"{inst.url}: {describe_error(e)}")
                continue
            if r.status_code == 200:
                return Response(content, media_type="application/json")
            return relay_error(r.status_code, content, "decode", inst, path,
                               router.pool.engine_ids())
        if tried:
            logger.warning("%s: no decode instance answered: %s", path, "; ".join(tried))
        why = "no decode instance answered" if tried else "no healthy decode instance"
        return APIError(f"cannot {what}: {why}", status_code=503).response()

    async def tokens(request: Request, which: Literal["tokenize", "detokenize"]) -> Response:
        """The engine-core front's /tokenize or /detokenize (the model's tokenizer), else
        a decode instance's (HTTP legs: vLLM's too)."""
        if router.cores.wanted():
            why = await router.cores_ready()
            front = router.cores.front
            if why is not None or front is None:
                return APIError(f"the router is starting: {why}", status_code=503,
                                code="starting").response()
            return await front.tokens(request, getattr(front.prompts, which))
        try:
            raw = await read_body_within(request, router.cfg.body_timeout_s)
        except ClientDisconnect:
            return Response(status_code=499)
        except APIError as err:  # 413, 408
            return err.response()
        return await from_decode(f"/{which}", which, raw)

    @app.post("/tokenize", summary="Token ids of a prompt or a chat (vLLM's)",
              openapi_extra=request_body("TokenizeRequest"))
    async def tokenize(request: Request) -> Response:
        return await tokens(request, "tokenize")

    @app.post("/detokenize", summary="Text of token ids (vLLM's)",
              openapi_extra=request_body("DetokenizeRequest"))
    async def detokenize(request: Request) -> Response:
        return await tokens(request, "detokenize")

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    @app.get("/v1/models")
    async def models() -> Response:
        return await from_decode("/v1/models", "list models")

    @app.get("/health")
    async def health() -> Response:
        pool = router.pool
        counts = {role: sum(i.healthy for i in group) for role, group in pool.by_role.items()}
        extra = ({"membership": router.discovery.health()}
                 if router.discovery is not None else {})
        if not pool.ready():
            err = APIError(f"the router cannot serve: healthy instances {counts}",
                           status_code=503)
            return JSONResponse({**err.body(), **extra}, status_code=err.status_code)
        routing = router.routing_state()
        if not routing.starting and router.cores.wanted():
            why = await router.cores_ready(HEALTH_WAIT_S)  # a handshake takes ms
            if why is not None:
                routing = RoutingState("starting", why)
        if routing.starting:
            err = APIError(f"the router is starting: {routing.why}", status_code=503,
                           code="starting")
            return JSONResponse({**err.body(), **extra}, status_code=err.status_code)
        body = {"status": "degraded" if routing.degraded else "ok",
                "mode": router.cfg.mode, "healthy": counts,
                "routing": routing.routing,
                # how legs reach the instances: their engine cores' request planes, or
                # their HTTP APIs (kvpush.router.core_front)
                "legs": "engine cores" if router.cores.wanted() else "http", **extra}
        if routing.degraded:
            body["degraded"] = routing.why
        return JSONResponse(body)

    @app.get("/router/instances", summary="The instances, their identity and health")
    async def instances() -> Response:
        body: dict[str, Any] = {"mode": router.cfg.mode, "policy": router.cfg.policy,
                                "instances": [_instance_state(router, i)
                                              for i in router.pool.instances]}
        if router.discovery is not None:  # where etcd is and what it last said
            body["membership"] = router.discovery.health(detail=True)
        return JSONResponse(body)

    @app.get("/metrics")
    async def metrics() -> Response:
        text = router.metrics.render()
        text += router.cores.render_metrics()  # the front's (vllm:* included)
        return Response(text, media_type=router.metrics.content_type)

    install_openapi(app)
    return app


def _instance_state(router: Router, inst: Instance) -> dict:
    state = inst.state()
    if router.cache is not None:
        state["kv_index"] = router.cache.state(inst)
    return state


async def serve_forever(router: Router, host: str, port: int, log_level: str,
                        sockets: list | None = None) -> bool:
    """Wait for the instances, then serve until stopped. False when the server did not
    start (port taken, ...); start-up errors of the pool raise."""
    import uvicorn

    await router.start(wait=True)
    try:
        # --discover: decodes (and so the tokenizer's source) may join later; serve soon,
        # /health says 503 "starting" until the tokenizer has loaded
        await router.wait_routing(FIRST_VIEW_S if router.cfg.discover is not None
                                  else router.cfg.startup_timeout_s)
        app = build_app(router, manage=False)
        cfg = router.cfg
        server = uvicorn.Server(uvicorn.Config(
            app, host=host, port=port, log_level=log_level, access_log=False,
            log_config=None,  # uvicorn's records: our handler (kvpush.logs)
            timeout_graceful_shutdown=5,
            **uvicorn_options(cfg.header_timeout_s, cfg.max_client_connections)))
        await server.serve(sockets=sockets)
        return bool(server.started)
    finally:
        await router.close()
