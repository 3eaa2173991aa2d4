"""Random-weight Llama and Qwen3 models in Hugging Face format, for tests and benchmarks.

:func:`make_random_model` writes an ordinary HF model folder (config.json,
generation_config.json, model.safetensors in fp32, tokenizer.json, tokenizer_config.json
with a ChatML chat template) that both ``transformers`` and kvpush load.

Weights are not HF's default init (std 0.02 gives nearly flat logits, so greedy argmax
ties flip between two correct implementations). Every parameter is drawn from one seeded
generator, in sorted-name order, independent of the transformers version:

* linear weights ~ N(0, (gain / sqrt(fan_in))^2): gain 1 for q/k/v/gate/up,
  :data:`RESID_GAIN` for o_proj/down_proj, :data:`LM_HEAD_GAIN` for an untied lm_head;
* embeddings ~ N(0, (EMBED_NORM / sqrt(hidden))^2), i.e. rows of norm ~ EMBED_NORM;
* RMSNorm weights (including Qwen3's q/k norms) ~ U(0.5, 1.5), the final norm's times
  :data:`FINAL_NORM_SCALE`, so a loader that skips or misplaces a norm weight is caught
  by reference tests.

The gains are chosen so that greedy decoding has clear top-1/top-2 margins (near-ties
only in the tail any random logits have), varied tokens and hidden states of moderate
magnitude; tests/test_models.py::test_greedy_decoding_is_varied_with_clear_margins checks
it, and docs/MEASURED.md has the figures.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from kvpush.models.tokenizer import ENDOFTEXT_ID, IM_END_ID, write_tokenizer

Arch = Literal["llama", "qwen3"]
ARCHS: tuple[str, ...] = ("llama", "qwen3")

#: Row norm of the embedding table (so tied logits spread ~ EMBED_NORM * FINAL_NORM_SCALE).
EMBED_NORM = 4.0
#: Gain of the projections that write into the residual stream (o_proj, down_proj). Twice
#: EMBED_NORM, so the layers, not the input token's own embedding, steer the output (with
#: tied embeddings a weaker residual makes greedy decoding repeat the input token).
RESID_GAIN = 8.0
#: Gain of an untied lm_head (logits spread ~ LM_HEAD_GAIN * FINAL_NORM_SCALE).
LM_HEAD_GAIN = 4.0
#: Scale of the final RMSNorm weight: widens the logit spread (and so the top-1/top-2
#: margins) without changing which token wins or the residual stream.
FINAL_NORM_SCALE = 2.5
_GAINS = {"lm_head": LM_HEAD_GAIN, "o_proj": RESID_GAIN, "down_proj": RESID_GAIN}

#: Model shapes by preset name. ``head_dim`` is explicit (it need not be hidden/heads);
#: ``rope_theta`` is deliberately not HF's default for either arch, so an engine that
#: ignores the config's value fails reference tests.
#:
#: =============  ======  ======  =====  ========  ========  =====  =======  ==========
#: preset         layers  hidden  heads  kv heads  head_dim  inter  max pos  rope_theta
#: =============  ======  ======  =====  ========  ========  =====  =======  ==========
#: tiny           2       64      4      2 (GQA2)  16        128    2048     50000
#: tiny-gqa4      2       64      8      2 (GQA4)  32 (!=8)  128    2048     1000000
#: tiny-mqa       2       64      4      1 (MQA)   16        128    2048     20000
#: small          4       256     8      4 (GQA2)  32        512    4096     500000
#: qwen3-32b-kv   64      256     8      8 (MHA)   128       512    32768    1000000
#: bench          3       128     4      2 (GQA2)  32        256    2048     1000000
#: =============  ======  ======  =====  ========  ========  =====  =======  ==========
#:
#: All have vocab_size 1024 (the test tokenizer's size). ``qwen3-32b-kv`` has the KV
#: footprint of Qwen3-32B: 64 layers x 8 KV heads x 128 x 2 (K and V) x 2 bytes =
#: 256 KiB per token in bf16 (512 KiB in fp32), on a ~90M-parameter body that runs on a
#: CPU; it is meant for transfer benchmarks, not unit tests (~360 MB of fp32 weights). ``bench``
#: is the serving-path benchmarks' model (`kvpush bench handoff`): compute is negligible,
#: so what they measure is HTTP, routing, scheduling and the KV hand-off.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, max_position_embeddings=2048,
        rope_theta=50000.0, vocab_size=1024,
    ),
    "tiny-gqa4": dict(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
        head_dim=32, intermediate_size=128, max_position_embeddings=2048,
        rope_theta=1000000.0, vocab_size=1024,
    ),
    # one KV head: tensor parallelism replicates it on every rank
    "tiny-mqa": dict(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
        head_dim=16, intermediate_size=128, max_position_embeddings=2048,
        rope_theta=20000.0, vocab_size=1024,
    ),
    "small": dict(
        num_hidden_layers=4, hidden_size=256, num_attention_heads=8, num_key_value_heads=4,
        head_dim=32, intermediate_size=512, max_position_embeddings=4096,
        rope_theta=500000.0, vocab_size=1024,
    ),
    "bench": dict(
        num_hidden_layers=3, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=256, max_position_embeddings=2048,
        rope_theta=1000000.0, vocab_size=1024,
    ),
    "qwen3-32b-kv": dict(
        num_hidden_layers=64, hidden_size=256, num_attention_heads=8, num_key_value_heads=8,
        head_dim=128, intermediate_size=512, max_position_embeddings=32768,
        rope_theta=1000000.0, vocab_size=1024,
    ),
}

#: Whether embeddings are tied when the caller does not say: Llama ties (like SmolLM2),
#: Qwen3 does not (like Qwen3-32B), so the default tests cover both layouts.
DEFAULT_TIED: dict[str, bool] = {"llama": True, "qwen3": False}


def _check(arch: str, preset: str) -> None:
    from kvpush.errors import ConfigError

    if arch not in ARCHS:
        raise ConfigError(f"unknown arch {arch!r}; choose one of: {', '.join(ARCHS)}")
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")


def preset_config(
    arch: str, preset: str = "tiny", tie_word_embeddings: bool | None = None
) -> dict[str, Any]:
    """The config.json content :func:`make_random_model` writes, without building weights.

    Raises :class:`kvpush.config.ConfigError` for an unknown arch or preset.
    """
    _check(arch, preset)
    p = dict(PRESETS[preset])
    rope_theta = p.pop("rope_theta")
    tied = DEFAULT_TIED[arch] if tie_word_embeddings is None else bool(tie_word_embeddings)
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen3ForCausalLM"],
        "model_type": arch,
        **p,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "tie_word_embeddings": tied,
        "bos_token_id": None,
        "eos_token_id": IM_END_ID,
        "pad_token_id": ENDOFTEXT_ID,
        "use_cache": True,
    }
    if arch == "llama":
        cfg["mlp_bias"] = False
    else:
        cfg["use_sliding_window"] = False
        cfg["sliding_window"] = None
        cfg["max_window_layers"] = p["num_hidden_layers"]
    return cfg


def kv_bytes_per_token(config: Mapping[str, Any], elem_bytes: int = 2) -> int:
    """KV-cache bytes per token of a config dict (K and V, all layers); 2 = bf16."""
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    return 2 * int(config["num_hidden_layers"]) * kv_heads * head_dim * elem_bytes


def _init_weights(model: Any, seed: int) -> None:
    """Overwrite every parameter from one generator seeded with `seed` (see module doc)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    tied = bool(model.config.tie_word_embeddings)
    with torch.no_grad():
        # named_parameters() lists a tied lm_head once (as the embedding).
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                scale = FINAL_NORM_SCALE if name == "model.norm.weight" else 1.0
                param.copy_((0.5 + torch.rand(param.shape, generator=gen)) * scale)
            elif name.endswith("embed_tokens.weight"):
                param.copy_(torch.randn(param.shape, generator=gen) * EMBED_NORM / hidden**0.5)
            elif name.endswith(".weight") and param.dim() == 2:
                gain = _GAINS.get(name.rsplit(".", 2)[-2], 1.0)
                std = gain / math.sqrt(param.shape[1])
                param.copy_(torch.randn(param.shape, generator=gen) * std)
            elif name.endswith(".bias"):
                param.zero_()
            else:  # pragma: no cover - a parameter kind these archs do not have
                raise RuntimeError(f"no init rule for parameter {name}")
    if tied:
        model.tie_weights()


