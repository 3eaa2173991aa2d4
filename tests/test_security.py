"""API keys on the instance and the router, secrets on the command line, and binding:
in-process apps on the fake engine, then one real push cluster (two `kvpush serve`
processes behind an in-process router) with an API key and a side-channel secret."""

from __future__ import annotations

import argparse
import os
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from fake_engine import FakeEngine
from kvpush.cluster import cli as up_cli
from kvpush.config import KVTransferConfig
from kvpush.crypto.auth import ParamsSigner
from kvpush.crypto.membership import member_view_token
from kvpush.discovery.instance_spec import parse_instance
from kvpush.router import cli as router_cli
from kvpush.router.app import Router
from kvpush.router.app import build_app as build_router_app
from kvpush.router.config import RouterConfig
from kvpush.server import cli as serve_cli
from kvpush.server.admin_key import ADMIN_KEY_ENV
from kvpush.server.app import build_app
from kvpush.server.auth import (
    API_KEY_ENV,
    KV_SECRET_ENV,
    SecretError,
    check_bearer,
    resolve_api_key,
    resolve_kv_secret,
)
from kvpush.server.member_view import member_header
from router_helpers import RouterThread, metric_value, start_instances

pytestmark = pytest.mark.timeout(180)

KEY = "sk-test-0123456789"
ADMIN = "admin-test-9876543210"
SECRET = "cluster-secret-0123456789abcdef"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"



# ---- pieces ---------------------------------------------------------------------------

def test_check_bearer():
    key = b"k3y"
    assert check_bearer(b"Bearer k3y", key) is None
    assert check_bearer(b"bearer  k3y ", key) is None
    assert check_bearer(None, key) == "missing"
    assert check_bearer(b"", key) == "missing"
    for bad in (b"Bearer k3", b"Bearer k3yy", b"Basic k3y", b"k3y", b"Bearer", b"Bearer \xff"):
        assert check_bearer(bad, key) == "invalid", bad


def test_resolve_api_key_and_secret(tmp_path: Path):
    assert resolve_api_key(None, {}) is None
    assert resolve_api_key(None, {API_KEY_ENV: " k "}) == "k"
    assert resolve_api_key("flag", {API_KEY_ENV: "env"}) == "flag"
    assert resolve_api_key("", {API_KEY_ENV: "env"}) is None
    assert resolve_kv_secret(None, {}) == (None, None)
    assert resolve_kv_secret(None, {KV_SECRET_ENV: "s" * 20}) == (b"s" * 20, None)
    f = tmp_path / "secret"
    f.write_text("t" * 20 + "\n")
    f.chmod(0o600)
    assert resolve_kv_secret(str(f), {KV_SECRET_ENV: "ignored"}) == (b"t" * 20, None)
    f.chmod(0o644)  # issue 40: refused unless forced (it used to be only a warning)
    with pytest.raises(SecretError, match="readable by other users.*--allow-loose"):
        resolve_kv_secret(str(f), {})
    f.chmod(0o620)
    with pytest.raises(SecretError, match="readable by other users"):
        resolve_kv_secret(str(f), {})
    secret, warning = resolve_kv_secret(str(f), {}, allow_loose=True)
    assert secret == b"t" * 20 and "readable by other users" in warning
    with pytest.raises(SecretError, match="cannot read"):
        resolve_kv_secret(str(tmp_path / "missing"), {})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SecretError, match="empty"):
        resolve_kv_secret(str(tmp_path / "empty"), {})


def test_short_secret_refused_and_secret_never_shown():
    from kvpush.errors import ConfigError

    with pytest.raises(ConfigError, match="at least 16 bytes"):
        KVTransferConfig(side_channel_secret=b"short").validate()
    cfg = KVTransferConfig(role="prefill", side_channel_secret=SECRET.encode())
    assert SECRET not in repr(cfg)
    rc = RouterConfig(mode="colocated", prefill=(), decode=(parse_instance("h:1"),),
                      api_key=KEY)
    assert KEY not in repr(rc)


def _parser(add) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add(p.add_subparsers())
    return p


