"""Schemathesis against the OpenAPI documents of an instance and of the router.

Bodies are generated from the schemas (valid ones, and ones that break them: wrong
types, missing fields, malformed kv_transfer_params) and sent to: the instance app on
the fake engine (in-process, with an API key); the router in colocated mode in front of
a fake-engine instance served by uvicorn; and a real `kvpush serve` on the tiny random
model. Every answer must be below 500, a JSON error body in OpenAI's shape when it is
not a 2xx; afterwards each server still answers, and every KV block is free again.
A bigger budget runs under the ``slow`` marker (KVPUSH_FUZZ_EXAMPLES overrides).
"""

from __future__ import annotations

import os
import time
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.python import asgi as st_asgi

from fake_engine import FakeEngine
from kvpush.discovery.instance_spec import parse_instance
from kvpush.router.app import Router
from kvpush.router.app import build_app as build_router_app
from kvpush.router.config import RouterConfig
from kvpush.server.app import build_app
from server_helpers import ServerProcess, uvicorn_server
from stand_in import vllm_like

pytestmark = pytest.mark.timeout(300)

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODES = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
#: operations and their share of the budget (generation endpoints get the most)
WEIGHT = {"/v1/completions": 1.0, "/v1/chat/completions": 1.0, "/kv/abort": 0.3}


def budget(default: int) -> int:
    return int(os.environ.get("KVPUSH_FUZZ_EXAMPLES", default))


def check_answer(status: int, headers: Any, body: bytes, what: str) -> None:
    assert status < 500, f"{what}: {status} {body[:500]!r}"
    if status >= 400:
        import json

        err = json.loads(body)["error"]
        assert isinstance(err["message"], str) and err["message"], what
        assert {"type", "param", "code"} <= err.keys(), what


def _run_operation(op: Any, mode: GenerationMode, n: int, send) -> int:
    label = f"{mode.value} {op.method.upper()} {op.path}"
    sent = 0

    @settings(max_examples=n, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        nonlocal sent
        sent += 1
        send(case, f"{label} body={case.body!r}")

    run()
    return sent


def fuzz(schema: Any, send, examples: int, skip: tuple[str, ...] = ()) -> int:
    """Run every operation of ``schema`` in both generation modes; returns cases sent."""
    sent = 0
    for result in schema.get_all_operations():
        op = result.ok()
        if op.path in skip:
            continue
        n = max(3, int(examples * WEIGHT.get(op.path, 0.15)))
        for mode in MODES if op.method.upper() == "POST" else MODES[:1]:  # GETs: no input
            sent += _run_operation(op, mode, n, send)
    return sent


# ---- instance on the fake engine, in-process ---------------------------------------------


def _fuzz_fake_instance(fake_model, examples: int) -> None:
    engine = FakeEngine(*fake_model, token_delay=0)
    app = build_app(engine, api_key=KEY)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, headers=AUTH)
    paths = {r.ok().path for r in schema.get_all_operations()}
    assert {"/v1/completions", "/v1/chat/completions"} <= paths
    body = schema.raw_schema["paths"]["/v1/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"].endswith("CompletionRequest")
    with st_asgi.get_client(app) as client:
        def send(case: Any, what: str) -> None:
            r = case.call(session=client, headers=AUTH)
            check_answer(r.status_code, r.headers, r.content, what)

        sent = fuzz(schema, send, examples)
        assert sent >= examples
        r = client.post("/v1/completions", json={"prompt": "still here", "max_tokens": 2},
                        headers=AUTH)
        assert r.status_code == 200
        _wait_engine_idle(engine)


def _wait_engine_idle(engine: FakeEngine, timeout: float = 10.0) -> None:
    """Until the fake engine runs nothing and every block is free again."""
    deadline = time.monotonic() + timeout
    while engine.active or engine.free_blocks != engine.num_blocks:
        assert time.monotonic() < deadline, "blocks not returned"
        time.sleep(0.01)


def test_fuzz_instance_fake_engine(fake_model):
    _fuzz_fake_instance(fake_model, budget(40))


@pytest.mark.slow
def test_fuzz_instance_fake_engine_big(fake_model):
    _fuzz_fake_instance(fake_model, budget(600))


# ---- router (colocated) over a vLLM-like stand-in served by uvicorn ----------------------

#: found by the sampling property test: extreme but valid sampling values
EXTREME_VALID = ({"temperature": 1e-300}, {"temperature": 5e-324},
                 {"temperature": 1.0, "top_p": 5e-324}, {"temperature": 1e308},
                 {"temperature": 1.0, "top_k": 10**20, "seed": -(2**63)})
