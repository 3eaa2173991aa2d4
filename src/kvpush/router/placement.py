"""Which instance takes each leg of a request: the configured order (round-robin,
least-outstanding), or the cache-aware policy (kvpush.router.cache_policy) when the
router runs it. One :class:`Placement` per router, always present: the request life asks
it, and never asks which policy runs.

It also keeps the request's claims on instances: a picked instance's in-flight count
(``Pool.pick``) and, with the cache-aware policy, the KV tokens a decode leg will hold,
released when the leg is over or moves elsewhere.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from kvpush.router.decide import Decision, Route
from kvpush.router.job import Job
from kvpush.router.pool import Instance, Pool
from kvpush.server.errors import APIError

if TYPE_CHECKING:
    from kvpush.router.cache_policy import CachePolicy
    from kvpush.sampling_params import SamplingParams

logger = logging.getLogger("kvpush.router")


class Placement:
    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        #: the cache-aware policy, once started (None: the configured order)
        self.cache: CachePolicy | None = None

    # ---- the request's facts -------------------------------------------------------
    def route(self, job: Job, prompt: list[int], params: SamplingParams) -> None:
        """Attach the prompt's routing facts to the job (the cache-aware policy's)."""
        if self.cache is not None:
            job.route = Route(list(prompt), cache_salt=params.cache_salt,
                              answer_tokens=params.max_tokens)

    def local(self, job: Job) -> bool:
        """Whether decode alone should compute the prompt (its prefix cache holds most
        of it: the cache-aware policy's ``local``)."""
        return self.cache is not None and self.cache.decide(job) is Decision.LOCAL

    def cost(self, job: Job) -> Callable[[Instance], float] | None:
        return self.cache.cost(job) if self.cache is not None else None

    # ---- claims on instances -------------------------------------------------------
    def pick(self, role: str, job: Job, exclude: Iterable[Instance] = ()) -> Instance | None:
        """A healthy instance of ``role`` for one of the job's legs (its in-flight count
        taken: ``Pool.release``, or ``release_decode``), not one of ``exclude``."""
        inst = self.pool.pick(role, exclude, cost=self.cost(job))
        if inst is not None and role == "prefill":
            job.prefill = inst
            if self.cache is not None:
                self.cache.picked(job, inst)
        return inst

    def pick_decode(self, job: Job, exclude: set[Instance] | None = None) -> Instance:
        """A decode instance for the job (held until ``release_decode``), not one of
        ``exclude``, or a 503 naming the missing role."""
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
        if self.cache is not None:
            self.cache.picked(job, d)
        return d

    def release_decode(self, job: Job) -> None:
        if self.cache is not None:
            self.cache.released(job)
        if job.d_held is not None:
            self.pool.release(job.d_held)
            job.d_held = None

    def count(self, job: Job) -> None:
        if self.cache is not None:
            self.cache.count(job)

    # ---- refusals ------------------------------------------------------------------
    def unavailable(self, job: Job, role: str) -> APIError:
        """The 503 for a request no healthy ``role`` instance can take (it names the
        role; the log names the instances and why each is out)."""
        why = "; ".join(f"{i.url}: {i.last_error}" for i in self.pool.by_role[role])
        return fail(job, 503, f"no healthy {role} instance; try again shortly",
                    f"no healthy {role} instance: {why or 'none configured'}")


def fail(job: Job, status: int, message: str, detail: str) -> APIError:
    """The client's error (``message``: no internal names), with ``detail`` (which may
    name them) logged under the request id."""
    logger.warning("request %s: %s", job.rid, detail)
    return APIError(message, status_code=status)