def test_everything_binds_loopback_by_default():
    serve = _parser(serve_cli.add_serve_parser).parse_args(["serve", "m"])
    assert serve.host == "127.0.0.1" and serve.side_channel_host == "127.0.0.1"
    assert KVTransferConfig().side_channel_host == "127.0.0.1"
    router = _parser(router_cli.add_router_parser).parse_args(
        ["router", "--decode", "h:1", "--prefill", "h:2"])
    assert router.host == "127.0.0.1"
    up = _parser(up_cli.add_up_parser).parse_args(["up"])
    argv = up_cli.serve_argv(up, "m", "prefill", 1234, 1)
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    rargv = up_cli.router_argv(up, 8000, ["http://127.0.0.1:1"], ["http://127.0.0.1:2"])
    assert rargv[rargv.index("--host") + 1] == "127.0.0.1"


def test_up_hands_secret_and_key_to_children_by_environment(monkeypatch):
    monkeypatch.delenv(KV_SECRET_ENV, raising=False)
    monkeypatch.setenv(API_KEY_ENV, "from-outside")
    up = _parser(up_cli.add_up_parser).parse_args(["up", "--api-key", KEY])
    env1, env2 = up_cli.child_env(KEY), up_cli.child_env(None)
    assert len(env1[KV_SECRET_ENV]) >= 32 and env1[KV_SECRET_ENV] != env2[KV_SECRET_ENV]
    assert env1[API_KEY_ENV] == KEY and API_KEY_ENV not in env2
    monkeypatch.setenv(KV_SECRET_ENV, SECRET)  # an operator's own secret is kept
    assert up_cli.child_env(KEY)[KV_SECRET_ENV] == SECRET
    for argv in (up_cli.serve_argv(up, "m", "decode", 1, 1),
                 up_cli.router_argv(up, 8000, ["a"], ["b"])):
        assert KEY not in " ".join(argv) and SECRET not in " ".join(argv)


# ---- the instance's API key (fake engine, in-process) ---------------------------------

async def _client(app) -> AsyncIterator[httpx.AsyncClient]:
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=10) as c:
        yield c


def assert_401(r: httpx.Response) -> None:
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"].startswith("Bearer")
    err = r.json()["error"]
    assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
    assert err["param"] is None and err["message"]
    assert KEY not in r.text


PROTECTED = [("GET", "/v1/models"), ("GET", "/kv/info"),
             ("GET", "/openapi.json"), ("POST", "/v1/completions"),
             ("POST", "/v1/chat/completions"), ("POST", "/kv/abort"), ("GET", "/nowhere")]


