"""`kvpush serve --role prefill|decode` processes over HTTP, driven by a minimal two-leg
driver (the router issue builds the real one): outputs equal a single instance, and both
sides publish the KV cache events of the transferred blocks. The push pair is shared by
the module's tests; each leaves every block free."""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import pytest

from router_helpers import metric_value
from server_helpers import ServerProcess, push_kv, sign_kv
from test_kv_events import BS, Mirror, published
from test_kv_events import _check_snapshot as check_snapshot
from test_kv_events import _prompt as random_prompt
from test_kv_events import _subscribe as subscribe

PROMPTS = [
    "the quick brown fox jumps over the lazy dog " * 3,
    "a b c d e f g",
    "hello world " * 20,
]


PAIR_KV = ("--block-size", "16", "--num-blocks", "256")


def _start_pair(model_dir, mode: str, log_dir) -> tuple[ServerProcess, ServerProcess]:
    common = [*PAIR_KV, "--kv-transfer", mode]
    p = ServerProcess(model_dir, "--role", "prefill", *common, log_dir=log_dir, name="P")
    try:
        d = ServerProcess(model_dir, "--role", "decode", *common, log_dir=log_dir, name="D")
    except BaseException:
        p.stop()
        raise
    return p, d


@pytest.fixture(scope="module")
def push_pair(tiny_llama, tmp_path_factory):
    p, d = _start_pair(tiny_llama, "push", tmp_path_factory.mktemp("pair-logs"))
    yield p, d
    p.stop()
    d.stop()


@pytest.fixture
def pair(request, tiny_llama, tmp_path, mode):
    """The module's push pair, or a pull pair of the test's own (the slow tier's)."""
    shared = mode == "push"
    p, d = request.getfixturevalue("push_pair") if shared else _start_pair(
        tiny_llama, mode, tmp_path)
    try:
        yield p, d
        p.wait_all_free()
        d.wait_all_free()
    finally:
        if not shared:
            p.stop()
            d.stop()


@pytest.fixture(scope="module")
def single(tiny_llama, tmp_path_factory):
    srv = ServerProcess(tiny_llama, "--block-size", "16", "--num-blocks", "256",
                        log_dir=tmp_path_factory.mktemp("logs"), name="single")
    yield srv
    srv.stop()


def _body(prompt: str, stream: bool, kv: dict | None = None, max_tokens: int = 12,
          **extra) -> dict:
    b = {"model": "ignored-by-default", "prompt": prompt, "max_tokens": max_tokens,
         "temperature": 0, "stream": stream, **extra}
    b.pop("model")
    if kv is not None:
        b["kv_transfer_params"] = kv
    return b


async def _complete(client: httpx.AsyncClient, url: str, body: dict, rid: str) -> dict:
    headers = {"X-Request-Id": rid}
    if not body["stream"]:
        r = await client.post(url + "/v1/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text
        return r.json()
    text, last = "", None
    async with client.stream("POST", url + "/v1/completions", json=body,
                             headers=headers) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[6:])
                text += last["choices"][0]["text"]
    return {"choices": [{"text": text, "finish_reason": last["choices"][0]["finish_reason"]}]}


async def _two_legs(p_url, d_url, p_info, d_info, prompt, mode, stream, **extra) -> dict:
    """Both legs as the router sends them (params signed with the test secret)."""
    tid = uuid.uuid4().hex
    async with httpx.AsyncClient(timeout=60) as client:
        p_kv = sign_kv({"do_remote_decode": True, "transfer_id": tid}, p_info, "prefill")
        p_body = _body(prompt, False, p_kv, max_tokens=1, **extra)
        if mode == "pull":
            p_out = await _complete(client, p_url, p_body, tid)
            kv = sign_kv(p_out["kv_transfer_params"], d_info, "decode", p_info)
            return await _complete(client, d_url, _body(prompt, stream, kv, **extra), tid)
        d_kv = push_kv(tid, p_info, d_info)[1]
        p_task = asyncio.create_task(_complete(client, p_url, p_body, tid))
        d_out = await _complete(client, d_url, _body(prompt, stream, d_kv, **extra), tid)
        await p_task
        return d_out


