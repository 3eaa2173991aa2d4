"""Prometheus metrics of one server: request outcomes, latencies, token counts, and
engine gauges read from ``engine.stats()`` at scrape time.

On an instance the ``vllm:`` request families are the engine core's figures for every
request it ran, whichever front sent it (``observe_engine``, fed with each turn's
IterationStats); the ``kvpush_`` ones are the HTTP front's own requests on its clock
(``RequestTimer``). The router's front feeds both from its clock.

Beside kvpush's own ``kvpush_*`` families, the ones vLLM's dashboards, llm-d's scheduler
and Dynamo's planner read are exported under vLLM's names (``vllm:*``, labelled with
``model_name``), with vLLM v1's meanings and types; docs/METRICS.md lists them all.

Each app gets its own :class:`CollectorRegistry`, so several apps in one process (tests,
a prefill and a decode server side by side) never clash on metric names.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from kvpush.engine.outputs import EngineStats, IterationStats, RequestOutput
from kvpush.engine.request_stats import RequestClock
from kvpush.kv_transfer.record import TransferCounters, TransferRecord
from kvpush.server.admission import WaitingBound

logger = logging.getLogger("kvpush.server")

OUTCOMES = ("stop", "length", "abort", "error", "rejected")

# Time to first token: a few ms (prefix hit, GPU) up to minutes (long prompt queued on CPU).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
# Mean time between output tokens of one request: sub-ms (GPU, small model) to seconds.
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
# Whole request, arrival to last token.
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
               30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


# vLLM v1's buckets for its ``vllm:`` histograms (so its dashboards' quantiles line up).
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                     2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
VLLM_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                        50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector(Collector):
    """Gauges and counters owned by the engine, read once per scrape (kvpush's names and
    vLLM's, from the same ``EngineStats``)."""

    def __init__(self, stats: Callable[[], EngineStats], healthy: Callable[[], bool],
                 model_name: str) -> None:
        self._stats = stats
        self._healthy = healthy
        self._model = model_name

    def describe(self) -> Iterator[Metric]:
        return iter(())  # unchecked collector: names are not known to clash

    def collect(self) -> Iterator[Metric]:
        try:
            healthy = bool(self._healthy())
        except Exception:  # noqa: BLE001 - a scrape must never fail
            healthy = False
        yield GaugeMetricFamily("kvpush_engine_healthy",
                                "1 while /health is 200 (the step loop runs; P/D roles: "
                                "the transfer thread too)", value=1.0 if healthy else 0.0)
        try:
            s = self._stats()
        except Exception:  # noqa: BLE001
            logger.warning("engine.stats() failed during a metrics scrape", exc_info=True)
            return
        gauges = {
            "kvpush_num_requests_running": ("Requests in the running batch", s.num_running),
            "kvpush_num_requests_waiting": ("Requests queued for admission", s.num_waiting),
            "kvpush_kv_blocks_free": ("Free KV-cache blocks", s.num_free_blocks),
            "kvpush_kv_blocks_total": ("KV-cache blocks in the pool", s.num_total_blocks),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=float(value))
        counters = {
            "kvpush_num_preemptions": ("Requests preempted to free KV blocks",
                                       s.num_preemptions),
            "kvpush_prefix_cache_hit_tokens": ("Prompt tokens served from the prefix cache",
                                               s.prefix_cache_hit_tokens),
            "kvpush_prefix_cache_query_tokens": ("Prompt tokens looked up in the prefix cache",
                                                 s.prefix_cache_query_tokens),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=float(value))
        yield from self._vllm(s)

    def _vllm(self, s: EngineStats) -> Iterator[Metric]:
        """vLLM's names for the same figures, labelled with the served model's name."""
        lab = ["model_name"]
        usage = 1.0 - s.num_free_blocks / s.num_total_blocks if s.num_total_blocks else 0.0
        for name, doc, value in (
                ("vllm:num_requests_running", "Number of requests in model execution "
                 "batches", s.num_running),
                ("vllm:num_requests_waiting", "Number of requests waiting to be processed",
                 s.num_waiting),
                ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage "
                 "(fraction of KV blocks not free)", usage)):
            g = GaugeMetricFamily(name, doc, labels=lab)
            g.add_metric([self._model], float(value))
            yield g
        for name, doc, value in (
                ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
                 "queried tokens", s.prefix_cache_query_tokens),
                ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                 "tokens", s.prefix_cache_hit_tokens),
                ("vllm:num_preemptions", "Cumulative number of preemptions from the engine",
                 s.num_preemptions)):
            c = CounterMetricFamily(name, doc, labels=lab)
            c.add_metric([self._model], float(value))
            yield c


