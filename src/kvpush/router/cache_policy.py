"""The cache-aware policy's state in a running router: the tokenizer, the KV index of
every instance, and each request's choices that :class:`kvpush.router.placement.Placement`
asks for (kvpush.router.decide has the rules).

Started by the router after its instances are usable: the index follows each instance's
KV events as the health checks read its ``/kv/info`` (a restart, a new engine id, drops
its index), and the tokenizer loads in the background. Until it has loaded, or when it
cannot, the router serves nothing (kvpush.router.app, ``no_tokenizer``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import httpx

from kvpush.router.answers import fetch
from kvpush.router.config import RouterConfig, RouterKeys
from kvpush.router.decide import (
    Decision,
    Route,
    cost_fn,
    decide,
    lacks_room,
)
from kvpush.router.job import Job
from kvpush.router.kv_index import KVIndex, Snapshot, parse_snapshot
from kvpush.router.metrics import RouterMetrics
from kvpush.router.pool import Instance, Pool, describe_error
from kvpush.router.prompts import PromptTokenizer, model_id, model_max_len, model_source
from kvpush.router.stopping import cancel_and_wait

logger = logging.getLogger("kvpush.router")


class CachePolicy:
    def __init__(self, cfg: RouterConfig, pool: Pool, metrics: RouterMetrics,
                 client: httpx.AsyncClient) -> None:
        self.cfg, self.pool, self.metrics, self.client = cfg, pool, metrics, client
        self.tokenizer = PromptTokenizer(cfg.tokenizer)
        self.index = KVIndex(self._fetch_snapshot, retry_s=cfg.health_interval_s,
                             keys=cfg.keys.events if cfg.keys else None)
        self._load: asyncio.Task | None = None
        pool.on_info.append(self._on_info)
        pool.on_remove.append(self._on_remove)
        for inst in pool.instances:  # checked once already (start-up)
            if inst.healthy:
                self._on_info(inst)

    # ------------------------------------------------------------------ background

    def _on_info(self, inst: Instance) -> None:
        self.index.update(inst, inst.url, inst.info)
        # the model's context, from any instance's /kv/info: with --tokenizer the
        # router may have started before any decode answered /v1/models (--discover)
        if inst.info is not None and inst.info.max_model_len > self.tokenizer.max_model_len:
            self.tokenizer.max_model_len = inst.info.max_model_len

    def _on_remove(self, inst: Instance) -> None:  # left the pool: its index goes
        self.index.update(inst, inst.url, None)

    async def _fetch_snapshot(self, url: str) -> Snapshot:
        keys = self.cfg.keys  # (with the API key: the client's)
        r = await self.client.get(url + "/kv/cache_blocks", timeout=self.cfg.health_timeout_s,
                                  headers=keys.member_header()
                                  if isinstance(keys, RouterKeys) else None)
        if r.status_code != 200:
            raise RuntimeError(f"/kv/cache_blocks answered HTTP {r.status_code}")
        return parse_snapshot(r.content)

    @property
    def loading(self) -> asyncio.Task | None:
        """The tokenizer's load (None before ``start``)."""
        return self._load

    def start(self) -> None:
        """Load the tokenizer in the background (the model's, from a decode's
        /v1/models, unless --tokenizer names one)."""
        self._load = asyncio.create_task(
            load_model_tokenizer(self.tokenizer, self.cfg, self.pool, self.client),
            name="kvpush-tokenizer-load")

    async def close(self) -> None:
        await cancel_and_wait([self._load], "the tokenizer's load")
        await self.index.close()

    # ------------------------------------------------------------------ per request

    def cached_tokens(self, inst: object, route: Route) -> int:
        blocks = self.index.longest_prefix(inst, route.chain)
        bs = self.index.block_size(inst)
        return route.cached_tokens(blocks, bs) if bs else 0

    def no_room(self, inst: Instance, route: Route) -> bool:
        """Whether the instance's engine core, as its latest snapshot says, has too few
        free blocks for the prompt (False when it does not say: vLLM, no link yet)."""
        stats = self.pool.core_stats(inst)
        if stats is None or inst.info is None:
            return False
        return lacks_room(route.prompt_tokens, stats.num_free_blocks, inst.info.block_size)

    def cost(self, job: Job) -> Callable[[Instance], float] | None:
        """``Pool.pick``'s cost for the job (None: no route, the configured order)."""
        if job.route is None:
            return None
        return cost_fn(job.route, self.cached_tokens, self.cfg.load_cost_tokens,
                       self.no_room, self.cfg.load_weight)

    def decide(self, job: Job) -> Decision:
        """``local`` or ``remote`` for the decode instance the job would get now."""
        r = job.route
        if r is None:  # (placed without its prompt: cannot be, Placement.route runs first)
            return Decision.REMOTE
        d = self.pool.choose("decode", cost=self.cost(job))
        if d is None:
            return Decision.REMOTE  # the caller answers 503
        r.d_cached_tokens = self.cached_tokens(d, r)
        p = self.pool.choose("prefill", cost=self.cost(job))
        p_cached = None if p is None else self.cached_tokens(p, r)
        r.decision = decide(r.prompt_tokens, r.d_cached_tokens, p_cached,
                            self.cfg.local_prefill_max_tokens)
        return r.decision

    def picked(self, job: Job, inst: Instance) -> None:
        """Note the cached tokens of the instance a leg went to."""
        r = job.route
        if r is None:
            return
        n = self.cached_tokens(inst, r)
        if inst.role == "prefill":
            r.p_cached_tokens = n
        else:
            r.d_cached_tokens = n
            # the KV the decode leg will hold: the load others see (until ``released``)
            self.released(job)
            job.d_tokens = r.prompt_tokens + r.answer_tokens
            job.d_charged = inst
            inst.tokens_in_flight += job.d_tokens

    @staticmethod
    def released(job: Job) -> None:
        """The job's decode leg is over (or moves elsewhere): its tokens leave the load."""
        inst = job.d_charged
        if inst is not None:
            inst.tokens_in_flight = max(0, inst.tokens_in_flight - job.d_tokens)
            job.d_charged, job.d_tokens = None, 0

    def count(self, job: Job) -> None:
        """The decision and the cached token counts, into /metrics (once per request)."""
        r = job.route
        if r is None:  # refused before it was placed: no decision
            return
        self.metrics.decisions.labels(r.decision.value).inc()
        if r.d_cached_tokens is not None:
            self.metrics.cached_tokens.labels("decode").observe(r.d_cached_tokens)
        if r.p_cached_tokens is not None:
            self.metrics.cached_tokens.labels("prefill").observe(r.p_cached_tokens)
        self.metrics.prompt_tokens.observe(r.prompt_tokens)

    def state(self, inst: Instance) -> dict[str, Any] | None:
        return self.index.state(inst)


async def load_model_tokenizer(tok: PromptTokenizer, cfg: RouterConfig, pool: Pool,
                               client: httpx.AsyncClient) -> None:
    """Load ``tok``: --tokenizer, else the model a healthy (proven) decode instance's
    /v1/models names (with --discover, asked again until a decode has joined)."""
    source = None
    while True:
        for inst in pool.by_role["decode"]:
            if not inst.healthy:  # proven first: an unproven URL gets no API key
                continue
            try:
                # (whole within the deadline and the health answers' cap)
                r = await fetch(client, "GET", inst.url + "/v1/models", cfg.health_timeout_s)
                models = r.json() if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError) as e:
                logger.info("/v1/models of %s: %s", inst.url, describe_error(e))
                continue
            source = model_source(models)
            tok.max_model_len = max(tok.max_model_len, model_max_len(models))
            tok.served_model = tok.served_model or model_id(models)
            if source is not None:
                break
        if source is not None or cfg.tokenizer or cfg.discover is None:
            break
        # --discover: no decode has joined yet; ask again when one may have
        await asyncio.sleep(cfg.health_interval_s)
    await tok.load(None if cfg.tokenizer else source)
