"""bfloat16 engine against the float32 HF reference, and ``--dtype auto``'s choice.

bf16 keeps 8 bits of mantissa: on the tiny random models a logit of ~35 carries an
error of up to ~1 (HF's own bf16 forward differs from its fp32 one by 0.4-1.0), and
greedy tokens of bf16 and fp32 can part at the first token where two logits are that
close (HF bf16's and HF fp32's own did, on two prompts of eight). So the parity check
has a tolerance in two parts, both measured against HF in float32:

* logits: kvpush bf16's max abs error, at the prefill's last position and at every
  decode step (teacher-forced on the fp32 reference's tokens), is at most
  ``BF16_ERR_FACTOR`` (2) times HF bf16's own max abs error on the same positions, plus
  ``BF16_ERR_SLACK`` (0.05);
* greedy tokens: at every position where the fp32 reference's top-1 logit leads its
  top-2 by more than twice that bound, kvpush bf16 picks the same token (a near-tie can
  go either way in bf16; a clear lead cannot).
"""

from __future__ import annotations

import pytest
import torch

from engine_helpers import assert_all_blocks_free, hf_model, make_engine, random_prompts
from kvpush import auto_dtype
from kvpush.config import EngineConfig, dtype_name, resolve_dtype
from kvpush.dtypes import Dtype
from kvpush.sampling_params import SampledToken, SamplingParams

BF16_ERR_FACTOR = 2.0
BF16_ERR_SLACK = 0.05
DECODE_STEPS = 8


@torch.inference_mode()
def _hf_bf16_logits(model_dir, tokens: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    return m(torch.tensor([tokens])).logits[0].float()


def _engine_logits_teacher_forced(engine, prompt: list[int], forced: list[int]):
    """kvpush's logits rows: the prefill's last position, then one per decode step fed
    ``forced`` (the reference's tokens), each a [vocab] float32 tensor."""
    engine.add_request("r", prompt, SamplingParams(max_tokens=len(forced) + 1,
                                                   temperature=0, ignore_eos=True))
    rows: list[torch.Tensor] = []
    for tok in forced:
        plan = engine.scheduler.schedule()
        rows.append(engine.runner.forward(plan)[0].float())
        engine.scheduler.update_after_step(plan, {"r": SampledToken(tok)})
    plan = engine.scheduler.schedule()
    rows.append(engine.runner.forward(plan)[0].float())
    engine.abort_request("r")
    return torch.stack(rows)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_matches_fp32_reference_within_bf16_tolerance(model_factory, arch):
    model_dir = model_factory(arch)
    prompt = random_prompts([45], seed=5)[0]
    with torch.inference_mode():  # the fp32 reference's greedy continuation
        seq = list(prompt)
        for _ in range(DECODE_STEPS):
            seq.append(int(hf_model(model_dir)(torch.tensor([seq])).logits[0, -1].argmax()))
        ref = hf_model(model_dir)(torch.tensor([seq])).logits[0].float()
    forced = seq[len(prompt):]
    ref = ref[len(prompt) - 1:]  # rows that predict forced[0..] and the one after
    hf16 = _hf_bf16_logits(model_dir, seq)[len(prompt) - 1:]

    engine = make_engine(model_dir, dtype="bfloat16")
    assert engine.runner.kv_region.layout.dtype == "bfloat16"
    got = _engine_logits_teacher_forced(engine, prompt, forced)
    assert_all_blocks_free(engine)

    hf16_err = float((hf16 - ref).abs().max())
    bound = BF16_ERR_FACTOR * hf16_err + BF16_ERR_SLACK
    err = float((got - ref).abs().max())
    assert err <= bound, f"bf16 max abs logit error {err:.3f} > {bound:.3f} " \
        f"(HF bf16's {hf16_err:.3f})"
    # bf16 is not fp32: the engine must actually have computed in bf16
    assert err > 1e-3

    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * bound
    assert clear.any(), "no position with a clear lead: the check would test nothing"
    assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])


# ---- --dtype auto ---------------------------------------------------------------------
CPUINFO = "processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: fpu sse avx2 avx512f {}\n"


@pytest.mark.parametrize("extra,want", [
    ("", Dtype.FLOAT32),
    ("avx512_bf16", Dtype.BFLOAT16),
    ("amx_tile amx_bf16", Dtype.BFLOAT16),
    ("avx512_fp16", Dtype.FLOAT32),
])
def test_auto_picks_bf16_only_with_bf16_instructions(extra, want):
    flags = auto_dtype.cpu_flags(CPUINFO.format(extra))
    assert "avx512f" in flags
    choice = auto_dtype.choose("cpu", flags)
    assert choice.dtype == want
    assert choice.reason.startswith("auto: ")
    assert auto_dtype.cpu_flags("no flags line here") == frozenset()


def test_auto_resolves_in_the_engine_config(tiny_llama):
    want = auto_dtype.choose("cpu")
    cfg = EngineConfig.build(tiny_llama, dtype="auto", num_blocks=64, max_model_len=256)
    assert cfg.dtype == want.dtype and cfg.cache.dtype == want.dtype
    assert cfg.dtype_reason == want.reason
    # the KV dtype may be given apart from the weights'
    cfg = EngineConfig.build(tiny_llama, dtype="auto", kv_dtype="bfloat16", num_blocks=64,
                             max_model_len=256)
    assert cfg.cache.dtype is Dtype.BFLOAT16 and cfg.dtype == want.dtype
    assert resolve_dtype("fp32", "cpu") == (Dtype.FLOAT32, "asked for")
    # the library's default stays float32 (fp32 references in tests and benchmarks)
    assert EngineConfig.build(tiny_llama, num_blocks=64, max_model_len=256).dtype is \
        Dtype.FLOAT32


def test_serve_defaults_to_auto_and_kv_info_shows_the_dtype(tiny_llama):
    from kvpush.cli import build_parser
    from kvpush.server.cli import build_config

    args = build_parser().parse_args(["serve", str(tiny_llama), "--num-blocks", "64",
                                      "--max-model-len", "256"])
    assert args.dtype == "auto"
    cfg = build_config(args)
    assert cfg.dtype == auto_dtype.choose("cpu").dtype
    engine = make_engine(tiny_llama, dtype="bfloat16")
    info = engine.kv_info()
    assert info.dtype == "bfloat16" == info.layout["dtype"]
    assert info.dtype_reason == "asked for"
    assert dtype_name(cfg.dtype) in ("float32", "bfloat16")


@pytest.mark.parametrize("native,want", [(True, Dtype.BFLOAT16), (False, Dtype.FLOAT32)])
def test_auto_on_cuda_follows_native_bf16_support(monkeypatch, native, want):
    """No GPU here: torch.cuda's answers are stubbed; the choice asks for native bf16
    (an emulated one would be slower than fp32) and never reads the CPU flags."""
    asked = {}

    def supported(including_emulation=True):
        asked["emulation"] = including_emulation
        return native

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", supported)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Test GPU")
    monkeypatch.setattr(auto_dtype, "cpu_flags", lambda cpuinfo=None: pytest.fail("read"))
    choice = auto_dtype.choose("cuda:1")
    assert choice.dtype == want and asked == {"emulation": False}
    assert ("Test GPU" in choice.reason) == native
