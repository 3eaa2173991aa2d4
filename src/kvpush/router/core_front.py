"""Whether and how a request is served over the engine cores: the router's
:class:`OpenAIFront` (kvpush.server.app) over a :class:`ClusterEngine`.

A request takes this path when the router holds the cluster secret and the model's
tokenizer, and every healthy instance has a request plane, a proven one for at least
one decode; else it takes the HTTP legs (kvpush.router.legs: vLLM instances, a router
whose tokenizer is still loading, or ``KVPUSH_ROUTER_PATH=http`` for side-by-side
measurements). The front is built once, from a decode instance's ``/kv/info`` (the
served model's name, its context, its vocabulary, and its ``--chat-template`` if it
was given one: the router renders chats for the cores).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Literal

from fastapi import Request
from fastapi.responses import Response

from kvpush.router.cluster_engine import ClusterEngine
from kvpush.router.config import RouterConfig
from kvpush.router.job import Job, outcome_for
from kvpush.router.life import Book, RequestLife
from kvpush.router.senders import CoreSender, remote_core
from kvpush.router.wire import LegSigner
from kvpush.server.app import FrontSettings, OpenAIFront

if TYPE_CHECKING:
    from kvpush.router.prompts import PromptTokenizer

log = logging.getLogger("kvpush.router")

#: environment variable that keeps kvpush instances on the HTTP legs (``http``)
ROUTER_PATH_ENV = "KVPUSH_ROUTER_PATH"


class CoreFront:
    def __init__(self, cfg: RouterConfig, book: Book, signer: LegSigner) -> None:
        self.cfg = cfg
        self.book = book
        self.pool = book.placement.pool
        self.signer = signer
        self.sender: CoreSender | None = None
        self.cluster: ClusterEngine | None = None
        self.front: OpenAIFront | None = None

    def serving(self, tokenizer: PromptTokenizer | None) -> bool:
        """Whether requests take the engine cores now (builds the front on first use)."""
        keys = self.cfg.kv_secret
        if (keys is None or tokenizer is None or not tokenizer.ready
                or os.environ.get(ROUTER_PATH_ENV) == "http"):
            return False
        if self.sender is None:
            self.sender = CoreSender(self.pool, remote_core(keys.request_plane,
                                                            tokenizer.tokenizer))
            self.pool.link_up = self.sender.link_up
            life = RequestLife(self.cfg, self.book, self.sender, self.signer,
                               tokenizer.tokenizer)
            self.cluster = ClusterEngine(life)
        if not self.sender.serves():
            return False
        if self.front is None:
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
            self.front = OpenAIFront(self.cluster, settings,  # type: ignore[arg-type]
                                     max_waiting_requests=0,
                                     body_timeout_s=self.cfg.body_timeout_s,
                                     engine_gauges=False)
            self.front.on_job = self.cluster.note_stream
        return True

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
