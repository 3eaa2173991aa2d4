"""The router's OpenAI-compatible front: ``build_app(router) -> FastAPI``.

``POST /v1/completions`` and ``/v1/chat/completions`` (streaming and not) go through
the router's front (kvpush.router.front) and each one's request life
(kvpush.router.life); ``GET /v1/models``, ``/tokenize`` and ``/detokenize`` are the
front's;
``/health`` says whether the router can serve; ``/router/instances`` shows the pool;
``/metrics`` is Prometheus.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Literal

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from kvpush import __version__
from kvpush.aio import within
from kvpush.router.config import RouterConfig
from kvpush.router.front import STARTING_WAIT_S, RouterFront
from kvpush.router.intake import RETRY_AFTER_S, Admission, full_error
from kvpush.router.job import RequestRecord, outcome_for
from kvpush.router.life import Book
from kvpush.router.metrics import RouterMetrics
from kvpush.router.placement import Placement
from kvpush.router.pool import CHECKS_AT_ONCE, Instance, Pool
from kvpush.router.prompts import PromptTokenizer, TokenizerState, load_model_tokenizer
from kvpush.router.stopping import cancel_and_wait
from kvpush.router.wire import LegSigner
from kvpush.server.admin_key import ADMIN_PATHS, protect
from kvpush.server.app import MAX_BODY_BYTES, OpenAIFront, new_request_id, read_body_within
from kvpush.server.auth import auth_header
from kvpush.server.body_limit import BodyLimitMiddleware
from kvpush.server.door import uvicorn_options
from kvpush.server.errors import APIError, install_error_handlers
from kvpush.server.metrics import auth_rejected_counter
from kvpush.server.openapi import install_openapi, request_body
from kvpush.server.protocol import ModelCard, ModelList, VersionResponse

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
        self._health: asyncio.Task | None = None
        #: --discover: the etcd watch that adds and drops instances (kvpush.router.discover)
        self.discovery: EtcdLink | None = None
        self._joins: set[asyncio.Task] = set()
        #: the model's tokenizer (the front renders and tokenizes every request with it:
        #: the router serves nothing until it has loaded)
        self.tokenizer = PromptTokenizer(cfg.tokenizer)
        #: the front every request goes through (kvpush.router.front)
        self.front = RouterFront(cfg, self.book, self.signer, self.tokenizer)
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
        RouterConfigError / RouterStartupError), start the health loop; with ``wait``
        (but --discover: serving now) for the tokenizer and the core links too."""
        self.client = self.make_client()
        self.health_client = self.make_health_client()
        # --discover: instances come and go: serve soon, /health says when ready
        discovering = self.cfg.discover is not None
        try:
            if discovering:
                await self._start_discovery()
            if wait and not discovering:
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
            self.placement.follow(self.client)
        self._tokenizer_load = asyncio.create_task(
            load_model_tokenizer(self.tokenizer, self.cfg, self.pool, self.client),
            name="kvpush-tokenizer-load")
        self._health = asyncio.create_task(self.pool.health_loop(self.health_client),
                                           name="kvpush-health-loop")
        if wait and not discovering:
            await self.wait_serving(self.cfg.startup_timeout_s)

    async def wait_serving(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) until requests can be served; logs whether they
        can, loudly when the router cannot serve at all."""
        why = await self.front_ready(timeout)
        tok = self.tokenizer
        if tok.state is TokenizerState.FAILED:
            logger.error("ROUTER CANNOT SERVE: %s", self.no_tokenizer())
        elif why is not None:
            logger.warning("not serving yet: %s (requests wait for it, then 503)", why)
        else:
            logger.info("ready: %s routing (tokenizer %s loaded)", self.cfg.policy,
                        tok.source)

    def no_tokenizer(self) -> str:
        return (f"the router cannot serve without the model's tokenizer "
                f"({self.tokenizer.why}): give it --tokenizer")

    async def front_ready(self, timeout: float = STARTING_WAIT_S) -> str | None:
        """Why requests cannot be served yet (waiting at most ``timeout`` s for the
        tokenizer and the engine cores' links), or None."""
        assert self.client is not None
        return await self.front.ready(self._tokenizer_load, self.client, timeout)

    async def _start_discovery(self) -> None:
        """Watch the etcd prefix; each instance that joins is checked at once."""
        from kvpush.router.discover import EtcdLink

        def on_join(inst: Instance) -> None:
            assert self.health_client is not None
            task = asyncio.create_task(self.pool.check(self.health_client, inst))
            self._joins.add(task)
            task.add_done_callback(self._joins.discard)

        self.discovery = EtcdLink(self.pool, on_join)
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

    async def close(self) -> None:
        if self.discovery is not None:
            await self.discovery.close()
            self.discovery = None
        await cancel_and_wait(list(self._joins), "checks of joined instances")
        await cancel_and_wait([self._health], "the health loop")
        await self.front.close()
        await cancel_and_wait([self._tokenizer_load], "the tokenizer's load")
        await self.placement.close()
        if self.client is not None:
            await self.client.aclose()
        if self.health_client is not None:
            await self.health_client.aclose()
        self._health = None


async def _handle(router: Router, request: Request,
                  kind: Literal["completion", "chat"]) -> Response:
    arrival = time.perf_counter()
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
    job = RequestRecord(rid=new_request_id(kind), kind=kind, arrival=arrival,
              client_rid=request.headers.get("x-request-id"),
              on_done=router.admission.leave)
    why = await router.front_ready()
    if why is None:
        return await router.front.serve(request, kind, raw, job)
    router.book.close(job, "unavailable", 503)
    return APIError(f"the router is starting: {why}", status_code=503,
                    code="starting").response(
        headers={"X-Request-Id": job.rid, "Retry-After": str(RETRY_AFTER_S)})


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

    # no max_body_size: Starlette's limit answers text/plain (BodyLimitMiddleware: JSON)
    app = FastAPI(title="kvpush router", summary="OpenAI-compatible P/D router",
                  lifespan=lifespan)
    app.state.router = router
    install_error_handlers(app)

    def too_large(scope: Any) -> None:  # a request refused before its handler: counted
        if scope["path"] in ("/v1/completions", "/v1/chat/completions"):
            router.metrics.requests.labels(router.cfg.mode, "client_error").inc()

    app.add_middleware(BodyLimitMiddleware, limit=MAX_BODY_BYTES, on_reject=too_large)
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

    async def front_or_503() -> tuple[OpenAIFront | None, Response | None]:
        why = await router.front_ready()
        front = router.front.front
        if why is not None or front is None:
            return None, APIError(f"the router is starting: {why}", status_code=503,
                                  code="starting").response()
        return front, None

    async def tokens(request: Request, which: Literal["tokenize", "detokenize"]) -> Response:
        """The front's /tokenize or /detokenize (the model's tokenizer)."""
        front, starting = await front_or_503()
        if front is None:
            assert starting is not None
            return starting
        return await front.tokens(request, getattr(front.prompts, which))

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
        """The served model, as the front knows it (its name and context from a decode,
        its folder the tokenizer's)."""
        front, starting = await front_or_503()
        if front is None:
            assert starting is not None
            return starting
        card = ModelCard(id=front.model_name, created=front.created,
                         root=str(router.tokenizer.source),
                         max_model_len=front.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump(mode="json"))

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
        tok = router.tokenizer
        if tok.state is TokenizerState.FAILED:
            err = APIError(router.no_tokenizer(), status_code=503, code="no_tokenizer")
            return JSONResponse({**err.body(), **extra}, status_code=err.status_code)
        why = (await router.front_ready(HEALTH_WAIT_S) if tok.ready  # a handshake takes ms
               else f"loading the tokenizer {tok.source or ''}".strip())
        if why is not None:
            err = APIError(f"the router is starting: {why}", status_code=503,
                           code="starting")
            return JSONResponse({**err.body(), **extra}, status_code=err.status_code)
        return JSONResponse({"status": "ok", "mode": router.cfg.mode, "healthy": counts,
                             "routing": router.cfg.policy,
                             # how legs reach the instances: kvpush instances' engine
                             # cores, vLLM instances' HTTP APIs (kvpush.router.senders)
                             "legs": router.front.legs(), **extra})

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
        text += router.front.render_metrics()  # the front's (vllm:* included)
        return Response(text, media_type=router.metrics.content_type)

    install_openapi(app)
    return app


def _instance_state(router: Router, inst: Instance) -> dict:
    state = inst.state(router.pool.core_stats(inst))
    if router.placement.index is not None:
        state["kv_index"] = router.placement.index.state(inst)
    return state


async def serve_forever(router: Router, host: str, port: int, log_level: str,
                        sockets: list | None = None) -> bool:
    """Wait for the instances, then serve until stopped. False when the server did not
    start (port taken, ...); start-up errors of the pool raise."""
    import uvicorn

    await router.start(wait=True)
    try:
        if router.cfg.discover is not None:  # decodes (the tokenizer's source) join later
            await router.wait_serving(FIRST_VIEW_S)
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
