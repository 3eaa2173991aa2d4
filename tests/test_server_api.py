"""The OpenAI-compatible server (kvpush.server) on a fake engine.

In-process tests go through httpx's ASGITransport (the whole response is buffered, so
stream shapes are checked, not timing); disconnect tests drive the ASGI app by hand and
through a real uvicorn in a thread; the official openai client talks to that uvicorn.
Every wait is bounded, and every app, server and thread started here is stopped here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from fake_engine import (
    FakeEngine,
    fake_logprob,
    fake_token,
    fake_top_logprobs,
)
from kvpush.config import DEFAULT_BLOCK_SIZE
from kvpush.errors import RequestError
from kvpush.kv_transfer.params import KVTransferParams
from kvpush.server.app import build_app
from kvpush.server.chat import INLINE_BODY_BYTES
from kvpush.server.cli import add_serve_parser, build_config
from server_helpers import uvicorn_server
from waits import wait_until_async

pytestmark = pytest.mark.timeout(60)

MODEL = "tiny-test"
MAX_MODEL_LEN = 128
C = "/v1/completions"
CHAT = "/v1/chat/completions"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def tokenizer(fake_model: tuple[Any, Any]) -> Any:
    return fake_model[1]


@pytest.fixture
def engine(fake_model: tuple[Any, Any]) -> FakeEngine:
    return FakeEngine(*fake_model)


@contextlib.asynccontextmanager
async def running(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test",
                                     timeout=10) as client:
            yield client


@pytest.fixture
async def client(engine: FakeEngine) -> AsyncIterator[httpx.AsyncClient]:
    app = build_app(engine)
    async with running(app) as c:
        assert engine.started
        c.app = app  # type: ignore[attr-defined]
        yield c
        # no request may leak KV blocks, however it ended
        await wait_until_async(
            lambda: engine.free_blocks == engine.num_blocks and not engine.active)
    assert engine.shut_down


def sse(text: str) -> list[Any]:
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def expected_ids(prompt_ids: list[int], n: int) -> list[int]:
    return [fake_token(prompt_ids, i) for i in range(n)]


def assert_error(r: httpx.Response, status: int, param: str | None = None,
                 code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    want_type = {404: "not_found_error"}.get(status, "server_error" if status >= 500
                                             else "invalid_request_error")
    assert err["type"] == want_type
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


# --------------------------------------------------------------------------- completions


@pytest.mark.anyio
async def test_completion(client: httpx.AsyncClient, engine: FakeEngine, tokenizer: Any) -> None:
    r = await client.post(C, json={"model": MODEL, "prompt": "hello world", "max_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    prompt_ids = tokenizer.encode("hello world")
    assert prompt_ids[0] == tokenizer.bos_token_id
    rid, ids, params, _ = engine.requests[-1]
    assert ids == prompt_ids
    assert body["id"] == rid and rid.startswith("cmpl-")
    assert r.headers["x-request-id"] == rid
    assert body["object"] == "text_completion" and body["model"] == MODEL
    (choice,) = body["choices"]
    out = expected_ids(prompt_ids, 5)
    assert choice["text"] == tokenizer.decode(out, skip_special_tokens=True)
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 5,
                             "total_tokens": len(prompt_ids) + 5}
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (1.0, 1.0, 0, 5)


@pytest.mark.anyio
async def test_completion_defaults_and_prompt_forms(client: httpx.AsyncClient,
                                                    engine: FakeEngine, tokenizer: Any) -> None:
    r = await client.post(C, json={"prompt": "hello"})  # no model: the served one
    assert r.status_code == 200
    assert engine.requests[-1][2].max_tokens == 16  # OpenAI's completions default
    assert r.json()["usage"]["completion_tokens"] == 16
    ids = tokenizer.encode("hello world")
    for prompt in (["hello world"], ids, [ids]):
        r = await client.post(C, json={"prompt": prompt, "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert engine.requests[-1][1] == ids  # token ids are taken as-is: no second BOS


@pytest.mark.anyio
async def test_sampling_fields_pass_through(client: httpx.AsyncClient,
                                            engine: FakeEngine) -> None:
    r = await client.post(C, json={
        "prompt": "hello world", "max_tokens": 4, "temperature": 0, "top_p": 0.5, "top_k": 7,
        "seed": 11, "stop": "zzz", "stop_token_ids": [3], "ignore_eos": True,
        "kv_transfer_params": {"do_remote_decode": True, "transfer_id": "t1", "peer": [1]},
        "user": "someone", "some_future_field": {"x": 1}, "stream_options": None,
    })
    assert r.status_code == 200, r.text
    p = engine.requests[-1][2]
    assert (p.temperature, p.top_p, p.top_k, p.seed) == (0.0, 0.5, 7, 11)
    assert p.stop == ("zzz",) and p.stop_token_ids == frozenset({3}) and p.ignore_eos
    kv = engine.requests[-1][3]  # checked once by the server, typed
    assert kv == KVTransferParams(do_remote_decode=True, transfer_id="t1")
    assert r.json()["kv_transfer_params"] == {"do_remote_prefill": False,
                                              "do_remote_decode": True, "transfer_id": "echo"}
    r = await client.post(C, json={"prompt": "hello", "max_tokens": 2, "stop": ["a", "b"]})
    assert engine.requests[-1][2].stop == ("a", "b")
    assert engine.requests[-1][3] is None
    assert not engine.requests[-1][2].adjusts_logits  # no penalties, no bias by default
    r = await client.post(CHAT, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "presence_penalty": 0.5, "frequency_penalty": -0.25, "repetition_penalty": 1.2,
        "logit_bias": {"5": -100, "7": 2.5}})
    assert r.status_code == 200, r.text
    p = engine.requests[-1][2]
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.25, 1.2)
    assert p.logit_bias == ((5, -100), (7, 2.5)) and p.penalized


@pytest.mark.anyio
async def test_stop_string(client: httpx.AsyncClient) -> None:
    base = {"prompt": "hello world", "max_tokens": 5}
    full = (await client.post(C, json=base)).json()["choices"][0]["text"]
    assert full == " worldhello worldhello"
    r = await client.post(C, json={**base, "stop": ["hello"]})
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (" world", "stop")
    r = await client.post(C, json={**base, "stop": "hello", "include_stop_str_in_output": True})
    assert r.json()["choices"][0]["text"] == " worldhello"
    r = await client.post(C, json={**base, "stop": "hello", "stream": True})
    events = sse(r.text)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == " world"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.anyio
async def test_completion_stream(client: httpx.AsyncClient, tokenizer: Any) -> None:
    body = {"prompt": "hello world", "max_tokens": 6}
    whole = (await client.post(C, json=body)).json()
    r = await client.post(C, json={**body, "stream": True})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert r.headers["x-request-id"] == chunks[0]["id"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert all(c["usage"] is None for c in chunks)

    r = await client.post(C, json={**body, "stream": True,
                                   "stream_options": {"include_usage": True}})
    events = sse(r.text)
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == whole["usage"]
    assert all(e["usage"] is None for e in events[:-2])


@pytest.mark.anyio
async def test_completion_return_token_ids(client: httpx.AsyncClient, tokenizer: Any) -> None:
    """vLLM's return_token_ids: each choice says its token ids and the prompt's (a
    stream: the prompt's with the first chunk, each chunk its new ids); without it the
    answer has neither field."""
    body = {"prompt": "hello world", "max_tokens": 6}
    prompt = tokenizer.encode("hello world")
    plain = (await client.post(C, json=body)).json()
    assert "token_ids" not in plain["choices"][0]
    whole = (await client.post(C, json={**body, "return_token_ids": True})).json()
    choice = whole["choices"][0]
    assert choice["prompt_token_ids"] == prompt and len(choice["token_ids"]) == 6
    assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == choice["text"]
    assert choice["text"] == plain["choices"][0]["text"]
    r = await client.post(C, json={**body, "return_token_ids": True, "stream": True})
    chunks = [e["choices"][0] for e in sse(r.text)[:-1]]
    assert chunks[0]["prompt_token_ids"] == prompt
    assert all(c["prompt_token_ids"] is None for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == choice["token_ids"]
    r = await client.post(C, json={**body, "stream": True})
    assert all("token_ids" not in e["choices"][0] for e in sse(r.text)[:-1])


@pytest.mark.anyio
async def test_stream_sends_a_chunk_per_token_even_with_text_held_back(
        client: httpx.AsyncClient, engine: FakeEngine, tokenizer: Any) -> None:
    # the fake answers with the prompt's tokens backwards: the byte-level pieces of
    # "✓" and "ö" come out of order, so some tokens end in part of a character and
    # their text is held back until a later token completes it
    prompt = "✓ wörld ✓ héllo"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    n = len(ids)
    body = {"prompt": ids, "max_tokens": n, "ignore_eos": True}
    whole = (await client.post(C, json=body)).json()
    r = await client.post(C, json={**body, "stream": True})
    chunks = sse(r.text)[:-1]
    texts = [c["choices"][0]["text"] for c in chunks]
    assert len(chunks) == n == whole["usage"]["completion_tokens"]  # one per token
    assert "" in texts  # a token whose text came with a later one
    assert "".join(texts) == whole["choices"][0]["text"]

    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 12,
            "ignore_eos": True}
    whole = (await client.post(CHAT, json=chat)).json()
    r = await client.post(CHAT, json={**chat, "stream": True})
    chunks = sse(r.text)[:-1]
    deltas = [c["choices"][0]["delta"] for c in chunks[1:]]  # after the role chunk
    assert len(deltas) == 12 and all(isinstance(d.get("content"), str) for d in deltas)
    assert "".join(d["content"] for d in deltas) == whole["choices"][0]["message"]["content"]


@pytest.mark.anyio
async def test_completion_logprobs(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    for stream in (False, True):
        r = await client.post(C, json={"prompt": "hello world", "max_tokens": 4, "logprobs": 1,
                                       "stream": stream})
        assert r.status_code == 200
        if stream:
            chunks = [e for e in sse(r.text)[:-1] if e["choices"][0]["logprobs"]]
            lps: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [],
                                         "top_logprobs": [], "text_offset": []}
            for c in chunks:
                for k in lps:
                    lps[k] += c["choices"][0]["logprobs"][k]
            text = "".join(e["choices"][0]["text"] for e in sse(r.text)[:-1])
        else:
            lps = r.json()["choices"][0]["logprobs"]
            text = r.json()["choices"][0]["text"]
        assert lps["token_logprobs"] == [fake_logprob(i) for i in range(4)]
        assert "".join(lps["tokens"]).replace("<s>", "") == text  # special tokens: no text
        # the engine's one top alternative (id 100, never sampled here) and the sampled
        # token beside it, as OpenAI lists up to logprobs + 1
        for top, t, lp in zip(lps["top_logprobs"], lps["tokens"], lps["token_logprobs"],
                              strict=True):
            assert len(top) == 2 and top[t] == lp
            assert [v for k, v in top.items() if k != t] == [fake_top_logprobs(1)[0][1]]
        assert lps["text_offset"] == [sum(len(t) for t in lps["tokens"][:i]) for i in range(4)]
    assert engine.requests[-1][2].logprobs and engine.requests[-1][2].top_logprobs == 1
    r = await client.post(C, json={"prompt": "hello", "max_tokens": 2, "logprobs": 0})
    assert r.json()["choices"][0]["logprobs"]["top_logprobs"] == [None, None]
    assert engine.requests[-1][2].top_logprobs == 0


@pytest.mark.anyio
async def test_request_id_header(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    r = await client.post(C, json={"prompt": "hi", "max_tokens": 1},
                          headers={"X-Request-Id": "router-42"})
    assert r.status_code == 200
    assert engine.requests[-1][0] == "router-42"
    assert r.json()["id"] == "router-42" and r.headers["x-request-id"] == "router-42"
    r = await client.post(C, json={"prompt": "hi"}, headers={"X-Request-Id": "x" * 300})
    assert_error(r, 400, "X-Request-Id")


# ---------------------------------------------------------------------------------- chat


@pytest.mark.anyio
async def test_chat_template_applied(client: httpx.AsyncClient, engine: FakeEngine,
                                     tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    r = await client.post(CHAT, json={"model": MODEL, "messages": messages})
    assert r.status_code == 200, r.text
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    want = tokenizer.encode(text, add_special_tokens=False)
    rid, ids, params, _ = engine.requests[-1]
    assert ids == want
    # the template writes BOS itself: exactly one, not a second one from encode()
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert params.max_tokens == MAX_MODEL_LEN - len(ids)  # chat default: rest of context
    body = r.json()
    assert body["id"] == rid and rid.startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] == "stop"  # the fake reaches <|im_end|>, an EOS id
    n = body["usage"]["completion_tokens"]
    gen = expected_ids(ids, n)
    assert gen[-1] in engine.config.model.eos_token_ids
    assert choice["message"]["content"] == tokenizer.decode(gen[:-1], skip_special_tokens=True)
    assert body["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.anyio
async def test_chat_content_parts_and_roles(client: httpx.AsyncClient, engine: FakeEngine,
                                            tokenizer: Any) -> None:
    parts = [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]
    r = await client.post(CHAT, json={"messages": [{"role": "user", "content": parts}]})
    assert r.status_code == 200, r.text
    r = await client.post(CHAT, json={"messages": [{"role": "user", "content": "hel\nlo"}]})
    assert engine.requests[-1][1] == engine.requests[-2][1]
    r = await client.post(CHAT, json={"messages": [
        {"role": "developer", "content": "sys"}, {"role": "user", "content": "q"},
        {"role": "assistant", "content": None}, {"role": "user", "content": "q2"}],
        "max_completion_tokens": 3, "max_tokens": 50})
    assert r.status_code == 200, r.text
    ids = engine.requests[-1][1]
    assert "<|im_start|>system\nsys" in tokenizer.decode(ids)
    assert engine.requests[-1][2].max_tokens == 3  # max_completion_tokens wins


@pytest.mark.anyio
async def test_chat_stream(client: httpx.AsyncClient) -> None:
    body = {"messages": [{"role": "user", "content": "hello world"}], "max_tokens": 8}
    whole = (await client.post(CHAT, json=body)).json()
    r = await client.post(CHAT, json={**body, "stream": True,
                                      "stream_options": {"include_usage": True}})
    events = sse(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-2]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert content == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert events[-2]["choices"] == [] and events[-2]["usage"] == whole["usage"]


@pytest.mark.anyio
async def test_chat_logprobs(client: httpx.AsyncClient, tokenizer: Any) -> None:
    body = {"messages": [{"role": "user", "content": "héllo wörld ✓"}], "max_tokens": 6,
            "logprobs": True, "ignore_eos": True}
    r = await client.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == 6
    for i, item in enumerate(content):
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        assert item["logprob"] == fake_logprob(i) and item["top_logprobs"] == []
    # raw bytes rebuild the text exactly, even where a token splits a UTF-8 character
    raw = b"".join(bytes(item["bytes"]) for item in content).decode("utf-8", "replace")
    specials = {"<s>", "</s>", "<|im_start|>", "<|im_end|>"}
    for s in specials:
        raw = raw.replace(s, "")
    assert raw == choice["message"]["content"]
    r = await client.post(CHAT, json={**body, "top_logprobs": 3, "stream": True})
    chunks = [e for e in sse(r.text)[:-1] if e["choices"] and e["choices"][0]["logprobs"]]
    items = [it for c in chunks for it in c["choices"][0]["logprobs"]["content"]]
    assert [it["logprob"] for it in items] == [fake_logprob(i) for i in range(6)]
    want = [lp for _, lp in fake_top_logprobs(3)]
    for it in items:  # the engine's alternatives, most likely first, with their text
        assert [alt["logprob"] for alt in it["top_logprobs"]] == want
        assert all(set(alt) == {"token", "logprob", "bytes"} and alt["token"]
                   for alt in it["top_logprobs"])


# -------------------------------------------------------------------------- bad input

LONG_IDS = [5] * (MAX_MODEL_LEN + 2)
U = [{"role": "user", "content": "hello"}]

BAD_INPUTS: list[tuple[str, str, Any, int, str | None, str | None]] = [
    ("malformed-json", C, b'{"prompt": "x",', 400, None, None),
    ("body-not-object", C, b"[1, 2]", 400, None, None),
    ("empty-body", C, b"", 400, None, None),
    ("missing-prompt", C, {"max_tokens": 3}, 400, "prompt", None),
    ("unknown-model", C, {"model": "gpt-4", "prompt": "x"}, 404, "model", "model_not_found"),
    ("prompt-too-long", C, {"prompt": LONG_IDS}, 400, "prompt", "context_length_exceeded"),
    ("prompt-fills-context", C, {"prompt": [5] * MAX_MODEL_LEN}, 400, "prompt", None),
    ("max-tokens-zero", C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    ("max-tokens-negative", C, {"prompt": "x", "max_tokens": -1}, 400, "max_tokens", None),
    ("max-tokens-beyond-context", C, {"prompt": "hello", "max_tokens": 500}, 400,
     "max_tokens", "context_length_exceeded"),
    ("max-tokens-string", C, {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens", None),
    ("max-tokens-bool", C, {"prompt": "x", "max_tokens": True}, 400, "max_tokens", None),
    ("max-tokens-float", C, {"prompt": "x", "max_tokens": 1.5}, 400, "max_tokens", None),
    ("temperature-negative", C, {"prompt": "x", "temperature": -0.5}, 400, "temperature", None),
    ("temperature-string", C, {"prompt": "x", "temperature": "hot"}, 400, "temperature", None),
    ("temperature-nan", C, b'{"prompt": "x", "temperature": NaN}', 400, None, None),
    ("top-p-zero", C, {"prompt": "x", "top_p": 0}, 400, "top_p", None),
    ("top-p-above-one", C, {"prompt": "x", "top_p": 1.5}, 400, "top_p", None),
    ("top-k-invalid", C, {"prompt": "x", "top_k": -2}, 400, "top_k", None),
    ("empty-prompt", C, {"prompt": ""}, 400, "prompt", None),
    ("empty-prompt-list", C, {"prompt": []}, 400, "prompt", None),
    ("batched-prompt", C, {"prompt": ["a", "b"]}, 400, "prompt", None),
    ("prompt-wrong-type", C, {"prompt": 5}, 400, "prompt", None),
    ("prompt-token-out-of-range", C, {"prompt": [1, 99999]}, 400, "prompt", None),
    ("stop-token-out-of-range", C, {"prompt": "x", "stop_token_ids": [-1]}, 400,
     "stop_token_ids", None),
    ("stop-wrong-type", C, {"prompt": "x", "stop": 5}, 400, "stop", None),
    ("stop-empty-string", C, {"prompt": "x", "stop": [""]}, 400, "stop", None),
    ("n-65", C, {"prompt": "x", "n": 65}, 400, "n", None),
    ("echo", C, {"prompt": "x", "echo": True}, 400, "echo", None),
    ("logprobs-too-many", C, {"prompt": "x", "logprobs": 6}, 400, "logprobs", None),
    ("presence-penalty-too-big", C, {"prompt": "x", "presence_penalty": 2.5}, 400,
     "presence_penalty", None),
    ("frequency-penalty-too-small", C, {"prompt": "x", "frequency_penalty": -3}, 400,
     "frequency_penalty", None),
    ("repetition-penalty-zero", C, {"prompt": "x", "repetition_penalty": 0}, 400,
     "repetition_penalty", None),
    ("logit-bias-not-an-id", C, {"prompt": "x", "logit_bias": {"abc": 1}}, 400,
     "logit_bias", None),
    ("logit-bias-unicode-digit", C, {"prompt": "x", "logit_bias": {"\u00b3": 1}}, 400,
     "logit_bias", None),
    ("logit-bias-id-out-of-range", C, {"prompt": "x", "logit_bias": {"99999": 1}}, 400,
     "logit_bias", None),
    ("logit-bias-too-big", C, {"prompt": "x", "logit_bias": {"5": 101}}, 400,
     "logit_bias", None),
    ("seed-too-big", C, {"prompt": "x", "seed": 2**70}, 400, "seed", None),
    ("chat-messages-not-list", CHAT, {"messages": "hi"}, 400, "messages", None),
    ("chat-messages-empty", CHAT, {"messages": []}, 400, "messages", None),
    ("chat-messages-missing", CHAT, {"model": MODEL}, 400, "messages", None),
    ("chat-unknown-role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role", None),
    ("chat-missing-role", CHAT, {"messages": [{"content": "x"}]}, 400, "messages[0].role",
     None),
    ("chat-content-wrong-type", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content", None),
    ("chat-image-part", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400,
     "messages[0].content[0].type", None),
    ("chat-user-null-content", CHAT, {"messages": [{"role": "user", "content": None}]}, 400,
     "messages[0].content", None),
    ("chat-template-rejects", CHAT, {"messages": [*U, {"role": "tool", "content": "r"}]}, 400,
     "messages", None),
    ("chat-prompt-too-long", CHAT, {"messages": [{"role": "user", "content": "hello " * 200}]},
     400, "messages", "context_length_exceeded"),
    ("chat-max-completion-tokens-zero", CHAT, {"messages": U, "max_completion_tokens": 0}, 400,
     "max_completion_tokens", None),
    ("chat-max-tokens-beyond-context", CHAT, {"messages": U, "max_tokens": 1000}, 400,
     "max_tokens", "context_length_exceeded"),
    ("chat-n-0", CHAT, {"messages": U, "n": 0}, 400, "n", None),
    ("chat-top-logprobs-alone", CHAT, {"messages": U, "top_logprobs": 2}, 400, "top_logprobs",
     None),
    ("chat-tools-no-function", CHAT, {"messages": U, "tools": [{"type": "function"}]}, 400,
     "tools[0].function", None),
    ("chat-tools-template", CHAT, {"messages": U, "tools": [
        {"type": "function", "function": {"name": "f"}}]}, 400, "tools", None),
    ("chat-unknown-model", CHAT, {"model": "nope", "messages": U}, 404, "model",
     "model_not_found"),
    ("chat-logprobs-not-bool", CHAT, {"messages": U, "logprobs": 3}, 400, "logprobs", None),
]


@pytest.mark.anyio
@pytest.mark.parametrize("path,body,status,param,code",
                         [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
async def test_bad_input(client: httpx.AsyncClient, engine: FakeEngine, path: str, body: Any,
                         status: int, param: str | None, code: str | None) -> None:
    if isinstance(body, bytes):
        r = await client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = await client.post(path, json=body)
    assert_error(r, status, param, code)
    assert engine.requests == []  # refused before it reached the engine
    # and the server keeps serving
    good = {"prompt": "hello", "max_tokens": 2} if path == C else {"messages": U,
                                                                   "max_tokens": 2}
    r = await client.post(path, json=good)
    assert r.status_code == 200, r.text


@pytest.mark.anyio
async def test_json_body_without_content_type(client: httpx.AsyncClient) -> None:
    # curl -d sends application/x-www-form-urlencoded; the body is still JSON
    r = await client.post(C, content=b'{"prompt": "hi", "max_tokens": 1}',
                          headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200, r.text


@pytest.mark.anyio
async def test_unknown_route_and_method(client: httpx.AsyncClient) -> None:
    assert_error(await client.get("/v1/nothing"), 404)
    r = await client.get(C)
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.anyio
async def test_body_too_large(engine: FakeEngine) -> None:
    async with running(build_app(engine, max_body_bytes=1000)) as client:
        r = await client.post(C, json={"prompt": "x" * 2000})
        assert r.status_code == 413
        r = await client.post(C, json={"prompt": "hi", "max_tokens": 1})
        assert r.status_code == 200


# ------------------------------------------------------------------ engine-side failures


@pytest.mark.anyio
async def test_engine_request_error_is_400(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    for stream in (False, True):
        engine.fail_with = RequestError("prompt has a bad token", param="prompt",
                                        code="bad_token")
        r = await client.post(C, json={"prompt": "hi", "stream": stream})
        err = assert_error(r, 400, "prompt", "bad_token")
        assert "bad token" in err["message"]
    assert (await client.post(C, json={"prompt": "hi", "max_tokens": 1})).status_code == 200


@pytest.mark.anyio
async def test_unexpected_error_is_500(client: httpx.AsyncClient, engine: FakeEngine,
                                       caplog: pytest.LogCaptureFixture) -> None:
    engine.fail_with = RuntimeError("kaboom")
    r = await client.post(C, json={"prompt": "hi"})
    err = assert_error(r, 500)
    assert "kaboom" not in err["message"]  # internals are logged, not sent
    assert "kaboom" in caplog.text
    # a crash in the middle of a non-streamed request
    engine.raise_after = 2
    assert_error(await client.post(C, json={"prompt": "hello world", "max_tokens": 8}), 500)
    # an engine-reported failure
    engine.error_after = 2
    err = assert_error(await client.post(C, json={"prompt": "hello world", "max_tokens": 8}), 500)
    assert "injected engine failure" in err["message"]
    assert (await client.post(C, json={"prompt": "hi", "max_tokens": 1})).status_code == 200


@pytest.mark.anyio
async def test_error_mid_stream(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    for knob in ("raise_after", "error_after"):
        setattr(engine, knob, 2)
        r = await client.post(C, json={"prompt": "hello world", "max_tokens": 8, "stream": True})
        assert r.status_code == 200  # the status line went out with the first token
        events = sse(r.text)
        assert events[-1] == "[DONE]"
        assert "error" in events[-2] and events[-2]["error"]["type"] == "server_error"
        assert sum(1 for e in events[:-2] if e["choices"][0]["text"]) == 2
    assert (await client.post(C, json={"prompt": "hi", "max_tokens": 1})).status_code == 200


@pytest.mark.anyio
async def test_engine_side_abort(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    engine.token_delay = 0.02
    task = asyncio.ensure_future(client.post(C, json={"prompt": "hi", "max_tokens": 100},
                                             headers={"X-Request-Id": "victim"}))
    await wait_until_async(lambda: "victim" in engine.active)
    await engine.abort("victim")
    r = await asyncio.wait_for(task, 5)
    assert r.status_code == 200
    assert r.json()["choices"][0]["finish_reason"] == "abort"


@pytest.mark.anyio
async def test_health_and_models(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    r = await client.get("/health")
    assert r.status_code == 200
    r = await client.get("/v1/models")
    assert r.status_code == 200
    (card,) = r.json()["data"]
    assert r.json()["object"] == "list"
    assert card["id"] == MODEL and card["object"] == "model"
    assert card["max_model_len"] == MAX_MODEL_LEN
    engine.healthy = False
    assert_error(await client.get("/health"), 503)
    assert_error(await client.post(C, json={"prompt": "hi"}), 503)
    engine.healthy = True


@pytest.mark.anyio
async def test_long_prompt_tokenized_off_the_event_loop(client: httpx.AsyncClient,
                                                        engine: FakeEngine,
                                                        tokenizer: Any) -> None:
    server = client.app.state.server  # type: ignore[attr-defined]
    submitted = []
    real_submit = server.executor.submit

    def spy(fn: Any, *args: Any) -> Any:
        submitted.append(fn)
        return real_submit(fn, *args)

    server.executor.submit = spy
    text = "hello " * (INLINE_BODY_BYTES // 6 + 1)
    r = await client.post(C, json={"prompt": text, "max_tokens": 1})
    assert_error(r, 400, "prompt", "context_length_exceeded")  # longer than the context
    assert len(submitted) == 2  # a large body: parsed, then tokenized, on a worker
    r = await client.post(C, json={"prompt": "hello", "max_tokens": 1})
    assert r.status_code == 200 and len(submitted) == 2  # short: inline
    messages = [{"role": "user", "content": "x" * (INLINE_BODY_BYTES + 1)}]
    r = await client.post(CHAT, json={"messages": messages})
    assert r.status_code == 400 and len(submitted) == 4


def test_token_texts_metaspace() -> None:
    """SentencePiece-style vocabularies: U+2581 is a space in logprob text and bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from kvpush.server.chat import TokenTexts

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(["hello world hello there"] * 4, trainers.BpeTrainer(
        vocab_size=60, special_tokens=["<unk>"], show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    texts = TokenTexts(fast)
    ids = fast.encode("hello world", add_special_tokens=False)
    pieces = [texts(i) for i in ids]
    assert "".join(t for t, _ in pieces) == " hello world"
    assert b"".join(bytes(b) for _, b in pieces) == b" hello world"


# ----------------------------------------------------------------------------- metrics


@pytest.mark.anyio
async def test_metrics(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    r1 = await client.post(C, json={"prompt": "hello world", "max_tokens": 3})  # length
    r2 = await client.post(CHAT, json={"messages": U})  # stop (EOS)
    await client.post(C, json={"prompt": "hi", "max_tokens": 0})  # rejected
    engine.fail_with = RuntimeError("x")
    await client.post(C, json={"prompt": "hi"})  # error
    r = await client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    names = {name for name, _ in samples}
    for name in ("kvpush_requests_total", "kvpush_time_to_first_token_seconds_bucket",
                 "kvpush_time_per_output_token_seconds_bucket",
                 "kvpush_e2e_request_latency_seconds_bucket", "kvpush_prompt_tokens_total",
                 "kvpush_generation_tokens_total", "kvpush_num_requests_running",
                 "kvpush_num_requests_waiting", "kvpush_kv_blocks_free",
                 "kvpush_kv_blocks_total", "kvpush_num_preemptions_total",
                 "kvpush_prefix_cache_hit_tokens_total",
                 "kvpush_prefix_cache_query_tokens_total", "kvpush_engine_healthy"):
        assert name in names, name

    def outcome(o: str) -> float:
        return samples[("kvpush_requests_total", (("outcome", o),))]

    assert (outcome("length"), outcome("stop"), outcome("rejected"), outcome("error"),
            outcome("abort")) == (1, 1, 1, 1, 0)
    assert samples[("kvpush_kv_blocks_total", ())] == engine.num_blocks
    assert samples[("kvpush_kv_blocks_free", ())] == engine.num_blocks
    assert samples[("kvpush_time_to_first_token_seconds_count", ())] == 2
    usage = [r1.json()["usage"], r2.json()["usage"]]
    assert samples[("kvpush_generation_tokens_total", ())] == sum(
        u["completion_tokens"] for u in usage)
    assert samples[("kvpush_prompt_tokens_total", ())] == sum(
        u["prompt_tokens"] for u in usage)


#: vLLM's families the server must export (vLLM v1's types), docs/METRICS.md
VLLM_FAMILIES = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge", "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter", "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
}


@pytest.mark.anyio
async def test_vllm_metrics(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    """vLLM's names, types and model_name label, parsed with prometheus_client's parser,
    moving as the requests served say they must."""
    from prometheus_client.parser import text_string_to_metric_families

    model = (await client.get("/v1/models")).json()["data"][0]["id"]
    rs = [await client.post(C, json={"prompt": "hello world", "max_tokens": 3}),
          await client.post(CHAT, json={"messages": U}),
          await client.post(C, json={"prompt": "hello there", "max_tokens": 1})]
    usage = [r.json()["usage"] for r in rs]
    r = await client.post(C, json={"prompt": "hello", "max_tokens": 5, "stream": True})
    assert r.status_code == 200 and sse(r.text)[-1] == "[DONE]"
    ntok = [u["completion_tokens"] for u in usage] + [5]
    nprompt = [u["prompt_tokens"] for u in usage] + [len(engine.requests[-1][1])]
    await client.post(C, json={"prompt": "hi", "max_tokens": 0})  # rejected: not counted
    await wait_until_async(lambda: not engine.active)
    text = (await client.get("/metrics")).text
    fams = {f.name: f for f in text_string_to_metric_families(text)
            if f.name.startswith("vllm:")}
    assert {n: f.type for n, f in fams.items()} == VLLM_FAMILIES
    v: dict[str, float] = {}
    for f in fams.values():
        for smp in f.samples:
            assert smp.labels.get("model_name") == model, smp  # on every series
            if smp.name.endswith(("_sum", "_count", "_total")) or f.type == "gauge":
                v[smp.name] = smp.value
    assert v["vllm:generation_tokens_total"] == sum(ntok)
    assert v["vllm:prompt_tokens_total"] == sum(nprompt)
    assert v["vllm:prefix_cache_queries_total"] == engine.stats().prefix_cache_query_tokens
    assert v["vllm:prefix_cache_hits_total"] == 0
    assert v["vllm:num_requests_running"] == 0 and v["vllm:num_requests_waiting"] == 0
    assert v["vllm:kv_cache_usage_perc"] == 0.0
    for h in ("time_to_first_token", "e2e_request_latency", "request_queue_time",
              "request_prefill_time", "request_decode_time", "request_inference_time"):
        assert v[f"vllm:{h}_seconds_count"] == 4, h
        assert v[f"vllm:{h}_seconds_sum"] >= 0, h
    # one gap per token after a request's first; their sum is the requests' decode time
    assert v["vllm:inter_token_latency_seconds_count"] == sum(ntok) - 4
    assert v["vllm:inter_token_latency_seconds_sum"] == pytest.approx(
        v["vllm:request_decode_time_seconds_sum"])
    assert v["vllm:request_decode_time_seconds_sum"] > 0  # the fake waits between tokens
    assert v["vllm:e2e_request_latency_seconds_sum"] >= (
        v["vllm:request_decode_time_seconds_sum"])
    # kvpush's own names are still there, moving together with vLLM's
    assert f"kvpush_generation_tokens_total {float(sum(ntok))}" in text
    # docs/METRICS.md lists every family the instance exports
    doc = (Path(__file__).resolve().parents[1] / "docs" / "METRICS.md").read_text()
    missing = [f.name for f in text_string_to_metric_families(text)
               if f"`{f.name}`" not in doc and f"`{f.name}_total`" not in doc]
    assert not missing, missing


@pytest.mark.anyio
async def test_kv_cache_usage_while_a_request_runs(client: httpx.AsyncClient,
                                                   engine: FakeEngine) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    engine.token_delay = 0.05
    task = asyncio.create_task(client.post(C, json={"prompt": "hello", "max_tokens": 20}))
    await wait_until_async(lambda: bool(engine.active))
    text = (await client.get("/metrics")).text
    got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    used = engine.num_blocks - engine.free_blocks
    assert got["vllm:kv_cache_usage_perc"] == pytest.approx(used / engine.num_blocks)
    assert got["vllm:num_requests_running"] == 1
    assert (await task).status_code == 200


@pytest.mark.anyio
async def test_two_apps_have_separate_metrics(fake_model: tuple[Any, Any]) -> None:
    e1, e2 = FakeEngine(*fake_model), FakeEngine(*fake_model)
    async with running(build_app(e1)) as c1, running(build_app(e2)) as c2:
        assert (await c1.post(C, json={"prompt": "hi", "max_tokens": 2})).status_code == 200
        m1, m2 = (await c1.get("/metrics")).text, (await c2.get("/metrics")).text
        assert 'kvpush_requests_total{outcome="length"} 1.0' in m1
        assert 'kvpush_requests_total{outcome="length"} 0.0' in m2


# ------------------------------------------------------------- disconnects (raw ASGI)


async def call_asgi(app: FastAPI, path: str, body: dict[str, Any], *,
                    disconnect_after: float | None = None, disconnect_on_body: bool = False,
                    raise_on_send: bool = False,
                    headers: Sequence[tuple[bytes, bytes]] = ()) -> list[dict[str, Any]]:
    """Drive the app like a server whose client goes away at a chosen moment."""
    sent: list[dict[str, Any]] = []
    gone = asyncio.Event()
    data = json.dumps(body).encode()
    body_given = False

    async def receive() -> dict[str, Any]:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": data, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if raise_on_send and gone.is_set():
            raise OSError("connection reset")  # what an ASGI 2.4 server does
        sent.append(message)
        if disconnect_on_body and message["type"] == "http.response.body" and message["body"]:
            gone.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), *headers],
             "client": ("127.0.0.1", 5000), "server": ("test", 80)}
    if disconnect_after is not None:
        asyncio.get_running_loop().call_later(disconnect_after, gone.set)
    await asyncio.wait_for(app(scope, receive, send), 5)
    return sent


@pytest.mark.anyio
@pytest.mark.parametrize("stream,raise_on_send", [(False, False), (True, False), (True, True)])
async def test_client_disconnect_aborts(engine: FakeEngine, stream: bool,
                                        raise_on_send: bool) -> None:
    engine.token_delay = 0.02  # 100 tokens: 2 s unless aborted
    app = build_app(engine)
    async with app.router.lifespan_context(app):
        t0 = time.monotonic()
        await call_asgi(app, C, {"prompt": "hello", "max_tokens": 100, "stream": stream},
                        disconnect_after=None if stream else 0.1, disconnect_on_body=stream,
                        raise_on_send=raise_on_send, headers=[(b"x-request-id", b"gone-1")])
        assert time.monotonic() - t0 < 1.5
        await wait_until_async(lambda: "gone-1" in engine.aborted)
        assert engine.free_blocks == engine.num_blocks and not engine.active
        assert 'kvpush_requests_total{outcome="abort"} 1.0' in app.state.server.metrics.render(
            ).decode()


@pytest.mark.anyio
async def test_disconnect_while_waiting_for_first_token(engine: FakeEngine) -> None:
    engine.token_delay = 0.5
    app = build_app(engine)
    async with app.router.lifespan_context(app):
        sent = await call_asgi(app, CHAT, {"messages": U, "stream": True},
                               disconnect_after=0.05, headers=[(b"x-request-id", b"early")])
        assert not any(m["type"] == "http.response.body" and m.get("body") for m in sent)
        await wait_until_async(lambda: "early" in engine.aborted)
        assert engine.free_blocks == engine.num_blocks


# ------------------------------------------------------------ a real server, real clients




def sync_wait(cond: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_openai_client(fake_model: tuple[Any, Any]) -> None:
    import openai

    engine = FakeEngine(*fake_model)
    with uvicorn_server(build_app(engine)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                               timeout=10)
        with client:
            assert [m.id for m in client.models.list()] == [MODEL]
            c = client.completions.create(model=MODEL, prompt="hello world", max_tokens=5)
            assert c.choices[0].text == " worldhello worldhello"
            assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 5
            parts = [ch.choices[0].text for ch in client.completions.create(
                model=MODEL, prompt="hello world", max_tokens=5, stream=True)]
            assert "".join(parts) == c.choices[0].text

            msgs: Any = [{"role": "user", "content": "hello world"}]
            cc = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8,
                                                logprobs=True)
            assert cc.choices[0].message.role == "assistant"
            assert cc.choices[0].logprobs is not None
            assert len(cc.choices[0].logprobs.content or []) == cc.usage.completion_tokens
            chunks = list(client.chat.completions.create(
                model=MODEL, messages=msgs, max_tokens=8, stream=True,
                stream_options={"include_usage": True}))
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            assert text == cc.choices[0].message.content
            assert chunks[-1].usage is not None and chunks[-1].usage == cc.usage

            with pytest.raises(openai.BadRequestError) as bad:
                client.completions.create(model=MODEL, prompt="hi", max_tokens=10_000)
            assert "maximum context length" in str(bad.value)
            with pytest.raises(openai.NotFoundError):
                client.chat.completions.create(model="gpt-4o", messages=msgs)
            with pytest.raises(openai.BadRequestError):
                client.chat.completions.create(model=MODEL, messages=msgs, n=65)
            engine.raise_after = 1
            with pytest.raises(openai.APIError):
                for _ in client.completions.create(model=MODEL, prompt="hello world",
                                                   max_tokens=5, stream=True):
                    pass
            # still serving
            assert client.completions.create(model=MODEL, prompt="hi", max_tokens=1).choices
    assert engine.shut_down and engine.free_blocks == engine.num_blocks


def test_real_server_disconnects_abort(fake_model: tuple[Any, Any]) -> None:
    engine = FakeEngine(*fake_model, token_delay=0.02)
    with uvicorn_server(build_app(engine)) as url:
        body = {"prompt": "hello world", "max_tokens": 100, "stream": True}
        with httpx.Client(base_url=url, timeout=10) as http:
            with http.stream("POST", C, json=body, headers={"X-Request-Id": "s1"}) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                got = 0
                for line in lines:
                    got += line.startswith("data: ")
                    if got == 2:
                        break  # leaving the block closes the connection
            sync_wait(lambda: "s1" in engine.aborted)
            with pytest.raises(httpx.ReadTimeout):
                http.post(C, json={**body, "stream": False}, headers={"X-Request-Id": "n1"},
                          timeout=0.3)
            sync_wait(lambda: "n1" in engine.aborted)
            sync_wait(lambda: engine.free_blocks == engine.num_blocks)
            r2 = http.post(C, json={"prompt": "hi", "max_tokens": 1})
            assert r2.status_code == 200


# ------------------------------------------------------------------------------ CLI


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpush")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def test_cli_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        serve_parser().parse_args(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--host", "--port", "--served-model-name", "--max-model-len", "--block-size",
                 "--kv-cache-memory", "--num-blocks", "--dtype", "--kv-dtype", "--device",
                 "--threads", "--max-num-seqs", "--max-num-batched-tokens",
                 "--no-chunked-prefill", "--no-prefix-caching", "--seed", "--log-level"):
        assert flag in out, flag
    flat = " ".join(out.split())
    assert f"a power of two (default: {DEFAULT_BLOCK_SIZE})" in flat  # matches config.py


