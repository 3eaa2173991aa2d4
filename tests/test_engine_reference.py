"""The engine against HF transformers: logits and greedy tokens, on tiny random models."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import (
    assert_all_blocks_free,
    greedy,
    hf_greedy,
    hf_logits,
    make_engine,
    random_prompts,
    run_to_completion,
)
from kvpush.sampling_params import SampledToken, SamplingParams

MODELS = [
    ("llama", "tiny", None),
    ("llama", "tiny", False),
    ("qwen3", "tiny", None),
    ("qwen3", "tiny", True),
    ("qwen3", "tiny-gqa4", None),
    ("llama", "tiny-gqa4", None),
]


def _prefill_logits(engine, prompt: list[int]) -> torch.Tensor:
    """Drive scheduler + runner by hand until the prompt's last chunk; its logits row."""
    engine.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0))
    while True:
        plan = engine.scheduler.schedule()
        logits = engine.runner.forward(plan)
        chunk = plan.chunks[0]
        if chunk.sample:
            engine.abort_request("r")
            return logits[0]
        engine.scheduler.update_after_step(plan, {})


@pytest.mark.parametrize("arch,preset,tied", MODELS)
def test_logits_match_hf(model_factory, arch, preset, tied):
    model_dir = model_factory(arch, preset, tied)
    prompt = random_prompts([77])[0]
    ref = hf_logits(model_dir, prompt)[-1]
    # whole prompt in one step, and in chunks of 16 tokens over the paged cache
    for budget in (1024, 16):
        engine = make_engine(model_dir, max_num_batched_tokens=budget)
        got = _prefill_logits(engine, prompt)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        assert_all_blocks_free(engine)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decode_logits_match_hf(model_factory, arch):
    """Logits at every decode step (paged decode attention) equal HF's full forward."""
    model_dir = model_factory(arch)
    prompt = random_prompts([40])[0]
    engine = make_engine(model_dir)
    seq = list(prompt)
    engine.add_request("r", prompt, greedy(8))
    for _ in range(8):
        plan = engine.scheduler.schedule()
        logits = engine.runner.forward(plan)
        ref = hf_logits(model_dir, seq)[-1]
        torch.testing.assert_close(logits[0], ref, rtol=1e-4, atol=1e-4)
        tok = int(logits[0].argmax())
        seq.append(tok)
        engine.scheduler.update_after_step(plan, {"r": SampledToken(tok)})
    engine.abort_request("r")
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_batch_matches_hf(model_factory, arch):
    """Prompts of different lengths, all in flight together, equal HF one by one."""
    model_dir = model_factory(arch)
    lengths = [1, 5, 16, 17, 33, 64, 100, 250]
    prompts = {f"r{i}": p for i, p in enumerate(random_prompts(lengths, seed=3))}
    engine = make_engine(model_dir, max_num_batched_tokens=128)
    outs = run_to_completion(engine, prompts, greedy(24))
    for rid, p in prompts.items():
        assert outs[rid] == hf_greedy(model_dir, p, 24), rid
    assert_all_blocks_free(engine)


def test_logprobs_are_log_softmax_of_logits(tiny_qwen3):
    prompt = random_prompts([20])[0]
    engine = make_engine(tiny_qwen3)
    engine.add_request("r", prompt, greedy(4, logprobs=True))
    toks, lps = [], []
    while engine.has_work():
        for o in engine.step():
            toks += o.new_token_ids
            lps += o.new_logprobs
    seq = prompt + toks
    ref = torch.log_softmax(hf_logits(tiny_qwen3, seq), dim=-1)
    for i, (t, lp) in enumerate(zip(toks, lps)):
        assert lp == pytest.approx(ref[len(prompt) - 1 + i, t].item(), abs=1e-4)
        assert lp <= 0
    assert_all_blocks_free(engine)


