"""Issue 40, finding 7: a cluster secret file that group or others can read is refused
by `kvpush serve` and `kvpush router` unless forced (it used to be only a warning)."""

from __future__ import annotations

import msgspec
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


def test_the_router_keeps_only_keys_derived_from_the_secret(loose):
    """Finding 7: the router was handed (and kept) the raw cluster secret, so a router
    compromise was a side-channel compromise. Its config now holds only the grant key
    and the event keys; grants it signs verify at an instance holding the secret."""
    import dataclasses

    from kvpush.crypto.auth import ParamsForbidden, ParamsSigner
    from kvpush.crypto.curve import derive_curve_keys
    from kvpush.kv_transfer.params import KVTransferParams, WireKVParams
    from kvpush.router.config import RouterKeys
    from kvpush.router.wire import LegSigner

    secret = b"s" * 32
    parser = build_parser()
    argv = ["router", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
            "--kv-secret-file", str(loose), "--allow-loose-secret-file"]
    cfg = build_config(parser.parse_args(argv))
    keys = cfg.kv_secret
    assert isinstance(keys, RouterKeys) and repr(keys) == "RouterKeys(...)"
    held = [keys.grant_key, keys.events.hash_key, keys.events.curve.client_secret,
            keys.events.curve.server_secret]
    side = derive_curve_keys(secret)
    assert secret not in held and side.client_secret not in held
    assert side.server_secret not in held
    assert dataclasses.replace(cfg, max_connections=7).kv_secret is keys  # kept as is

    class Inst:
        kvpush = True
        engine_id = "p1"

    # a kvpush instance's: the request plane's struct, whose fields the signature covers
    signed = LegSigner(keys).sign({"transfer_id": "t", "tp_size": 1}, Inst(), "prefill")
    assert isinstance(signed, WireKVParams) and signed.transfer_id == "t"
    check = ParamsSigner(secret)
    assert check.verify(signed.wire(), role="prefill", engine_id="p1")
    assert KVTransferParams.parse(signed, "prefill", check, "p1").transfer_id == "t"
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(signed), type=WireKVParams)
    assert KVTransferParams.parse(back, "prefill", check, "p1").grant is not None
    with pytest.raises(ParamsForbidden):  # altered on the way
        KVTransferParams.parse(msgspec.structs.replace(back, transfer_id="u"), "prefill",
                               check, "p1")
