"""The router as the front of engine cores (issue 51): with the cluster secret and the
model's tokenizer it sends each leg as the engine's typed request to the prefill and
decode cores over their request planes, never through the instances' HTTP APIs. Outputs
equal a single instance's, token for token; faults free every block. Every wait is
bounded."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from router_helpers import (
    CHATS,
    CLUSTER_FAULTY,
    CLUSTER_KV,
    PROMPTS,
    Instance,
    RouterCluster,
    RouterThread,
    answer_text,
    body,
    chat_body,
    metric_value,
    over_cores,
    reference_answers,
    sse_text,
    start_instances,
    wait_until,
)


@pytest.fixture
def cluster(router_cluster: RouterCluster) -> Iterator[RouterCluster]:
    """The router tests' shared instances (its push pair: the first of each role);
    each test leaves every free-block count as it found it."""
    yield router_cluster
    router_cluster.wait_all_free()


@pytest.fixture(scope="module")
def refs(router_cluster: RouterCluster) -> dict:
    return reference_answers(router_cluster.single.url)


_body, _chat = body, chat_body


def _router(mode: str, p: Instance, d: Instance, tokenizer: str, **kw) -> RouterThread:
    """A router with the tokenizer given, once it serves over the cores."""
    return over_cores(RouterThread(mode, [p.url], [d.url], tokenizer=tokenizer, **kw))


def _api_requests(inst: Instance) -> float:
    """Requests the instance's own HTTP API has finished (any outcome)."""
    text = httpx.get(inst.url + "/metrics", timeout=10).text
    return sum(metric_value(text, "kvpush_requests_total", f'outcome="{o}"')
               for o in ("stop", "length", "abort", "error", "rejected"))


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_outputs_over_the_cores_equal_single_instance(cluster, refs, tiny_llama, mode):
    p, d = ((cluster.push_p[0], cluster.push_d[0]) if mode == "push"
            else (cluster.pull_p, cluster.pull_d))
    rt = _router(mode, p, d, str(tiny_llama))
    try:
        before = _api_requests(p) + _api_requests(d)

        def one(kind: str, i: int, stream: bool) -> tuple[tuple[str, int], str]:
            with httpx.Client(timeout=60) as c:
                chat = kind == "chat"
                body = _chat(CHATS[i]) if chat else _body(PROMPTS[i])
                if stream:
                    text, reason, frames = sse_text(c, rt.url, body, chat=chat)
                    assert reason == "length" and not any("error" in f for f in frames)
                    return (kind, i), text
                path = "/v1/chat/completions" if chat else "/v1/completions"
                r = c.post(rt.url + path, json=body)
                assert r.status_code == 200, r.text
                assert r.json()["id"] == r.headers["x-request-id"]
                return (kind, i), answer_text(r.json(), chat=chat)

        jobs = [("completion", i) for i in range(len(PROMPTS))] + [
            ("chat", i) for i in range(len(CHATS))]
        with ThreadPoolExecutor(4) as ex:
            futs = [ex.submit(one, k, i, s) for k, i in jobs for s in (False, True)]
            results = [f.result(timeout=90) for f in futs]
        for key, text in results:
            assert text == refs[key], key
        # no leg went through an instance's HTTP API
        assert _api_requests(p) + _api_requests(d) == before
        # (a stream's request is counted once its generator closes, after [DONE])
        wait_until(lambda: metric_value(rt.metrics(), "kvpush_router_requests_total",
                                        f'mode="{mode}",outcome="ok"') == len(results),
                   10, "every request counted ok")
        m = rt.metrics()
        assert metric_value(m, "vllm:e2e_request_latency_seconds_count") == len(results)
        # the front's checks answer as an instance's do, and nothing is left held
        r = httpx.post(rt.url + "/v1/completions", json=_body("x", max_tokens=0), timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = httpx.post(rt.url + "/v1/completions", timeout=30,
                       json=_body("x", kv_transfer_params={"do_remote_decode": True}))
        assert r.status_code == 403, r.text
        r = httpx.post(rt.url + "/v1/completions", timeout=30,
                       json=_body("word " * 5000))
        assert r.status_code == 400 and r.json()["error"]["code"] == \
            "context_length_exceeded"
        assert metric_value(rt.metrics(), "kvpush_router_instance_in_flight") == 0
        p.wait_all_free()
        d.wait_all_free()
    finally:
        rt.stop()


def test_router_gone_mid_stream_frees_every_block(cluster, tiny_llama):
    p, d = cluster.push_p[0], cluster.push_d[0]
    rt = _router("push", p, d, str(tiny_llama))
    stopped = False
    try:
        long = _body(PROMPTS[2], max_tokens=1900, ignore_eos=True, stream=True)
        with httpx.Client(timeout=30) as c, c.stream("POST", rt.url + "/v1/completions",
                                                     json=long) as r:
            assert r.status_code == 200
            next(r.iter_raw())  # generating; now the router goes away
            rt.stop()
            stopped = True
        p.wait_all_free(timeout=15)
        d.wait_all_free(timeout=15)
    finally:
        if not stopped:
            rt.stop()


def test_decode_core_killed_mid_stream_ends_the_stream_with_an_error(tiny_llama, tmp_path):
    push = ("--kv-transfer", "push", *CLUSTER_KV, *CLUSTER_FAULTY)
    p, d = start_instances(tiny_llama, [("P2", ("--role", "prefill", *push)),
                                        ("D2", ("--role", "decode", *push))], tmp_path)
    rt = None
    try:
        rt = _router("push", p, d, str(tiny_llama))
        long = _body(PROMPTS[0], max_tokens=1900, ignore_eos=True, stream=True)
        with httpx.Client(timeout=30) as c, c.stream("POST", rt.url + "/v1/completions",
                                                     json=long) as r:
            assert r.status_code == 200
            it = r.iter_lines()
            next(it)
            killed = time.monotonic()
            os.killpg(d.proc.proc.pid, signal.SIGKILL)
            rest = [line for line in it if line]
            took = time.monotonic() - killed
        assert any('"error"' in line for line in rest), rest[-3:]
        assert rest[-1] == "data: [DONE]"
        print(f"error frame {took * 1000:.0f} ms after the decode core was killed")
        assert took < 5.0
        p.wait_all_free(timeout=15)  # the transfer's fence frees prefill's blocks
    finally:
        if rt is not None:
            rt.stop()
        p.stop()
        d.kill()


#: a template unlike the model's own: roles in brackets, one line per message
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "[assistant]")


