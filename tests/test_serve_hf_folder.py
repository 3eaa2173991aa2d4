"""Serving another model (issue 66, point 7): a Hugging Face folder of a Llama or Qwen3
model is served from its path under its folder's name, and a Hugging Face id kvpush does
not know is answered with how to do that. A random-weight Qwen3 folder written by
`kvpush models make-random` stands in for a downloaded one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvpush.cli import build_parser
from kvpush.errors import ConfigError
from kvpush.server.cli import build_config
from server_helpers import ServerProcess


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory) -> Path:
    """What `huggingface-cli download ... --local-dir Qwen3-Tiny` would leave, made by
    the command a user has."""
    out = tmp_path_factory.mktemp("hf") / "Qwen3-Tiny"
    subprocess.run([sys.executable, "-m", "kvpush", "models", "make-random", "--arch",
                    "qwen3", str(out)], check=True, capture_output=True, timeout=120)
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= {
        p.name for p in out.iterdir()}
    return out


def test_a_hugging_face_folder_is_served_under_its_name(tiny_qwen3):
    """(the session's random Qwen3 folder, as make-random writes it)"""
    cfg = build_config(build_parser().parse_args(["serve", str(tiny_qwen3),
                                                  "--num-blocks", "64"]))
    assert cfg.model.arch == "qwen3" and Path(cfg.model.path) == tiny_qwen3
    assert (cfg.served_model_name or Path(cfg.model.path).name) == tiny_qwen3.name


def test_an_unknown_hugging_face_id_says_how_to_serve_it():
    args = build_parser().parse_args(["serve", "Qwen/Qwen3-0.6B"])
    with pytest.raises(ConfigError) as e:
        build_config(args)
    msg = str(e.value)
    assert "known models: smollm2-135m" in msg
    assert "huggingface-cli download Qwen/Qwen3-0.6B" in msg and "kvpush serve ./" in msg


@pytest.mark.slow  # the make-random command and a server start: a minute or two
def test_the_folder_answers_chats_by_its_name_or_path(qwen3_folder, tmp_path):
    srv = ServerProcess(qwen3_folder, log_dir=tmp_path)
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            assert c.get("/v1/models").json()["data"][0]["id"] == "Qwen3-Tiny"
            for model in ("Qwen3-Tiny", str(qwen3_folder)):
                r = c.post("/v1/chat/completions", json={
                    "model": model, "max_tokens": 4,
                    "messages": [{"role": "user", "content": "hi"}]})
                assert r.status_code == 200, r.text
                assert r.json()["id"].startswith("chatcmpl-")
                assert r.json()["usage"]["completion_tokens"] >= 1
    finally:
        srv.stop()
