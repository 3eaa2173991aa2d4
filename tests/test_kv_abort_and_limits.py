"""Issue 40, finding 7: ``/kv/abort`` only from the router (signed for this instance,
with an expiry), bounded and never a 500; an instance's 413 in OpenAI's JSON shape.
The instance app on the fake engine, dressed as a prefill instance."""

from __future__ import annotations

import dataclasses
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest

from fake_engine import FakeEngine
from kvpush.config import KVTransferConfig
from kvpush.crypto.auth import ParamsSigner
from kvpush.server.app import build_app
from kvpush.server.kv_abort import MAX_ABORT_BODY_BYTES, abort_body
from server_helpers import uvicorn_server

SECRET = b"0123456789abcdef0123456789abcdef"
ENGINE_ID = "prefill-abc123"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"



class PrefillFake(FakeEngine):
    """The fake engine with a prefill role and a cluster secret; records aborts."""

    def __init__(self, config, tokenizer, secret: bytes | None) -> None:
        kvt = KVTransferConfig(role="prefill", mode="pull", engine_id=ENGINE_ID,
                               side_channel_secret=secret,
                               accept_unsigned_params=secret is None)
        super().__init__(dataclasses.replace(config, kv_transfer=kvt), tokenizer)
        self.engine_id = ENGINE_ID
        self.aborted: list[str] = []

    def abort_transfer(self, transfer_id: str, why: str = "") -> None:
        self.aborted.append(transfer_id)


@asynccontextmanager
async def running(app) -> AsyncIterator[httpx.AsyncClient]:
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test",
                                     timeout=10) as client:
            yield client


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code, err
    return err


@pytest.mark.anyio
async def test_kv_abort_takes_only_the_routers_signed_abort(fake_model):
    engine = PrefillFake(*fake_model, secret=SECRET)
    signer = ParamsSigner(SECRET)
    async with running(build_app(engine)) as client:
        # unsigned (any API-key holder used to release any transfer)
        r = await client.post("/kv/abort", json={"transfer_id": "t1"})
        assert_openai_error(r, 403, "kv_transfer_params_unsigned")
        # another secret, another instance, expired, a leg's params replayed as an abort
        other = ParamsSigner(b"another secret of 32 bytes......")
        cases = [
            (other.sign(abort_body("t1"), role="prefill", engine_id=ENGINE_ID),
             "kv_transfer_params_bad_signature"),
            (signer.sign(abort_body("t1"), role="prefill", engine_id="prefill-other"),
             "kv_transfer_params_wrong_instance"),
            (signer.sign(abort_body("t1"), role="prefill", engine_id=ENGINE_ID,
                         now_ms=int(time.time() * 1000) - 120_000),
             "kv_transfer_params_expired"),
            (signer.sign({"do_remote_decode": True, "transfer_id": "t1"}, role="prefill",
                         engine_id=ENGINE_ID), "kv_abort_not_signed_for_abort"),
        ]
        for body, code in cases:
            assert_openai_error(await client.post("/kv/abort", json=body), 403, code)
        assert engine.aborted == []
        ok = signer.sign(abort_body("t1"), role="prefill", engine_id=ENGINE_ID)
        r = await client.post("/kv/abort", json=ok)
        assert r.status_code == 200 and r.json()["transfer_id"] == "t1"
        assert engine.aborted == ["t1"]


@pytest.mark.anyio
async def test_kv_abort_bodies_are_bounded_and_never_a_500(fake_model):
    engine = PrefillFake(*fake_model, secret=None)  # --insecure-kv-params: unsigned accepted
    async with running(build_app(engine)) as client:
        r = await client.post("/kv/abort", content=b"[" * 100_000 + b"]" * 100_000,
                              headers={"content-type": "application/json"})
        assert_openai_error(r, 413, "request_too_large")
        r = await client.post("/kv/abort", content=b"[" * 2000 + b"]" * 2000)
        assert_openai_error(r, 400)  # nested too deep for the parser: a 400, not a 500
        r = await client.post("/kv/abort", json={"transfer_id": "x" * 1_000_000})
        assert_openai_error(r, 413)
        r = await client.post("/kv/abort", json={"transfer_id": "x" * 257})
        assert_openai_error(r, 400)
        for bad in ([], {"transfer_id": 3}, {"transfer_id": ""}, {"transfer_id": "a\nb"}):
            assert_openai_error(await client.post("/kv/abort", json=bad), 400)
        assert engine.aborted == []
        r = await client.post("/kv/abort", json={"transfer_id": "fine"})
        assert r.status_code == 200 and engine.aborted == ["fine"]


@pytest.mark.anyio
async def test_an_instances_413_is_openai_json(fake_model):
    engine = FakeEngine(*fake_model)
    async with running(build_app(engine, max_body_bytes=1000)) as client:
        r = await client.post("/v1/completions", json={"prompt": "x" * 2000})
        assert_openai_error(r, 413, "request_too_large")

        async def chunks():  # no Content-Length: stopped while it is read
            for _ in range(8):
                yield b" " * 200
            yield b'{"prompt": "hi"}'

        r = await client.post("/v1/completions", content=chunks(),
                              headers={"content-type": "application/json"})
        assert_openai_error(r, 413, "request_too_large")
        r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert r.status_code == 200


def _answer_within(url: str, head: bytes, first: bytes, seconds: float) -> bytes:
    """Send ``head`` and ``first`` (never the rest of the body) and return what the
    server answers within ``seconds`` (b"" if nothing)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=seconds) as s:
        s.sendall(head + first)
        got = b""
        deadline = time.monotonic() + seconds
        while b"\r\n\r\n" not in got or not got.rstrip().endswith(b"}"):
            s.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = s.recv(65536)
            except TimeoutError:
                break
            if not data:
                break
            got += data
        return got


def test_kv_abort_stops_reading_a_body_over_its_cap(fake_model):
    """A /kv/abort body is refused (413, OpenAI's shape) as soon as more than the 4 KiB
    cap arrived, without waiting for the rest: on old main the instance read the whole
    body (up to the 32 MiB instance limit) first, so this unfinished one got no answer."""
    engine = PrefillFake(*fake_model, secret=None)
    with uvicorn_server(build_app(engine)) as url:
        chunk = b" " * (MAX_ABORT_BODY_BYTES + 100)
        head = (b"POST /kv/abort HTTP/1.1\r\nHost: t\r\ncontent-type: application/json\r\n"
                b"transfer-encoding: chunked\r\n\r\n")
        got = _answer_within(url, head, b"%x\r\n" % len(chunk) + chunk + b"\r\n", 5)
        assert got.startswith(b"HTTP/1.1 413"), got[:200]
        assert b'"code":"request_too_large"' in got
        # a declared length over the cap is refused before any of the body arrives
        head = (b"POST /kv/abort HTTP/1.1\r\nHost: t\r\ncontent-type: application/json\r\n"
                b"content-length: 1000000\r\n\r\n")
        got = _answer_within(url, head, b"", 5)
        assert got.startswith(b"HTTP/1.1 413"), got[:200]
        assert httpx.post(url + "/kv/abort", json={"transfer_id": "fine"},
                          timeout=10).status_code == 200
        assert engine.aborted == ["fine"]
