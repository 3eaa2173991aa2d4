"""The router at its trust boundary (issue 30, findings 7 and 8): a client's mistake is a
4xx in OpenAI's shape, never a 5xx; client-facing errors name no internal host, port or
engine id (the router's log does, with the request id); a frozen decode's legs end within
seconds of the health check that notices it; the router holds a bounded number of
requests and answers 429 beyond it.

Instances are the fake engine behind the real instance app, small scripted instances
(for answers a real one gives only under faults), and one real `kvpush serve` for the
frozen decode (SIGSTOP needs a process). Every wait is bounded; everything started here is
stopped here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from fake_engine import FakeEngine
from kvpush.server.app import MAX_BODY_BYTES, build_app
from router_helpers import RouterThread, metric_value, wait_until
from server_helpers import ServerProcess, free_port, uvicorn_server
from stand_in import add_models, stand_in, vllm_like

pytestmark = pytest.mark.timeout(120)


def _openai_error(r: httpx.Response) -> dict:
    """The error of an OpenAI-shaped JSON error answer (asserts the shape)."""
    assert r.headers["content-type"].startswith("application/json"), (r.status_code, r.text)
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"], err
    assert {"type", "param", "code"} <= err.keys(), err
    return err



def _wait_engine_idle(engine: FakeEngine, timeout: float = 10.0) -> None:
    wait_until(lambda: not engine.active and engine.free_blocks == engine.num_blocks,
               timeout, "the fake engine idle with every block free")


# ------------------------------------------------------------------ finding 7: bad input


#: bodies that Python's parser accepts and its encoder refuses
UNENCODABLE = [
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "temperature": 1e999}'),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1e999}'),
    ("/v1/completions", b'{"prompt": "a \\ud800 b", "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "stop": ["x", "\\ud800"]}'),
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "\\udc00"}], "max_tokens": 2}'),
]


def test_bad_input_is_a_4xx_in_openai_shape(fake_model, tiny_llama):
    """1e999, lone surrogates (in a prompt, a stop string, a chat message), a body nested
    too deeply and a body over 32 MiB: the router answers 400 / 413 in OpenAI's shape
    (it answered 500, and a text/plain 413), as the instance itself does; the instance
    behind the router is never bothered, and the router serves the next request."""
    engine = FakeEngine(*fake_model, token_delay=0)
    bodies: list[dict] = []
    with uvicorn_server(build_app(engine)) as inst_url, \
            uvicorn_server(vllm_like(str(tiny_llama), bodies)) as vllm_url:
        rt = RouterThread("colocated", [], [vllm_url], kv_secret=None)
        try:
            with httpx.Client(timeout=30, headers={"content-type": "application/json"}) as c:
                for path, raw in UNENCODABLE:
                    direct = c.post(inst_url + path, content=raw)
                    assert direct.status_code == 400, (raw, direct.text)
                    r = c.post(rt.url + path, content=raw)
                    assert r.status_code == 400, (raw, r.status_code, r.text)
                    # the router's front is the instance's: the same answer, word for word
                    err = _openai_error(r)
                    assert err == _openai_error(direct), (raw, err)
                    assert err["type"] == "invalid_request_error", err
                deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
                r = c.post(rt.url + "/v1/completions", content=deep)
                assert r.status_code == 400 and "JSON" in _openai_error(r)["message"]
                big = b'{"prompt": "' + b"a" * (MAX_BODY_BYTES + 1) + b'"}'
                r = c.post(rt.url + "/v1/completions", content=big)
                assert r.status_code == 413, (r.status_code, r.text[:200])
                assert _openai_error(r)["type"] == "invalid_request_error"
                r = c.post(rt.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                assert r.status_code == 200, r.text
            assert len(bodies) == 1  # only the good one reached the instance
            m = rt.metrics()
            assert metric_value(m, "kvpush_router_requests_total", 'outcome="error"') == 0
            assert metric_value(m, "kvpush_router_requests_total",
                                'outcome="client_error"') == len(UNENCODABLE) + 2
        finally:
            rt.stop()
        _wait_engine_idle(engine)


# ------------------------------------------------------------------ finding 7: leaks

PEER_ENGINE = "prefill-0badc0de"  # an engine the router does not know (a peer's)
PEER_ADDR = "10.9.8.7:5601"


def scripted_instance(engine_id: str, side_port: int, script: dict[str, str],
                      model_root: str) -> FastAPI:
    """A stand-in vLLM instance whose /v1/completions answers per ``script["answer"]``
    with the kinds of errors a real one gives under faults, each naming internals."""
    app = stand_in()
    add_models(app, model_root)

    def frame(obj: dict) -> bytes:
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        here = f"{request.url.scheme}://{request.url.netloc}"
        leak = (f"engine {engine_id} at {here} (side channel 127.0.0.1:{side_port}, port "
                f"{side_port}) waited for {PEER_ENGINE} at {PEER_ADDR} and http://[::1]:9")
        answer = script["answer"]
        if answer == "500-json":
            return JSONResponse({"error": {"message": f"KV transfer failed: {leak}",
                                           "type": "server_error", "param": None,
                                           "code": "kv_transfer_failed"}}, status_code=500)
        if answer == "502-text":
            return PlainTextResponse(f"bad gateway: {leak}", status_code=502)
        if answer == "vllm-400":  # vLLM's older flat error shape
            return JSONResponse({"object": "error", "message": f"bad request: {leak}",
                                 "type": "BadRequestError", "param": None, "code": 400},
                                status_code=400)
        token = {"choices": [{"index": 0, "text": "a", "token_ids": [5]}]}
        last = {"choices": [{"index": 0, "text": "b", "token_ids": [6],
                             "finish_reason": "length"}]}
        if answer == "stream-error":
            async def frames() -> AsyncIterator[bytes]:
                yield frame(token)
                body = {"error": {"message": f"the engine failed this request: {leak}",
                                  "type": "server_error", "param": None, "code": None}}
                text = frame(body) + b"data: [DONE]\n\n"
                yield text[:25]  # one frame over two chunks
                yield text[25:]
            return StreamingResponse(frames(), media_type="text/event-stream")
        if answer == "done-then-hold":  # the whole answer, then the stream stays open
            async def held() -> AsyncIterator[bytes]:
                yield frame(token) + frame(last) + b"data: [DONE]\n\n"
                await asyncio.sleep(5)
            return StreamingResponse(held(), media_type="text/event-stream")
        # "no-kv": a pull prefill answer without kv_transfer_params
        return JSONResponse({"id": "x", "object": "text_completion", "choices": [
            {"index": 0, "text": "a", "token_ids": [5], "finish_reason": "length"}]})

    return app


def test_client_hanging_up_after_done_counts_ok(tiny_llama):
    """A client that closes the connection as soon as ``[DONE]`` arrives (kvpush bench
    and most SDKs do) got its whole answer: the router counts it ok, not abort, even
    while the instance's stream is still open behind the ``[DONE]``."""
    inst = scripted_instance("both-1234abcd", free_port(), {"answer": "done-then-hold"},
                             str(tiny_llama))
    with uvicorn_server(inst) as url:
        rt = RouterThread("colocated", [], [url], kv_secret=None)
        try:
            with httpx.Client(timeout=30) as c:
                for _ in range(2):
                    with c.stream("POST", rt.url + "/v1/completions",
                                  json={"prompt": "hi", "max_tokens": 2,
                                        "stream": True}) as r:
                        assert r.status_code == 200
                        for line in r.iter_lines():
                            if line == "data: [DONE]":
                                break  # hang up at once
            deadline = time.monotonic() + 10
            while (metric_value(rt.metrics(), "kvpush_router_requests_total",
                                'outcome="ok"') < 2 and time.monotonic() < deadline):
                time.sleep(0.05)
            assert metric_value(rt.metrics(), "kvpush_router_requests_total",
                                'outcome="ok"') == 2
            assert metric_value(rt.metrics(), "kvpush_router_requests_total",
                                'outcome="abort"') == 0
        finally:
            rt.stop()