#: JSON that Python parses but cannot encode again (each a 400 from the instances)
UNENCODABLE = (b'{"prompt": "x", "max_tokens": 2, "temperature": 1e999}',
               b'{"prompt": "x", "max_tokens": 1e999}',
               b'{"prompt": "\\ud800", "max_tokens": 2}',
               b'{"prompt": "x", "max_tokens": 2, "stop": "\\udfff"}',
               b'{"prompt": "x", "max_tokens": 2, "logit_bias": {"\\ud800": 1}}')


def _fuzz_router(fake_model, examples: int) -> None:
    config, _ = fake_model  # the router loads the model's tokenizer from its folder
    with uvicorn_server(vllm_like(str(config.model.path))) as url:
        cfg = RouterConfig(mode="colocated", prefill=(), decode=(parse_instance(url),),
                           api_key=KEY, startup_timeout_s=10, request_timeout_s=30)
        app = build_router_app(Router(cfg))
        schema = schemathesis.openapi.from_asgi("/openapi.json", app, headers=AUTH)
        with st_asgi.get_client(app) as client:
            def send(case: Any, what: str) -> None:
                r = case.call(session=client, headers=AUTH)
                check_answer(r.status_code, r.headers, r.content, what)

            fuzz(schema, send, examples)
            # the instance's own extreme cases, through the router: valid ones are
            # served, the ones JSON cannot carry on are a 400 (they were a 500)
            for extra in EXTREME_VALID:
                r = client.post("/v1/completions", headers=AUTH,
                                json={"prompt": "x", "max_tokens": 2, **extra})
                assert r.status_code == 200, (extra, r.text)
            for raw in UNENCODABLE:
                r = client.post("/v1/completions", data=raw,
                                headers={**AUTH, "content-type": "application/json"})
                check_answer(r.status_code, r.headers, r.content, repr(raw))
                assert r.status_code == 400, (raw, r.text)
            r = client.post("/v1/chat/completions", headers=AUTH, json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert r.status_code == 200, r.text


def test_fuzz_router_colocated(fake_model):
    _fuzz_router(fake_model, budget(30))


@pytest.mark.slow
def test_fuzz_router_colocated_big(fake_model):
    _fuzz_router(fake_model, budget(400))


# ---- a real `kvpush serve` ------------------------------------------------------------------

def _fuzz_real(model_dir, tmp_path, examples: int) -> None:
    srv = ServerProcess(model_dir, "--max-model-len", "256", "--num-blocks", "64",
                        "--block-size", "16", log_dir=tmp_path, name="fuzz")
    try:
        schema = schemathesis.openapi.from_url(srv.url + "/openapi.json")
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            def send(case: Any, what: str) -> None:
                kw = case.as_transport_kwargs(base_url=srv.url)
                r = client.request(kw["method"], kw["url"], headers=kw.get("headers"),
                                   params=kw.get("params"),
                                   content=_content(kw))
                check_answer(r.status_code, r.headers, r.content, what)

            fuzz(schema, send, examples, skip=("/kv/abort",))
            assert srv.proc.poll() is None, srv.log_tail()
            for extra in EXTREME_VALID:
                r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2,
                                                         **extra})
                assert r.status_code == 200, (extra, r.text)
            r = client.post("/v1/completions", json={"prompt": "after", "max_tokens": 3})
            assert r.status_code == 200, r.text
        _wait_free(srv)
        assert "Traceback" not in srv.log_path.read_text(), srv.log_tail(80)
    finally:
        srv.stop()


def _content(kw: dict) -> bytes | None:
    import json

    if "json" in kw:
        return json.dumps(kw["json"]).encode()
    data = kw.get("data")
    if isinstance(data, str):
        return data.encode()
    return data


def _wait_free(srv: ServerProcess, timeout: float = 20.0) -> None:
    import re

    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(srv.url + "/metrics", timeout=5).text
        free = float(re.search(r"^kvpush_kv_blocks_free (\S+)", text, re.M).group(1))
        total = float(re.search(r"^kvpush_kv_blocks_total (\S+)", text, re.M).group(1))
        if free == total:
            return
        assert time.monotonic() < deadline, f"{free} of {total} blocks free"
        time.sleep(0.05)


def test_fuzz_real_instance(tiny_llama, tmp_path):
    _fuzz_real(tiny_llama, tmp_path, budget(25))


@pytest.mark.slow
def test_fuzz_real_instance_big(tiny_llama, tmp_path):
    _fuzz_real(tiny_llama, tmp_path, budget(300))


# ---- sampling values through the real engine (hypothesis) -----------------------------------