@pytest.mark.anyio
async def test_instance_api_key(fake_model):
    engine = FakeEngine(*fake_model)
    app = build_app(engine, api_key=KEY, admin_key=ADMIN)
    good = {"Authorization": f"Bearer {KEY}"}
    async for c in _client(app):
        assert (await c.get("/health")).status_code == 200  # open, for probes
        n = 0
        for method, path in PROTECTED:
            for headers in ({}, {"Authorization": "Bearer nope"},
                            {"Authorization": f"Basic {KEY}"}):
                assert_401(await c.request(method, path, headers=headers,
                                           json={"prompt": "hi"}))
                n += 1
        assert not engine.requests  # nothing reached the engine
        r = await c.post("/v1/completions", headers=good,
                         json={"prompt": "hello", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        r = await c.post("/v1/chat/completions", headers=good, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True})
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        r = await c.get("/metrics", headers=good)  # an operator view: not the API key's
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_key"
        text = (await c.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"})).text
        assert metric_value(text, "kvpush_http_auth_rejected_total",
                            'reason="admin_invalid"') == 1
        missing = metric_value(text, "kvpush_http_auth_rejected_total", 'reason="missing"')
        invalid = metric_value(text, "kvpush_http_auth_rejected_total", 'reason="invalid"')
        assert (missing, invalid) == (len(PROTECTED), 2 * len(PROTECTED))
        assert missing + invalid == n
    assert engine.free_blocks == engine.num_blocks


@pytest.mark.anyio
async def test_instance_operator_views_are_closed_to_api_keys(fake_model):
    """An API key but no admin key: /metrics (what others found cached) is closed to
    every caller, API-key holders included; the API is not."""
    app = build_app(FakeEngine(*fake_model), api_key=KEY)
    good = {"Authorization": f"Bearer {KEY}"}
    async for c in _client(app):
        for headers in ({}, good, {"Authorization": "Bearer x"}):
            r = await c.get("/metrics", headers=headers)
            assert r.status_code == 403, r.text
            assert r.json()["error"]["code"] == "operator_view_closed"
            assert "--admin-key" in r.json()["error"]["message"]
        assert (await c.get("/v1/models", headers=good)).status_code == 200


@pytest.mark.anyio
async def test_instance_without_key_stays_open(fake_model):
    app = build_app(FakeEngine(*fake_model))
    async for c in _client(app):
        assert (await c.get("/v1/models")).status_code == 200
        assert (await c.get("/metrics", headers={"Authorization": "Bearer x"})).status_code \
            == 200


@pytest.mark.anyio
async def test_router_api_key_in_process():
    cfg = RouterConfig(mode="colocated", prefill=(), decode=(parse_instance("127.0.0.1:9"),),
                       api_key=KEY, admin_key=ADMIN, startup_timeout_s=1)
    router = Router(cfg)
    assert router.make_client().headers["authorization"] == f"Bearer {KEY}"
    app = build_router_app(router, manage=False)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://test", timeout=10) as c:
        assert (await c.get("/health")).status_code == 503  # open (no instance is up)
        for method, path in PROTECTED:
            assert_401(await c.request(method, path, json={"prompt": "x"}))
        for path in ("/metrics", "/router/instances"):  # operator views: not the API key's
            r = await c.get(path, headers={"Authorization": f"Bearer {KEY}"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_key"
        r = await c.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
        assert metric_value(r.text, "kvpush_router_auth_rejected_total",
                            'reason="missing"') == len(PROTECTED)
    assert Router(RouterConfig(mode="colocated", prefill=(),
                               decode=(parse_instance("h:1"),))).make_client().headers.get(
        "authorization") is None


# ---- a real push cluster with a key and a secret ----------------------------------------

def listening(pid: int) -> set[str]:
    """host:port of every TCP socket ``pid`` and its children (the engine core of
    `kvpush serve`) listen on (from /proc)."""
    inodes = set()
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        pids = [pid, *map(int, f.read().split())]
    for p in pids:
        for fd in os.listdir(f"/proc/{p}/fd"):
            try:
                link = os.readlink(f"/proc/{p}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    out = set()
    for table, v6 in (("tcp", False), ("tcp6", True)):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                    continue
                hexaddr, hexport = cols[1].split(":")
                if v6:
                    host = "::1" if hexaddr == "0" * 24 + "01000000" else hexaddr
                else:
                    host = ".".join(str(int(hexaddr[i:i + 2], 16)) for i in (6, 4, 2, 0))
                out.add(f"{host}:{int(hexport, 16)}")
    return out


def wait_free(url: str, headers: dict, timeout: float = 20.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while True:
        info = httpx.get(url + "/kv/info", headers=headers, timeout=5).json()
        if info["num_free_blocks"] == info["num_total_blocks"]:
            return
        assert time.monotonic() < deadline, info
        time.sleep(0.05)


def test_push_cluster_with_api_key_and_signed_side_channel(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, KEY)
    monkeypatch.setenv(ADMIN_KEY_ENV, ADMIN)  # the instances' /metrics take this one
    monkeypatch.setenv(KV_SECRET_ENV, SECRET)
    flags = ("--kv-transfer", "push", "--num-blocks", "64", "--block-size", "16",
             "--max-model-len", "512",
             "--log-level", "info")
    p, d = start_instances(tiny_llama, [("prefill", ("--role", "prefill", *flags)),
                                        ("decode", ("--role", "decode", *flags))], tmp_path)
    router = None
    try:
        # an instance refuses a client without the key; /health stays open
        assert httpx.get(p.url + "/health", timeout=5).status_code == 200
        assert httpx.get(p.url + "/kv/info", timeout=5).status_code == 401
        # the router sends its key to the instances (health, /kv/info, legs)
        router = RouterThread("push", [p.url], [d.url], api_key=KEY)
        good = {"Authorization": f"Bearer {KEY}"}
        body = {"prompt": "hello there, how are you today my friend", "max_tokens": 4,
                "temperature": 0}
        assert httpx.post(router.url + "/v1/completions", json=body,
                          timeout=60).status_code == 401
        r = httpx.post(router.url + "/v1/completions", json=body, headers=good, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        for inst in (p, d):
            assert httpx.get(inst.url + "/metrics", headers=good, timeout=5).status_code == 401
            metrics = httpx.get(inst.url + "/metrics", timeout=5,
                                headers={"Authorization": f"Bearer {ADMIN}"}).text
            assert metric_value(metrics, "kvpush_kv_side_channel_rejected_total") == 0
            assert 'kvpush_kv_side_channel_rejected_total{reason="bad_signature"} 0.0' \
                in metrics
            info = httpx.get(inst.url + "/kv/info", headers=good, timeout=5).json()
            assert info["side_channel_host"] == "127.0.0.1"
            # everything it listens on is loopback (HTTP, side channel, NIXL/UCX)
            addrs = listening(inst.proc.proc.pid)
            assert f"127.0.0.1:{inst.port}" in addrs
            assert f"127.0.0.1:{info['side_channel_port']}" in addrs
            assert all(a.startswith(("127.", "::1:")) for a in addrs), addrs
        # malformed kv_transfer_params sent straight to the instances, signed as the
        # router signs (so they pass the signature check): 400, nothing held
        p_info = httpx.get(p.url + "/kv/info", headers=good, timeout=5).json()
        d_info = httpx.get(d.url + "/kv/info", headers=good, timeout=5).json()
        signer = ParamsSigner(SECRET.encode())
        peer = {"do_remote_prefill": True, "transfer_id": "t-bad",
                "remote_host": "127.0.0.1", "remote_port": p_info["side_channel_port"]}
        for inst, kv in [
            (d, {"do_remote_prefill": "yes"}),
            (d, {"do_remote_prefill": True}),  # no remote_host/port
            (d, {**peer, "remote_port": 70000}),
            (d, {**peer, "remote_host": "bad host\n"}),
            (d, {**peer, "remote_engine_id": "nobody"}),  # unknown engine (P is known)
            (d, {**peer, "remote_block_ids": "0,1"}),
            (d, {**peer, "remote_block_ids": [0, -1]}),
            (d, {**peer, "transfer_id": "x" * 300}),
            (d, [1, 2]),
            (p, {"do_remote_decode": 1}),
            (p, {"do_remote_decode": True, "transfer_id": 5}),
        ]:
            if isinstance(kv, dict):
                to, role = (d_info, "decode") if inst is d else (p_info, "prefill")
                kv = signer.sign(kv, role=role, engine_id=to["engine_id"],
                                 peer_engine_id=p_info["engine_id"] if inst is d else None)
            r = httpx.post(inst.url + "/v1/completions", headers=good, timeout=30,
                           json={**body, "kv_transfer_params": kv})
            assert r.status_code == 400, (kv, r.text)
            assert "kv_transfer_params" in r.text
        r = httpx.post(router.url + "/v1/completions", json=body, headers=good, timeout=60)
        assert r.status_code == 200, r.text
        d_metrics = httpx.get(d.url + "/metrics", timeout=5,
                              headers={"Authorization": f"Bearer {ADMIN}"}).text
        assert metric_value(d_metrics, "kvpush_kv_transfers_ok_total") >= 1
        # kvpush bench sends $KVPUSH_API_KEY (set above) as the bearer token
        from kvpush.bench.client import run_benchmark
        from kvpush.bench.settings import BenchConfig

        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        res = run_benchmark(BenchConfig(url=router.url, input_len=16, output_len=2,
                                        num_prompts=2, tokenizer=str(tiny_llama),
                                        progress=False)).to_dict()
        assert res["completed"] == 2 and res["failed"] == 0, res["errors"]
        for inst in (p, d):
            # the block counts are a member view (server/member_view.py)
            wait_free(inst.url, good | member_header(member_view_token(SECRET.encode())))
        # neither the key nor the secret is in any log
        for inst in (p, d):
            log = inst.proc.log_path.read_text()
            assert KEY not in log and SECRET not in log
            assert "messages signed" in log
    finally:
        if router is not None:
            router.stop()
        for inst in (p, d):
            inst.stop()
