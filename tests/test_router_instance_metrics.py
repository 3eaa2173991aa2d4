"""Metrics behind the router (issue 66): requests the router sends over the engine
cores' request planes, never through the instances' HTTP APIs, still move every
instance's ``vllm:`` request families (the engine core's figures reach its API process),
and the router exports the client-side TTFT, inter-token latency and e2e. The rule that
makes the figures (kvpush.engine.request_stats) is checked on its own too."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvpush.engine.outputs import EngineOutput, EngineStats, FinishReason
from kvpush.engine.request_stats import RequestStatsTracker
from kvpush.server.metrics import ServerMetrics
from router_helpers import (
    CHATS,
    MAX_TOKENS,
    PROMPTS,
    Instance,
    RouterThread,
    body,
    chat_body,
    metric_value,
    sse_text,
    start_instances,
    wait_until,
)

KV = ("--block-size", "16", "--num-blocks", "256")
VLLM_HISTOGRAMS = ("time_to_first_token", "e2e_request_latency", "request_queue_time",
                   "request_prefill_time", "request_decode_time", "request_inference_time")


def _out(rid: str, n: int, *, finish: FinishReason | None = None,
         prompt: int = 4) -> EngineOutput:
    return EngineOutput(rid, list(range(n)), finish_reason=finish, num_prompt_tokens=prompt,
                        arrival_time=10.0, scheduled_time=10.5, first_token_time=11.0)


def test_the_core_clock_counts_every_request_once():
    t = RequestStatsTracker()
    assert t.observe([EngineOutput("refused", [], finish_reason=FinishReason.ERROR)],
                     11.0) is None
    s = t.observe([_out("a", 1), _out("b", 2)], 12.0)
    assert s is not None and s.num_prompt_tokens == 8 and s.num_generation_tokens == 3
    assert s.ttft_s == [2.0, 2.0] and s.itl_s == [0.0]  # b's second came with its first
    s = t.observe([_out("a", 2, finish=FinishReason.LENGTH),
                   _out("b", 0, finish=FinishReason.ABORT)], 14.0)
    assert s is not None and s.num_prompt_tokens == 0 and s.itl_s == [1.0, 1.0]
    (fin,) = s.finished  # the aborted one: no phases
    assert (fin.e2e_s, fin.decode_s, fin.num_generation_tokens) == (4.0, 2.0, 3)
    assert (fin.queue_s, fin.prefill_s) == (0.5, 0.5)
    assert len(t) == 0  # nothing kept once a request ended

    idle = EngineStats(0, 0, 8, 8, 0, 0, 0)
    m = ServerMetrics(lambda: idle, lambda: True, "m")  # an instance: the core feeds vllm:
    m.observe_engine(s)
    text = m.render().decode()
    assert metric_value(text, "vllm:request_inference_time_seconds_sum") == 2.5
    assert metric_value(text, "vllm:inter_token_latency_seconds_count") == 2
    assert metric_value(text, "kvpush_e2e_request_latency_seconds_count") == 0


@pytest.fixture(scope="module")
def pd(tiny_llama, tmp_path_factory) -> Iterator[dict[str, Instance]]:
    push = ("--kv-transfer", "push", *KV)
    specs = [("P", ("--role", "prefill", *push)), ("D", ("--role", "decode", *push))]
    insts = dict(zip(["P", "D"], start_instances(
        tiny_llama, specs, tmp_path_factory.mktemp("instance-metrics-logs")), strict=True))
    yield insts
    for inst in insts.values():
        inst.stop()


@pytest.fixture(scope="module")
def router(pd, tiny_llama) -> Iterator[RouterThread]:
    """A push router over the pair's engine cores."""
    rt = RouterThread("push", [pd["P"].url], [pd["D"].url], tokenizer=str(tiny_llama))
    try:
        wait_until(lambda: httpx.get(rt.url + "/health", timeout=5).json().get("legs")
                   == "engine cores", 20, "the router serves over the engine cores")
        yield rt
    finally:
        rt.stop()