def make_random_model(
    out_dir: str | Path,
    arch: str,
    preset: str = "tiny",
    seed: int = 0,
    tie_word_embeddings: bool | None = None,
) -> Path:
    """Write a random-weight `arch` model of shape `preset` into `out_dir`; return it.

    `arch` is ``"llama"`` or ``"qwen3"``; `preset` a key of :data:`PRESETS`; `seed` makes
    the weights reproducible (same seed, same bytes); `tie_word_embeddings` overrides
    :data:`DEFAULT_TIED`. The folder gets config.json, generation_config.json,
    model.safetensors (fp32), tokenizer.json and tokenizer_config.json.
    """
    cfg = preset_config(arch, preset, tie_word_embeddings)
    import torch
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    config_cls, model_cls = (
        (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen3Config, Qwen3ForCausalLM)
    )
    hf_kwargs = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type",
                                                          "rope_theta")}
    hf_config = config_cls(**hf_kwargs)
    hf_config.architectures = cfg["architectures"]
    torch.manual_seed(seed)
    model = model_cls(hf_config).to(torch.float32)
    _init_weights(model, seed)
    model.generation_config = GenerationConfig(
        eos_token_id=[IM_END_ID, ENDOFTEXT_ID],
        pad_token_id=ENDOFTEXT_ID,
        do_sample=False,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    # Keep a top-level rope_theta beside rope_parameters: older readers look there.
    cfg_path = out / "config.json"
    written = json.loads(cfg_path.read_text())
    written.setdefault("rope_theta", cfg["rope_theta"])
    cfg_path.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    write_tokenizer(out, vocab_size=cfg["vocab_size"],
                    model_max_length=cfg["max_position_embeddings"])
    return out