def _counts(url: str) -> dict[str, float]:
    """The counters this module's tests read, from ``url``'s /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    names = ("kvpush_kv_transfers_ok_total", "vllm:request_queue_time_seconds_count",
             "vllm:request_prefill_time_seconds_count", "vllm:request_decode_time_seconds_count")
    return {n: metric_value(text, n, "" if n.startswith("kvpush") else "model_name=")
            for n in names}


@pytest.mark.parametrize("mode", ["push", pytest.param("pull", marks=pytest.mark.slow)])
def test_pd_over_http_equals_single(single, pair, mode):
    p, d = pair
    d_before, p_before = _counts(d.url), _counts(p.url)
    p_info, d_info = p.get("/kv/info"), d.get("/kv/info")
    assert p_info["role"] == "prefill" and d_info["role"] == "decode"
    assert p_info["kv_transfer"] == mode and p_info["block_size"] == 16
    assert p_info["layout"]["block_bytes"] > 0 and p_info["side_channel_port"] > 0

    async def run_all():
        jobs = [_two_legs(p.url, d.url, p_info, d_info, pr, mode, stream)
                for pr in PROMPTS for stream in (False, True)]
        return await asyncio.gather(*jobs)

    results = asyncio.run(run_all())
    refs = [httpx.post(single.url + "/v1/completions", json=_body(pr, False),
                       timeout=60).json()["choices"][0]["text"]
            for pr in PROMPTS for _ in (False, True)]
    for got, ref in zip(results, refs):
        assert got["choices"][0]["text"] == ref
    p.wait_all_free()
    d.wait_all_free()
    metrics = httpx.get(d.url + "/metrics").text
    assert f'kvpush_kv_transfer_bytes_count{{mode="{mode}",outcome="ok",role="decode"}}' \
        in metrics
    # six transfers; vLLM's phases on decode: every request was scheduled (blocks for
    # its KV) and its queue and prefill (the KV's arrival) times observed, from the
    # engine core's clock
    d_after, p_after = _counts(d.url), _counts(p.url)
    for name, before in d_before.items():
        assert d_after[name] - before == 6, name
    name = "vllm:request_prefill_time_seconds_count"
    assert p_after[name] - p_before[name] == 6
    # logprobs with 3 alternatives per token: token #1's from prefill (push) or
    # decode's recompute (pull), the rest from decode; all equal the single instance's
    # (pull's recompute batches token #1 differently: logprobs agree to ~2e-5)
    got = asyncio.run(_two_legs(p.url, d.url, p_info, d_info, PROMPTS[0], mode, False,
                                logprobs=3))["choices"][0]["logprobs"]
    ref = httpx.post(single.url + "/v1/completions", timeout=60,
                     json=_body(PROMPTS[0], False, logprobs=3)).json()["choices"][0]
    ref = ref["logprobs"]
    assert got["tokens"] == ref["tokens"] and len(got["top_logprobs"]) == 12
    assert got["token_logprobs"] == pytest.approx(ref["token_logprobs"], abs=1e-4)
    for g, r in zip(got["top_logprobs"], ref["top_logprobs"], strict=True):
        # keyed by text: alternatives that decode alike (a lone UTF-8 byte is "\ufffd")
        # share a key, as in OpenAI's legacy format
        assert 1 <= len(g) <= 4 and g.keys() == r.keys()
        assert list(g.values()) == pytest.approx(list(r.values()), abs=1e-4)


def test_prefill_and_decode_publish_transferred_blocks(push_pair):
    """Both sides of a push transfer publish the prompt's full blocks (a subscriber's
    mirror of each equals its /kv/cache_blocks)."""
    p, d = push_pair
    mirrors: list[Mirror] = []
    try:
        p_info, d_info = p.get("/kv/info"), d.get("/kv/info")
        for info in (p_info, d_info):
            host = info["side_channel_host"]
            assert info["kv_events"]["endpoint"].startswith(f"tcp://{host}:")
        mirrors.append(subscribe(p))
        mirrors.append(subscribe(d))  # decode warmed up by plain local requests
        prompt = random_prompt(3, 4 * BS + 3)
        asyncio.run(_two_legs(p.url, d.url, p_info, d_info, prompt, "push", False))
        want = set(published(prompt, BS))
        for srv, mirror, info in ((p, mirrors[0], p_info), (d, mirrors[1], d_info)):
            mirror.drain()
            assert want <= mirror.cached, info["role"]
            assert {b.engine_id for b in mirror.batches} == {info["engine_id"]}
            snap = srv.get("/kv/cache_blocks")
            assert snap["engine_id"] == info["engine_id"]
            check_snapshot(mirror, snap)
        p.wait_all_free()
        d.wait_all_free()
    finally:
        for m in mirrors:
            m.close()
