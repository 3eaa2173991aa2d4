"""The OpenAI surface agent workloads need (issue 65), on real instances of the tiny
random model: colocated, and through a router over prefill and decode in push and pull
(the router fronts the engine cores). ``/tokenize``, ``/detokenize``, ``/version`` on
the router. Every wait is bounded; every process stopped."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

import kvpush
from router_helpers import Instance, RouterThread, start_instances, wait_until

pytestmark = pytest.mark.timeout(120)

KV = ("--block-size", "16", "--num-blocks", "256")


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory) -> Iterator[dict[str, Instance]]:
    log_dir = tmp_path_factory.mktemp("openai-surface-logs")
    specs = [("single", KV),
             ("P", ("--role", "prefill", "--kv-transfer", "push", *KV)),
             ("D", ("--role", "decode", "--kv-transfer", "push", *KV)),
             ("pullP", ("--role", "prefill", "--kv-transfer", "pull", *KV)),
             ("pullD", ("--role", "decode", "--kv-transfer", "pull", *KV))]
    insts = dict(zip([s[0] for s in specs], start_instances(tiny_llama, specs, log_dir),
                     strict=True))
    yield insts
    for inst in insts.values():
        inst.stop()


@pytest.fixture(scope="module")
def routers(cluster, tiny_llama) -> Iterator[dict[str, str]]:
    """URL of a router over the engine cores, by mode."""
    out: dict[str, RouterThread] = {}
    try:
        for mode, (p, d) in {"push": ("P", "D"), "pull": ("pullP", "pullD")}.items():
            rt = RouterThread(mode, [cluster[p].url], [cluster[d].url],
                              tokenizer=str(tiny_llama))
            out[mode] = rt
            wait_until(lambda rt=rt: httpx.get(rt.url + "/health", timeout=5).json().get(
                "legs") == "engine cores", 30, "the router serves over the engine cores")
        yield {mode: rt.url for mode, rt in out.items()}
    finally:
        for rt in out.values():
            rt.stop()


def test_router_tokenize_detokenize_version_match_an_instance(cluster, routers) -> None:
    single = cluster["single"].url
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
        assert r.json() == c.post(cluster["single"].url + "/tokenize", json=body).json()
        r = c.post(routers["push"] + "/detokenize", json={"tokens": r.json()["tokens"]})
        assert r.status_code == 200 and "hello" in r.json()["prompt"]
        r = c.post(routers["push"] + "/detokenize", json={"tokens": [-1]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens", r.text

