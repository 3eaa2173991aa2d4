"""Issue 40, finding 7: a cluster secret file that group or others can read is refused
by `kvpush serve` and `kvpush router` unless forced (it used to be only a warning)."""

from __future__ import annotations

import pytest

from kvpush.cli import build_parser
from kvpush.router.cli import build_config
from kvpush.router.config import RouterConfigError


@pytest.fixture
def loose(tmp_path, monkeypatch):
    monkeypatch.delenv("KVPUSH_KV_SECRET", raising=False)
    f = tmp_path / "secret"
    f.write_text("s" * 32 + "\n")
    f.chmod(0o644)
    return f


def test_serve_refuses_a_loose_secret_file_unless_forced(tmp_path, loose, capsys):
    parser = build_parser()
    argv = ["serve", str(tmp_path / "no-model"), "--role", "decode",
            "--kv-secret-file", str(loose)]
    args = parser.parse_args(argv)
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "readable by other users" in err and "--allow-loose-secret-file" in err
    assert "s" * 32 not in err
    args = parser.parse_args([*argv, "--allow-loose-secret-file"])
    args.func(args)  # gets past the secret (and fails on the missing model)
    assert "--allow-loose-secret-file)" not in capsys.readouterr().err


def test_router_refuses_a_loose_secret_file_unless_forced(loose):
    parser = build_parser()
    argv = ["router", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
            "--kv-secret-file", str(loose)]
    with pytest.raises(RouterConfigError, match="readable by other users"):
        build_config(parser.parse_args(argv))
    cfg = build_config(parser.parse_args([*argv, "--allow-loose-secret-file"]))
    assert cfg.kv_secret is not None