class _TransferCollector(Collector):
    """KV-transfer counters (the engine core's last ``TransferCounters``), read once per
    scrape."""

    COUNTERS = {
        "kvpush_kv_transfers_ok": ("KV transfers that completed", "transfers_ok"),
        "kvpush_kv_transfers_failed": ("KV transfers that failed (post, completion, peer "
                                       "gone, refused)", "transfers_failed"),
        "kvpush_kv_leases_expired": ("Transfer leases that ran out (blocks freed)",
                                     "leases_expired"),
        "kvpush_kv_aborts_sent": ("Aborts sent to a peer (a fence's repeats of one not "
                                  "counted)", "aborts_sent"),
        "kvpush_kv_aborts_received": ("Aborts received from a peer", "aborts_received"),
        "kvpush_kv_side_channel_bad_messages": ("Side-channel frames dropped as malformed",
                                                "messages_bad"),
        "kvpush_kv_fences": ("Push transfers whose blocks were fenced when their request "
                             "ended with prefill's WRITEs possibly in flight", "fences"),
        "kvpush_kv_fences_peer_gone": ("Fences ended by the prefill's connection dropping "
                                       "(its process ended)", "fences_peer_gone"),
        "kvpush_kv_fence_timeouts": ("Fences given up at --fence-timeout (prefill neither "
                                     "answered nor dropped its connection): blocks freed "
                                     "anyway", "fence_timeouts"),
        "kvpush_kv_writes_refused": ("WRITEs not posted because their transfer had ended "
                                     "(aborted or done)", "writes_refused"),
        "kvpush_kv_digest_mismatches": ("Receives whose KV failed the --kv-digest check "
                                        "(failed or recomputed, never used)",
                                        "digest_mismatches"),
        "kvpush_kv_registrations_after_blocks": (
            "Push registrations that reached prefill after some of the prompt's KV was "
            "computed (those blocks were written as the registration arrived, mid-step "
            "included)", "registrations_after_blocks"),
    }
    GAUGES = {
        "kvpush_kv_sends_in_flight": ("Prefill-side transfers in flight", "sends_in_flight"),
        "kvpush_kv_recvs_in_flight": ("Decode-side transfers in flight", "recvs_in_flight"),
        "kvpush_kv_blocks_lent": ("Blocks lent to decode instances (pull)", "blocks_lent"),
        "kvpush_kv_blocks_fenced": ("Blocks held out of the pool until a transfer that may "
                                    "still write or read them has ended", "blocks_fenced"),
    }

    def __init__(self, kv_stats: Callable[[], TransferCounters | None]) -> None:
        self._kv_stats = kv_stats

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        try:
            st = self._kv_stats()
        except Exception:  # noqa: BLE001 - a scrape must never fail
            return
        if st is None:
            return
        for name, (doc, key) in self.COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=float(getattr(st, key)))
        yield _labelled(CounterMetricFamily, st.side_channel_rejected,
                        "kvpush_kv_side_channel_rejected", "Side-channel messages and "
                        "connections refused by the shared-secret check (unsigned, "
                        "bad_signature, replayed, stale, malformed; closed_in_handshake: the "
                        "far end closed our connection in the CURVE handshake, no side "
                        "channel of ours there or one without our secret)",
                        "reason")
        yield _labelled(CounterMetricFamily, st.side_channel_send_dropped,
                        "kvpush_kv_side_channel_send_dropped",
                        "Side-channel messages not sent: the peer's queue was full "
                        "(queue_full), its connection could not be opened "
                        "(connect_failed), ZMQ refused it (send_failed), the channel was "
                        "closed (closed), the peer refused us or we it (peer_refused), the "
                        "peer table was full (peer_table_full), its handshake was given up "
                        "(handshake_timeout) or its handshake queue was full "
                        "(handshake_queue_full)", "reason")
        yield _labelled(CounterMetricFamily, st.side_channel_peers_evicted,
                        "kvpush_kv_side_channel_peers_evicted",
                        "Side-channel peers dropped from the peer table (their sockets "
                        "closed): handshake never answered (handshake_timeout), idle, "
                        "refusal expired, or their place needed for a new peer (room)",
                        "reason")
        yield _labelled(GaugeMetricFamily, st.side_channel_peers,
                        "kvpush_kv_side_channel_peers",
                        "Side-channel peers in the peer table, by state", "state",
                        only=("handshake", "ready", "refused"))
        for name, (doc, key) in self.GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=float(getattr(st, key)))


