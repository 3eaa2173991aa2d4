"""Ready means ready (issue 38, point 2): an instance's /health is 503 until its step
thread's start-up work (the matmul autotune) is done; a cache-aware router's /health is
503 "starting" until its tokenizer has loaded, and 503 "no_tokenizer" when it cannot load
one (it serves nothing without it). Every wait is bounded."""

from __future__ import annotations

import asyncio
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


def test_step_thread_is_starting_until_its_startup_work_is_done(tiny_llama):
    """The core's snapshot says "starting" until prepare_step_thread has run on the
    stepping thread, and the loop posts the snapshot that clears it before any request
    arrives (the idle loop would otherwise block on its inbox with the old one)."""
    from engine_helpers import make_engine

    gate = threading.Event()
    eng = make_engine(tiny_llama)
    prepare = eng.prepare_step_thread

    def slow_prepare() -> None:
        assert gate.wait(20)
        prepare()

    eng.prepare_step_thread = slow_prepare  # type: ignore[method-assign]

    async def main() -> None:
        ae = AsyncEngine(eng.config, engine=eng)
        ae.start()
        try:
            assert "matmul" in (ae.starting() or "")
            gate.set()
            for _ in range(400):
                if ae.starting() is None:
                    break
                await asyncio.sleep(0.01)
            assert ae.starting() is None
            assert ae.health_problem() is None
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

    async def slow_load(self: PromptTokenizer, source: Any) -> bool:
        await asyncio.get_running_loop().run_in_executor(None, gate.wait, 20)
        return await load(self, source)

    monkeypatch.setattr(PromptTokenizer, "load", slow_load)
    p = FakeInstance("prefill", "prefill-1", str(tiny_llama))
    d = FakeInstance("decode", "decode-1", str(tiny_llama))
    router = None
    try:
        router = RouterThread("push", [p.url], [d.url], kv_secret=None, policy="cache-aware",
                              wait=False)
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


def test_router_without_a_tokenizer_says_it_cannot_serve(tmp_path):
    """A model root that does not exist on this host and an id that is no model: the
    tokenizer cannot load, and /health says so (503 ``no_tokenizer``, and why), as does
    a request (the router renders and tokenizes every request)."""
    p = FakeInstance("prefill", "prefill-1", str(tmp_path / "nowhere"))
    d = FakeInstance("decode", "decode-1", str(tmp_path / "nowhere"))
    router = None
    try:
        router = RouterThread("push", [p.url], [d.url], kv_secret=None, policy="cache-aware")
        wait_until(lambda: httpx.get(router.url + "/health", timeout=5).status_code == 503
                   and "no_tokenizer" in httpx.get(router.url + "/health", timeout=5).text,
                   20, "the tokenizer's load failed")
        err = httpx.get(router.url + "/health", timeout=5).json()["error"]
        assert "tokenizer" in err["message"] and "--tokenizer" in err["message"], err
        r = httpx.post(router.url + "/v1/completions", json={"prompt": "hi"}, timeout=30)
        assert r.status_code == 503 and "tokenizer" in r.json()["error"]["message"], r.text
        assert not p.bodies and not d.bodies
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


def test_up_banner_says_loudly_when_the_router_cannot_serve(monkeypatch):
    from kvpush.cluster import cli as up

    router = SimpleNamespace(url="http://127.0.0.1:9")
    answers: dict = {"error": {"message": "the router cannot serve without the model's "
                               "tokenizer (x)", "code": "no_tokenizer"}}
    monkeypatch.setattr(httpx, "get", lambda *a, **k: SimpleNamespace(json=lambda: answers))
    line = up._router_routing(router)  # type: ignore[arg-type]
    assert line is not None and "WARNING" in line and "tokenizer (x)" in line
    answers = {"status": "ok", "routing": "cache-aware"}
    assert "cache-aware" in (up._router_routing(router) or "")  # type: ignore[arg-type]
