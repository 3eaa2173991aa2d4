"""Engine behaviour: prefix cache, chunked prefill, preemption, aborts, sampling, stops."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import (
    assert_all_blocks_free,
    greedy,
    hf_greedy,
    make_engine,
    random_prompts,
    run_to_completion,
)
from kvpush.engine.output_processor import RequestStream
from kvpush.engine.outputs import FinishReason, RequestError
from kvpush.model.sampler import sample
from kvpush.sampling_params import SamplingParams, SamplingParamsError
from kvpush.scheduler.request import RequestState


def test_prefix_cache_hit_gives_identical_output(tiny_llama):
    shared = random_prompts([70], seed=5)[0]
    a, b = shared + [11, 12, 13], shared + [21, 22]
    engine = make_engine(tiny_llama)
    first = run_to_completion(engine, {"a": a}, greedy(12))
    stats0 = engine.stats()
    second = run_to_completion(engine, {"b": b, "a2": a}, greedy(12))
    stats1 = engine.stats()
    hit = stats1.prefix_cache_hit_tokens - stats0.prefix_cache_hit_tokens
    # 70 shared tokens = 4 full blocks of 16 for b; a2 hits every full block of a
    assert hit >= 64 + 64
    assert second["a2"] == first["a"]
    cold = make_engine(tiny_llama, enable_prefix_caching=False)
    assert run_to_completion(cold, {"b": b}, greedy(12))["b"] == second["b"]
    assert cold.stats().prefix_cache_hit_tokens == 0
    assert_all_blocks_free(engine)
    assert_all_blocks_free(cold)


def test_full_prompt_hit_recomputes_last_token(tiny_qwen3):
    prompt = random_prompts([64], seed=9)[0]  # exactly 4 blocks
    engine = make_engine(tiny_qwen3)
    first = run_to_completion(engine, {"a": prompt}, greedy(5))
    again = run_to_completion(engine, {"b": prompt}, greedy(5))
    assert again["b"] == first["a"]
    assert engine.stats().prefix_cache_hit_tokens == 48  # 3 blocks; the last recomputed
    assert_all_blocks_free(engine)


def test_chunked_prefill_same_output(tiny_qwen3):
    prompts = {f"r{i}": p for i, p in enumerate(random_prompts([300, 45, 130], seed=1))}
    whole = make_engine(tiny_qwen3, max_num_batched_tokens=1024, enable_chunked_prefill=False)
    chunked = make_engine(tiny_qwen3, max_num_batched_tokens=32)
    out_whole = run_to_completion(whole, prompts, greedy(10))
    out_chunked = run_to_completion(chunked, prompts, greedy(10))
    assert out_whole == out_chunked
    assert_all_blocks_free(whole)
    assert_all_blocks_free(chunked)


def test_preemption_recomputes_and_gives_same_output(tiny_llama):
    prompts = {f"r{i}": p for i, p in enumerate(random_prompts([40, 50, 60, 30], seed=2))}
    roomy = make_engine(tiny_llama, num_blocks=256, max_model_len=256)
    # 4 requests of ~45 + 60 tokens need ~28 blocks of 16; 14 blocks force preemption
    tight = make_engine(tiny_llama, num_blocks=14, max_model_len=160)
    ref = run_to_completion(roomy, prompts, greedy(60))
    got = run_to_completion(tight, prompts, greedy(60))
    assert tight.stats().num_preemptions > 0
    assert got == ref
    for rid, p in prompts.items():
        assert got[rid] == hf_greedy(tiny_llama, p, 60)
    assert_all_blocks_free(tight)


def test_max_num_seqs_caps_running(tiny_llama):
    engine = make_engine(tiny_llama, max_num_seqs=2)
    for i, p in enumerate(random_prompts([10] * 5)):
        engine.add_request(f"r{i}", p, greedy(4))
    engine.step()
    assert engine.stats().num_running == 2
    assert engine.stats().num_waiting == 3
    while engine.has_work():
        engine.step()
        assert engine.stats().num_running <= 2
    assert_all_blocks_free(engine)


def test_outputs_carry_when_the_request_was_scheduled(tiny_llama):
    """arrival <= scheduled <= first token, on every output (vllm: queue and
    prefill time); a request held back by max_num_seqs is scheduled later than one that
    ran at once."""
    engine = make_engine(tiny_llama, max_num_seqs=1)
    for i, p in enumerate(random_prompts([10, 10])):
        engine.add_request(f"r{i}", p, greedy(3))
    assert engine.scheduler.requests["r0"].scheduled_time is None
    seen: dict[str, tuple] = {}
    while engine.has_work():
        for o in engine.step():
            assert o.scheduled_time is not None and o.first_token_time is not None
            assert o.arrival_time <= o.scheduled_time <= o.first_token_time
            times = (o.arrival_time, o.scheduled_time, o.first_token_time)
            assert seen.setdefault(o.request_id, times) == times  # set once
    assert seen["r1"][1] >= seen["r0"][2]  # r1 waited for r0's slot
    assert_all_blocks_free(engine)


def test_scheduled_time_is_the_last_admission_before_the_first_token(tiny_llama):
    """As vLLM's queue/prefill intervals: a request preempted before its first token
    counts from its new admission; one preempted while decoding keeps its time."""
    engine = make_engine(tiny_llama)
    req = engine.add_request("r", random_prompts([10])[0], greedy(4))
    sched = engine.scheduler
    sched.schedule()  # admitted, then preempted before its prefill ran
    t1 = req.scheduled_time
    assert t1 is not None
    sched.running.remove(req)
    sched._preempt(req)
    (out,) = engine.step()
    t2 = req.scheduled_time
    assert t2 is not None and t2 > t1 and out.scheduled_time == t2
    assert out.first_token_time is not None and t2 <= out.first_token_time
    sched.running.remove(req)
    sched._preempt(req)  # while decoding: recomputed, not re-timed
    while engine.has_work():
        for o in engine.step():
            assert o.scheduled_time == t2
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("when", ["waiting", "prefilling", "decoding"])
def test_abort_frees_blocks_at_any_moment(tiny_qwen3, when):
    engine = make_engine(tiny_qwen3, max_num_batched_tokens=32)
    start = engine.stats().num_free_blocks
    engine.add_request("keep", random_prompts([20], seed=4)[0], greedy(6))
    engine.add_request("x", random_prompts([200], seed=4)[0], greedy(50))
    keep_tokens: list[int] = []

    def step():
        for o in engine.step():
            if o.request_id == "keep":
                keep_tokens.extend(o.new_token_ids)

    if when != "waiting":
        step()
        req = engine.scheduler.requests["x"]
        if when == "decoding":
            while req.num_output_tokens == 0:
                step()
        assert req.block_ids and req.state is RequestState.RUNNING
    out = engine.abort_request("x")
    assert out.finished and out.finish_reason is FinishReason.ABORT
    assert engine.abort_request("x") is None  # second abort: nothing left
    while engine.has_work():
        step()
    assert len(keep_tokens) == 6
    assert engine.stats().num_free_blocks == start
    assert_all_blocks_free(engine)


def test_request_validation(tiny_llama):
    engine = make_engine(tiny_llama, max_model_len=64)
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("a", [], greedy())
    with pytest.raises(RequestError, match="maximum context length is 64"):
        engine.add_request("a", [10] * 60, greedy(5))
    with pytest.raises(RequestError, match="maximum context length"):
        engine.add_request("a", [10] * 64, greedy(1))
    with pytest.raises(RequestError, match="token ids"):
        engine.add_request("a", [10, 100_000], greedy())
    with pytest.raises(SamplingParamsError):
        SamplingParams(max_tokens=0)
    with pytest.raises(SamplingParamsError):
        SamplingParams(temperature=-1)
    with pytest.raises(SamplingParamsError):
        SamplingParams(top_p=0)
    with pytest.raises(SamplingParamsError):
        SamplingParams(temperature=float("nan"))
    for bad_top_k in (float("nan"), 2.5, 3.0, True, -2):
        with pytest.raises(SamplingParamsError) as err:
            SamplingParams(top_k=bad_top_k)
        assert err.value.param == "top_k"
    for bad_top in ({"top_logprobs": 21, "logprobs": True}, {"top_logprobs": -1},
                    {"top_logprobs": 2.0, "logprobs": True}, {"top_logprobs": 2}):
        with pytest.raises(SamplingParamsError) as err:
            SamplingParams(**bad_top)
        assert err.value.param == "top_logprobs"
    assert_all_blocks_free(engine)


def test_degenerate_sampling_values_never_fail_a_step(tiny_llama):
    """Temperatures too small to divide by are greedy, a top_p that float32 rounds to 0
    keeps the top token; and should the probabilities still be NaN, the row is greedy."""
    assert SamplingParams(temperature=1e-300).greedy
    assert SamplingParams(top_p=5e-324).top_p == pytest.approx(1e-5)
    engine = make_engine(tiny_llama)
    prompts = {"tiny-t": [5, 6, 7, 8], "tiny-p": [9, 10, 11], "plain": [12, 13]}
    params = {"tiny-t": SamplingParams(max_tokens=4, temperature=5e-324),
              "tiny-p": SamplingParams(max_tokens=4, top_p=5e-324, seed=1),
              "plain": greedy(4)}
    out = run_to_completion(engine, prompts, params)
    greedy_ref = run_to_completion(make_engine(tiny_llama), prompts, greedy(4))
    assert out["tiny-t"] == greedy_ref["tiny-t"] and out["plain"] == greedy_ref["plain"]
    assert out["tiny-p"] == greedy_ref["tiny-p"]  # nucleus of one token: the argmax
    logits = torch.tensor([[0.0, float("inf"), float("nan"), 1.0]])
    tokens, *_ = sample(logits, [SamplingParams(temperature=0.7)], [None], torch.Generator())
    assert tokens == [1]  # the row's argmax, NaN ignored: no exception, no failed step
    assert_all_blocks_free(engine)


def test_repetition_penalty_counts_each_token_once():
    """A token in the prompt and the output, or several times in either, is penalized
    once (HF's RepetitionPenaltyLogitsProcessor over the unique ids): positive logits
    divided by the penalty, negative ones multiplied, the rest untouched."""
    from kvpush.model.sampler import adjust_logits_

    row = torch.tensor([2.0, -1.0, 0.5, -3.0, 4.0, 1.0])
    got = row.clone()
    adjust_logits_(got, SamplingParams(repetition_penalty=2.0), ([0, 1, 0, 3, 0], (1, 3, 3)))
    assert got.tolist() == [1.0, -2.0, 0.5, -6.0, 4.0, 1.0]
    same = row.clone()
    adjust_logits_(same, SamplingParams(repetition_penalty=2.0), ([], []))
    assert same.tolist() == row.tolist()


def test_frequency_and_presence_penalties_touch_only_output_tokens():
    """OpenAI's formula, logit - count x frequency - (count > 0) x presence, over the
    output's tokens only (the prompt's are not penalized), repeats counted."""
    from kvpush.model.sampler import adjust_logits_

    gen = torch.Generator().manual_seed(3)
    row = torch.randn(50, generator=gen)
    output = [7, 3, 7, 7, 49, 3, 0]
    got = row.clone()
    adjust_logits_(got, SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
                   ([1, 2, 7], output))
    counts = torch.bincount(torch.tensor(output), minlength=50).float()
    want = row - counts * 0.5 - (counts > 0).float() * 0.25
    assert torch.allclose(got, want)
    assert got[1] == row[1] and got[2] == row[2]  # prompt tokens: untouched


def test_seeded_sampling_is_reproducible_and_varies(tiny_llama):
    prompt = random_prompts([12])[0]

    def run(seed, **kw):
        engine = make_engine(tiny_llama)
        p = SamplingParams(max_tokens=20, temperature=1.0, seed=seed, ignore_eos=True, **kw)
        return run_to_completion(engine, {"r": prompt}, p)["r"]

    assert run(1) == run(1)
    assert run(1) != run(2)
    engine = make_engine(tiny_llama)
    ref = run_to_completion(engine, {"r": prompt}, greedy(20))["r"]
    # top_k=1 and a tiny top_p both collapse to the argmax
    assert run(3, top_k=1) == ref
    assert run(4, top_p=1e-6) == ref


def test_seed_independent_of_batch(tiny_llama):
    """A seeded request samples the same tokens alone and beside other requests."""
    p = SamplingParams(max_tokens=15, temperature=0.8, seed=7, ignore_eos=True)
    prompts = random_prompts([12, 30, 50], seed=6)
    alone = run_to_completion(make_engine(tiny_llama), {"r": prompts[0]}, p)["r"]
    engine = make_engine(tiny_llama)
    together = run_to_completion(
        engine, {"r": prompts[0], "o1": prompts[1], "o2": prompts[2]}, p
    )
    assert together["r"] == alone


def _collect(engine, rid, prompt, params):
    """Run one request to its end; its text as the front end makes it (RequestStream:
    detokenizer, stop strings; a stop string aborts the request in the engine)."""
    engine.add_request(rid, prompt, params)
    stream = RequestStream(rid, engine.tokenizer, params)
    toks, text, last = [], "", None
    while engine.has_work():
        for o in engine.step():
            out = stream.process(o)
            toks += out.new_token_ids
            text += out.new_text
            last = out
            if stream.stopped_early:
                engine.abort_request(rid)
    return toks, text, last


def test_stop_token_ids_eos_and_length(tiny_llama):
    engine = make_engine(tiny_llama)
    prompt = random_prompts([15])[0]
    ref, _, last = _collect(engine, "a", prompt, greedy(12))
    assert last.finish_reason is FinishReason.LENGTH and len(ref) == 12
    # stop at the 5th generated token id
    stop_tok = ref[4]
    first = ref.index(stop_tok)
    toks, _, last = _collect(engine, "b", prompt, greedy(12, stop_token_ids=(stop_tok,)))
    assert toks == ref[: first + 1] and last.finish_reason is FinishReason.STOP
    # the same token as EOS (ignore_eos False)
    engine.eos_token_ids = frozenset({stop_tok})
    toks, _, last = _collect(
        engine, "c", prompt, SamplingParams(max_tokens=12, temperature=0)
    )
    assert toks == ref[: first + 1] and last.finish_reason is FinishReason.STOP
    assert_all_blocks_free(engine)


def test_stop_strings_cut_text(tiny_llama):
    engine = make_engine(tiny_llama)
    prompt = random_prompts([15], seed=11)[0]
    ref_toks, ref_text, _ = _collect(engine, "a", prompt, greedy(30))
    assert ref_text == engine.tokenizer.decode(ref_toks, skip_special_tokens=True)
    stop = ref_text[len(ref_text) // 2 : len(ref_text) // 2 + 3]
    assert stop.strip(), "pick a visible stop string"
    cut = ref_text.index(stop)
    _, text, last = _collect(engine, "b", prompt, greedy(30, stop=(stop,)))
    assert last.finish_reason is FinishReason.STOP
    assert text == ref_text[:cut]
    _, text, _ = _collect(
        engine, "c", prompt, greedy(30, stop=(stop,), include_stop_str_in_output=True)
    )
    assert text == ref_text[: cut + len(stop)]
    assert_all_blocks_free(engine)
