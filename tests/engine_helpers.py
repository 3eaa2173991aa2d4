"""Helpers for engine tests: build engines on tiny models, run them, HF references."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from kvpush.config import EngineConfig
from kvpush.engine.llm_engine import LLMEngine
from kvpush.sampling_params import SamplingParams


def make_engine(model_dir: Path, **kw) -> LLMEngine:
    kw.setdefault("block_size", 16)
    kw.setdefault("num_blocks", 256)
    kw.setdefault("max_model_len", 1024)
    return LLMEngine(EngineConfig.build(model_dir, **kw))


def greedy(max_tokens: int = 16, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def run_to_completion(
    engine: LLMEngine, prompts: dict[str, list[int]],
    params: SamplingParams | dict[str, SamplingParams], max_steps=10_000
) -> dict[str, list[int]]:
    """Add every prompt at once (``params``: for all, or by id), step until all finish;
    returns output tokens by id."""
    for rid, p in prompts.items():
        engine.add_request(rid, p, params[rid] if isinstance(params, dict) else params)
    outs: dict[str, list[int]] = {rid: [] for rid in prompts}
    for _ in range(max_steps):
        if not engine.has_work():
            break
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert not engine.has_work(), "engine did not finish in max_steps"
    return outs


def assert_all_blocks_free(engine: LLMEngine) -> None:
    s = engine.stats()
    assert s.num_free_blocks == s.num_total_blocks, s
    assert s.num_running == 0 and s.num_waiting == 0, s
    assert not engine.scheduler.requests


@functools.lru_cache(maxsize=8)
def hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_greedy(model_dir: Path, prompt: list[int], n: int, **generate_kw) -> list[int]:
    """Greedy continuation by HF transformers with its own KV cache, no EOS stop.

    ``eos_token_id=None`` rather than ``min_new_tokens``: the latter suppresses EOS in
    the logits and so changes the argmax wherever EOS would win."""
    model = hf_model(model_dir)
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=n,
        eos_token_id=None,
        do_sample=False,
        pad_token_id=0,
        **generate_kw,
    )
    return out[0, len(prompt) :].tolist()


@torch.inference_mode()
def hf_logits(model_dir: Path, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] logits of HF's forward pass over the whole sequence."""
    return hf_model(model_dir)(torch.tensor([tokens])).logits[0].float()


def random_prompts(lengths, vocab: int = 1000, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # skip the first ids: the test tokenizer's special tokens live there
    return [torch.randint(8, vocab, (n,), generator=g).tolist() for n in lengths]