def _assert_no_internals(text: str, secrets: list[str]) -> None:
    for s in secrets:
        assert s not in text, f"{s!r} in {text!r}"
    assert not re.search(r"\b\d{1,3}(\.\d{1,3}){3}\b|://|\[::1\]", text), text


def test_client_errors_name_no_internal_host_port_or_engine(caplog, tiny_llama):
    """Every error a client can get from the router — its own (no healthy instance, a
    pull prefill answer without kv_transfer_params) and an instance's relayed (a JSON
    5xx, a text 5xx, vLLM's flat 4xx, an error frame in a stream, split over chunks) —
    keeps its meaning, is in OpenAI's shape, and names no instance URL, port, side
    channel or engine id; the router's log names them, with the request id."""
    caplog.set_level(logging.WARNING, logger="kvpush.router")
    side = free_port()
    script = {"answer": "500-json"}
    root = str(tiny_llama)
    both = scripted_instance("both-1234abcd", side, script, root)
    pull_p = scripted_instance("vllm-prefill-east", side, {"answer": "no-kv"}, root)
    pull_d = scripted_instance("decode-77aa88bb", side, script, root)
    texts: list[str] = []
    with uvicorn_server(both) as both_url, uvicorn_server(pull_p) as p_url, \
            uvicorn_server(pull_d) as d_url:
        secrets = [u.removeprefix("http://") for u in (both_url, p_url, d_url)] + [
            u.rsplit(":", 1)[1] for u in (both_url, p_url, d_url)] + [
            str(side), "both-1234abcd", "vllm-prefill-east", "decode-77aa88bb", PEER_ENGINE,
            PEER_ADDR]
        col = RouterThread("colocated", [], [both_url], kv_secret=None)
        try:
            with httpx.Client(timeout=30) as c:
                body = {"prompt": "hi", "max_tokens": 2}
                for answer, status in (("500-json", 500), ("502-text", 502),
                                       ("vllm-400", 400)):
                    script["answer"] = answer
                    r = c.post(col.url + "/v1/completions", json=body)
                    assert r.status_code == status, (answer, r.text)
                    texts.append(r.text)
                    _openai_error(r)
                assert "KV transfer failed" in json.loads(texts[0])["error"]["message"]
                assert json.loads(texts[0])["error"]["code"] == "kv_transfer_failed"
                assert "bad request" in json.loads(texts[2])["error"]["message"]
                script["answer"] = "stream-error"
                with c.stream("POST", col.url + "/v1/completions",
                              json={**body, "stream": True}) as r:
                    assert r.status_code == 200
                    sse = r.read().decode()
                frames = [json.loads(line[6:]) for line in sse.split("\n\n")
                          if line.startswith("data: {")]
                assert frames[0]["choices"][0]["text"]  # the token before the error
                assert "the engine failed" in frames[-1]["error"]["message"], frames
                assert sse.endswith("data: [DONE]\n\n")
                texts.append(sse)
        finally:
            col.stop()
        pull = RouterThread("pull", [p_url], [d_url], kv_secret=None)
        dead = RouterThread("pull", [f"http://127.0.0.1:{free_port()}"], [d_url], wait=False,
                            kv_secret=None)
        try:
            with httpx.Client(timeout=30) as c:
                r = c.post(pull.url + "/v1/completions", json={"prompt": "hi"})
                assert r.status_code == 502 and "prefill instance failed" in r.text, r.text
                texts.append(r.text)
                rid = r.headers["x-request-id"]
                r = c.post(dead.url + "/v1/completions", json={"prompt": "hi"})
                assert r.status_code == 503, r.text
                assert "no healthy prefill instance" in _openai_error(r)["message"]
                texts.append(r.text)
                r = c.get(dead.url + "/health")
                texts.append(r.text)
        finally:
            pull.stop()
            dead.stop()
    for text in texts:
        _assert_no_internals(text, secrets)
    logged = [rec.getMessage() for rec in caplog.records]
    assert any(rid in m and p_url in m and "kv_transfer_params" in m
               for m in logged), logged  # the operator's view


