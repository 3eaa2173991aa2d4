"""The router's request log: one line per client request (``kvpush.router.requests``),
with its instances, legs, outcome, the cache-aware policy's decision and cached token
counts, and its stage times (``t_r_*``, one clock with the instances' hand-off lines).
"""

from __future__ import annotations

import logging

from kvpush.router.job import RequestRecord

request_log = logging.getLogger("kvpush.router.requests")


def log_request(job: RequestRecord) -> None:
    """The request's one line in ``kvpush.router.requests``, written when it ends:
    instances, legs, outcome, the cache-aware decision and the stage stamps."""
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.1f}ms"

    total = None if job.ended is None else job.ended - job.arrival
    request_log.info(
        "request %s %s%s mode=%s P=%s D=%s transfer=%s p_leg=%s (%s) d_first_byte=%s "
        "total=%s status=%s outcome=%s%s%s%s%s%s%s",
        job.rid, job.kind, " stream" if job.stream else "", job.mode or "-",
        job.prefill.engine_id if job.prefill else "-",
        job.decode.engine_id if job.decode else "-", job.transfer_id or "-",
        ms(job.p_leg_s), job.p_outcome, ms(job.d_first_byte_s), ms(total), job.status,
        job.outcome, f" attempts={job.attempts}" if job.attempts > 1 else "",
        f" migrations={job.migrations}" if job.migrations else "",
        f" client_request_id={job.client_rid}" if job.client_rid else "",
        f" error={job.error!r}" if job.error else "", _route(job), _stamps(job))


def _route(job: RequestRecord) -> str:
    """The cache-aware policy's fields: decision, prompt and cached token counts."""
    r = job.route
    if r is None:
        return ""

    def n(v: int | None) -> str:
        return "-" if v is None else str(v)

    return (f" decision={r.decision.value}{'(local refused)' if r.local_refused else ''}"
            f" prompt_tokens={r.prompt_tokens} d_cached={n(r.d_cached_tokens)}"
            f" p_cached={n(r.p_cached_tokens)}")


def _stamps(job: RequestRecord) -> str:
    """The job's stage times as ``t_r_*`` fields (perf_counter seconds: one clock with
    the instances' ``handoff`` lines on this host, kvpush.kv_transfer.timeline)."""
    stamps = {"r_in": job.arrival, "r_sent": job.legs_sent, "r_d_sent": job.d_sent,
              "r_first": job.first_byte}
    return "".join(f" t_{k}={v:.6f}" for k, v in stamps.items() if v is not None)