def test_chats_over_the_cores_use_the_instances_chat_template(tiny_llama, tmp_path):
    """An instance's --chat-template is in its /kv/info, and a router in front of its
    engine core renders chats with it: the same prompt and answer as the instance's own
    API gives, where the model's template gives another prompt."""
    [inst] = start_instances(tiny_llama, [("tmpl", (*CLUSTER_KV, "--chat-template", TEMPLATE))],
                             tmp_path)
    rt = None
    try:
        assert httpx.get(inst.url + "/kv/info", timeout=10).json()["chat_template"] == TEMPLATE
        rt = RouterThread("colocated", [], [inst.url], tokenizer=str(tiny_llama))
        wait_until(lambda: httpx.get(rt.url + "/health", timeout=5).json().get("legs")
                   == "engine cores", 20, "the router serves over the engine cores")
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tiny_llama))
        with httpx.Client(timeout=60) as c:
            for messages in CHATS:
                ids = tok.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=True,
                                              return_dict=True)["input_ids"]
                model_ids = tok.apply_chat_template(messages, add_generation_prompt=True,
                                                    tokenize=True, return_dict=True)["input_ids"]
                assert len(ids) != len(model_ids)  # (the two templates differ here)
                own = c.post(inst.url + "/v1/chat/completions", json=_chat(messages)).json()
                via = c.post(rt.url + "/v1/chat/completions", json=_chat(messages)).json()
                assert via["usage"]["prompt_tokens"] == own["usage"]["prompt_tokens"] == len(ids)
                assert answer_text(via, chat=True) == answer_text(own, chat=True)
        inst.wait_all_free()
    finally:
        if rt is not None:
            rt.stop()
        inst.stop()


def test_a_cluster_without_a_secret_is_served_over_plain_request_planes(tiny_llama,
                                                                         tmp_path, refs):
    """--insecure-kv-params instances (a trusted network, no cluster secret) still have a
    request plane (plain TCP), and a router without a secret reaches them over it."""
    push = ("--kv-transfer", "push", "--insecure-kv-params", *CLUSTER_KV)
    p, d = start_instances(tiny_llama, [("P3", ("--role", "prefill", *push)),
                                        ("D3", ("--role", "decode", *push))], tmp_path)
    rt = None
    try:
        assert d.get("/kv/info")["request_plane"]
        rt = _router("push", p, d, str(tiny_llama), kv_secret=None)
        with httpx.Client(timeout=60) as c:
            r = c.post(rt.url + "/v1/completions", json=_body(PROMPTS[0]))
            assert r.status_code == 200 and answer_text(r.json()) == refs[("completion", 0)]
        assert _api_requests(d) == 0  # the leg went over the plane, not the HTTP API
        p.wait_all_free(timeout=15)
        d.wait_all_free(timeout=15)
    finally:
        if rt is not None:
            rt.stop()
        p.stop()
        d.stop()
