"""vLLM's --kv-transfer-config recipes (issue 66, point 2): each key of vLLM's
KVTransferConfig is taken (as the kvpush flag it means) or refused with what to use
instead; kv_role kv_both, vLLM's NixlConnector recipe for both sides, is refused beside a
P/D --role and warned about on a plain instance. Parser and config level: nothing
starts but `kvpush serve`'s refusal path."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvpush.cli import build_parser
from kvpush.errors import ConfigError
from kvpush.server.cli import (
    KV_BOTH_ADVICE,
    VLLM_KV_DEFAULTS,
    VLLM_KV_KEYS_REFUSED,
    VLLM_KV_KEYS_TAKEN,
    build_config,
)

#: the fields of vLLM's KVTransferConfig (vllm/config/kv_transfer.py, vLLM 0.11 - 0.13)
VLLM_FIELDS = ("kv_connector", "engine_id", "kv_buffer_device", "kv_buffer_size", "kv_role",
               "kv_rank", "kv_parallel_size", "kv_ip", "kv_port",
               "kv_connector_extra_config", "kv_connector_module_path",
               "enable_permute_local_kv", "kv_load_failure_policy")
NIXL_BOTH = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}


def _parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_every_vllm_key_is_taken_or_refused_with_advice():
    assert set(VLLM_KV_KEYS_TAKEN) | set(VLLM_KV_KEYS_REFUSED) == set(VLLM_FIELDS)
    assert not set(VLLM_KV_KEYS_TAKEN) & set(VLLM_KV_KEYS_REFUSED)
    assert set(VLLM_KV_DEFAULTS) == set(VLLM_KV_KEYS_REFUSED)


@pytest.mark.parametrize("key, value, advice", [
    ("kv_buffer_size", 5e9, "--kv-cache-memory"),
    ("kv_ip", "10.0.0.1", "--side-channel-host"),
    ("kv_port", 15000, "--side-channel-port"),
    ("kv_parallel_size", 2, "paired by the router"),
    ("kv_rank", 0, "paired by the router"),
    ("kv_connector_module_path", "x.y", "NixlPushConnector"),
    ("enable_permute_local_kv", True, "maps between KV layouts itself"),
])
def test_a_refused_key_says_what_to_use(capsys, key, value, advice):
    cfg = json.dumps({**NIXL_BOTH, "kv_role": "kv_consumer", key: value})
    with pytest.raises(SystemExit) as e:
        _parse("m", "--kv-transfer-config", cfg)
    assert e.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{key} is not taken" in err and advice in err


def test_vllm_defaults_of_refused_keys_pass():
    """vLLM's own defaults (a config dumped from vLLM) say nothing kvpush must refuse."""
    cfg = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer",
           "kv_connector_extra_config": {}, "enable_permute_local_kv": False,
           "kv_rank": None, "kv_connector_module_path": None, "kv_parallel_size": 1,
           "kv_ip": "127.0.0.1", "kv_port": 14579, "kv_buffer_size": 1e9}
    assert _parse("m", "--kv-transfer-config", json.dumps(cfg)).role == "decode"


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_kv_load_failure_policy_sets_its_flag(tiny_llama, policy):
    cfg = json.dumps({"kv_connector": "NixlPushConnector", "kv_role": "kv_consumer",
                      "kv_load_failure_policy": policy})
    args = _parse(str(tiny_llama), "--kv-transfer-config", cfg, "--num-blocks", "64",
                  "--insecure-kv-params")
    assert args.kv_load_failure_policy == policy
    assert build_config(args).kv_transfer.load_failure_policy == policy


@pytest.mark.parametrize("role, use", [("prefill", "kv_producer"), ("decode", "kv_consumer")])
def test_kv_both_with_a_pd_role_is_refused(tiny_llama, role, use):
    for argv in (["--kv-transfer-config", json.dumps(NIXL_BOTH), "--role", role],
                 ["--role", role, "--kv-transfer-config", json.dumps(NIXL_BOTH)]):
        args = _parse(str(tiny_llama), *argv, "--num-blocks", "64", "--insecure-kv-params")
        assert args.role == role  # whichever comes first, kv_both does not set a role
        with pytest.raises(ConfigError) as e:
            build_config(args)
        assert "kvpush needs kv_producer or kv_consumer" in str(e.value)
        assert f"use kv_role {use}" in str(e.value)


def test_kv_both_alone_is_a_plain_instance(tiny_llama):
    args = _parse(str(tiny_llama), "--kv-transfer-config", json.dumps(NIXL_BOTH),
                  "--num-blocks", "64")
    assert (args.role, args.kv_transfer) == ("both", "pull")
    assert not build_config(args).kv_transfer.enabled


def test_serve_refuses_kv_both_with_a_role_before_anything_starts(tiny_llama):
    """The command itself: exit status 1 and the message, no engine started."""
    r = subprocess.run([sys.executable, "-m", "kvpush", "serve", str(tiny_llama),
                        "--kv-transfer-config", json.dumps(NIXL_BOTH), "--role", "decode",
                        "--port", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "kvpush needs kv_producer or kv_consumer" in r.stderr, r.stderr
    assert KV_BOTH_ADVICE.split(";")[0] in " ".join(r.stderr.split())
