"""docs/METRICS.md (issue 54) lists every metric family an instance (P/D roles included)
and the router export; the vLLM-named ones keep vLLM's types and the model_name label."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpush.discovery.instance_spec import parse_instance
from kvpush.engine.outputs import EngineStats
from kvpush.kv_transfer.record import TransferCounters, TransferRecord
from kvpush.router.app import Router
from kvpush.router.app import build_app as build_router_app
from kvpush.router.config import RouterConfig
from kvpush.server.admission import WaitingBound
from kvpush.server.metrics import ServerMetrics

DOC = (Path(__file__).resolve().parents[1] / "docs" / "METRICS.md").read_text()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def undocumented(text: str) -> list[str]:
    return [f.name for f in text_string_to_metric_families(text)
            if f"`{f.name}`" not in DOC and f"`{f.name}_total`" not in DOC]


def stats(free: int = 30) -> EngineStats:
    return EngineStats(num_running=2, num_waiting=3, num_free_blocks=free,
                       num_total_blocks=40, num_preemptions=1, prefix_cache_hit_tokens=16,
                       prefix_cache_query_tokens=64)


def test_a_pd_instance_exports_only_documented_families():
    m = ServerMetrics(stats, lambda: True, "my-model")
    m.register_waiting(WaitingBound(8))
    m.register_kv_stats(lambda: TransferCounters(side_channel_peers={"ready": 1}))
    m.observe_transfer(TransferRecord("t1", role="prefill", mode="push", ok=True,
                                      transfer_s=0.01, post_s=0.001, num_bytes=1 << 20,
                                      num_descriptors=8))
    text = m.render().decode()
    assert "kvpush_kv_transfers_ok_total" in text and "kvpush_kv_transfer_seconds" in text
    assert not undocumented(text), undocumented(text)


def test_engine_gauges_under_vllm_names():
    text = ServerMetrics(stats, lambda: True, "my-model").render().decode()
    got = {(f.name, f.type): s.value for f in text_string_to_metric_families(text)
           for s in f.samples if s.labels == {"model_name": "my-model"}}
    assert got[("vllm:num_requests_running", "gauge")] == 2
    assert got[("vllm:num_requests_waiting", "gauge")] == 3
    assert got[("vllm:kv_cache_usage_perc", "gauge")] == pytest.approx(0.25)  # 10 of 40
    assert got[("vllm:prefix_cache_hits", "counter")] == 16
    assert got[("vllm:prefix_cache_queries", "counter")] == 64
    assert got[("vllm:num_preemptions", "counter")] == 1
    assert "vllm:prefix_cache_hits_total{model_name=\"my-model\"} 16.0" in text


@pytest.mark.anyio
async def test_the_router_exports_only_documented_families():
    cfg = RouterConfig(mode="colocated", prefill=(), decode=(parse_instance("127.0.0.1:9"),),
                       startup_timeout_s=1)
    app = build_router_app(Router(cfg), manage=False)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://test", timeout=10) as c:
        r = await c.get("/metrics")
    assert r.status_code == 200
    assert "kvpush_router_requests_total" in r.text
    assert not undocumented(r.text), undocumented(r.text)
