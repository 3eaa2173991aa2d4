"""The API process and the router never import torch: `kvpush serve`'s HTTP side, its
engine-core client and `kvpush router` load without it, tokenizer included, and the
tokenizer they load that way is AutoTokenizer's own; dtypes are names until the engine
core builds the model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvpush.dtypes import NAMES, Dtype
from kvpush.models.tokenizer import load_tokenizer, plain_tokenizer_folder

_PROBE = """
import sys
import kvpush.server.app, kvpush.server.cli, kvpush.engine.core_client
import kvpush.router.app, kvpush.router.cli
from kvpush.config import EngineConfig
from kvpush.models.tokenizer import load_tokenizer
cfg = EngineConfig.build(sys.argv[1], dtype="auto", kv_dtype="bf16", num_blocks=64,
                         max_model_len=256)
tok = load_tokenizer(sys.argv[1])
assert tok.encode("hello world"), "tokenizer gives no ids"
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


def test_server_router_config_and_tokenizer_load_without_torch(tiny_llama):
    out = subprocess.run([sys.executable, "-c", _PROBE, str(tiny_llama)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_plain_folder_tokenizer_is_autotokenizers(model_factory, arch):
    from transformers import AutoTokenizer

    folder = str(model_factory(arch))
    assert plain_tokenizer_folder(folder)
    mine, auto = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert type(mine) is type(auto)
    assert mine.get_vocab() == auto.get_vocab()
    assert mine.all_special_ids == auto.all_special_ids
    assert mine.eos_token_id == auto.eos_token_id
    text = "The capital of France is Paris. <|im_end|> ünïcödé 123"
    assert mine.encode(text) == auto.encode(text)
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert mine.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def test_other_folders_go_through_autotokenizer(tiny_llama, tmp_path):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(tiny_llama, folder)
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    for change in ({"tokenizer_class": "LlamaTokenizer"},
                   {"auto_map": {"AutoTokenizer": ["x.Tok", None]}}):
        (folder / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, **change}))
        assert not plain_tokenizer_folder(str(folder)), change
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "mistral"}))
    assert not plain_tokenizer_folder(str(folder))
    assert not plain_tokenizer_folder(str(tmp_path / "missing"))
    assert not plain_tokenizer_folder("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_dtype_names_widths_and_torch():
    import torch

    for name, d in NAMES.items():
        assert d.torch().itemsize == d.itemsize, name
        assert Dtype.of(d.torch()) is d and Dtype.of(d.value) is d and Dtype.of(d) is d
    with pytest.raises(ValueError):
        Dtype.of(torch.float64)
