"""The command line as a vLLM user meets it (issue 54, point 1): no abbreviations, unknown
flags reported by their sub-command with a "did you mean", vLLM's flag names where the
meaning is the same, a clear refusal (and what to use instead) where kvpush does not take
one, `kvpush up MODEL`, `kvpush --version`. Parser-level: nothing is started."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvpush import __version__
from kvpush.cli import build_parser, main
from kvpush.errors import ConfigError


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def _usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """stderr of a parse that must fail with argparse's usage error (status 2)."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(list(argv))
    assert e.value.code == 2
    return " ".join(capsys.readouterr().err.split())


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


# ---- abbreviations, unknown flags, --version -----------------------------------------
def test_no_parser_takes_abbreviations():
    parsers = list(_parsers(build_parser()))
    assert len(parsers) > 10  # every command and sub-command
    assert [p.prog for p in parsers if p.allow_abbrev] == []


@pytest.mark.parametrize("argv, flag, prog", [
    (["up", "--prefil", "2"], "--prefill", "kvpush up"),
    (["serve", "m", "--max-model-length", "512"], "--max-model-len", "kvpush serve"),
    (["router", "--decod", "http://a"], "--decode", "kvpush router"),
    (["bench", "--url", "http://a", "--num-prompt", "3"], "--num-prompts", "kvpush bench"),
    (["bench", "compare", "--out", "d", "--rate", "1"], "--rates", "kvpush bench compare"),
    (["simulate", "run", "--profil", "x"], "--profile", "kvpush simulate run"),
    (["--verson"], "--version", "kvpush"),
])
def test_unknown_flag_gets_its_commands_usage_and_a_did_you_mean(capsys, argv, flag, prog):
    err = _usage_error(capsys, *argv)
    assert err.startswith(f"usage: {prog} ")
    assert f"{prog}: error: unrecognized arguments:" in err
    assert f"did you mean {flag}?" in err


def test_unknown_flag_that_made_another_error(capsys):
    # a required positional missing because of it: the flag is reported, not MODEL_DIR
    err = _usage_error(capsys, "serve", "--max-model-length", "512")
    assert "usage: kvpush serve " in err and "did you mean --max-model-len?" in err
    assert "required" not in err
    # its value taken for bench's sub-command
    err = _usage_error(capsys, "bench", "--num-prompt", "3")
    assert err.startswith("usage: kvpush bench ") and "invalid choice" not in err
    assert "did you mean --num-prompts?" in err


def test_unknown_flag_without_a_close_match(capsys):
    err = _usage_error(capsys, "serve", "m", "--zzzzzz")
    assert "unrecognized arguments: --zzzzzz" in err and "did you mean" not in err


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvpush {__version__}"


def _refused(capsys, argv, says):
    err = _usage_error(capsys, *argv)
    prog = "kvpush " + argv[0]
    assert err.startswith(f"usage: {prog} ")
    assert f"{prog} does not take vLLM's {next(a for a in argv[1:] if a[0] == '-')}" in err
    assert says in err


# ---- models and dtypes by vLLM's names ----------------------------------------------
def test_vllm_dtype_names():
    import torch

    from kvpush.config import parse_dtype

    assert parse_dtype("half").torch() is torch.float16
    assert parse_dtype("float").torch() is torch.float32
    assert parse_dtype("bf16").torch() is torch.bfloat16
    with pytest.raises(ConfigError, match="half"):
        parse_dtype("double")


@pytest.fixture
def installed_smollm2(tmp_path, monkeypatch, tiny_llama) -> Path:
    """smollm2-135m 'installed' in a private cache (the tiny model under its name)."""
    monkeypatch.setenv("KVPUSH_HOME", str(tmp_path))
    (tmp_path / "models").mkdir()
    target = tmp_path / "models" / "smollm2-135m"
    target.symlink_to(tiny_llama)
    return target


def test_hugging_face_id_of_an_installed_model(installed_smollm2):
    from kvpush.models.registry import known_name, resolve_model

    hf_id = "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert known_name(hf_id) == known_name(hf_id.upper()) == "smollm2-135m"
    assert known_name("smollm2-135m") == "smollm2-135m" and known_name("x/y") is None
    assert resolve_model(hf_id) == installed_smollm2
    assert resolve_model(hf_id.lower()) == installed_smollm2


