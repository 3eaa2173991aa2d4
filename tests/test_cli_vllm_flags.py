"""The command line as a vLLM user meets it (issue 54, point 1): no abbreviations, unknown
flags reported by their sub-command with a "did you mean", vLLM's flag names where the
meaning is the same, a clear refusal (and what to use instead) where kvpush does not take
one, `kvpush up MODEL`, `kvpush --version`. Parser-level: nothing is started."""

from __future__ import annotations

import argparse
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

    assert parse_dtype("half") is torch.float16
    assert parse_dtype("float") is torch.float32
    assert parse_dtype("bf16") is torch.bfloat16
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