def _labelled(kind, values: dict[str, int], name: str, doc: str, label: str,
              only: tuple[str, ...] | None = None) -> Metric:
    """One labelled family from ``values`` (label value -> count)."""
    family = kind(name, doc, labels=[label])
    for key, value in values.items():
        if only is None or key in only:
            family.add_metric([key], float(value))
    return family


class _WaitingCollector(Collector):
    """The HTTP server's bound on waiting requests (kvpush.server.admission)."""

    def __init__(self, bound: WaitingBound) -> None:
        self._bound = bound

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        b = self._bound
        yield GaugeMetricFamily("kvpush_http_requests_waiting", "Requests admitted by the "
                                "HTTP server that have no first output yet", value=b.waiting)
        yield GaugeMetricFamily("kvpush_http_max_waiting_requests", "The bound on waiting "
                                "requests (--max-waiting-requests; 0: none)", value=b.limit)
        yield CounterMetricFamily("kvpush_http_queue_full", "Requests refused with 429 "
                                  "because the waiting-request bound was reached",
                                  value=b.refused)


# Per-transfer figures: sub-ms on RDMA/loopback to seconds under load.
TRANSFER_S_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                      0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TRANSFER_BYTES_BUCKETS = tuple(float(1 << k) for k in range(12, 34, 2))  # 4 KiB .. 8 GiB
TRANSFER_DESC_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384, 65536)


def auth_rejected_counter(registry: CollectorRegistry, name: str) -> Counter:
    """``<name>_total{reason=missing|invalid}``: HTTP requests refused for their API key."""
    c = Counter(name, "HTTP requests refused with 401: API key missing or invalid",
                ["reason"], registry=registry)
    from kvpush.server.auth import REJECT_REASONS

    for reason in REJECT_REASONS:
        c.labels(reason)
    return c


