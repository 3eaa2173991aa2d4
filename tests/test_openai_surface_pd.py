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


def test_router_over_vllm_instances_tokenizes_as_an_instance(fake_model) -> None:
    """Over vLLM instances (HTTP legs) the router's /tokenize and /detokenize are its
    front's, with the model's tokenizer (from the decode's /v1/models): the answers a
    kvpush instance of the same model gives."""
    from fake_engine import FakeEngine
    from kvpush.server.app import build_app
    from server_helpers import uvicorn_server
    from stand_in import vllm_like

    config, _ = fake_model
    body = {"messages": [{"role": "user", "content": "hello"}], "return_token_strs": True}
    with uvicorn_server(build_app(FakeEngine(*fake_model, token_delay=0))) as inst, \
            uvicorn_server(vllm_like(str(config.model.path))) as vllm:
        rt = RouterThread("colocated", [], [vllm], kv_secret=None)
        try:
            with httpx.Client(timeout=30) as c:
                assert c.get(rt.url + "/health").json()["legs"] == "http"
                r = c.post(rt.url + "/tokenize", json=body)
                assert r.status_code == 200, r.text
                assert r.json() == c.post(inst + "/tokenize", json=body).json()
                ids = {"tokens": r.json()["tokens"]}
                r = c.post(rt.url + "/detokenize", json=ids)
                assert r.status_code == 200, r.text
                assert r.json() == c.post(inst + "/detokenize", json=ids).json()
                r = c.post(rt.url + "/detokenize", json={"tokens": [-1]})
                assert r.status_code == 400 and r.json()["error"]["param"] == "tokens", r.text
        finally:
            rt.stop()


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


def _transfers_ok(url: str) -> float:
    from router_helpers import metric_value

    return metric_value(httpx.get(url + "/metrics", timeout=10).text,
                        "kvpush_kv_transfers_ok_total")


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_n_choices_through_push_and_pull_move_the_kv_once(cluster, routers, mode) -> None:
    """Issue 65, point 3 in P/D: prefill runs one choice, its KV moves once, and decode
    forks the others from it; greedy choices equal the single instance's answer, seeded
    ones are reproducible, a stream names each choice's index."""
    url = routers[mode]
    d = cluster.push_d[0] if mode == "push" else cluster.pull_d
    body = {"prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    with httpx.Client(timeout=60) as c:
        want = c.post(cluster.single.url + "/v1/completions", json=body).json()
        before = _transfers_ok(d.url)
        r = c.post(url + "/v1/completions", json={**body, "n": 3})
        assert r.status_code == 200, r.text
        got = r.json()
        assert [ch["text"] for ch in got["choices"]] == [want["choices"][0]["text"]] * 3
        assert [ch["index"] for ch in got["choices"]] == [0, 1, 2]
        assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
        assert got["usage"]["completion_tokens"] == 24
        wait_until(lambda: _transfers_ok(d.url) >= before + 1, 10, "the transfer counted")
        assert _transfers_ok(d.url) == before + 1  # one transfer for three choices

        seeded = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "seed": 11,
                  "max_tokens": 6, "temperature": 1.0, "ignore_eos": True}
        a = c.post(url + "/v1/chat/completions", json=seeded).json()["choices"]
        b = c.post(url + "/v1/chat/completions", json=seeded).json()["choices"]
        assert [x["message"]["content"] for x in a] == [x["message"]["content"] for x in b]
        texts: dict[int, str] = {}
        with c.stream("POST", url + "/v1/chat/completions",
                      json={**seeded, "stream": True}) as s:
            assert s.status_code == 200, s.read()
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    for ch in json.loads(line[6:])["choices"]:
                        texts[ch["index"]] = (texts.get(ch["index"], "")
                                              + (ch["delta"].get("content") or ""))
        assert texts == {x["index"]: x["message"]["content"] for x in a}
    cluster.wait_all_free()


HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}\n</tools>\nAnswer calls in <tool_call></tool_call> tags.<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>"
    "\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tool_router(router_cluster: RouterCluster, tiny_llama, tmp_path_factory) -> Iterator[str]:
    """A push router whose tokenizer's chat template renders tools (Hermes style)."""
    import shutil

    folder = tmp_path_factory.mktemp("hermes-tokenizer")
    for f in tiny_llama.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, folder / f.name)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {**cfg, "chat_template": HERMES_TEMPLATE}))
    c = router_cluster
    rt = RouterThread("push", [c.push_p[0].url], [c.push_d[0].url], tokenizer=str(folder))
    try:
        wait_until(lambda: httpx.get(rt.url + "/health", timeout=5).json().get(
            "legs") == "engine cores", 30, "the router serves over the engine cores")
        yield rt.url
    finally:
        rt.stop()


def test_tool_calls_through_push_parse_token_one_from_prefill(cluster, tool_router) -> None:
    """A named tool_choice through push: token #1 is sampled on prefill under the call's
    grammar, decode resumes it; every call parses and validates, n = 2 forks on decode."""
    import openai

    params = {"type": "object", "additionalProperties": False, "required": ["city"],
              "properties": {"city": {"type": "string", "maxLength": 6}}}
    tools = [{"type": "function", "function": {"name": "weather", "parameters": params}}]
    with openai.OpenAI(base_url=tool_router + "/v1", api_key="x", max_retries=0,
                       timeout=60) as client:
        r = client.chat.completions.create(
            model=cluster.single.get("/v1/models")["data"][0]["id"],
            messages=[{"role": "user", "content": "weather?"}], tools=tools, n=2, seed=3,
            tool_choice={"type": "function", "function": {"name": "weather"}},
            max_tokens=60)
    assert [ch.index for ch in r.choices] == [0, 1]
    for ch in r.choices:
        [call] = ch.message.tool_calls
        assert call.function.name == "weather"
        jsonschema.validate(json.loads(call.function.arguments), params)
    cluster.wait_all_free()
