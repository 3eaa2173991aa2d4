"""n > 1 (issue 65, point 3): the prompt is computed once and choices 1..n-1 fork from
its blocks (shared by reference, at most the last block recomputed per choice); greedy
choices are equal, seeded ones reproducible and distinct; usage counts the prompt once;
every block comes back, aborts and preemptions included. The API (body, SSE with
``index``, the official ``openai`` client) on a real engine. P/D:
tests/test_openai_surface_pd.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from engine_helpers import assert_all_blocks_free, greedy, make_engine
from kvpush.engine.outputs import EngineOutput, FinishReason
from kvpush.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return make_engine(tiny_llama, block_size=16, num_blocks=128, max_model_len=256)


def run(engine, rid: str, prompt: list[int], params: SamplingParams,
        max_steps: int = 2000) -> tuple[dict[int, list[int]], list[EngineOutput]]:
    """Tokens by choice, and every output, of one request run to its end."""
    engine.add_request(rid, prompt, params)
    by_choice: dict[int, list[int]] = {}
    outs: list[EngineOutput] = []
    for _ in range(max_steps):
        if not engine.has_work():
            break
        for o in engine.step():
            assert o.request_id == rid
            by_choice.setdefault(o.index, []).extend(o.new_token_ids)
            outs.append(o)
    assert not engine.has_work()
    return by_choice, outs


def test_greedy_choices_are_equal_and_the_prompt_is_computed_once(tiny_llama,
                                                                  monkeypatch) -> None:
    """Without the prefix cache too: the choices share the prompt's blocks by fork."""
    engine = make_engine(tiny_llama, block_size=16, num_blocks=64, max_model_len=256,
                         enable_prefix_caching=False)
    prompt = list(range(5, 5 + 40))  # 2 full blocks of 16 and 8 tokens
    computed: list[int] = []
    execute = engine.runner.execute

    def counting(plan, hook=None):
        computed.append(plan.num_tokens)
        return execute(plan, hook)

    monkeypatch.setattr(engine.runner, "execute", counting)
    one, _ = run(engine, "single", prompt, greedy(12))
    alone = sum(computed)
    computed.clear()
    by_choice, outs = run(engine, "three", prompt, greedy(12, n=3))
    assert set(by_choice) == {0, 1, 2}
    assert by_choice[0] == by_choice[1] == by_choice[2] == one[0]
    # choices 1 and 2 recompute only the prompt's last partial block (8 tokens each)
    # beside their 11 decode steps: the two full blocks are shared
    assert sum(computed) == alone + 2 * (8 + 11)
    finals = [o for o in outs if o.finished]
    assert sorted(o.index for o in finals) == [0, 1, 2]
    assert [o.more_choices for o in finals] == [True, True, False]
    assert all(o.finish_reason is FinishReason.LENGTH for o in finals)
    assert_all_blocks_free(engine)


def test_block_aligned_prompt_forks_from_all_but_its_last_block(engine) -> None:
    prompt = list(range(100, 132))  # exactly 2 blocks: the last token's block is redone
    by_choice, _ = run(engine, "aligned", prompt, greedy(5, n=2))
    alone, _ = run(engine, "aligned-1", prompt, greedy(5))
    assert by_choice[0] == by_choice[1] == alone[0]
    assert_all_blocks_free(engine)


def test_seeded_choices_are_reproducible_and_differ(engine) -> None:
    prompt = [7, 8, 9, 10, 11]
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, n=3, ignore_eos=True)
    a, _ = run(engine, "seeded-a", prompt, params)
    b, _ = run(engine, "seeded-b", prompt, params)
    assert a == b
    assert len({tuple(t) for t in a.values()}) == 3
    # choice i runs as a one-choice request seeded with seed + i
    for i in range(3):
        alone, _ = run(engine, f"seeded-{i}", prompt, params.choice(i))
        assert alone[0] == a[i]
    assert_all_blocks_free(engine)


def test_abort_ends_every_choice_and_frees_the_shared_blocks(engine) -> None:
    from kvpush.engine.inputs import AbortRequests, choice_id

    engine.add_request("ab", list(range(3, 40)), greedy(50, n=4))
    for _ in range(3):
        engine.step()
    # one choice alone first (a stop string at the front), then the whole request
    engine.inbox.put(AbortRequests([choice_id("ab", 2)]))
    outs = engine.process_inbox()
    assert [(o.index, o.finish_reason, o.more_choices) for o in outs] == [
        (2, FinishReason.ABORT, True)]
    engine.inbox.put(AbortRequests(["ab"]))
    outs = engine.process_inbox()
    assert sorted(o.index for o in outs) == [0, 1, 3]
    assert [o.more_choices for o in outs] == [True, True, False]
    assert_all_blocks_free(engine)


def test_choices_survive_preemption(tiny_llama) -> None:
    """Few blocks: the forks preempt each other and recompute; every choice still
    equals the greedy answer and every block comes back."""
    small = make_engine(tiny_llama, block_size=16, num_blocks=10, max_model_len=128)
    prompt = list(range(20, 50))
    alone, _ = run(small, "one", prompt, greedy(40))
    by_choice, _ = run(small, "four", prompt, greedy(40, n=4))
    assert small.scheduler.num_preemptions > 0
    assert all(by_choice[i] == alone[0] for i in range(4))
    assert_all_blocks_free(small)