class ServerMetrics:
    """All metrics of one app, with a small API the request handlers call."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, stats: Callable[[], EngineStats] | None, healthy: Callable[[], bool],
                 model_name: str = "") -> None:
        """``stats``: the engine's gauges (None: a front over many engines, the router,
        exports none of its own, and its own clocks feed the ``vllm:`` request families;
        else the engine core's figures feed them, :meth:`observe_engine`)."""
        # The *_created series double the exposition for no use here (vLLM drops them too);
        # the switch is process-wide.
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        self.front_feeds_vllm = stats is None
        r = self.registry
        self.requests = Counter("kvpush_requests", "Finished generation requests by outcome",
                                ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)  # export zeros from the start
        self.ttft = Histogram("kvpush_time_to_first_token_seconds",
                              "Arrival to first output token", buckets=TTFT_BUCKETS,
                              registry=r)
        self.tpot = Histogram("kvpush_time_per_output_token_seconds",
                              "Mean time between output tokens of a request (after the "
                              "first)", buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("kvpush_e2e_request_latency_seconds",
                             "Arrival to last token of requests that finished (stop or "
                             "length)", buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kvpush_prompt_tokens", "Prompt tokens of requests the "
                                     "engine started generating for", registry=r)
        self.generation_tokens = Counter("kvpush_generation_tokens", "Generated tokens",
                                         registry=r)
        if stats is not None:
            r.register(_EngineCollector(stats, healthy, model_name))
        self._vllm_metrics(model_name)
        self.auth_rejected = auth_rejected_counter(r, "kvpush_http_auth_rejected")
        labels = ["role", "mode", "outcome"]
        self.kv_transfer_s = Histogram(
            "kvpush_kv_transfer_seconds", "Time of one KV transfer: prefill, first WRITE post "
            "to last completion; decode, request arrival to KV ready", labels,
            buckets=TRANSFER_S_BUCKETS, registry=r)
        self.kv_post_s = Histogram(
            "kvpush_kv_transfer_post_seconds", "Time spent posting a transfer's descriptors",
            labels, buckets=TRANSFER_S_BUCKETS, registry=r)
        self.kv_bytes = Histogram("kvpush_kv_transfer_bytes", "Bytes of one KV transfer",
                                  labels, buckets=TRANSFER_BYTES_BUCKETS, registry=r)
        self.kv_descs = Histogram("kvpush_kv_transfer_descriptors",
                                  "Descriptors (memory ranges) of one KV transfer", labels,
                                  buckets=TRANSFER_DESC_BUCKETS, registry=r)

    def _vllm_metrics(self, model: str) -> None:
        """The request-level families under vLLM's names (children bound to ``model``)."""
        r, lab = self.registry, ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, lab, buckets=buckets, registry=r).labels(model)

        self.vllm_prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens "
                                          "processed", lab, registry=r).labels(model)
        self.vllm_generation_tokens = Counter("vllm:generation_tokens", "Number of "
                                              "generation tokens processed", lab,
                                              registry=r).labels(model)
        self.vllm_ttft = hist("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds", VLLM_TTFT_BUCKETS)
        self.vllm_itl = hist("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds", VLLM_ITL_BUCKETS)
        self.vllm_e2e = hist("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds",
                             VLLM_REQUEST_BUCKETS)
        self.vllm_queue = hist("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request",
                               VLLM_REQUEST_BUCKETS)
        self.vllm_prefill = hist("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request",
                                 VLLM_REQUEST_BUCKETS)
        self.vllm_decode = hist("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request",
                                VLLM_REQUEST_BUCKETS)
        self.vllm_inference = hist("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request",
                                   VLLM_REQUEST_BUCKETS)

    def observe_engine(self, stats: IterationStats) -> None:
        """The ``vllm:`` request families: an instance's engine core's figures for every
        request it ran (FrontEnd's stats sink), the router's front's for its clients."""
        self.vllm_prompt_tokens.inc(stats.num_prompt_tokens)
        self.vllm_generation_tokens.inc(stats.num_generation_tokens)
        for v in stats.ttft_s:
            self.vllm_ttft.observe(v)
        for v in stats.itl_s:
            self.vllm_itl.observe(v)
        for f in stats.finished:
            self.vllm_e2e.observe(f.e2e_s)
            if f.decode_s is not None:
                self.vllm_decode.observe(f.decode_s)
            if f.queue_s is not None:
                self.vllm_queue.observe(f.queue_s)
            if f.prefill_s is not None:
                self.vllm_prefill.observe(f.prefill_s)
                if f.decode_s is not None:
                    self.vllm_inference.observe(f.prefill_s + f.decode_s)

    def observe_front(self, stats: IterationStats) -> None:
        """The ``kvpush_`` request families: this front's own requests, on its clock
        (and the ``vllm:`` ones too on a front over engines it does not own)."""
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens)
        for v in stats.ttft_s:
            self.ttft.observe(v)
        for f in stats.finished:
            self.e2e.observe(f.e2e_s)
            if f.decode_s is not None and f.num_generation_tokens > 1:
                self.tpot.observe(f.decode_s / (f.num_generation_tokens - 1))
        if self.front_feeds_vllm:
            self.observe_engine(stats)

    def register_waiting(self, bound: WaitingBound) -> None:
        """Export the waiting-request bound: how many wait, the cap, and the 429s."""
        self.registry.register(_WaitingCollector(bound))

    def register_kv_stats(self, kv_stats: Callable[[], TransferCounters | None]) -> None:
        self.registry.register(_TransferCollector(kv_stats))

    def observe_transfer(self, rec: TransferRecord) -> None:
        """One finished transfer."""
        lab = (rec.role, rec.mode, "ok" if rec.ok else "failed")
        self.kv_transfer_s.labels(*lab).observe(rec.transfer_s)
        self.kv_post_s.labels(*lab).observe(rec.post_s)
        self.kv_bytes.labels(*lab).observe(rec.num_bytes)
        self.kv_descs.labels(*lab).observe(rec.num_descriptors)

    def count(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def count_auth_rejected(self, reason: str) -> None:
        self.auth_rejected.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """One request as a front sees it: its clock (kvpush.engine.request_stats' rule) on
    the front's time, observed output by output; counted once, in :meth:`finish`."""

    __slots__ = ("_m", "_clock", "_done")

    def __init__(self, metrics: ServerMetrics, arrival: float, prompt_tokens: int) -> None:
        self._m = metrics
        self._clock = RequestClock(arrival, prompt_tokens)
        self._done = False

    def on_output(self, num_new_tokens: int, now: float,
                  out: RequestOutput | None = None) -> None:
        stats = IterationStats()
        if out is None:
            self._clock.on_output(stats, num_new_tokens, now)
        else:
            self._clock.on_output(stats, num_new_tokens, now, out.arrival_time,
                                  out.scheduled_time, out.first_token_time)
        self._m.observe_front(stats)

    def finish(self, outcome: str, now: float) -> None:
        if self._done:
            return
        self._done = True
        self._m.count(outcome)
        stats = IterationStats()
        self._clock.finish(stats, outcome, now)
        self._m.observe_front(stats)