class Scrape:
    """Counters read now, minus those read at the start (the module's other test may
    have sent requests before)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.before = self._get()

    def _get(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text

    def take(self) -> Scrape:
        self.after = self._get()
        return self

    def __call__(self, name: str, labels: str = "") -> float:
        return metric_value(self.after, name, labels) - metric_value(self.before, name, labels)


def test_instances_export_vllm_series_for_requests_from_the_router(pd, router):
    p, d, rt = pd["P"], pd["D"], router
    dm, pm, rm = Scrape(d.url), Scrape(p.url), Scrape(rt.url)

    def one(i: int) -> tuple[int, int]:
        with httpx.Client(timeout=60) as c:
            prompt = PROMPTS[i % len(PROMPTS)]
            if i % 2:
                _, reason, _ = sse_text(c, rt.url, body(prompt, ignore_eos=True))
                assert reason == "length"
                r = c.post(rt.url + "/v1/completions", json=body(prompt, max_tokens=1))
                u = r.json()["usage"]
                return 2 * u["prompt_tokens"], MAX_TOKENS + u["completion_tokens"]
            u = c.post(rt.url + "/v1/completions", json=body(prompt)).json()["usage"]
            return u["prompt_tokens"], u["completion_tokens"]

    with ThreadPoolExecutor(4) as ex:
        usage = [f.result(timeout=90) for f in [ex.submit(one, i) for i in range(6)]]
    n = 9  # 3 plain, 3 streamed + 3 more plain
    prompt_tokens, gen_tokens = sum(u[0] for u in usage), sum(u[1] for u in usage)
    p.wait_all_free()
    d.wait_all_free()
    dm.take(), pm.take()
    # none came through an instance's HTTP API ...
    assert dm("kvpush_requests_total") == 0 and pm("kvpush_requests_total") == 0
    # ... yet decode counts every request, its tokens and phases (engine core clock)
    assert dm("vllm:prompt_tokens_total") == prompt_tokens
    assert dm("vllm:generation_tokens_total") == gen_tokens
    assert {h: dm(f"vllm:{h}_seconds_count") for h in VLLM_HISTOGRAMS} == dict.fromkeys(
        VLLM_HISTOGRAMS, n)
    assert dm("vllm:inter_token_latency_seconds_count") == gen_tokens - n
    assert dm("vllm:time_to_first_token_seconds_sum") > 0
    # prefill ran every request's prompt and produced its token #1
    assert pm("vllm:prompt_tokens_total") == prompt_tokens
    assert pm("vllm:time_to_first_token_seconds_count") == n
    for m in (dm.after, pm.after):  # the engine gauges, idle now
        assert "vllm:num_requests_running{" in m and "vllm:num_requests_waiting{" in m
        assert metric_value(m, "vllm:num_requests_running") == 0
    # the router: client-side TTFT, inter-token latency and e2e of the same requests
    wait_until(lambda: rm.take()("vllm:e2e_request_latency_seconds_count") == n, 10,
               "every request counted at the router")
    assert rm("vllm:time_to_first_token_seconds_count") == n
    assert rm("vllm:inter_token_latency_seconds_count") == gen_tokens - n
    assert rm("vllm:generation_tokens_total") == gen_tokens
    # the router's TTFT holds decode's (the client waits for decode's token #1)
    assert rm("vllm:time_to_first_token_seconds_sum") >= dm(
        "vllm:time_to_first_token_seconds_sum")


def test_ids_and_model_names_through_the_router_as_vllm_gives_them(router, tiny_llama):
    """Answers' ids are vLLM's (chatcmpl-, cmpl-) and the model's folder path names it,
    as `vllm bench serve --model /path` sends it (issue 66, point 6)."""
    with httpx.Client(base_url=router.url, timeout=60) as c:
        r = c.post("/v1/chat/completions",
                   json={**chat_body(CHATS[0]), "model": str(tiny_llama)})
        assert r.status_code == 200, r.text
        assert r.json()["id"].startswith("chatcmpl-") and r.json()["model"] == tiny_llama.name
        r = c.post("/v1/completions", json=body(PROMPTS[0], model=f"{tiny_llama}/"))
        assert r.status_code == 200 and r.json()["id"].startswith("cmpl-"), r.text
        r = c.post("/v1/completions", json=body(PROMPTS[0], model="/models/other"))
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
