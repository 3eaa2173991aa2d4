"""The router's engine, as its :class:`OpenAIFront` (kvpush.server.app) sees one: the
same front an instance serves with parses, applies chat templates, tokenizes, checks and
formats; this engine hands each request to its :class:`RequestLife`
(kvpush.router.life), which places its legs on the cluster's engine cores and makes
its text once, however many legs and instances carry it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from kvpush.router.job import Job
from kvpush.server.errors import APIError

if TYPE_CHECKING:
    from kvpush.engine.outputs import RequestOutput
    from kvpush.router.life import RequestLife
    from kvpush.sampling_params import SamplingParams
    from kvpush.server.protocol import Job as FrontJob


class ClusterEngine:
    """The router's engine client: a request's life on the cluster's engine cores."""

    def __init__(self, life: RequestLife) -> None:
        self.life = life
        self.tokenizer: Any = life.tokenizer
        #: the router's jobs by request id, from the handler to ``generate``
        self.jobs: dict[str, Job] = {}

    def note_stream(self, parsed: FrontJob) -> None:
        """The front parsed the request: whether its client streams (the router's TTFT
        counts streams only)."""
        job = self.jobs.get(parsed.request_id)
        if job is not None:
            job.stream = parsed.stream

    def health_problem(self) -> str | None:
        pool = self.life.pool
        missing = [role for role in ("decode", "prefill")
                   if not pool.has_healthy(role)
                   and (role == "decode" or pool.cfg.needs_prefill)]
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
        return self.life.run(self.jobs[request_id], list(prompt_token_ids), params)
