"""The GPU check's in-process steps: HF parity, paged decode attention, the bench model.

Each step takes a :class:`StepContext` and returns a dict of figures; a failed
expectation raises :class:`CheckFailed` (the step is recorded as failed, with the
figures gathered so far). They run on CUDA in the check and on CPU for debugging the
script itself (``check.py --device cpu --quick``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: bf16 parity bound, as in tests/test_engine_bf16.py (a test keeps the two equal): max
#: abs logit error against HF fp32 <= FACTOR x HF bf16's own error + SLACK
BF16_ERR_FACTOR = 2.0
BF16_ERR_SLACK = 0.05
#: fp32 on CUDA: kvpush's logits against HF's, both fp32 on the same device
FP32_LOGIT_ATOL = 1e-3
#: paged decode attention against the dense path (each in the same dtype)
PAGED_ATOL = {"float32": 1e-4, "bfloat16": 2e-2}


class CheckFailed(AssertionError):
    """An expectation of a step did not hold."""


@dataclass
class StepContext:
    device: str  # "cuda" or "cpu"
    work: Path  # a folder the steps share (models are built there once)
    quick: bool = False  # smaller shapes (CPU debugging runs)
    figures: dict[str, Any] = field(default_factory=dict)


def expect(ok: bool, message: str) -> None:
    if not ok:
        raise CheckFailed(message)


def model_dir(ctx: StepContext, arch: str, preset: str) -> Path:
    """A random model, built once per (arch, preset) in the work folder."""
    from kvpush.models.random_model import make_random_model

    out = ctx.work / "models" / f"{arch}-{preset}"
    if not (out / "config.json").exists():
        make_random_model(out, arch, preset, seed=0)
    return out


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(8, 1000, (n,), generator=g).tolist() for n in lengths]


def _hf(path: Path, dtype, device: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def _engine(path: Path, device: str, dtype: str, **kw):
    from kvpush.config import EngineConfig
    from kvpush.engine.llm_engine import LLMEngine

    kw.setdefault("block_size", 16)
    kw.setdefault("num_blocks", 512)
    kw.setdefault("max_model_len", 1024)
    return LLMEngine(EngineConfig.build(path, device=device, dtype=dtype, **kw))


def _run_all(engine, prompts: dict[str, list[int]], n: int) -> dict[str, list[int]]:
    from kvpush.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    for rid, p in prompts.items():
        engine.add_request(rid, p, params)
    outs: dict[str, list[int]] = {rid: [] for rid in prompts}
    for _ in range(10_000):
        if not engine.has_work():
            break
        for o in engine.step():
            outs[o.request_id].extend(o.new_token_ids)
    expect(not engine.has_work(), "engine did not finish in 10000 steps")
    return outs


def _blocks_free(engine) -> bool:
    s = engine.stats()
    return s.num_free_blocks == s.num_total_blocks and not engine.scheduler.requests


def _hf_greedy(model, prompt: list[int], n: int, device: str) -> list[int]:
    import torch

    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt], device=device),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long,
                                                       device=device),
                             max_new_tokens=n, eos_token_id=None, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _teacher_forced(engine, prompt: list[int], forced: list[int]):
    """kvpush's logits rows: the prefill's last position, then one per decode step fed
    ``forced`` (as tests/test_engine_bf16.py does)."""
    import torch

    from kvpush.sampling_params import SampledToken, SamplingParams

    engine.add_request("r", prompt, SamplingParams(max_tokens=len(forced) + 1,
                                                   temperature=0, ignore_eos=True))
    rows = []
    for tok in forced:
        plan = engine.scheduler.schedule()
        rows.append(engine.runner.forward(plan)[0].float().cpu())
        engine.scheduler.update_after_step(plan, {"r": SampledToken(tok)})
    plan = engine.scheduler.schedule()
    rows.append(engine.runner.forward(plan)[0].float().cpu())
    engine.abort_request("r")
    return torch.stack(rows)


def hf_parity(ctx: StepContext) -> dict[str, Any]:
    """Greedy tokens of kvpush equal HF's in fp32 (batched, mixed prefill and decode,
    paged decode attention on CUDA), and bf16 logits within the documented bound."""
    import torch

    dev, figs = ctx.device, ctx.figures
    preset = "tiny" if ctx.quick else "small"
    lengths = [5, 37, 200] if ctx.quick else [5, 37, 200, 700]
    n_new = 8 if ctx.quick else 16
    for arch in ("qwen3", "llama"):
        path = model_dir(ctx, arch, preset)
        prompts = {f"p{i}": p for i, p in enumerate(_prompts(lengths, seed=1))}
        # fp32: greedy tokens equal, prefill logits close
        hf = _hf(path, torch.float32, dev)
        ref = {rid: _hf_greedy(hf, p, n_new, dev) for rid, p in prompts.items()}
        engine = _engine(path, dev, "float32")
        figs[f"{arch}_decode_attention"] = engine.config.cache.decode_attention
        got = _run_all(engine, prompts, n_new)
        figs[f"{arch}_fp32_tokens_equal"] = got == ref
        figs[f"{arch}_fp32_blocks_free"] = _blocks_free(engine)
        prompt = prompts["p1"]
        with torch.inference_mode():
            want = hf(torch.tensor([prompt], device=dev)).logits[0, -1].float().cpu()
        have = _teacher_forced(engine, prompt, [])[0]
        figs[f"{arch}_fp32_logit_err"] = float((have - want).abs().max())
        expect(got == ref, f"{arch} fp32: greedy tokens differ from HF's: {got} vs {ref}")
        expect(figs[f"{arch}_fp32_logit_err"] <= FP32_LOGIT_ATOL,
               f"{arch} fp32: logit error {figs[f'{arch}_fp32_logit_err']:.2e}")
        expect(_blocks_free(engine), f"{arch} fp32: blocks not all free after the run")
        del engine
        # bf16: teacher-forced logits against HF fp32, bounded by HF bf16's own error
        prompt = _prompts([45], seed=5)[0]
        with torch.inference_mode():
            seq = list(prompt)
            for _ in range(8):
                seq.append(int(hf(torch.tensor([seq], device=dev)).logits[0, -1].argmax()))
            ref32 = hf(torch.tensor([seq], device=dev)).logits[0].float().cpu()
            hf16 = _hf(path, torch.bfloat16, dev)
            ref16 = hf16(torch.tensor([seq], device=dev)).logits[0].float().cpu()
        del hf, hf16
        ref32, ref16 = ref32[len(prompt) - 1:], ref16[len(prompt) - 1:]
        engine = _engine(path, dev, "bfloat16")
        got16 = _teacher_forced(engine, prompt, seq[len(prompt):])
        hf16_err = float((ref16 - ref32).abs().max())
        bound = BF16_ERR_FACTOR * hf16_err + BF16_ERR_SLACK
        err = float((got16 - ref32).abs().max())
        top2 = ref32.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * bound
        same = got16.argmax(-1) == ref32.argmax(-1)
        figs[f"{arch}_bf16_logit_err"] = err
        figs[f"{arch}_bf16_bound"] = bound
        figs[f"{arch}_bf16_clear_positions"] = int(clear.sum())
        figs[f"{arch}_bf16_blocks_free"] = _blocks_free(engine)
        expect(err <= bound, f"{arch} bf16: logit error {err:.3f} > bound {bound:.3f}")
        expect(bool(same[clear].all()), f"{arch} bf16: a clear top-1 differs from fp32's")
        expect(_blocks_free(engine), f"{arch} bf16: blocks not all free after the run")
        del engine
    return figs


def paged_decode(ctx: StepContext) -> dict[str, Any]:
    """model/paged_decode.py on the device against the dense path (blocks gathered, one
    SDPA), one chunk and many (online softmax), fp32 and bf16; then one engine with
    paged decode and one with the dense decode cache give the same greedy tokens."""
    import torch
    import torch.nn.functional as F

    from kvpush.model.paged_decode import paged_decode_attention

    dev, figs = ctx.device, ctx.figures
    g = torch.Generator().manual_seed(3)
    B, H, hkv, D, bs, NB = 6, 8, 2, 64, 16, 128
    lens = [1, 17, 100, 333, 512, 700]
    nbs = [-(-n // bs) for n in lens]
    width = max(nbs)
    perm = torch.randperm(NB, generator=g).tolist()
    tables = torch.zeros((B, width), dtype=torch.long)
    used = 0
    for i, nb in enumerate(nbs):
        tables[i, :nb] = torch.tensor(perm[used:used + nb])
        used += nb
    mask = torch.full((B, 1, 1, width * bs), float("-inf"))
    for i, n in enumerate(lens):
        mask[i, ..., :n] = 0
    for dtype_name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        q = torch.randn((B, H, D), generator=g).to(dev, dtype)
        kv = torch.randn((NB, 2, bs, hkv, D), generator=g).to(dev, dtype)
        t, m = tables.to(dev), mask.to(dev)
        keys = kv[:, 0][t].flatten(1, 2).transpose(1, 2)  # [B, Hkv, L, D]
        values = kv[:, 1][t].flatten(1, 2).transpose(1, 2)
        dense = F.scaled_dot_product_attention(
            q.reshape(B, hkv, H // hkv, D).float(), keys.float(), values.float(),
            attn_mask=m, scale=D**-0.5).reshape(B, H, D)
        for label, chunk in (("one_chunk", None), ("chunked", 2 * B * bs * hkv * D * 4 * 3)):
            out = paged_decode_attention(q, kv, t, m, D**-0.5, chunk_bytes=chunk)
            expect(out.device.type == torch.device(dev).type, "output on another device")
            err = float((out.float() - dense).abs().max())
            figs[f"{dtype_name}_{label}_err"] = err
            expect(err <= PAGED_ATOL[dtype_name],
                   f"paged decode {dtype_name} {label}: error {err:.2e} against dense")
    path = model_dir(ctx, "qwen3", "tiny" if ctx.quick else "small")
    prompts = {f"p{i}": p for i, p in enumerate(_prompts([3, 40, 300], seed=7))}
    outs = {}
    for attn in ("paged", "dense"):
        engine = _engine(path, dev, "float32", decode_attention=attn)
        outs[attn] = _run_all(engine, prompts, 12)
        expect(_blocks_free(engine), f"{attn}: blocks not all free after the run")
        del engine
    figs["engine_paged_equals_dense"] = outs["paged"] == outs["dense"]
    expect(outs["paged"] == outs["dense"], "engine: paged and dense decode tokens differ")
    return figs


#: the announcement's workload in miniature: Qwen3-32B's KV per layer (8 KV heads x
#: 128) and its 64 layers, on a body small enough to build in seconds; max positions
#: 4096 so that one 2048-in/128-out request fits any instance's default KV budget
BENCH_PRESET = "gpu-qwen3-32b-kv"
BENCH_SHAPE = dict(num_hidden_layers=64, hidden_size=256, num_attention_heads=8,
                   num_key_value_heads=8, head_dim=128, intermediate_size=512,
                   max_position_embeddings=4096, rope_theta=1000000.0, vocab_size=1024)


def bench_model(ctx: StepContext) -> dict[str, Any]:
    """Build the bench model and time a 2,048-token prefill on the device (bf16 on
    CUDA): the figure that says whether the model is heavy enough (tens of ms)."""
    import torch

    from kvpush.models import random_model

    shape = dict(BENCH_SHAPE)
    if ctx.quick:
        shape.update(num_hidden_layers=4)
    random_model.PRESETS.setdefault(BENCH_PRESET, shape)
    path = model_dir(ctx, "qwen3", BENCH_PRESET)
    figs = ctx.figures
    figs["model"] = str(path)
    figs["layers"] = shape["num_hidden_layers"]
    kv_token = random_model.kv_bytes_per_token(random_model.preset_config("qwen3", BENCH_PRESET))
    figs["kv_bytes_per_token_bf16"] = kv_token
    cuda = ctx.device.startswith("cuda")
    dtype = "bfloat16" if cuda else "float32"
    n = 512 if ctx.quick else 2048
    engine = _engine(path, ctx.device, dtype, block_size=32, num_blocks=n // 32 + 8,
                     max_model_len=n + 32, max_num_batched_tokens=n)
    times = []
    for i, prompt in enumerate(_prompts([n] * 4, seed=11)):  # distinct: no prefix hits
        engine.add_request(f"w{i}", prompt, _one_token())
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()  # the whole prompt in one step (max_num_batched_tokens = n)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        while engine.has_work():
            engine.step()
    figs["prefill_tokens"] = n
    figs["prefill_ms"] = round(1000 * min(times[1:]), 2)  # the first one warms up
    figs["dtype"] = dtype
    expect(_blocks_free(engine), "blocks not all free after the prefills")
    return figs


def _one_token():
    from kvpush.sampling_params import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
