"""``/tokenize``, ``/detokenize`` and ``/version`` on an instance, in vLLM's shapes, on
the fake engine (the tokenizer is real). Every wait is bounded."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

import kvpush
from fake_engine import FakeEngine, make_test_model
from kvpush.server.app import build_app

pytestmark = [pytest.mark.timeout(60), pytest.mark.anyio]

MAX_MODEL_LEN = 128


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    return make_test_model(tmp_path_factory.mktemp("model") / "tiny",
                           max_model_len=MAX_MODEL_LEN)


@contextlib.asynccontextmanager
async def running(model: tuple[Any, Any]) -> AsyncIterator[httpx.AsyncClient]:
    app: FastAPI = build_app(FakeEngine(*model))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test",
                                     timeout=10) as client:
            yield client


async def test_tokenize_prompt_and_chat_match_what_generation_runs(model) -> None:
    _, tok = model
    messages = [{"role": "user", "content": "hello world"}]
    async with running(model) as client:
        r = await client.post("/tokenize", json={"prompt": "hello world"})
        assert r.status_code == 200, r.text
        body = r.json()
        ids = tok.encode("hello world")  # with BOS, as /v1/completions encodes
        assert body == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids,
                        "token_strs": None}
        assert ids[0] == tok.bos_token_id
        r = await client.post("/tokenize", json={"prompt": "hello world",
                                                "add_special_tokens": False,
                                                "return_token_strs": True})
        body = r.json()
        assert body["tokens"] == ids[1:]
        assert body["token_strs"] == tok.convert_ids_to_tokens(ids[1:])
        # a chat: the ids the chat endpoint runs (the template writes BOS itself)
        r = await client.post("/tokenize", json={"model": "tiny-test", "messages": messages})
        assert r.status_code == 200, r.text
        chat_ids = tok.apply_chat_template(messages, add_generation_prompt=True,
                                           tokenize=False)
        assert r.json()["tokens"] == tok.encode(chat_ids, add_special_tokens=False)
        r = await client.post("/tokenize", json={"messages": messages,
                                                "add_generation_prompt": False})
        no_header = r.json()["tokens"]
        assert len(no_header) < len(tok.encode(chat_ids, add_special_tokens=False))


async def test_detokenize_round_trips_and_version(model) -> None:
    _, tok = model
    async with running(model) as client:
        ids = (await client.post("/tokenize", json={"prompt": "héllo wörld ✓"})).json()["tokens"]
        r = await client.post("/detokenize", json={"tokens": ids})
        assert r.status_code == 200, r.text
        assert r.json() == {"prompt": tok.decode(ids)}
        assert r.json()["prompt"].endswith("héllo wörld ✓")
        r = await client.get("/version")
        assert r.json() == {"version": kvpush.__version__}


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
    ("/tokenize", {"prompt": 3}, 400, None),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages[0].role"),
    ("/tokenize", [1, 2], 400, None),
    ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, 400, None),
    ("/detokenize", {"tokens": [1], "model": "other"}, 404, "model"),
])
async def test_bad_bodies_get_openai_errors(model, path, body, status, param) -> None:
    async with running(model) as client:
        r = await client.post(path, json=body)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["message"]
        if param is not None:
            assert err["param"] == param
