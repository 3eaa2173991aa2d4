"""Prometheus metrics of the router: requests by mode and outcome, leg latencies, the
router's time to first token, and per-instance gauges read from the pool at scrape time.

``mode`` is the path a request took: push, pull, colocated, or fallback (no healthy
prefill instance, ``--fallback-local-prefill``: decode prefilled locally).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from kvpush.router.decide import DECISIONS
from kvpush.router.pool import Pool
from kvpush.server.metrics import E2E_BUCKETS, TTFT_BUCKETS

#: client-facing outcomes: ok (200, whole answer relayed), client_error (4xx relayed),
#: unavailable (503: no healthy instance, or an instance's own 503), error (5xx, a leg
#: lost, an in-band stream error), abort (the client went away), overloaded (429: the
#: router held --max-outstanding-requests already)
OUTCOMES = ("ok", "client_error", "unavailable", "error", "abort", "overloaded")
#: local: the cache-aware policy sent the request to decode alone (kvpush.router.decide)
PATHS = ("push", "pull", "colocated", "fallback", "local")
#: prompt tokens (buckets of the cached-token histograms)
TOKEN_BUCKETS = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class _PoolCollector(Collector):
    def __init__(self, pool: Pool) -> None:
        self._pool = pool

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        labels = ["role", "url"]
        in_flight = GaugeMetricFamily("kvpush_router_instance_in_flight",
                                      "Legs in flight on an instance", labels=labels)
        healthy = GaugeMetricFamily("kvpush_router_instance_healthy",
                                    "1 while an instance is in rotation", labels=labels)
        picked = CounterMetricFamily("kvpush_router_instance_requests",
                                     "Legs sent to an instance", labels=labels)
        failures = CounterMetricFamily("kvpush_router_instance_connection_failures",
                                       "Legs that hit a connection error on an instance "
                                       "(each one takes it out of rotation)", labels=labels)
        for inst in self._pool.instances:
            lab = [inst.role, inst.url]
            in_flight.add_metric(lab, float(inst.in_flight))
            healthy.add_metric(lab, 1.0 if inst.healthy else 0.0)
            picked.add_metric(lab, float(inst.requests))
            failures.add_metric(lab, float(inst.failures))
        yield from (in_flight, healthy, picked, failures)


class RouterMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, pool: Pool) -> None:
        disable_created_metrics()
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter("kvpush_router_requests", "Client requests by path and "
                                "outcome", ["mode", "outcome"], registry=r)
        for mode in PATHS:
            for outcome in OUTCOMES:
                self.requests.labels(mode, outcome)
        self.request_s = Histogram("kvpush_router_request_seconds",
                                   "Arrival to the end of the client's answer",
                                   ["mode", "outcome"], buckets=E2E_BUCKETS, registry=r)
        self.ttft_s = Histogram("kvpush_router_time_to_first_token_seconds",
                                "Streams: arrival to the first byte of decode's answer "
                                "relayed to the client", ["mode"], buckets=TTFT_BUCKETS,
                                registry=r)
        self.prefill_leg_s = Histogram("kvpush_router_prefill_leg_seconds",
                                       "Prefill leg: sent to answered", ["mode", "outcome"],
                                       buckets=TTFT_BUCKETS, registry=r)
        self.decode_first_byte_s = Histogram(
            "kvpush_router_decode_first_byte_seconds",
            "Decode leg: sent to the first byte of its answer (a non-streaming answer "
            "comes whole)", ["mode"], buckets=TTFT_BUCKETS, registry=r)
        self.retries = Counter("kvpush_router_retries", "Legs sent again to another "
                               "instance after a connection error", ["role"], registry=r)
        self.migrations = Counter("kvpush_router_migrations", "Requests moved to another "
                                  "decode instance after losing theirs, by cause",
                                  ["cause"], registry=r)
        for cause in ("connection_lost", "core_died"):
            self.migrations.labels(cause)
        self.outstanding = Gauge("kvpush_router_outstanding_requests",
                                 "Requests held now: arrival to the end of every leg "
                                 "(bounded by --max-outstanding-requests)", registry=r)
        self.outstanding_limit = Gauge("kvpush_router_max_outstanding_requests",
                                       "--max-outstanding-requests", registry=r)
        self.decisions = Counter("kvpush_router_route_decisions",
                                 "Cache-aware decisions: local (decode alone), remote (a "
                                 "prefill leg too)", ["decision"], registry=r)
        for d in DECISIONS:
            self.decisions.labels(d)
        self.cached_tokens = Histogram("kvpush_router_cached_prompt_tokens",
                                       "Prompt tokens the chosen instance had cached, as "
                                       "the router's KV index saw it", ["role"],
                                       buckets=TOKEN_BUCKETS, registry=r)
        self.prompt_tokens = Histogram("kvpush_router_prompt_tokens",
                                       "Prompt tokens of requests the router tokenized",
                                       buckets=TOKEN_BUCKETS, registry=r)
        r.register(_PoolCollector(pool))

    def track_outstanding(self, current: Callable[[], float], limit: int) -> None:
        """Read the outstanding count from ``current`` at scrape time."""
        self.outstanding.set_function(current)
        self.outstanding_limit.set(limit)

    def render(self) -> bytes:
        return generate_latest(self.registry)
