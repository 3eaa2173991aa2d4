"""Ready means ready (issue 38, point 2): an instance's /health is 503 until its step
thread's start-up work (the matmul autotune) is done; a cache-aware router's /health is
503 "starting" until its tokenizer has loaded, and says "degraded" (blind routing) when
it cannot load one. Every wait is bounded."""

from __future__ import annotations

import asyncio
import queue
import threading
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from fake_engine import FakeEngine, make_test_model
from kvpush.engine.async_engine import AsyncEngine
from kvpush.router.prompts import PromptTokenizer
from kvpush.server.app import build_app
from router_helpers import RouterThread, wait_until
from test_kv_routing import FakeInstance

pytestmark = pytest.mark.timeout(60)


def test_step_thread_is_starting_until_its_startup_work_is_done():
    gate = threading.Event()

    class SlowStart:
        tokenizer = None
        scheduler = SimpleNamespace(requests={})
        inbox: queue.SimpleQueue = queue.SimpleQueue()

        def prepare_step_thread(self) -> None:
            assert gate.wait(20)

        def process_inbox(self, block: bool = False, timeout: float | None = None) -> list:
            self.inbox.get(timeout=20)
            return ["stop"]

        def has_work(self) -> bool:
            return False

        def shutdown(self) -> None:
            pass

    async def main() -> None:
        ae = AsyncEngine(None, engine=SlowStart())  # type: ignore[arg-type]
        assert ae.starting() is None  # not started: nothing to wait for
        ae.start()
        try:
            assert "matmul" in (ae.starting() or "")
            gate.set()
            for _ in range(400):
                if ae.prepared.is_set():
                    break
                await asyncio.sleep(0.01)
            assert ae.starting() is None
        finally:
            gate.set()
            await ae.shutdown()

    asyncio.run(main())


def test_instance_health_is_503_while_starting(tmp_path):
    engine = FakeEngine(*make_test_model(tmp_path / "tiny", max_model_len=64))
    state = {"starting": "starting: the step thread is timing its matmul kernels"}
    engine.starting = lambda: state["starting"]  # type: ignore[attr-defined]
    app = build_app(engine)

    async def main() -> None:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                r = await c.get("/health")
                assert r.status_code == 503
                assert "matmul" in r.json()["error"]["message"]
                state["starting"] = None
                r = await c.get("/health")
                assert r.status_code == 200 and r.json() == {"status": "ok"}

    asyncio.run(main())


def test_router_health_waits_for_the_tokenizer(tiny_llama, monkeypatch):
    """/health is 503 ``starting`` while the tokenizer loads, then 200 ``cache-aware``."""
    gate = threading.Event()
    load = PromptTokenizer.load

    async def slow_load(self: PromptTokenizer, source: Any, executor: Any = None) -> bool:
        await asyncio.get_running_loop().run_in_executor(None, gate.wait, 20)
        return await load(self, source, executor)

    monkeypatch.setattr(PromptTokenizer, "load", slow_load)
    p = FakeInstance("prefill", "prefill-1", str(tiny_llama))
    d = FakeInstance("decode", "decode-1", str(tiny_llama))
    router = None
    try:
        router = RouterThread("push", [p.url], [d.url], kv_secret=None, policy="cache-aware")
        r = httpx.get(router.url + "/health", timeout=5)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "starting"
        assert "tokenizer" in r.json()["error"]["message"]
        gate.set()
        wait_until(lambda: httpx.get(router.url + "/health", timeout=5).status_code == 200,
                   20, "router ready")
        body = httpx.get(router.url + "/health", timeout=5).json()
        assert body["status"] == "ok" and body["routing"] == "cache-aware", body
    finally:
        gate.set()
        if router is not None:
            router.stop()
        p.stop()
        d.stop()


def test_router_without_a_tokenizer_says_it_runs_degraded(tmp_path):
    """A model root that does not exist on this host and an id that is no model: the
    tokenizer cannot load, and /health says so (200, ``degraded``, and why)."""
    p = FakeInstance("prefill", "prefill-1", str(tmp_path / "nowhere"))
    d = FakeInstance("decode", "decode-1", str(tmp_path / "nowhere"))
    router = None
    try:
        router = RouterThread("push", [p.url], [d.url], kv_secret=None, policy="cache-aware")
        wait_until(lambda: httpx.get(router.url + "/health", timeout=5).status_code == 200,
                   20, "router up")
        body = httpx.get(router.url + "/health", timeout=5).json()
        assert body["status"] == "degraded" and body["routing"] == "blind", body
        assert "tokenizer" in body["degraded"]
    finally:
        if router is not None:
            router.stop()
        p.stop()
        d.stop()


def test_router_health_without_cache_aware_policy_is_plain(tiny_llama):
    d = FakeInstance("both", "both-1", str(tiny_llama))
    router = None
    try:
        router = RouterThread("colocated", [], [d.url], kv_secret=None)
        body = httpx.get(router.url + "/health", timeout=5).json()
        assert body["status"] == "ok" and body["routing"] == "round-robin", body
    finally:
        if router is not None:
            router.stop()
        d.stop()


def test_up_banner_says_loudly_when_the_router_runs_degraded(monkeypatch):
    from kvpush.cluster import cli as up

    router = SimpleNamespace(url="http://127.0.0.1:9")
    answers = {"status": "degraded", "routing": "blind", "degraded": "no tokenizer (x)"}
    monkeypatch.setattr(httpx, "get", lambda *a, **k: SimpleNamespace(json=lambda: answers))
    line = up._router_routing(router)  # type: ignore[arg-type]
    assert line is not None and "DEGRADED" in line and "no tokenizer (x)" in line
    answers = {"status": "ok", "routing": "cache-aware"}
    assert "cache-aware" in (up._router_routing(router) or "")  # type: ignore[arg-type]