def test_top_logprobs_are_the_reference_distributions_most_likely_tokens(tiny_qwen3):
    """top_logprobs N: at every position the N most likely tokens of HF's distribution,
    most likely first, with their logprobs; a request beside it without top_logprobs
    gets none, and its tokens do not change."""
    prompt = random_prompts([20])[0]
    engine = make_engine(tiny_qwen3)
    engine.add_request("top", prompt, greedy(4, logprobs=True, top_logprobs=5))
    engine.add_request("plain", prompt, greedy(4, logprobs=True))
    toks: dict[str, list[int]] = {"top": [], "plain": []}
    tops: dict[str, list] = {"top": [], "plain": []}
    while engine.has_work():
        for o in engine.step():
            toks[o.request_id] += o.new_token_ids
            tops[o.request_id] += o.new_top_logprobs or []
    assert toks["top"] == toks["plain"] and tops["plain"] == []
    ref = torch.log_softmax(hf_logits(tiny_qwen3, prompt + toks["top"]), dim=-1)
    assert len(tops["top"]) == 4
    for i, (tok, top) in enumerate(zip(toks["top"], tops["top"])):
        want = ref[len(prompt) - 1 + i].topk(5)
        assert [t for t, _ in top] == want.indices.tolist()
        assert [lp for _, lp in top] == pytest.approx(want.values.tolist(), abs=1e-4)
        assert top[0][0] == tok  # greedy: the sampled token is the most likely one
    assert_all_blocks_free(engine)


def test_repetition_penalty_matches_hf_generate(tiny_llama):
    """repetition_penalty (HF's RepetitionPenaltyLogitsProcessor over prompt and output):
    greedy tokens equal HF generate's with the same penalty, and differ from the
    unpenalized ones (the tiny model repeats itself)."""
    prompts = {f"r{i}": p for i, p in enumerate(random_prompts([12, 40], seed=8))}
    engine = make_engine(tiny_llama)
    got = run_to_completion(engine, prompts, greedy(16, repetition_penalty=1.5))
    plain = run_to_completion(make_engine(tiny_llama), prompts, greedy(16))
    for rid, p in prompts.items():
        assert got[rid] == hf_greedy(tiny_llama, p, 16, repetition_penalty=1.5), rid
    assert got != plain
    assert_all_blocks_free(engine)


def test_presence_and_frequency_penalties_follow_openai_formula(tiny_llama):
    """logit - count x frequency - (count > 0) x presence over the output so far, then
    greedy: each step's token equals that formula applied to HF's logits; logprobs stay
    those of the raw distribution; the continuation changes (this model repeats
    itself)."""
    prompt = random_prompts([12], seed=8)[0]
    params = greedy(16, presence_penalty=1.5, frequency_penalty=1.0, logprobs=True)
    engine = make_engine(tiny_llama)
    engine.add_request("r", prompt, params)
    toks, lps = [], []
    while engine.has_work():
        for o in engine.step():
            toks += o.new_token_ids
            lps += o.new_logprobs
    logits = hf_logits(tiny_llama, prompt + toks)
    for i, tok in enumerate(toks):
        row = logits[len(prompt) - 1 + i].clone()
        counts = torch.bincount(torch.tensor(toks[:i], dtype=torch.long),
                                minlength=row.shape[0]).float()
        row -= counts * 1.0 + (counts > 0).float() * 1.5
        assert tok == int(row.argmax()), i
        raw = torch.log_softmax(logits[len(prompt) - 1 + i], dim=-1)[tok].item()
        assert lps[i] == pytest.approx(raw, abs=1e-4)
    plain = run_to_completion(make_engine(tiny_llama), {"r": prompt}, greedy(16))["r"]
    assert toks != plain
    assert_all_blocks_free(engine)


def test_logit_bias_forces_and_bans_tokens(tiny_llama):
    prompt = random_prompts([15], seed=10)[0]
    plain = run_to_completion(make_engine(tiny_llama), {"r": prompt}, greedy(6))["r"]
    engine = make_engine(tiny_llama)
    forced = run_to_completion(engine, {"r": prompt},
                               greedy(6, logit_bias=((77, 100.0),)))["r"]
    assert forced == [77] * 6
    banned = run_to_completion(engine, {"r": prompt},
                               greedy(6, logit_bias=((plain[0], -100.0),)))["r"]
    assert banned[0] != plain[0] and plain[0] not in banned
    assert_all_blocks_free(engine)
