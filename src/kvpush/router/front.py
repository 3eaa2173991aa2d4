"""The router's front: its :class:`OpenAIFront` (kvpush.server.app) over the router's
engine, :class:`RouterFront` (a ``FrontEngine``), so a routed request is parsed,
rendered, tokenized, checked and formatted by the same code as an instance's, and
lived once by its :class:`RequestLife` over the instances' :class:`Senders` (engine
cores for kvpush instances, HTTP for vLLM instances).

A request that arrives while the router is starting (the model's tokenizer loading, a
core's link handshaking) waits for that, woken by the events themselves, at most
``STARTING_WAIT_S``, then gets a 503 "starting". The front is built once, from a decode
instance (``RouterFront._build_front``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any, Literal

from fastapi import Request
from fastapi.responses import Response

from kvpush.aio import within
from kvpush.router.config import RouterConfig
from kvpush.router.http_sender import HttpSender
from kvpush.router.job import RequestRecord, outcome_for
from kvpush.router.life import Book, RequestLife
from kvpush.router.pool import Instance
from kvpush.router.senders import CoreSender, Senders, remote_core
from kvpush.router.wire import LegSigner
from kvpush.server.app import FrontSettings, OpenAIFront
from kvpush.server.errors import APIError

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    import httpx

    from kvpush.engine.outputs import RequestOutput
    from kvpush.router.prompts import PromptTokenizer
    from kvpush.sampling_params import SamplingParams
    from kvpush.server.protocol import Job as FrontJob

log = logging.getLogger("kvpush.router")


#: a vLLM decode's context when its /v1/models does not say it (vLLM checks each
#: request against its own)
UNKNOWN_CONTEXT = 1 << 30

#: how long a request that arrives while the router is starting (the tokenizer loading,
#: the engine cores' links handshaking) waits for it before a 503 "starting"
STARTING_WAIT_S = 10.0


class RouterFront:
    """The router's front and the engine its OpenAIFront serves over: each request
    handed to the one request life."""

    def __init__(self, cfg: RouterConfig, book: Book, signer: LegSigner,
                 prompts: PromptTokenizer) -> None:
        self.cfg = cfg
        self.book = book
        self.pool = book.placement.pool
        self.signer = signer
        #: the model's tokenizer, as the router loads it
        self.prompts = prompts
        #: the loaded tokenizer (FrontEngine's), once ``serving`` has built the life
        self.tokenizer: Any = None
        self.sender: Senders | None = None
        self.life: RequestLife | None = None
        self.front: OpenAIFront | None = None
        #: the router's jobs by request id, from the handler to ``generate``
        self.jobs: dict[str, RequestRecord] = {}

    def _over_cores(self) -> list[Instance]:
        """The healthy instances the router reaches over their engine cores."""
        return [i for i in self.pool.instances if i.healthy and i.kvpush]

    def legs(self) -> str:
        """How legs reach the healthy instances (/health's ``legs``)."""
        kinds = {i.kvpush for i in self.pool.instances if i.healthy}
        return " and ".join(name for over, name in ((True, "engine cores"),
                                                     (False, "http")) if over in kinds)

    def serving(self, client: httpx.AsyncClient) -> bool:
        """Whether requests can be served now (builds the front on first use): the
        model's tokenizer is loaded and a leg can leave for a decode (and a prefill where
        needed), or a role is missing (the request life's 503 says so)."""
        if not self.prompts.ready:
            return False
        if self.sender is None:
            self.tokenizer = self.prompts.tokenizer
            keys = self.cfg.keys
            plane = keys.request_plane if keys is not None else None
            cores = CoreSender(self.pool, remote_core(plane, self.tokenizer))
            self.pool.core_stats = cores.latest_stats
            self.sender = Senders(cores, HttpSender(self.cfg, self.pool, client))
            self.life = RequestLife(self.cfg, self.book, self.sender, self.signer,
                                    self.tokenizer)
        # links handshaking: wait; an instance role missing: the request life's 503
        if not self.sender.serves() and self.pool.ready():
            return False
        if self.front is None:
            if not any(i.healthy for i in self.pool.by_role["decode"]):
                return False
            self._build_front()
        return True

    async def ready(self, loading: asyncio.Task | None, client: httpx.AsyncClient,
                    timeout: float) -> str | None:
        """Wait (at most ``timeout`` s, on the events themselves: the tokenizer's
        ``loading``, the links' handshakes) until requests can be served; why they
        cannot, or None."""
        deadline = time.monotonic() + timeout
        if not self.prompts.ready and loading is not None:
            with contextlib.suppress(Exception):  # (a failed load: the tokenizer's why)
                await within(asyncio.shield(loading), timeout)
        if not self.prompts.ready:
            why = self.prompts.why
            return f"the model's tokenizer is not loaded{f' ({why})' if why else ''}"
        if self.serving(client):
            return None
        sender = self.sender
        assert sender is not None
        links = [sender.cores.link(i) for i in self._over_cores()]
        pending = {asyncio.ensure_future(link.wait_connected(timeout))
                   for link in links if link is not None and not link.connected}
        try:
            while pending and not self.serving(client):
                left = deadline - time.monotonic()
                done, pending = await asyncio.wait(pending, timeout=max(0.0, left),
                                                   return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    break
        finally:
            for task in pending:
                task.cancel()
        if self.serving(client):
            return None
        return "the links to the instances' engine cores are still connecting"

    def _build_front(self) -> None:
        """The OpenAI front, from a decode instance: a kvpush instance's /kv/info (the
        served model's name, its context, its vocabulary, and its ``--chat-template`` if
        it was given one: the router renders chats for the cores), else what a vLLM
        instance's /v1/models said (kvpush.router.prompts.load_model_tokenizer)."""
        tokenizer = self.prompts
        decodes = [i for i in self.pool.by_role["decode"] if i.healthy]
        inst = next((i for i in decodes if i.info is not None), decodes[0])
        info = inst.info
        if info is not None:
            if isinstance(info.chat_template, str):  # the instance's --chat-template
                tokenizer.tokenizer.chat_template = info.chat_template
                log.info("chats are rendered with %s's --chat-template", inst.url)
            settings = FrontSettings(info.model, info.max_model_len, info.vocab_size,
                                     "router", self.cfg.mode)
        else:
            settings = FrontSettings(tokenizer.served_model or str(tokenizer.source),
                                     tokenizer.max_model_len or UNKNOWN_CONTEXT,
                                     len(tokenizer.tokenizer), "router", self.cfg.mode)
        self.front = OpenAIFront(self, settings, max_waiting_requests=0,
                                 body_timeout_s=self.cfg.body_timeout_s)
        self.front.on_job = self.note_parsed

    async def serve(self, request: Request, kind: Literal["completion", "chat"],
                    raw: bytes, job: RequestRecord) -> Response:
        """The request through the front; the job is closed by its life once its legs
        are over, or here when no leg was placed (a 4xx from parsing or the front's
        checks)."""
        front = self.front
        assert front is not None
        self.jobs[job.rid] = job
        try:
            resp = await front.serve(request, kind, raw, job.arrival, request_id=job.rid)
        finally:
            self.jobs.pop(job.rid, None)
        if not job.mode:
            self.book.close(job, outcome_for(resp.status_code), resp.status_code)
        return resp

    # ---- FrontEngine: what the OpenAIFront uses of its engine ------------------------
    def note_parsed(self, parsed: FrontJob) -> None:
        """The front parsed the request: its record holds the parsed request."""
        job = self.jobs.get(parsed.request_id)
        if job is not None:
            job.parsed = parsed

    def health_problem(self) -> str | None:
        missing = [role for role in ("decode", "prefill")
                   if not self.pool.has_healthy(role)
                   and (role == "decode" or self.cfg.needs_prefill)]
        return f"no healthy {' or '.join(missing)} instance" if missing else None

    def kv_params(self, raw: object) -> None:
        if raw is not None:
            raise APIError("kv_transfer_params are cluster-internal: the router sets them "
                           "for each leg, and a client may not send its own",
                           status_code=403, param="kv_transfer_params",
                           code="kv_transfer_params_not_allowed")
        return None

    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams, kv_transfer_params: Any = None
                 ) -> AsyncIterator[RequestOutput]:
        assert self.life is not None
        return self.life.run(self.jobs[request_id], list(prompt_token_ids), params)

    def render_metrics(self) -> bytes:
        return self.front.metrics.render() if self.front is not None else b""

    async def close(self) -> None:
        if self.sender is not None:
            self.sender.cores.close()
        if self.front is not None:
            self.front.executor.shutdown(wait=False, cancel_futures=True)
