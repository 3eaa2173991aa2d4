"""Issue 40, finding 4: ``cache_salt`` (vLLM's field) isolates tenants' prefix caches:
mixed into the first block's hash on the instances (both legs) and in the router's
prefix lookup; it used to be accepted and ignored (tenant B found 256 of tenant A's
tokens cached)."""

from __future__ import annotations

import uuid

import pytest

from engine_helpers import hf_greedy, random_prompts
from kvpush.config import EngineConfig, KVTransferConfig
from kvpush.engine.llm_engine import LLMEngine
from kvpush.engine.outputs import FinishReason
from kvpush.kv_cache.block_pool import hash_prefix_blocks, hash_prompt_chain
from kvpush.router.decide import Route
from kvpush.sampling_params import SamplingParams
from kvpush.server.protocol import CompletionRequest
from kvpush_testing.links import InProcLinks
from pd_helpers import PDDriver

pytestmark = pytest.mark.timeout(120)
BS = 16


def salted(n: int = 3, salt: str | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, cache_salt=salt)


def test_the_salt_changes_every_hash_of_the_chain_and_only_with_one():
    ids = list(range(100, 100 + 3 * BS + 5))
    plain = hash_prefix_blocks(ids, BS)
    a, b = hash_prefix_blocks(ids, BS, "tenant-a"), hash_prefix_blocks(ids, BS, "tenant-b")
    assert hash_prefix_blocks(ids, BS, None) == plain  # no salt: the hashes as before
    assert a == hash_prefix_blocks(ids, BS, "tenant-a")
    for x, y in ((plain, a), (a, b), (plain, b)):
        assert all(h1 != h2 for h1, h2 in zip(x, y, strict=True))  # chained: every block
    assert hash_prompt_chain(ids, BS, salt="tenant-a")[:3] == a
    assert Route(ids, cache_salt="tenant-a").chain(BS) == a  # the router salts alike
    assert Route(ids).chain(BS) == plain


def test_requests_share_cached_blocks_only_with_the_same_salt(tiny_qwen3):
    eng = LLMEngine(EngineConfig.build(tiny_qwen3, block_size=BS, num_blocks=64,
                                       max_model_len=256))
    prompt = random_prompts([5 * BS + 3], seed=21)[0]
    try:
        def cached(rid: str, salt: str | None) -> int:
            eng.add_request(rid, prompt, salted(2, salt))
            n = None
            for _ in range(1000):
                for o in eng.step():
                    if o.request_id == rid and n is None:
                        n = o.num_cached_tokens
                if not eng.has_work():
                    break
            assert n is not None
            return n

        assert cached("a1", "tenant-a") == 0
        assert cached("b1", "tenant-b") == 0  # another tenant's cache: not found
        assert cached("n1", None) == 0
        assert cached("a2", "tenant-a") == 5 * BS  # its own: every full block
        assert cached("b2", "tenant-b") == 5 * BS
    finally:
        eng.shutdown()


def test_a_salted_request_goes_through_both_legs(tiny_qwen3):
    def inst(role: str) -> LLMEngine:
        kvt = KVTransferConfig(role=role, mode="push",
                               engine_id=f"{role}-{uuid.uuid4().hex[:6]}",
                               lease_timeout_s=5.0,
                               heartbeat_interval_s=0.1,
                               side_channel_secret=b"0123456789abcdef0123456789abcdef")
        return LLMEngine(EngineConfig.build(tiny_qwen3, kv_transfer=kvt, block_size=BS,
                                            num_blocks=64, max_model_len=256),
                         links=InProcLinks())

    drv = PDDriver(inst("prefill"), inst("decode"))
    try:
        prompt = random_prompts([70], seed=22)[0]
        drv.submit("r", prompt, salted(4, "tenant-a"))
        drv.run(timeout=30)
        assert drv.d_legs["r"].finish_reason is FinishReason.LENGTH
        assert drv.d_legs["r"].tokens == hf_greedy(tiny_qwen3, prompt, 4)
        # legs salted differently do not bind: decode's chain is not prefill's
        drv.send_decode("x", prompt, salted(4, "tenant-b"))
        drv.send_prefill("x", prompt, salted(4, "tenant-a"))
        drv.run(until=lambda: drv.d_legs["x"].finished, timeout=30)
        assert drv.d_legs["x"].finish_reason is FinishReason.ERROR
        assert "differs" in drv.d_legs["x"].error
        drv.settle()
    finally:
        drv.close()


@pytest.mark.parametrize("bad", ["", "x" * 1025, 7, ["a"]])
def test_a_bad_cache_salt_is_refused(bad):
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"prompt": "hi", "cache_salt": bad})
    assert "cache_salt" in str(e.value)
    assert CompletionRequest.model_validate({"prompt": "hi", "cache_salt": "ok"}).cache_salt


@pytest.mark.parametrize("field,value", [
    ("min_p", 0.1), ("min_tokens", 3), ("priority", 5), ("prompt_logprobs", 1)])
def test_a_field_the_server_cannot_honour_is_refused_not_ignored(field, value):
    """Issue 40: a field vLLM honours and kvpush cannot is a 400 naming it (it used to
    be dropped silently, as cache_salt was); its no-op value is accepted."""
    from pydantic import ValidationError

    from kvpush.server.chat import ChatCompletionRequest
    from kvpush.server.errors import from_validation_errors

    for model, base in ((CompletionRequest, {"prompt": "hi"}),
                        (ChatCompletionRequest, {"messages": [{"role": "user",
                                                              "content": "hi"}]})):
        with pytest.raises(ValidationError) as e:
            model.model_validate({**base, field: value})
        err = from_validation_errors(list(e.value.errors()))
        assert err.status_code == 400 and err.param == field, err.body()
        assert "not supported" in err.message
    assert CompletionRequest.model_validate({"prompt": "hi", "min_tokens": 0,
                                             "response_format": {"type": "text"}})
