"""Which instance takes each leg of a request: the configured order (round-robin,
least-outstanding), or with ``--policy cache-aware`` the cached prefix weighed against
load (kvpush.router.decide has the rules). One :class:`Placement` per router, always
present: the request life asks it, and never asks which policy runs.

Cache-aware, it keeps a KV index of every instance (kvpush.router.kv_index), following
each instance's KV events as the health checks read its ``/kv/info`` (a restart, a new
engine id, drops its index); a request's routing facts are its :class:`Route`.

It also keeps the request's claims on instances: a picked instance's in-flight count
(``Pool.pick``) and, cache-aware, the KV tokens a decode leg will hold, released when
the leg is over or moves elsewhere.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from kvpush.kv_info import CacheBlocks, decode_cache_blocks
from kvpush.router.config import RouterKeys
from kvpush.router.decide import FULL_COST, Decision, Route, cost, decide, lacks_room
from kvpush.router.job import RequestRecord
from kvpush.router.kv_index import KVIndex
from kvpush.router.pool import Instance, Pool
from kvpush.server.errors import APIError

if TYPE_CHECKING:
    import httpx

    from kvpush.sampling_params import SamplingParams

logger = logging.getLogger("kvpush.router")


class Placement:
    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.cfg = pool.cfg
        #: cache-aware: what each instance holds (None until ``follow``)
        self.index: KVIndex | None = None

    # ---- the cache-aware policy's KV index -----------------------------------------
    def follow(self, client: httpx.AsyncClient) -> None:
        """Cache-aware: follow the KV events of every instance whose check passes (those
        healthy now at once), snapshots over ``client``."""
        async def fetch_snapshot(url: str) -> CacheBlocks:
            keys = self.cfg.keys  # (with the API key: the client's)
            r = await client.get(url + "/kv/cache_blocks", timeout=self.cfg.health_timeout_s,
                                 headers=keys.member_header()
                                 if isinstance(keys, RouterKeys) else None)
            if r.status_code != 200:
                raise RuntimeError(f"/kv/cache_blocks answered HTTP {r.status_code}")
            return decode_cache_blocks(r.content)

        index = self.index = KVIndex(fetch_snapshot, retry_s=self.cfg.health_interval_s,
                                     keys=self.cfg.keys.events if self.cfg.keys else None)
        self.pool.on_info.append(lambda inst: index.update(inst, inst.url, inst.info))
        self.pool.on_remove.append(lambda inst: index.update(inst, inst.url, None))
        for inst in self.pool.instances:  # checked once already (start-up)
            if inst.healthy:
                index.update(inst, inst.url, inst.info)

    async def close(self) -> None:
        if self.index is not None:
            await self.index.close()

    # ---- the request's facts -------------------------------------------------------
    def route(self, job: RequestRecord, prompt: list[int], params: SamplingParams) -> None:
        """Attach the prompt's routing facts to the job (cache-aware)."""
        if self.cfg.policy == "cache-aware":
            job.route = Route(list(prompt), cache_salt=params.cache_salt,
                              answer_tokens=params.max_tokens)

    def cached_tokens(self, inst: Instance, route: Route) -> int:
        """The prompt tokens ``inst`` holds, as its KV index says (0: no index)."""
        if self.index is None:
            return 0
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

    def cost(self, job: RequestRecord) -> Callable[[Instance], float] | None:
        """``Pool.pick``'s cost for the job (None: no route, the configured order)."""
        r, cfg = job.route, self.cfg
        if r is None:
            return None

        def of(inst: Instance) -> float:
            c = cost(r.prompt_tokens, self.cached_tokens(inst, r), inst.in_flight,
                     cfg.load_cost_tokens, inst.tokens_in_flight, cfg.load_weight)
            return c + FULL_COST if self.no_room(inst, r) else c
        return of

    def local(self, job: RequestRecord) -> bool:
        """Whether decode alone should compute the prompt (cache-aware: the decode the
        job would get now holds most of it, decision ``local``)."""
        r = job.route
        if r is None:
            return False
        d = self.pool.choose("decode", cost=self.cost(job))
        if d is None:
            return False  # the caller answers 503
        r.d_cached_tokens = self.cached_tokens(d, r)
        p = self.pool.choose("prefill", cost=self.cost(job))
        p_cached = None if p is None else self.cached_tokens(p, r)
        r.decision = decide(r.prompt_tokens, r.d_cached_tokens, p_cached,
                            self.cfg.local_prefill_max_tokens)
        return r.decision is Decision.LOCAL

    # ---- claims on instances -------------------------------------------------------
    def pick(self, role: str, job: RequestRecord, exclude: Iterable[Instance] = ()
             ) -> Instance | None:
        """A healthy instance of ``role`` for one of the job's legs (its in-flight count
        taken: ``Pool.release``, or ``release_decode``), not one of ``exclude``."""
        inst = self.pool.pick(role, exclude, cost=self.cost(job))
        if inst is not None and role == "prefill":
            job.prefill = inst
            if job.route is not None:
                job.route.p_cached_tokens = self.cached_tokens(inst, job.route)
        return inst

    def pick_decode(self, job: RequestRecord, exclude: set[Instance] | None = None) -> Instance:
        """A decode instance for the job (held until ``release_decode``), not one of
        ``exclude``, or a 503 naming the missing role. Cache-aware, the KV its leg will
        hold (prompt and answer bound) is charged to it: the load others see."""
        self.release_decode(job)
        exclude = exclude or set()
        d = None
        if job.d_refused is not None:  # it answered "full" for this request already
            d = self.pool.pick("decode", exclude | {job.d_refused}, cost=self.cost(job))
        if d is None:
            d = self.pool.pick("decode", exclude, cost=self.cost(job))
        if d is None:
            raise self.unavailable(job, "decode")
        job.decode = job.d_held = d
        r = job.route
        if r is not None:
            r.d_cached_tokens = self.cached_tokens(d, r)
            job.d_tokens = r.prompt_tokens + r.answer_tokens
            d.tokens_in_flight += job.d_tokens
        return d

    def release_decode(self, job: RequestRecord) -> None:
        """The job's decode leg is over (or moves elsewhere): its claim goes."""
        d = job.d_held
        if d is not None:
            self.pool.release(d)
            d.tokens_in_flight = max(0, d.tokens_in_flight - job.d_tokens)
            job.d_held, job.d_tokens = None, 0

    # ---- refusals ------------------------------------------------------------------
    def unavailable(self, job: RequestRecord, role: str) -> APIError:
        """The 503 for a request no healthy ``role`` instance can take (it names the
        role; the log names the instances and why each is out)."""
        why = "; ".join(f"{i.url}: {i.last_error}" for i in self.pool.by_role[role])
        return fail(job, 503, f"no healthy {role} instance; try again shortly",
                    f"no healthy {role} instance: {why or 'none configured'}")


def fail(job: RequestRecord, status: int, message: str, detail: str) -> APIError:
    """The client's error (``message``: no internal names), with ``detail`` (which may
    name them) logged under the request id."""
    logger.warning("request %s: %s", job.rid, detail)
    return APIError(message, status_code=status)