def test_hugging_face_id_not_installed(tmp_path, monkeypatch):
    from kvpush.models.registry import resolve_model

    monkeypatch.setenv("KVPUSH_HOME", str(tmp_path))
    with pytest.raises(ConfigError, match="kvpush models install smollm2-135m"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")


# ---- serve: vLLM's names -------------------------------------------------------------
@pytest.mark.parametrize("argv, says", [
    (["serve", "m", "--gpu-memory-utilization", "0.9"], "--kv-cache-memory"),
    (["serve", "--gpu-memory-utilization", "0.9", "m"], "--kv-cache-memory"),
    (["serve", "m", "--trust-remote-code"], "never runs a model's code"),
    (["serve", "m", "--pipeline-parallel-size", "2"], "not implemented yet"),
    (["serve", "m", "--enforce-eager"], "drop the flag"),
])
def test_serve_refuses_vllm_flags_it_does_not_take(capsys, argv, says):
    _refused(capsys, argv, says)


def test_refused_flags_are_hidden_and_never_suggested(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    help_text = capsys.readouterr().out
    assert "--trust-remote-code" not in help_text and "--enforce-eager" not in help_text
    assert "use --kv-cache-memory SIZE" in " ".join(help_text.split())  # the epilog
    err = _usage_error(capsys, "serve", "m", "--enforce-eagr")
    assert "did you mean" not in err


def test_serve_tensor_parallel_size(capsys):
    """serve takes N (the model's shape is checked at start: test_tensor_parallel.py)."""
    assert _parse("serve", "m").tensor_parallel_size == 1
    assert _parse("serve", "m", "--tensor-parallel-size", "4").tensor_parallel_size == 4
    assert _parse("serve", "m", "-tp", "2").tensor_parallel_size == 2
    err = _usage_error(capsys, "serve", "m", "-tp", "0")
    assert "must be at least 1, got 0" in err


def test_prefix_caching_flags():
    assert _parse("serve", "m").enable_prefix_caching is True
    assert _parse("serve", "m", "--enable-prefix-caching").enable_prefix_caching is True
    assert _parse("serve", "m", "--no-enable-prefix-caching").enable_prefix_caching is False
    assert _parse("serve", "m", "--no-prefix-caching").enable_prefix_caching is False


def test_kv_cache_dtype_is_kv_dtype(capsys):
    assert _parse("serve", "m").kv_dtype is None
    assert _parse("serve", "m", "--kv-cache-dtype", "bfloat16").kv_dtype == "bfloat16"
    assert _parse("serve", "m", "--kv-dtype", "float16").kv_dtype == "float16"
    assert _parse("serve", "m", "--kv-cache-dtype", "auto").kv_dtype is None  # = --dtype
    err = _usage_error(capsys, "serve", "m", "--kv-cache-dtype", "fp8")
    assert "fp8 KV cache is not implemented" in err


def test_build_config_with_vllm_names(tiny_llama):
    import torch

    from kvpush.server.cli import build_config

    cfg = build_config(_parse(
        "serve", str(tiny_llama), "--dtype", "half", "--kv-cache-dtype", "auto",
        "--num-blocks", "64", "--no-enable-prefix-caching", "--tokenizer", str(tiny_llama),
        "-tp", "1"))
    assert cfg.dtype.torch() is torch.float16 and cfg.cache.dtype.torch() is torch.float16
    assert not cfg.cache.enable_prefix_caching
    cfg = build_config(_parse("serve", str(tiny_llama), "--dtype", "float",
                              "--kv-cache-dtype", "bf16", "--num-blocks", "64"))
    assert cfg.dtype.torch() is torch.float32 and cfg.cache.dtype.torch() is torch.bfloat16


def test_tokenizer_only_the_models_own(tiny_llama, tiny_qwen3):
    from kvpush.server.cli import build_config

    with pytest.raises(ConfigError, match="model folder's own tokenizer"):
        build_config(_parse("serve", str(tiny_llama), "--tokenizer", str(tiny_qwen3),
                            "--num-blocks", "64"))
    with pytest.raises(ConfigError, match="model folder's own tokenizer"):
        build_config(_parse("serve", str(tiny_llama), "--tokenizer", "no/such-tokenizer",
                            "--num-blocks", "64"))


def test_chat_template(tmp_path, tiny_llama):
    from kvpush.models.tokenizer import load_tokenizer
    from kvpush.server.chat import render_chat
    from kvpush.server.cli import load_chat_template

    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    f = tmp_path / "t.jinja"
    f.write_text(template)
    assert load_chat_template(str(f)) == template
    assert load_chat_template(template) == template
    assert _parse("serve", "m", "--chat-template", str(f)).chat_template == str(f)
    with pytest.raises(ConfigError, match="no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ConfigError, match="not a valid Jinja template"):
        load_chat_template("{% for m in messages %}")
    # what run_serve does with it: the HTTP process's tokenizer renders chats
    tok = load_tokenizer(str(tiny_llama))
    tok.chat_template = load_chat_template(str(f))
    assert render_chat(tok, [{"role": "user", "content": "hi"}]) == "<user>hi"


def test_disable_log_requests():
    assert _parse("serve", "m").disable_log_requests is False
    assert _parse("serve", "m", "--disable-log-requests").disable_log_requests is True


@pytest.mark.parametrize("connector, role, mode, kv_role", [
    ("NixlConnector", "kv_producer", "pull", "prefill"),
    ("NixlConnector", "kv_consumer", "pull", "decode"),
    ("NixlPushConnector", "kv_producer", "push", "prefill"),
    ("NixlPushConnector", "kv_consumer", "push", "decode"),
])
def test_kv_transfer_config(connector, role, mode, kv_role):
    cfg = json.dumps({"kv_connector": connector, "kv_role": role})
    args = _parse("serve", "m", "--kv-transfer-config", cfg)
    assert (args.kv_transfer, args.role) == (mode, kv_role)
    # a later --role overrides it (it is an alias of --kv-transfer and --role)
    assert _parse("serve", "m", "--kv-transfer-config", cfg, "--role", "decode").role == \
        "decode"


def test_kv_transfer_config_engine_id_and_buffer_device(tiny_llama):
    from kvpush.server.cli import build_config

    cfg = json.dumps({"kv_connector": "NixlPushConnector", "kv_role": "kv_consumer",
                      "engine_id": "d-1", "kv_buffer_device": "cuda"})
    args = _parse("serve", str(tiny_llama), "--kv-transfer-config", cfg, "--num-blocks",
                  "64", "--insecure-kv-params")
    assert args.engine_id == "d-1"
    with pytest.raises(ConfigError, match="kv_buffer_device 'cuda'"):
        build_config(args)  # the KV lives on --device, cpu here


@pytest.mark.parametrize("value, says", [
    ("{", "not JSON"),
    ("[1]", "must be a JSON object"),
    ('{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}', "NIXL only"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_other"}', "kv_role 'kv_other'"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_rank": 0}',
     "kv_rank is not taken: instances are paired by the router"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", '
     '"kv_connector_extra_config": {"x": 1}}', "kv_connector_extra_config is not taken"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_fancy": 1}',
     "does not take kv_fancy"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_producer", '
     '"kv_load_failure_policy": "retry"}', "kv_load_failure_policy 'retry': one of fail"),
])
def test_kv_transfer_config_refused(capsys, value, says):
    err = _usage_error(capsys, "serve", "m", "--kv-transfer-config", value)
    assert "usage: kvpush serve" in err and says in err


def test_serve_a_hugging_face_id(installed_smollm2):
    from kvpush.server.cli import _resolve_model, build_config

    hf_id = "HuggingFaceTB/SmolLM2-135M-Instruct"
    # served under the name the user gave, as vLLM does
    assert _resolve_model(hf_id) == (str(installed_smollm2), hf_id)
    cfg = build_config(_parse("serve", hf_id, "--num-blocks", "64", "--tokenizer", hf_id))
    assert cfg.served_model_name == hf_id


# ---- up: MODEL, --host, --served-model-name ------------------------------------------
def test_up_model_positional_or_flag():
    from kvpush.cluster.cli import model_arg

    assert model_arg(_parse("up")) is None
    assert model_arg(_parse("up", "smollm2-135m")) == "smollm2-135m"
    assert model_arg(_parse("up", "--model", "smollm2-135m")) == "smollm2-135m"
    assert model_arg(_parse("up", "a", "--model", "a")) == "a"
    with pytest.raises(ValueError, match="give one"):
        model_arg(_parse("up", "a", "--model", "b"))


def test_up_two_models_is_a_usage_error(capsys):
    assert main(["up", "a", "--model", "b"]) == 2
    assert "two models" in capsys.readouterr().err


def test_up_host_and_served_model_name():
    from kvpush.cluster import cli as up_cli
    from kvpush.cluster.launcher import Child, ChildSpec

    args = _parse("up", "m", "--host", "0.0.0.0", "--served-model-name", "my-model")
    argv = up_cli.serve_argv(args, "m", "decode", 1234, 1)
    assert argv[argv.index("--served-model-name") + 1] == "my-model"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"  # instances stay on loopback
    rargv = up_cli.router_argv(args, 8000, ["http://p"], ["http://d"])
    assert rargv[rargv.index("--host") + 1] == "0.0.0.0"
    inst = [Child(ChildSpec("decode-0", "decode", [], 1), Path("x"), None)]  # type: ignore
    spec = up_cli.plan_router(args, 8000, inst)
    assert spec.url == "http://127.0.0.1:8000"  # reached (health checks) over loopback
    defaults = _parse("up")
    assert defaults.host == "127.0.0.1"
    assert "--served-model-name" not in up_cli.serve_argv(defaults, "m", "both", 1, 1)
    assert up_cli.dial_host("10.0.0.5") == "10.0.0.5" and up_cli.dial_host("::") == "[::1]"


def test_up_refuses_vllm_flags_it_does_not_take(capsys):
    _refused(capsys, ["up", "--gpu-memory-utilization", "0.9"], "--kv-cache-memory")


@pytest.mark.parametrize("command", [["up"], ["bench", "compare", "--out", "o"]])
def test_up_and_compare_tensor_parallel_size_per_role(capsys, command):
    """-tp N for every instance, --prefill-tp/--decode-tp (long: --prefill-tensor-
    parallel-size, --decode-tensor-parallel-size) per role; unset overrides are None."""
    a = _parse(*command)
    assert (a.tensor_parallel_size, a.prefill_tp, a.decode_tp) == (1, None, None)
    a = _parse(*command, "-tp", "2", "--decode-tp", "1")
    assert (a.tensor_parallel_size, a.prefill_tp, a.decode_tp) == (2, None, 1)
    a = _parse(*command, "--tensor-parallel-size", "4", "--prefill-tensor-parallel-size",
               "2", "--decode-tensor-parallel-size", "8")
    assert (a.tensor_parallel_size, a.prefill_tp, a.decode_tp) == (4, 2, 8)
    for flag in ("-tp", "--prefill-tp", "--decode-tp"):
        assert "must be at least 1, got 0" in _usage_error(capsys, *command, flag, "0")


# ---- bench: vLLM's names -------------------------------------------------------------
@pytest.mark.parametrize("argv, says", [
    (["bench", "--backend", "vllm"], "--endpoint completions"),
    (["bench", "--host", "h"], "--base-url http://HOST:PORT"),
    (["bench", "--random-prefix-len", "8"], "--dataset shared-prefix"),
])
def test_bench_refuses_vllm_flags_it_does_not_take(capsys, argv, says):
    _refused(capsys, argv, says)


def test_bench_unknown_flag_whose_value_was_read_as_a_command(capsys):
    # --bse-url's value went to bench's sub-command positional: the flag is the cause
    err = _usage_error(capsys, "bench", "--bse-url", "http://127.0.0.1:8000")
    assert err.startswith("usage: kvpush bench ")
    assert "invalid choice" not in err
    assert "unrecognized arguments: --bse-url" in err and "did you mean --base-url?" in err


def test_bench_vllm_names():
    args = _parse("bench", "--base-url", "http://h:8000/v1", "--dataset-name", "sonnet",
                  "--random-input-len", "64", "--random-output-len", "8",
                  "--metric-percentiles", "50,99", "--endpoint", "/v1/chat/completions")
    assert args.url == "http://h:8000" and args.dataset == "sonnet"
    assert (args.input_len, args.output_len) == (64, 8)
    assert args.percentiles == (50.0, 99.0) and args.endpoint == "chat"
    assert _parse("bench", "--endpoint", "/v1/completions").endpoint == "completions"
    assert _parse("bench", "--endpoint", "chat").endpoint == "chat"


def test_bench_result_dir_and_filename(tmp_path):
    from kvpush.bench.cli import result_path

    result = {"request_rate": 2.0, "model_id": "HuggingFaceTB/SmolLM2-135M-Instruct"}
    assert result_path(_parse("bench"), result) is None
    assert result_path(_parse("bench", "--out", "r.json"), result) == "r.json"
    path = result_path(_parse("bench", "--result-dir", str(tmp_path)), result, now=0)
    assert Path(path).parent == tmp_path
    assert Path(path).name.startswith("kvpush-2.0qps-SmolLM2-135M-Instruct-")
    path = result_path(_parse("bench", "--save-result", "--max-concurrency", "4"), result)
    assert Path(path).parent == Path(".") and "-2.0qps-concurrency4-" in path
    path = result_path(_parse("bench", "--result-dir", str(tmp_path), "--result-filename",
                              "a.json"), result)
    assert path == str(tmp_path / "a.json")


def test_bench_out_and_result_dir_is_a_usage_error(capsys, tmp_path):
    assert main(["bench", "--base-url", "http://127.0.0.1:9", "--out", "x.json",
                 "--result-dir", str(tmp_path)]) == 2
    assert "not both" in capsys.readouterr().err