def test_cli_build_config(fake_model: tuple[Any, Any]) -> None:
    path = Path(fake_model[0].model.path)
    args = serve_parser().parse_args([
        "serve", str(path), "--max-model-len", "64", "--block-size", "16",
        "--kv-cache-memory", "1MiB", "--no-prefix-caching", "--no-chunked-prefill",
        "--max-num-batched-tokens", "64", "--served-model-name", "m1", "--threads", "1"])
    cfg = build_config(args)
    assert cfg.scheduler.max_model_len == 64 and cfg.cache.block_size == 16
    assert not cfg.cache.enable_prefix_caching and not cfg.scheduler.enable_chunked_prefill
    per_block = cfg.model.kv_bytes_per_token(cfg.cache.dtype) * 16
    # --kv-cache-memory is the total: blocks and the dense decode cache (role both)
    dense = cfg.cache.decode_cache_bytes
    assert 0 < dense <= (1 << 20) // 2
    assert cfg.cache.num_blocks == ((1 << 20) - dense) // per_block
    assert cfg.served_model_name == "m1" and cfg.threads == 1
    args = serve_parser().parse_args(["serve", str(path)])
    assert build_config(args).cache.block_size == DEFAULT_BLOCK_SIZE


@pytest.mark.parametrize("argv", [
    ["serve", "/no/such/model"],
    ["serve", "{model}", "--block-size", "24"],
    ["serve", "{model}", "--dtype", "int3"],
    ["serve", "{model}", "--max-model-len", "100000"],
])
def test_cli_config_errors(argv: list[str], fake_model: tuple[Any, Any],
                           capsys: pytest.CaptureFixture[str]) -> None:
    argv = [a.format(model=fake_model[0].model.path) for a in argv]
    args = serve_parser().parse_args(argv)
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpush serve: error: ") and "Traceback" not in err