def test_forks_give_up_their_shared_blocks_when_nothing_else_can_free_any() -> None:
    """Forked choices wait holding the prompt's blocks; when nothing runs and the pool
    cannot start them, they give them up (and start afresh later) instead of waiting
    forever."""
    import torch

    from kvpush.config import CacheConfig, SchedulerConfig
    from kvpush.scheduler.request import Request
    from kvpush.scheduler.scheduler import Scheduler

    s = Scheduler(SchedulerConfig(max_model_len=64),
                  CacheConfig(block_size=4, num_blocks=6, dtype=torch.float32,
                              enable_prefix_caching=False))
    params = greedy(4, n=3)
    parent = Request("p", list(range(9)), params, 64)
    parent.block_ids = s.pool.allocate(3)
    parent.num_computed_tokens = 9
    for i in (1, 2):
        s.fork(parent, Request(f"p/{i}", parent.prompt_token_ids, params.choice(i), 64))
    s.pool.free(parent.block_ids)  # the parent ended: its two prompt blocks stay shared
    other = s.pool.allocate(s.pool.num_free)  # blocks held elsewhere (a remote-KV wait)
    assert s.pool.num_free == 0
    plan = s.schedule()
    assert plan.empty and [r.block_ids for r in s.waiting] == [[], []]
    assert s.pool.num_free == 2  # the shared blocks came back
    s.pool.free(other)
    plan = s.schedule()
    assert sorted(c.request_id for c in plan.chunks) == ["p/1", "p/2"]
    assert all(c.start_pos == 0 and len(c.token_ids) == 9 for c in plan.chunks)  # afresh


# ------------------------------------------------------------------------- the API


@pytest.fixture(scope="module")
def served(tiny_llama):
    from kvpush.config import EngineConfig
    from kvpush.engine.async_engine import AsyncEngine
    from kvpush.server.app import build_app
    from server_helpers import uvicorn_server

    config = EngineConfig.build(tiny_llama, max_model_len=256, num_blocks=64, block_size=16)
    engine = AsyncEngine(config)
    with uvicorn_server(build_app(engine)) as url:
        yield url, engine, config.served_model_name


def _all_free(engine) -> None:
    from waits import wait_until

    def free() -> bool:
        s = engine.stats()
        return s.num_free_blocks == s.num_total_blocks and s.num_running == 0
    wait_until(free, timeout=10)


def test_openai_client_gets_n_choices(served) -> None:
    import openai

    url, engine, model = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30)
    r = client.completions.create(model=model, prompt="hello world", n=3, max_tokens=6,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.text for c in r.choices}) == 1
    prompt_tokens = r.usage.prompt_tokens
    assert r.usage.completion_tokens == 18 and r.usage.total_tokens == prompt_tokens + 18

    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=8,
        temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    again = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=8,
        temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert [c.message.content for c in chat.choices] == \
        [c.message.content for c in again.choices]
    assert chat.usage.completion_tokens == 16

    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage: Any = None
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], n=3, max_tokens=5,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    assert set(texts) == {0, 1, 2} and len(set(texts.values())) == 1
    assert reasons == {0: "length", 1: "length", 2: "length"}
    assert usage.completion_tokens == 15
    _all_free(engine)


def test_n_stops_each_choice_at_its_stop_string(served) -> None:
    """A stop string ends one choice at the front; the others run on."""
    import httpx

    url, engine, model = served
    body = {"model": model, "prompt": "hello world", "n": 4, "max_tokens": 30,
            "temperature": 1.0, "seed": 3, "ignore_eos": True, "stop": ["e"]}
    r = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for c in choices:
        assert "e" not in c["text"]
        assert c["finish_reason"] in ("stop", "length")
    _all_free(engine)


@pytest.mark.parametrize("body, param", [
    ({"n": 0}, "n"), ({"n": 65}, "n"), ({"n": 2, "best_of": 3}, "best_of"),
])
def test_bad_n_is_a_400(served, body, param) -> None:
    import httpx

    url, _, model = served
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "hi",
                                                  "max_tokens": 2, **body}, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_best_of_equal_to_n_is_taken(served) -> None:
    import httpx

    url, _, model = served
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "hi", "n": 2,
                                                  "best_of": 2, "max_tokens": 2},
                   timeout=10)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2


def test_async_stream_closed_early_frees_every_choice(served) -> None:
    import openai

    url, engine, model = served

    async def go() -> None:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        stream = await client.completions.create(model=model, prompt="hello", n=3,
                                                 max_tokens=200, stream=True,
                                                 extra_body={"ignore_eos": True})
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 6:
                break
        await stream.close()
        await client.close()
    asyncio.run(go())
    _all_free(engine)


def test_the_front_answers_the_choices_its_engine_runs(fake_model) -> None:
    """A prefill leg runs one choice of an n = 3 request (RequestChecker.leg_params):
    its front answers that one, finished, not two more aborted ones."""
    import httpx

    from fake_engine import FakeEngine
    from kvpush.server.app import build_app

    async def go() -> None:
        app = build_app(FakeEngine(*fake_model))
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://test",
                timeout=10) as client:
            r = await client.post("/v1/completions", json={
                "prompt": "hi", "n": 3, "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert [(c["index"], c["finish_reason"]) for c in r.json()["choices"]] == [
            (0, "length")]
    asyncio.run(go())
