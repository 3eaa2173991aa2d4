"""The OpenAI surface agent workloads need (issue 65), on real instances of the tiny
random model: colocated, and through a router over prefill and decode in push and pull
(the router fronts the engine cores). ``/tokenize``, ``/detokenize``, ``/version`` on
the router; structured outputs whose every answer parses and validates against its
schema, token #1 included (in push it is sampled on prefill under the grammar and
decode resumes the grammar after it). Every wait is bounded; every process stopped."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import pytest

import kvpush
from router_helpers import RouterCluster, RouterThread, wait_until

pytestmark = pytest.mark.timeout(120)

@pytest.fixture
def cluster(router_cluster: RouterCluster) -> Iterator[RouterCluster]:
    """The router tests' shared instances (test_router.py's); each test leaves every
    free-block count as it found it."""
    yield router_cluster
    router_cluster.wait_all_free()


@pytest.fixture(scope="module")
def routers(router_cluster: RouterCluster, tiny_llama) -> Iterator[dict[str, str]]:
    """URL of a router over the engine cores, by mode."""
    out: dict[str, RouterThread] = {}
    try:
        c = router_cluster
        for mode, (p, d) in {"push": (c.push_p[0], c.push_d[0]),
                             "pull": (c.pull_p, c.pull_d)}.items():
            rt = RouterThread(mode, [p.url], [d.url],
                              tokenizer=str(tiny_llama))
            out[mode] = rt
            wait_until(lambda rt=rt: httpx.get(rt.url + "/health", timeout=5).json().get(
                "legs") == "engine cores", 30, "the router serves over the engine cores")
        yield {mode: rt.url for mode, rt in out.items()}
    finally:
        for rt in out.values():
            rt.stop()


def test_router_tokenize_detokenize_version_match_an_instance(cluster, routers) -> None:
    single = cluster.single.url
    with httpx.Client(timeout=30) as c:
        for body in ({"prompt": "hello world", "return_token_strs": True},
                     {"messages": [{"role": "user", "content": "hello"}]}):
            mine = c.post(routers["push"] + "/tokenize", json=body)
            assert mine.status_code == 200, mine.text
            assert mine.json() == c.post(single + "/tokenize", json=body).json()
            assert mine.json()["count"] == len(mine.json()["tokens"]) > 0
        ids = c.post(single + "/tokenize", json={"prompt": "hello world"}).json()["tokens"]
        r = c.post(routers["push"] + "/detokenize", json={"tokens": ids})
        assert r.status_code == 200, r.text
        assert r.json() == c.post(single + "/detokenize", json={"tokens": ids}).json()
        assert "hello world" in r.json()["prompt"]
        r = c.post(routers["push"] + "/detokenize", json={"tokens": [10**7]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
        for url in (routers["push"], single):
            assert c.get(url + "/version").json() == {"version": kvpush.__version__}


def test_router_on_http_legs_relays_tokenize_to_a_decode(cluster, routers,
                                                         monkeypatch) -> None:
    """Without the engine-core front (KVPUSH_ROUTER_PATH=http, or vLLM instances) the
    router relays /tokenize and /detokenize to a healthy decode instance."""
    from kvpush.router.core_front import ROUTER_PATH_ENV

    monkeypatch.setenv(ROUTER_PATH_ENV, "http")
    body = {"messages": [{"role": "user", "content": "hello"}], "return_token_strs": True}
    with httpx.Client(timeout=30) as c:
        assert c.get(routers["push"] + "/health").json()["legs"] == "http"
        r = c.post(routers["push"] + "/tokenize", json=body)
        assert r.status_code == 200, r.text
        assert r.json() == c.post(cluster.single.url + "/tokenize", json=body).json()
        r = c.post(routers["push"] + "/detokenize", json={"tokens": r.json()["tokens"]})
        assert r.status_code == 200 and "hello" in r.json()["prompt"]
        r = c.post(routers["push"] + "/detokenize", json={"tokens": [-1]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens", r.text


#: every value bounded, so max_tokens covers any answer the grammar allows
SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "ok", "n", "colour"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 999},
                         "colour": {"enum": ["red", "green", "blue"]}}}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}


def _stream_text(c: httpx.Client, url: str, body: dict) -> str:
    parts = []
    with c.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    parts.append(choice["delta"].get("content") or "")
    return "".join(parts)


@pytest.mark.parametrize("where", ["single", "push", "pull"])
def test_structured_outputs_validate_colocated_and_through_push_and_pull(
        cluster, routers, where) -> None:
    """In push, token #1 is sampled on prefill under the grammar and decode resumes the
    grammar after it: a token #1 sampled unconstrained, or a decode that restarted the
    grammar (a second "{"), would not parse."""
    url = cluster.single.url if where == "single" else routers[where]
    msgs = [{"role": "user", "content": "a thing, as JSON"}]
    answers = []
    with httpx.Client(timeout=60) as c:
        for seed in range(3):
            r = c.post(url + "/v1/chat/completions", json={
                "messages": msgs, "max_tokens": 100, "temperature": 1.0, "seed": seed,
                "response_format": RESPONSE_FORMAT})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["finish_reason"] == "stop"
            answers.append(json.loads(r.json()["choices"][0]["message"]["content"]))
        r = c.post(url + "/v1/completions", json={
            "prompt": "thing:", "max_tokens": 100, "temperature": 0, "guided_json": SCHEMA})
        assert r.status_code == 200, r.text
        answers.append(json.loads(r.json()["choices"][0]["text"]))
        answers.append(json.loads(_stream_text(c, url, {
            "messages": msgs, "max_tokens": 100, "seed": 7, "response_format": RESPONSE_FORMAT})))
        for answer in answers:
            jsonschema.validate(answer, SCHEMA)
        r = c.post(url + "/v1/chat/completions", json={
            "messages": msgs, "max_tokens": 20, "seed": 1,
            "structured_outputs": {"choice": ["left", "right", "up or down"]}})
        assert r.json()["choices"][0]["message"]["content"] in ("left", "right", "up or down")
        r = c.post(url + "/v1/chat/completions", json={
            "messages": msgs, "max_tokens": 20, "guided_json": {"type": "nope"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "guided_json", r.text
    cluster.wait_all_free()  # the instances it used, and the others