# ------------------------------------------------------------------ finding 8: frozen decode


def test_frozen_decode_ends_its_legs_within_seconds(tiny_llama, tmp_path):
    """A decode instance SIGSTOPped while it streams one answer and computes another:
    both requests end within seconds of the freeze (the health check that takes it out
    of rotation ends its legs), the stream with an error frame and [DONE], the other
    with a 502, both saying what happened; after SIGCONT the instance frees every
    block."""
    srv = ServerProcess(tiny_llama, "--block-size", "16", "--num-blocks", "256",
                        log_dir=tmp_path, name="frozen")
    rt = None
    stopped = False
    try:
        rt = RouterThread("colocated", [], [srv.url], health_interval_s=0.3,
                          health_timeout_s=1.0)
        long = {"prompt": "hello world " * 20, "max_tokens": 1900, "ignore_eos": True,
                "temperature": 0}
        plain: dict[str, Any] = {}

        def non_streaming() -> None:
            t0 = time.monotonic()
            try:
                r = httpx.post(rt.url + "/v1/completions", json=long, timeout=40)
                plain.update(status=r.status_code, body=r.json())
            except Exception as e:  # noqa: BLE001 - recorded, asserted below
                plain["exception"] = repr(e)
            plain["end"] = time.monotonic()
            plain["start"] = t0

        worker = threading.Thread(target=non_streaming, daemon=True)
        worker.start()
        frames: list[str] = []
        with httpx.Client(timeout=httpx.Timeout(20, connect=5)) as c, c.stream(
                "POST", rt.url + "/v1/completions", json={**long, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert '"text"' in first
            wait_until(lambda: metric_value(rt.metrics(), "kvpush_router_instance_in_flight")
                       == 2, 10, "both legs on decode")
            os.killpg(srv.proc.pid, signal.SIGSTOP)
            stopped = True
            t_stop = time.monotonic()
            frames = [line for line in lines if line.startswith("data: ")]
            t_end = time.monotonic()
        print(f"stream ended {t_end - t_stop:.1f} s after SIGSTOP")
        assert t_end - t_stop < 10, t_end - t_stop
        assert frames[-1] == "data: [DONE]", frames[-3:]
        err = json.loads(frames[-2].removeprefix("data: "))["error"]
        assert "stopped answering" in err["message"], err
        worker.join(20)
        assert not worker.is_alive()
        assert plain.get("status") == 502, plain
        assert "stopped answering" in plain["body"]["error"]["message"], plain
        assert plain["end"] - t_stop < 10, plain["end"] - t_stop
        assert not rt.instances()[0]["healthy"]
        os.killpg(srv.proc.pid, signal.SIGCONT)
        stopped = False
        srv.wait_all_free(timeout=20)  # the instance saw both legs go and freed them
        wait_until(lambda: rt.instances()[0]["healthy"], 10, "back in rotation")
        assert metric_value(rt.metrics(), "kvpush_router_instance_in_flight") == 0
        assert metric_value(rt.metrics(), "kvpush_router_requests_total",
                            'outcome="error"') == 2
    finally:
        if stopped:
            os.killpg(srv.proc.pid, signal.SIGCONT)
        if rt is not None:
            rt.stop()
        srv.stop()


# ------------------------------------------------------------------ finding 8: bounded


def test_vllm_legs_carry_n_and_logprobs(tiny_llama):
    """Over a vLLM instance's HTTP legs, n > 1 and logprobs come back as the router's
    front formats them: n choices (each the instance's tokens), each token's logprob
    and its top alternatives (read from vLLM's token_id:N keys); the leg asked vLLM for
    n, logprobs and token ids."""
    bodies: list[dict] = []
    with uvicorn_server(vllm_like(str(tiny_llama), bodies)) as url:
        rt = RouterThread("colocated", [], [url], kv_secret=None)
        try:
            r = httpx.post(rt.url + "/v1/completions", timeout=30, json={
                "prompt": "hi", "max_tokens": 3, "n": 2, "logprobs": 2, "temperature": 0})
            assert r.status_code == 200, r.text
            choices = r.json()["choices"]
            assert [c["index"] for c in choices] == [0, 1]
            assert choices[0]["text"] == choices[1]["text"] != ""
            lp = choices[0]["logprobs"]
            assert lp["token_logprobs"] == [-0.5, -0.5, -0.5], lp
            assert all(len(top) >= 2 for top in lp["top_logprobs"]), lp
            leg = bodies[-1]
            assert (leg["n"], leg["logprobs"], leg["return_token_ids"]) == (2, 2, True)
            assert leg["return_tokens_as_token_ids"] is True
        finally:
            rt.stop()


def test_requests_beyond_the_bound_get_429(tiny_llama):
    """With --max-outstanding-requests 2 and two streams open, a third request is a 429
    with Retry-After in OpenAI's shape, at once and without reaching the instance;
    counted in /metrics; once the streams are over the router takes requests again."""
    bodies: list[dict] = []
    body = {"prompt": "one two three", "max_tokens": 60, "ignore_eos": True, "stream": True}
    inst = vllm_like(str(tiny_llama), bodies, tokens=(5,) * 60, frame_delay_s=0.05)
    with uvicorn_server(inst) as inst_url:
        rt = RouterThread("colocated", [], [inst_url], max_outstanding_requests=2,
                          kv_secret=None)
        try:
            with httpx.Client(timeout=30) as c1, httpx.Client(timeout=30) as c2, \
                    c1.stream("POST", rt.url + "/v1/completions", json=body) as s1, \
                    c2.stream("POST", rt.url + "/v1/completions", json=body) as s2:
                assert s1.status_code == 200 and s2.status_code == 200
                chunks = [s1.iter_raw(), s2.iter_raw()]  # kept: a dropped one hangs up
                for it in chunks:
                    next(it)
                m = rt.metrics()
                assert metric_value(m, "kvpush_router_outstanding_requests") == 2
                assert metric_value(m, "kvpush_router_max_outstanding_requests") == 2
                t0 = time.monotonic()
                r = httpx.post(rt.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
                assert time.monotonic() - t0 < 2
                assert r.status_code == 429, r.text
                assert r.headers["retry-after"] == "1"
                err = _openai_error(r)
                assert err["type"] == "rate_limit_error" and err["code"] == "too_many_requests"
                assert len(bodies) == 2
            assert metric_value(rt.metrics(), "kvpush_router_requests_total",
                                'outcome="overloaded"') == 1
            wait_until(lambda: metric_value(rt.metrics(),
                                            "kvpush_router_outstanding_requests") == 0,
                       10, "both places given back")
            r = httpx.post(rt.url + "/v1/completions", json={**body, "stream": False},
                           timeout=30)
            assert r.status_code == 200, r.text
        finally:
            rt.stop()


def test_leg_watch_ends_only_its_own_wait():
    """A LegWatch turns its own cancellation into LegLost (ended, or timed out), leaves
    a wait that finishes alone untouched, and lets a cancellation by someone else
    through as a cancellation."""
    import asyncio

    from kvpush.router.watch import LegLost, LegWatch, end_all

    async def main() -> None:
        watches: set[LegWatch] = set()
        never = asyncio.Event()

        async def wait(timeout: float | None = None) -> None:
            with LegWatch(watches, "test", timeout):
                await never.wait()

        task = asyncio.create_task(wait())
        await asyncio.sleep(0)
        assert end_all(watches, "instance marked dead") == 1
        with pytest.raises(LegLost, match="marked dead") as lost:
            await task
        assert not lost.value.timed_out and not watches
        with pytest.raises(LegLost, match="for 0.01 s") as lost:
            await asyncio.wait_for(wait(0.01), 5)
        assert lost.value.timed_out
        with LegWatch(watches, "quick", 5):
            await asyncio.sleep(0)
        assert not watches
        if sys.version_info < (3, 11):  # no Task.uncancel: cannot tell the two apart
            return
        task = asyncio.create_task(wait())
        await asyncio.sleep(0)
        task.cancel()  # the client went away ...
        end_all(watches, "instance marked dead")  # ... as the instance died
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
