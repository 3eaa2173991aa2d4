"""Limits that keep one request from holding up the others (issue 30, finding 5):
a body's size and message count decide off-loop parsing and tokenizing, and both are
capped; stop_token_ids, stop strings and logit_bias are capped, stop_token_ids kept as a
frozenset.

The server runs on the fake engine (tests/fake_engine.py) in a real uvicorn on
127.0.0.1. Every wait is bounded and everything started here is stopped here.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest

from fake_engine import FakeEngine, make_test_model
from kvpush.sampling_params import (
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_STR_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
    SamplingParamsError,
)
from kvpush.server.app import build_app
from kvpush.server.protocol import MAX_CHAT_MESSAGES
from server_helpers import uvicorn_server

pytestmark = pytest.mark.timeout(120)

C = "/v1/completions"
CHAT = "/v1/chat/completions"
#: /health must answer within this while a huge request is being handled (it took 7.6 s
#: behind 200,000 chat messages before the fix; a healthy answer takes milliseconds)
HEALTH_BOUND_S = 1.0


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    return make_test_model(tmp_path_factory.mktemp("model") / "tiny", max_model_len=128)


def assert_error(r: httpx.Response, status: int, param: str | None = None,
                 code: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error body with this status (and param / code)."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param",
                                                             "code"}
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


class HealthProbe:
    """Polls /health from its own thread and keeps the slowest answer's time."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.slowest = 0.0
        self.answers = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                try:
                    status = client.get(self.url + "/health").status_code
                except httpx.HTTPError as e:
                    self.failures.append(repr(e))
                    return
                self.slowest = max(self.slowest, time.perf_counter() - t0)
                self.answers += 1
                if status != 200:
                    self.failures.append(f"HTTP {status}")
                self._stop.wait(0.01)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        assert not self._thread.is_alive()


# ---- finding 5: the event loop ------------------------------------------------------

def test_many_messages_do_not_block_health(model: tuple[Any, Any]) -> None:
    """200,000 empty chat messages (6.6 MB) are refused with a 400 naming the cap, and
    /health keeps answering meanwhile; a chat within the cap with many small messages is
    rendered and tokenized on a worker thread, not on the event loop."""
    engine = FakeEngine(*model)
    rendered_on: list[str] = []
    real_apply = engine.tokenizer.apply_chat_template

    def spy(*args: Any, **kw: Any) -> Any:
        rendered_on.append(threading.current_thread().name)
        return real_apply(*args, **kw)

    engine.tokenizer.apply_chat_template = spy
    try:
        with uvicorn_server(build_app(engine)) as url, HealthProbe(url) as probe:
            huge = json.dumps({"messages": [{"role": "user", "content": ""}] * 200_000})
            assert len(huge) > 6_000_000
            r = httpx.post(url + CHAT, content=huge, timeout=60,
                           headers={"Content-Type": "application/json"})
            err = assert_error(r, 400, "messages")
            assert str(MAX_CHAT_MESSAGES) in err["message"] and "200000" in err["message"]
            assert not rendered_on  # refused before any rendering
            # within the cap: many short messages, a small body of its own
            few = {"messages": [{"role": "user", "content": "hi"}] * 40, "max_tokens": 1}
            assert len(json.dumps(few)) < 4096
            r = httpx.post(url + CHAT, json=few, timeout=60)
            assert_error(r, 400, code="context_length_exceeded")  # 128-token model
            assert rendered_on and rendered_on[-1].startswith("kvpush-tokenize"), rendered_on
            ok = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
            assert httpx.post(url + CHAT, json=ok, timeout=60).status_code == 200
        assert not probe.failures, probe.failures
        assert probe.answers > 0
        assert probe.slowest < HEALTH_BOUND_S, f"/health took {probe.slowest:.2f} s"
    finally:
        engine.tokenizer.apply_chat_template = real_apply
    assert engine.free_blocks == engine.num_blocks


def test_stop_token_ids_capped_and_kept_as_a_frozenset(model: tuple[Any, Any]) -> None:
    """stop_token_ids beyond the cap are a 400 (so are too many or too long stop strings
    and too many logit_bias entries); within it the engine gets a frozenset, whose
    per-token check costs the same however many ids there are."""
    engine = FakeEngine(*model)
    vocab = engine.config.model.vocab_size
    with uvicorn_server(build_app(engine)) as url, httpx.Client(timeout=60) as client:
        def post(**fields: Any) -> httpx.Response:
            return client.post(url + C, json={"prompt": "hello world", "max_tokens": 2,
                                              **fields})

        # 3 million ids: refused at once, before the list is looked at id by id
        many = json.dumps({"prompt": "hi", "stop_token_ids": [1] * 3_000_000})
        t0 = time.perf_counter()
        r = client.post(url + C, content=many, headers={"Content-Type": "application/json"})
        err = assert_error(r, 400, "stop_token_ids")
        assert str(MAX_STOP_TOKEN_IDS) in err["message"]
        assert time.perf_counter() - t0 < 30  # generous: the bound is "not minutes"
        assert_error(post(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1)), 400,
                     "stop_token_ids")
        ids = [i % vocab for i in range(MAX_STOP_TOKEN_IDS)]
        r = post(stop_token_ids=ids)
        assert r.status_code == 200, r.text
        got = engine.requests[-1][2].stop_token_ids
        assert isinstance(got, frozenset) and got == set(ids)
        # stop strings: at most MAX_STOP_STRINGS, each at most MAX_STOP_STR_CHARS
        assert_error(post(stop=["x"] * (MAX_STOP_STRINGS + 1)), 400, "stop")
        assert_error(post(stop=["x" * (MAX_STOP_STR_CHARS + 1)]), 400, "stop")
        r = post(stop=["x" * MAX_STOP_STR_CHARS] * MAX_STOP_STRINGS)
        assert r.status_code == 200, r.text
        bias = {str(i): 1.0 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}
        assert_error(post(logit_bias=bias), 400, "logit_bias")
    assert engine.free_blocks == engine.num_blocks
    # the engine-level check, for callers that build SamplingParams themselves
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(stop_token_ids=range(MAX_STOP_TOKEN_IDS + 1))
    assert e.value.param == "stop_token_ids"
    assert SamplingParams(stop_token_ids=(5, 5, 7)).stop_token_ids == frozenset({5, 7})
    with pytest.raises(SamplingParamsError):
        SamplingParams(stop_token_ids=(-1,))
