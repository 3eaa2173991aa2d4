"""--kv-digest (issue 63, point 4): prefill sends a digest of each block it writes
(pull: lends), decode checks its blocks before the request runs. In process (two
engines, the in-process transport): clean transfers pass with no mismatch; one byte
changed in flight (FaultPlan.corrupt_transfers) is caught: the request fails with a
clear error, or is recomputed to the right answer, the mismatch is counted, and every
block comes back; a prefill without --kv-digest is refused by a decode with it."""

from __future__ import annotations

import pytest

from engine_helpers import greedy, make_engine, random_prompts, run_to_completion
from kvpush.config import EngineConfig, KVTransferConfig
from kvpush.engine.outputs import FinishReason
from kvpush.errors import ConfigError
from kvpush.kv_transfer.digest import BlockDigests, mismatches
from kvpush_testing.faults import FaultPlan
from pd_helpers import PDDriver, make_instance


def _pd(model, mode, p_digest=True, d_digest=True, **kw):
    faults = FaultPlan()
    p = make_instance(model, "prefill", mode, faults=faults, kv_digest=p_digest, **kw)
    d = make_instance(model, "decode", mode, faults=faults, kv_digest=d_digest, **kw)
    drv = PDDriver(p, d)
    drv.faults = faults
    return drv


@pytest.fixture
def pd(tiny_qwen3, request):
    mode, kw = request.param if isinstance(request.param, tuple) else (request.param, {})
    drv = _pd(tiny_qwen3, mode, **kw)
    yield drv
    drv.close()


def _clean(pd) -> None:
    pd.settle()
    for eng in (pd.p, pd.d):
        s = eng.stats()
        assert s.num_free_blocks == s.num_total_blocks
        assert not eng.connector.holds.by_tid


def _reference(model, prompts, n):
    return run_to_completion(make_engine(model), {f"r{i}": p for i, p in enumerate(prompts)},
                             greedy(n))


@pytest.mark.parametrize("pd", ["push", "pull"], indirect=True)
def test_clean_transfers_pass_the_check(pd, tiny_qwen3):
    prompts = random_prompts([7, 33, 100, 161], seed=63)
    ref = _reference(tiny_qwen3, prompts, 6)
    for i, p in enumerate(prompts):
        pd.submit(f"r{i}", p, greedy(6))
    pd.run(timeout=30)
    for i in range(len(prompts)):
        assert pd.d_legs[f"r{i}"].tokens == ref[f"r{i}"], pd.d_legs[f"r{i}"].error
    _clean(pd)
    assert pd.d.connector.counters.digest_mismatches == 0
    assert pd.d.connector.counters.transfers_ok == len(prompts)


@pytest.mark.parametrize("pd", ["push", "pull"], indirect=True)
def test_one_byte_changed_in_flight_fails_the_request_clearly(pd):
    pd.faults.arm(corrupt_transfers=1)
    pd.submit("r", random_prompts([70], seed=5)[0], greedy(5))
    pd.run(timeout=30)
    leg = pd.d_legs["r"]
    assert pd.faults.count("corruptions") == 1
    assert leg.finish_reason is FinishReason.ERROR and leg.tokens == [], leg
    assert "KV digest mismatch in 1 of" in leg.error, leg.error
    assert pd.d.connector.counters.digest_mismatches == 1
    _clean(pd)
    pd.submit("next", random_prompts([70], seed=6)[0], greedy(5))  # the next is fine
    pd.run(timeout=30)
    assert pd.d_legs["next"].finish_reason is FinishReason.LENGTH
    assert pd.d.connector.counters.digest_mismatches == 1
    _clean(pd)


@pytest.mark.parametrize("pd", [("push", {"policy": "recompute"}),
                                ("pull", {"policy": "recompute"})], indirect=True)
def test_a_mismatch_under_recompute_gives_the_right_answer(pd, tiny_qwen3):
    prompt = random_prompts([90], seed=8)[0]
    ref = _reference(tiny_qwen3, [prompt], 6)["r0"]
    pd.faults.arm(corrupt_transfers=1)
    pd.submit("r", prompt, greedy(6))
    pd.run(timeout=30)
    assert pd.faults.count("corruptions") == 1
    assert pd.d.connector.counters.digest_mismatches == 1
    assert pd.d_legs["r"].tokens == ref
    _clean(pd)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_prefill_without_digests_is_refused_by_a_decode_that_checks(tiny_qwen3, mode):
    pd = _pd(tiny_qwen3, mode, p_digest=False)
    try:
        pd.submit("r", random_prompts([40], seed=2)[0], greedy(4))
        pd.run(timeout=30)
        leg = pd.d_legs["r"]
        assert leg.finish_reason is FinishReason.ERROR
        assert "prefill instance sent no digest" in leg.error, leg.error
        _clean(pd)
    finally:
        pd.close()


def test_digests_follow_the_bytes_of_each_block(tiny_qwen3):
    import torch

    storage = torch.zeros((3, 8, 2, 4, 16), dtype=torch.bfloat16)
    digests = BlockDigests(storage)
    before = digests.of(range(8))
    assert len(set(before)) == 1 and all(len(d) == 16 for d in before)
    storage[2, 5, 1, 3, 15] = 1.0  # the last layer, V, one element of block 5
    after = digests.of(range(8))
    assert mismatches(before, after) == [5]
    assert mismatches(None, after) == list(range(8))


def test_kv_digest_is_refused_at_tensor_parallelism(tiny_qwen3):
    with pytest.raises(ConfigError, match="--kv-digest with --tensor-parallel-size 2"):
        EngineConfig.build(tiny_qwen3, tensor_parallel_size=2,
                           kv_transfer=KVTransferConfig(role="decode", kv_digest=True))


def test_the_hash_is_named_and_blake2b_serves_without_xxhash(tiny_qwen3, monkeypatch):
    from kvpush.kv_transfer import digest

    assert next(iter(digest.HASHERS)) == "xxh3_128"  # the pinned set installs xxhash
    monkeypatch.setattr(digest, "HASHERS", {"blake2b": digest.HASHERS["blake2b"]})
    pd = _pd(tiny_qwen3, "push")
    try:
        assert pd.p.connector.worker.ctx.digests.algorithm == "blake2b"
        pd.submit("r", random_prompts([50], seed=3)[0], greedy(4))
        pd.run(timeout=30)
        assert pd.d_legs["r"].finish_reason is FinishReason.LENGTH, pd.d_legs["r"].error
        assert pd.d.connector.counters.digest_mismatches == 0
        _clean(pd)
    finally:
        pd.close()
    # a decode without prefill's hash says so (and fails the receive)
    assert "cannot be checked here" in digest.unusable(True, "xxh3_128")
    assert digest.unusable(True, "blake2b") is None