def test_cli_port_in_use_fails_before_loading_the_model(
        fake_model: tuple[Any, Any], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A taken port is an error at once, not after the model has loaded (the socket is
    bound first), and its message says so in the words `kvpush up` looks for."""
    import socket

    import kvpush.engine.async_engine as async_engine

    def no_load(*_a: Any, **_k: Any) -> None:
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(async_engine, "AsyncEngine", no_load)
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        busy = blocker.getsockname()[1]
        args = serve_parser().parse_args(["serve", fake_model[0].model.path, "--host",
                                          "127.0.0.1", "--port", str(busy)])
        assert args.func(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpush serve: error: cannot listen on 127.0.0.1:")
    assert "address already in use" in err.lower() and "Traceback" not in err


@pytest.mark.parametrize("argv", [
    ["serve", "m", "--kv-cache-memory", "lots"],
    ["serve", "m", "--kv-cache-memory", "1GiB", "--num-blocks", "10"],
    ["serve", "m", "--port", "70000"],
    ["serve", "m", "--threads", "many"],
])
def test_cli_bad_flags(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        serve_parser().parse_args(argv)
    assert e.value.code == 2
    assert "kvpush serve: error: " in capsys.readouterr().err


# ----------------------------------------------------- the real engine on a tiny model


def test_real_engine_end_to_end(tiny_llama: Path) -> None:
    """The server on the real AsyncEngine and a random tiny Llama (ChatML tokenizer):
    chat template, both endpoints, streaming, a disconnect, and no leaked blocks."""
    from kvpush.config import EngineConfig
    from kvpush.engine.async_engine import AsyncEngine

    config = EngineConfig.build(tiny_llama, max_model_len=256, num_blocks=64, block_size=16,
                                max_num_batched_tokens=256)
    engine = AsyncEngine(config)
    tok = engine.tokenizer
    app = build_app(engine)

    async def all_free() -> None:
        def free() -> bool:
            s = engine.stats()
            return s.num_free_blocks == s.num_total_blocks and s.num_running == 0
        await wait_until_async(free)

    async def go() -> None:
        async with running(app) as client:
            name = config.served_model_name
            r = await client.post(C, json={"model": name, "prompt": "hello world",
                                           "max_tokens": 8, "temperature": 0,
                                           "ignore_eos": True, "logprobs": 1})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["usage"]["completion_tokens"] == 8
            assert len(body["choices"][0]["logprobs"]["token_logprobs"]) == 8
            r = await client.post(CHAT, json={"messages": U, "max_tokens": 6, "stream": True,
                                              "temperature": 0, "ignore_eos": True,
                                              "stream_options": {"include_usage": True}},
                                  headers={"X-Request-Id": "real-1"})
            events = sse(r.text)
            assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 6
            if tok.chat_template:
                text = tok.apply_chat_template(U, add_generation_prompt=True, tokenize=False)
                assert events[-2]["usage"]["prompt_tokens"] == len(
                    tok.encode(text, add_special_tokens=False))
            r = await client.post(C, json={"prompt": [1] * 300})
            assert_error(r, 400, "prompt", "context_length_exceeded")
            await call_asgi(app, C, {"prompt": "hello", "max_tokens": 200, "stream": True,
                                     "ignore_eos": True}, disconnect_on_body=True)
            await all_free()
            m = (await client.get("/metrics")).text
            assert 'kvpush_requests_total{outcome="abort"} 1.0' in m

    asyncio.run(asyncio.wait_for(go(), 60))
    assert not engine.is_healthy()  # shut down with the app
