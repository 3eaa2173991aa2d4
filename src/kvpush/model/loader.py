"""Load a Hugging Face-format folder (config.json + *.safetensors) into DecoderModel."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from kvpush.config import ConfigError, ModelConfig
from kvpush.model.llama import DecoderModel, LayerWeights
from kvpush.model.parallel import TPShard


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors weights in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensors[name] = sf.get_tensor(name)
    return tensors


def load_model(
    cfg: ModelConfig, dtype: torch.dtype, device: str, max_positions: int,
    shard: TPShard | None = None,
) -> DecoderModel:
    """The model in ``cfg.path``; with ``shard``, only that tensor-parallel rank's part
    (model/parallel.py: the caller sets the model's ``all_reduce``)."""
    raw = _read_tensors(Path(cfg.path))

    def take(name: str, required: bool = True) -> torch.Tensor | None:
        t = raw.pop(name, None)
        if t is None:
            if required:
                raise ConfigError(f"weight {name!r} missing from {cfg.path}")
            return None
        return t.to(device=device, dtype=dtype).contiguous()

    def cat(*ts: torch.Tensor | None) -> torch.Tensor | None:
        if all(t is None for t in ts):
            return None
        if any(t is None for t in ts):
            raise ConfigError(f"{cfg.path}: some projections have a bias and others not")
        return torch.cat(ts, dim=0).contiguous()

    layers: list[LayerWeights] = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        q, k, v = (take(p + f"self_attn.{n}_proj.weight") for n in "qkv")
        qb, kb, vb = (take(p + f"self_attn.{n}_proj.bias", required=False) for n in "qkv")
        gate, up = take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")
        gb = take(p + "mlp.gate_proj.bias", required=False)
        ub = take(p + "mlp.up_proj.bias", required=False)
        qn = take(p + "self_attn.q_norm.weight", required=cfg.arch == "qwen3")
        kn = take(p + "self_attn.k_norm.weight", required=cfg.arch == "qwen3")
        layer = LayerWeights(
            input_norm=take(p + "input_layernorm.weight"),
            qkv=cat(q, k, v),
            qkv_bias=cat(qb, kb, vb),
            o=take(p + "self_attn.o_proj.weight"),
            o_bias=take(p + "self_attn.o_proj.bias", required=False),
            q_norm=qn,
            k_norm=kn,
            post_norm=take(p + "post_attention_layernorm.weight"),
            gate_up=cat(gate, up),
            gate_up_bias=cat(gb, ub),
            down=take(p + "mlp.down_proj.weight"),
            down_bias=take(p + "mlp.down_proj.bias", required=False),
        )
        expect_q = cfg.num_heads * cfg.head_dim
        if q.shape[0] != expect_q or k.shape[0] != cfg.num_kv_heads * cfg.head_dim:
            raise ConfigError(
                f"{cfg.path}: layer {i} projection shapes {tuple(q.shape)}/{tuple(k.shape)} "
                "do not match config heads/head_dim"
            )
        layers.append(layer if shard is None else shard.shard_layer(layer, cfg))
    embed = take("model.embed_tokens.weight")
    final_norm = take("model.norm.weight")
    lm_head = take("lm_head.weight", required=not cfg.tie_word_embeddings)
    if lm_head is None:
        lm_head = embed
    leftover = [n for n in raw if not n.endswith("rotary_emb.inv_freq")]
    if leftover:
        raise ConfigError(f"{cfg.path}: unexpected weights {leftover[:5]}")
    local = cfg if shard is None else shard.local_config(cfg)
    return DecoderModel(local, embed, layers, final_norm, lm_head, max_positions, device)
