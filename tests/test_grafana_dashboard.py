"""deploy/grafana/kvpush-dashboard.json (issue 66, point 7) reads only series kvpush
exports: every metric its PromQL names is a family an instance (P/D role) or the router
exports, with the suffix its type gives it (_total, _bucket, _sum, _count)."""

from __future__ import annotations

import json
import re
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

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "kvpush-dashboard.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
            "gauge": ("",), "unknown": ("",)}
METRIC = re.compile(r"\b((?:vllm:|kvpush_)[a-zA-Z0-9_:]+)")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _series(text: str) -> set[str]:
    return {f.name + suffix for f in text_string_to_metric_families(text)
            for suffix in SUFFIXES[f.type]}


def _instance_series() -> set[str]:
    idle = EngineStats(0, 0, 8, 8, 0, 0, 0)
    m = ServerMetrics(lambda: idle, lambda: True, "m")
    m.register_waiting(WaitingBound(8))
    m.register_kv_stats(lambda: TransferCounters())
    m.observe_transfer(TransferRecord("t", role="decode", mode="push", ok=True,
                                      transfer_s=0.01, post_s=0.001, num_bytes=1,
                                      num_descriptors=1))
    return _series(m.render().decode())


async def _router_series() -> set[str]:
    cfg = RouterConfig(mode="colocated", prefill=(), decode=(parse_instance("127.0.0.1:9"),),
                       startup_timeout_s=1)
    app = build_router_app(Router(cfg), manage=False)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://test", timeout=10) as c:
        return _series((await c.get("/metrics")).text)


def _exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


@pytest.mark.anyio
async def test_the_dashboard_reads_only_exported_series():
    exported = _instance_series() | await _router_series()
    used = {m for e in _exprs() for m in METRIC.findall(e)}
    assert len(used) >= 15  # the panels name the families they plot
    assert not used - exported, sorted(used - exported)
    # the ones vLLM's own dashboards plot are there
    for name in ("vllm:time_to_first_token_seconds_bucket", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:generation_tokens_total"):
        assert name in used, name


def test_a_misspelt_metric_would_be_caught():
    """The check above finds names in expressions as Prometheus spells them."""
    assert METRIC.findall('rate(vllm:prompt_tokens_totl[1m]) / kvpush_kv_blocks_free') == [
        "vllm:prompt_tokens_totl", "kvpush_kv_blocks_free"]
    assert "vllm:prompt_tokens_totl" not in _instance_series()


def test_every_panel_is_complete():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "kvpush" and dash["panels"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert p["title"] and p["targets"] and p["datasource"]["uid"] == "${datasource}"
        assert all(t["expr"].count("(") == t["expr"].count(")") for t in p["targets"])
