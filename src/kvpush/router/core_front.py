"""The router's front over kvpush instances' engine cores: its :class:`OpenAIFront`
(kvpush.server.app) over a :class:`ClusterEngine`.

A kvpush instance (its /kv/info names a request plane) is reached over its engine core
only: a request that arrives while the router is starting (the model's tokenizer
loading, a core's link handshaking) waits for that, woken by the events themselves, at
most ``STARTING_WAIT_S``, then gets a 503 "starting". The HTTP legs
(kvpush.router.legs) are for vLLM instances. The front is built once, from a decode
instance's ``/kv/info`` (the served model's name, its context, its vocabulary, and its
``--chat-template`` if it was given one: the router renders chats for the cores).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Literal

from fastapi import Request
from fastapi.responses import Response

from kvpush.aio import within
from kvpush.router.cluster_engine import ClusterEngine
from kvpush.router.config import RouterConfig
from kvpush.router.job import Job, outcome_for
from kvpush.router.life import Book, RequestLife
from kvpush.router.pool import Instance
from kvpush.router.senders import CoreSender, remote_core
from kvpush.router.wire import LegSigner
from kvpush.server.app import FrontSettings, OpenAIFront

if TYPE_CHECKING:
    from kvpush.router.prompts import PromptTokenizer

log = logging.getLogger("kvpush.router")


def has_plane(inst: Instance, members: bool) -> bool:
    """Whether the router reaches ``inst`` over its engine core: a kvpush instance whose
    /kv/info names a request plane the router can join (``members``: it holds the
    cluster secret; a router without it joins only plain planes)."""
    info = inst.info or {}
    return bool(info.get("request_plane")) and (
        members or not info.get("request_plane_members", True))


#: how long a request that arrives while the router is starting (the tokenizer loading,
#: the engine cores' links handshaking) waits for it before a 503 "starting"
STARTING_WAIT_S = 10.0


class CoreFront:
    def __init__(self, cfg: RouterConfig, book: Book, signer: LegSigner) -> None:
        self.cfg = cfg
        self.book = book
        self.pool = book.placement.pool
        self.signer = signer
        self.sender: CoreSender | None = None
        self.cluster: ClusterEngine | None = None
        self.front: OpenAIFront | None = None

    def _over_cores(self) -> list[Instance]:
        """The healthy instances the router reaches over their engine cores."""
        members = self.cfg.keys is not None
        return [i for i in self.pool.instances if i.healthy and has_plane(i, members)]

    def wanted(self) -> bool:
        """Whether the healthy instances are kvpush instances: reached over their engine
        cores only (the HTTP legs are for instances without a request plane)."""
        return bool(self._over_cores())

    def serving(self, tokenizer: PromptTokenizer | None) -> bool:
        """Whether requests can take the engine cores now (builds the front on first
        use): the model's tokenizer is loaded and a leg can leave for a decode (and a
        prefill where needed), or a role is missing (the request life's 503 says so)."""
        if tokenizer is None or not tokenizer.ready:
            return False
        if self.sender is None:
            keys = self.cfg.keys
            plane = keys.request_plane if keys is not None else None
            self.sender = CoreSender(self.pool, remote_core(plane, tokenizer.tokenizer))
            self.pool.link_up = self.sender.link_up
            life = RequestLife(self.cfg, self.book, self.sender, self.signer,
                               tokenizer.tokenizer)
            self.cluster = ClusterEngine(life)
        # links handshaking: wait; an instance role missing: the request life's 503
        if not self.sender.serves() and self.pool.ready():
            return False
        if self.front is None:
            if not any(i.healthy and i.info for i in self.pool.by_role["decode"]):
                return False
            self._build_front(tokenizer)
        return True

    async def ready(self, tokenizer: PromptTokenizer | None, loading: asyncio.Task | None,
                    timeout: float) -> str | None:
        """Wait (at most ``timeout`` s, on the events themselves) until requests can take
        the engine cores; why they cannot, or None."""
        deadline = time.monotonic() + timeout
        if tokenizer is not None and not tokenizer.ready and loading is not None:
            with contextlib.suppress(Exception):  # (a failed load: the tokenizer's why)
                await within(asyncio.shield(loading), timeout)
        if tokenizer is None or not tokenizer.ready:
            why = tokenizer.why if tokenizer is not None else None
            return f"the model's tokenizer is not loaded{f' ({why})' if why else ''}"
        if self.serving(tokenizer):
            return None
        sender = self.sender
        assert sender is not None
        links = [sender.link(i) for i in self._over_cores()]
        pending = {asyncio.ensure_future(link.wait_connected(timeout))
                   for link in links if link is not None and not link.connected}
        try:
            while pending and not self.serving(tokenizer):
                left = deadline - time.monotonic()
                done, pending = await asyncio.wait(pending, timeout=max(0.0, left),
                                                   return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    break
        finally:
            for task in pending:
                task.cancel()
        if self.serving(tokenizer):
            return None
        return "the links to the instances' engine cores are still connecting"

    def _build_front(self, tokenizer: PromptTokenizer) -> None:
        """The OpenAI front, from a decode instance's /kv/info: the served model's name,
        its context, its vocabulary, and its ``--chat-template`` if it was given one
        (the router renders chats for the cores)."""
        assert self.cluster is not None
        inst = next(i for i in self.pool.by_role["decode"] if i.healthy and i.info)
        info = inst.info
        assert info is not None
        template = info.get("chat_template")
        if isinstance(template, str):  # the instance's --chat-template, not the model's
            tokenizer.tokenizer.chat_template = template
            log.info("chats are rendered with %s's --chat-template", inst.url)
        settings = FrontSettings(str(info.get("model")), int(info["max_model_len"]),
                                 int(info["vocab_size"]), "router", self.cfg.mode)
        self.front = OpenAIFront(self.cluster, settings, max_waiting_requests=0,
                                 body_timeout_s=self.cfg.body_timeout_s)
        self.front.on_job = self.cluster.note_stream

    async def serve(self, request: Request, kind: Literal["completion", "chat"],
                    raw: bytes, job: Job) -> Response:
        """The request through the front; the job is closed by its life once its legs
        are over, or here when no leg was placed (a 4xx from parsing or the front's
        checks)."""
        cluster, front = self.cluster, self.front
        assert cluster is not None and front is not None
        cluster.jobs[job.rid] = job
        try:
            resp = await front.serve(request, kind, raw, job.arrival, request_id=job.rid)
        finally:
            cluster.jobs.pop(job.rid, None)
        if not job.mode:
            self.book.close(job, outcome_for(resp.status_code), resp.status_code)
        return resp

    def render_metrics(self) -> bytes:
        return self.front.metrics.render() if self.front is not None else b""

    async def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.front is not None:
            self.front.executor.shutdown(wait=False, cancel_futures=True)