def test_sampling_values_never_fail_the_engine(tiny_llama):
    """Any sampling values the API accepts generate tokens: none makes the step fail
    (a failing step fails every request in its batch)."""
    from hypothesis import strategies as st

    from engine_helpers import make_engine
    from kvpush.server.chat import PromptBuilder
    from kvpush.server.protocol import CompletionRequest

    engine = make_engine(tiny_llama)
    floats = st.floats(min_value=0, max_value=1e308) | st.sampled_from(
        [0.0, 5e-324, 1e-300, 1e-45, 1e-8, 1e-5, 2.0])

    @settings(max_examples=60, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(temperature=floats, top_p=floats.filter(lambda x: 0 < x <= 1) | st.just(1.0),
           top_k=st.integers(-1, 2**70), seed=st.none() | st.integers(-(2**63), 2**64 - 1),
           logprobs=st.booleans())
    def run(temperature, top_p, top_k, seed, logprobs):
        req = CompletionRequest(prompt=[1, 2, 3], temperature=temperature, top_p=top_p,
                                top_k=top_k, seed=seed)
        params = PromptBuilder._sampling_params(req, 2, logprobs)
        engine.add_request("r", [1, 2, 3, 4], params)
        outs = []
        for _ in range(10):
            outs += engine.step()
            if not engine.has_work():
                break
        final = [o for o in outs if o.finished]
        assert final and final[0].failure is None, (temperature, top_p, top_k, final)

    run()
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


# ---- malformed kv_transfer_params at a real decode instance ---------------------------------

def test_fuzz_kv_transfer_params_real_decode(tiny_llama, tmp_path):
    """Random kv_transfer_params (wrong types, missing fields, unknown hosts and engines,
    block ids out of range) at a real push decode instance with a 1 s lease: each ends
    with a 400, or — when the params are well-formed but no prefill answers for that
    transfer — with the transfer's failure once the lease runs out; the instance keeps
    serving and frees every block."""
    from hypothesis import strategies as st

    # unsigned params reach the parser only with --insecure-kv-params (signed, only the
    # router's would): this fuzzes the parser, tests/test_trust.py the signature check
    srv = ServerProcess(tiny_llama, "--role", "decode", "--kv-transfer", "push",
                        "--insecure-kv-params", "--lease-timeout", "1",
                        "--heartbeat-interval", "0.2",
                        "--max-model-len", "256", "--num-blocks", "64", "--block-size", "16",
                        log_dir=tmp_path, name="decode")
    values = st.one_of(
        st.none(), st.booleans(), st.integers(-5, 2**64), st.text(max_size=12),
        st.lists(st.integers(-2, 2**63) | st.booleans(), max_size=5),
        st.sampled_from(["127.0.0.1", "localhost", "no host", "[::1]"]))
    info = httpx.get(srv.url + "/kv/info", timeout=5).json()
    from kvpush.cluster.launcher import free_port

    dead_port = free_port()  # nothing listens there
    valid = {  # well-formed values, each replaced by a random one half the time
        "do_remote_prefill": st.just(True),
        "transfer_id": st.text("abcdef0123456789", min_size=1, max_size=12),
        "remote_host": st.sampled_from(["127.0.0.1", "localhost"]),
        "remote_port": st.sampled_from([dead_port, info["side_channel_port"]]),  # itself
        "remote_engine_id": st.sampled_from(["", "nobody", info["engine_id"]]),
        "remote_block_ids": st.sampled_from([None, [0, 1], [10**6], [3, 3]]),
    }
    params = st.tuples(
        st.fixed_dictionaries({k: v | values for k, v in valid.items()}),
        st.sets(st.sampled_from(sorted(valid))),
    ).map(lambda t: {k: v for k, v in t[0].items() if k not in t[1]})
    counts: dict[str, int] = {"400": 0, "transfer failed": 0}
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as client:
            @settings(max_examples=budget(25), deadline=None, database=None,
                      derandomize=True, suppress_health_check=list(HealthCheck))
            @given(kv=params | values)
            def run(kv: Any) -> None:
                r = client.post("/v1/completions", json={"prompt": "hi there", "max_tokens": 2,
                                                         "kv_transfer_params": kv})
                if r.status_code in (200, 400):  # 200: nothing remote asked (served here)
                    counts[str(r.status_code)] = counts.get(str(r.status_code), 0) + 1
                    return
                msg = r.json().get("error", {}).get("message", "")
                assert r.status_code == 500 and "KV transfer" in msg, (kv, r.text)
                counts["transfer failed"] += 1

            run()
            assert srv.proc.poll() is None, srv.log_tail()
            assert counts["400"] > 0, counts
            print(counts)
            r = client.post("/v1/completions", json={"prompt": "plain", "max_tokens": 2})
            assert r.status_code == 200, r.text
        _wait_free(srv)
        assert "Traceback" not in srv.log_path.read_text(), srv.log_tail(80)
    finally:
        srv.stop()
