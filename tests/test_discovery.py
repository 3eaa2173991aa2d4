"""kvpush.discovery without model processes: etcd addresses and credentials, cards, the
pool's add/remove, and registration + discovery in-process against a real etcd (with
auth on: the password never reaches a log)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from msgspec.structs import replace

from etcd_helpers import EtcdServer, require_etcd
from kvpush.discovery.card import (
    Card,
    CardError,
    card_from_info,
    decode,
    encode,
    mismatch,
    sign,
)
from kvpush.discovery.etcd import EtcdClient, EtcdError, prefix_end
from kvpush.discovery.instance_spec import InstanceSpec
from kvpush.discovery.target import EtcdAuth, TargetError, parse_target, resolve_auth
from kvpush.router.config import RouterConfig, RouterConfigError
from stand_in import make_kv_info

SECRET = b"discovery-test-secret"
INFO = make_kv_info(role="decode", engine_id="decode-1", side_channel="127.0.0.1:5000",
                    kv_transfer="push", model="m", block_size=16,
                    layout={"num_layers": 2}, kv_params_signed=True, num_free_blocks=3)


def _ns(**kw) -> argparse.Namespace:
    base = {"etcd_user": None, "etcd_password_file": None, "etcd_ca": None,
            "etcd_cert": None, "etcd_key": None}
    return argparse.Namespace(**{**base, **kw})


# ------------------------------------------------------------------ addresses, credentials


def test_parse_target():
    t = parse_target("etcd://10.0.0.1:2379/prod/kv")
    assert (t.host, t.port, t.prefix, t.endpoint) == ("10.0.0.1", 2379, "/prod/kv/",
                                                      "http://10.0.0.1:2379")
    assert parse_target("etcd://h:1").prefix == "/kvpush/"
    for bad in ("http://h:1/x", "etcd://h/x", "etcd://h:x/y", "etcd://h:1/x?a=b", "h:1"):
        with pytest.raises(TargetError):
            parse_target(bad)
    with pytest.raises(TargetError, match="do not go in the URL"):
        parse_target("etcd://user:secret@h:1/x")


def test_credentials_from_flags_and_env_never_shown(tmp_path):
    pw = tmp_path / "pw"
    pw.write_text("s3cret-pw\n")
    a = resolve_auth(_ns(etcd_user="kv", etcd_password_file=str(pw)), env={})
    assert (a.user, a.password) == ("kv", "s3cret-pw")
    t = parse_target("etcd://h:1/x", a)
    assert "s3cret" not in repr(t) and "s3cret" not in str(t) and "s3cret" not in repr(a)
    env = {"KVPUSH_ETCD_USER": "u", "KVPUSH_ETCD_PASSWORD_FILE": str(pw)}
    assert resolve_auth(_ns(), env=env).password == "s3cret-pw"
    assert resolve_auth(_ns(), env={"KVPUSH_ETCD_USER": "u",
                                    "KVPUSH_ETCD_PASSWORD": "p"}).password == "p"
    assert resolve_auth(_ns(), env={}) == EtcdAuth()
    with pytest.raises(TargetError, match="without a password"):
        resolve_auth(_ns(etcd_user="u"), env={})
    with pytest.raises(TargetError, match="without a user"):
        resolve_auth(_ns(etcd_password_file=str(pw)), env={})
    with pytest.raises(TargetError, match="cannot read"):
        resolve_auth(_ns(etcd_user="u", etcd_password_file=str(tmp_path / "no")), env={})
    with pytest.raises(TargetError, match="go together"):
        resolve_auth(_ns(etcd_cert=str(pw)), env={})
    tls = resolve_auth(_ns(etcd_ca=str(pw)), env={})
    assert parse_target("etcd://h:1/x", tls).endpoint == "https://h:1"


def test_prefix_end():
    import base64

    assert base64.b64decode(prefix_end("/a/")) == b"/a0"
    assert base64.b64decode(prefix_end("kv/ab")) == b"kv/ac"
    assert base64.b64decode(prefix_end("\xff")) == b"\xc3\xc0"  # UTF-8 c3 bf


# ------------------------------------------------------------------ cards


def test_card_round_trip_and_checks():
    card = card_from_info("http://127.0.0.1:8001/", INFO)
    assert card.url == "http://127.0.0.1:8001"
    assert decode(encode(card)) == card
    assert mismatch(card, INFO) is None
    why = mismatch(card, replace(INFO, engine_id="decode-2", side_channel="1.2.3.4:1"))
    assert why and "engine_id" in why and "side_channel" in why
    assert mismatch(card, replace(INFO, kv_params_signed=False))
    assert mismatch(card, replace(INFO, num_free_blocks=99)) is None  # not identity
    for bad in (b"{", b"[]", encode(Card(version=2, url=card.url, role="decode",
                                              engine_id="e", model="m")),
                encode(Card(version=1, url="ftp://h:1", role="decode", engine_id="e",
                            model="m")),
                encode(Card(version=1, url="http://h:1", role="boss", engine_id="e",
                            model="m")),
                encode(Card(version=1, url="http://h:1", role="decode", engine_id="",
                            model="m"))):
        with pytest.raises(CardError):
            decode(bad)


# ------------------------------------------------------------------ the pool's membership API


def test_pool_add_remove_keeps_rotation_consistent():
    from kvpush.router.pool import Pool

    cfg = RouterConfig(mode="push", prefill=(), decode=(), discover=object(), kv_secret=SECRET)
    pool = Pool(cfg)
    removed = []
    pool.on_remove.append(removed.append)
    insts = [pool.add_instance(InstanceSpec(f"http://127.0.0.1:{p}"), "decode")
             for p in (1, 2, 3)]
    with pytest.raises(ValueError):
        pool.add_instance(InstanceSpec("http://127.0.0.1:2"), "decode")
    assert pool.pick("decode") is None  # nothing checked yet: nothing in rotation
    for i in insts:
        i.healthy = True
    assert pool.pick("decode") is insts[0]
    assert pool.pick("decode") is insts[1]
    gone = pool.remove_instance("http://127.0.0.1:2")
    assert gone is insts[1] and removed == [gone] and not gone.healthy
    assert [i.index for i in pool.by_role["decode"]] == [0, 1]
    picks = {pool.pick("decode").url for _ in range(4)}
    assert picks == {"http://127.0.0.1:1", "http://127.0.0.1:3"}
    assert pool.remove_instance("http://127.0.0.1:2") is None
    Pool.release(gone)  # a leg that was in flight on it ends normally


def test_router_config_needs_instances_unless_discovering():
    with pytest.raises(RouterConfigError):
        RouterConfig(mode="push", prefill=(), decode=())
    RouterConfig(mode="push", prefill=(), decode=(), discover=parse_target("etcd://h:1/x"),
                 kv_secret=SECRET)
    with pytest.raises(RouterConfigError, match="needs the cluster secret"):
        RouterConfig(mode="push", prefill=(), decode=(),
                     discover=parse_target("etcd://h:1/x"))


def test_cli_refuses_bad_membership_flags(tmp_path):
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kvpush", *args], capture_output=True,
                              text=True, timeout=60)

    r = run("router", "--discover", "etcd://user:pw@127.0.0.1:1/x")
    assert r.returncode == 2 and "do not go in the URL" in r.stderr and "pw@" not in r.stderr
    r = run("router", "--discover", "http://127.0.0.1:1/x")
    assert r.returncode == 2 and "etcd://HOST:PORT/PREFIX" in r.stderr
    r = run("router", "--discover", "etcd://127.0.0.1:1/x", "--etcd-user", "u")
    assert r.returncode == 2 and "without a password" in r.stderr


def test_serve_refuses_bad_registration_before_loading(tiny_llama):
    def serve(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kvpush", "serve", str(tiny_llama),
                               "--port", "0", "--register", "etcd://127.0.0.1:1/x", *args],
                              capture_output=True, text=True, timeout=60)

    r = serve("--host", "0.0.0.0")
    assert r.returncode == 2 and "--advertise-url" in r.stderr, r.stderr
    r = serve("--register-ttl", "1", "--advertise-url", "ftp://x")  # argparse: at once
    assert r.returncode == 2 and "--register-ttl" in r.stderr, r.stderr
    r = serve("--advertise-url", "ftp://x")
    assert r.returncode == 2 and "--advertise-url" in r.stderr, r.stderr


# ------------------------------------------------------------------ against a real etcd


@pytest.fixture(scope="module")
def etcd_auth(tmp_path_factory) -> tuple[EtcdServer, Path]:
    require_etcd()
    d = tmp_path_factory.mktemp("etcd-auth")
    server = EtcdServer(d / "data", d)
    e = server.endpoint
    for path, body in (("/v3/auth/user/add", {"name": "root", "password": "root-pw-1"}),
                       ("/v3/auth/role/add", {"name": "root"}),
                       ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
                       ("/v3/auth/enable", {})):
        assert httpx.post(e + path, json=body, timeout=5).status_code == 200
    pw = d / "pw"
    pw.write_text("root-pw-1\n")
    yield server, pw
    server.stop()


def test_register_and_discover_with_auth(etcd_auth, caplog):
    from kvpush.discovery.register import Registrar, RegState
    from kvpush.router.discover import EtcdLink, LinkState
    from kvpush.router.pool import Pool

    server, pw = etcd_auth
    auth = resolve_auth(_ns(etcd_user="root", etcd_password_file=str(pw)), env={})
    target = parse_target(server.url("auth"), auth)
    card = sign(card_from_info("http://127.0.0.1:8001", INFO), SECRET)
    caplog.set_level(logging.DEBUG)

    async def go() -> None:
        # without credentials etcd refuses, and says so
        anon = EtcdClient(parse_target(server.url("auth")))
        with pytest.raises(EtcdError, match="user name is empty"):
            await anon.get_prefix("/auth/")
        await anon.aclose()
        wrong = EtcdClient(parse_target(server.url("auth"),
                                        EtcdAuth(user="root", password="wrong-pw-2")))
        with pytest.raises(EtcdError, match="refused user 'root'") as exc:
            await wrong.grant(5)
        assert "wrong-pw-2" not in str(exc.value)
        await wrong.aclose()

        pool = Pool(RouterConfig(mode="push", prefill=(), decode=(), discover=target,
                                 kv_secret=SECRET))
        joined = []
        link = EtcdLink(pool, joined.append)
        link.start()
        reg = Registrar(target, card, ttl_s=2)
        reg.start()
        await asyncio.wait_for(reg.registered.wait(), 5)
        assert reg.state is RegState.REGISTERED
        for _ in range(100):
            if pool.find(card.url) is not None:
                break
            await asyncio.sleep(0.02)
        inst = pool.find(card.url)
        assert inst is not None and inst.cards == (card,) and joined == [inst]
        assert link.state is LinkState.WATCHING
        await asyncio.sleep(2.5)  # longer than the TTL: the keep-alive holds it
        assert pool.find(card.url) is not None
        await reg.close()
        assert reg.state is RegState.WITHDRAWN
        for _ in range(100):
            if pool.find(card.url) is None:
                break
            await asyncio.sleep(0.02)
        assert pool.find(card.url) is None
        await link.close()

    asyncio.run(go())
    assert "root-pw-1" not in caplog.text and "wrong-pw-2" not in caplog.text
    assert "registered in etcd://127.0.0.1:" in caplog.text


def test_registrar_waits_for_etcd_then_registers(tmp_path):
    """An instance started before etcd registers once etcd answers."""
    from kvpush.discovery.register import Registrar, RegState

    require_etcd()
    server = EtcdServer(tmp_path / "data", tmp_path)
    url = server.url("late")
    server.stop()
    card = card_from_info("http://127.0.0.1:8002", INFO)

    async def go() -> None:
        reg = Registrar(parse_target(url), card, ttl_s=3)
        reg.start()
        for _ in range(100):
            if reg.state is RegState.WAITING:
                break
            await asyncio.sleep(0.02)
        assert reg.state is RegState.WAITING
        await asyncio.to_thread(server.start)
        await asyncio.wait_for(reg.registered.wait(), 10)
        await reg.close()

    try:
        asyncio.run(go())
        assert server.registered("/late/") == []  # withdrawn on close
    finally:
        server.stop()


def test_router_started_while_etcd_is_down_catches_up(tmp_path):
    """No view at start: the router serves anyway (/health 503, membership unreachable)
    within its first-view wait, and takes the cards in once etcd answers."""
    import time

    from router_helpers import RouterThread, signed, wait_until

    require_etcd()
    server = EtcdServer(tmp_path / "data", tmp_path)
    server.stop()
    t0 = time.monotonic()
    rt = RouterThread("push", [], [], discover=parse_target(server.url()))
    try:
        assert time.monotonic() - t0 < 15
        h = httpx.get(rt.url + "/health", timeout=5)
        assert h.status_code == 503 and h.json()["membership"]["state"] == "unreachable"
        etcd_port = str(server.client_port)
        assert h.json()["membership"]["error"] and etcd_port not in h.text  # public
        view = httpx.get(rt.url + "/router/instances", timeout=5).json()["membership"]
        assert etcd_port in view["etcd"] and view["error"]  # the operator's view
        server.start()
        card = signed(card_from_info("http://127.0.0.1:9", INFO))

        server.put("/kvpush/instances/decode/decode-1", encode(card))
        wait_until(lambda: [i["url"] for i in rt.instances()] == [card.url], 10,
                   "the card taken in after etcd came up")
        assert not rt.instances()[0]["healthy"]  # nothing answers there
        wait_until(lambda: httpx.get(rt.url + "/health", timeout=5).json()["membership"]
                   ["state"] == "watching", 5, "watching")
    finally:
        rt.stop()
        server.stop()


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _make_certs(d: Path) -> None:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, for one day."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
             "ca.pem", "-days", "1", "-subj", "/CN=kvpush-test-ca", cwd=d)
    # the server's certificate needs clientAuth too: with --client-cert-auth, etcd's JSON
    # gateway dials etcd's own gRPC server with it
    server_ext = "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth"
    for name, ext in (("server", server_ext),
                      ("client", "extendedKeyUsage=clientAuth")):
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
                 f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile",
                 f"{name}.ext", cwd=d)


def test_register_and_discover_over_tls(tmp_path):
    """etcd with client-certificate auth: --etcd-ca/--etcd-cert/--etcd-key work, and a
    client without a certificate is refused."""
    import shutil
    import time

    from kvpush.discovery.local import etcd_command
    from kvpush.discovery.register import Registrar
    from kvpush.router.discover import EtcdLink, LinkState
    from kvpush.router.pool import Pool
    from server_helpers import free_port

    binary = require_etcd()
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make test certificates")
    _make_certs(tmp_path)
    port = free_port()
    cmd = etcd_command(binary, tmp_path / "data", port, free_port(),
                       tls=(str(tmp_path / "server.pem"), str(tmp_path / "server.key"),
                            str(tmp_path / "ca.pem")))
    with open(tmp_path / "etcd.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    auth = resolve_auth(_ns(etcd_ca=str(tmp_path / "ca.pem"),
                            etcd_cert=str(tmp_path / "client.pem"),
                            etcd_key=str(tmp_path / "client.key")), env={})
    target = parse_target(f"etcd://127.0.0.1:{port}/tls", auth)
    assert target.endpoint.startswith("https://")
    card = sign(card_from_info("http://127.0.0.1:8003", INFO), SECRET)

    async def go() -> None:
        c = EtcdClient(target)
        for _ in range(100):  # etcd starting
            if await c.healthy():
                break
            await asyncio.sleep(0.1)
        await c.aclose()
        no_cert = EtcdClient(parse_target(f"etcd://127.0.0.1:{port}/tls",
                                          EtcdAuth(ca_file=str(tmp_path / "ca.pem"))))
        with pytest.raises(EtcdError):
            await no_cert.get_prefix("/tls/")
        await no_cert.aclose()
        pool = Pool(RouterConfig(mode="push", prefill=(), decode=(), discover=target,
                                 kv_secret=SECRET))
        link = EtcdLink(pool, lambda inst: None)
        link.start()
        reg = Registrar(target, card, ttl_s=3)
        reg.start()
        await asyncio.wait_for(reg.registered.wait(), 10)
        t0 = time.monotonic()
        while pool.find(card.url) is None and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.02)
        assert pool.find(card.url) is not None and link.state is LinkState.WATCHING
        await reg.close()
        await link.close()

    try:
        asyncio.run(go())
    finally:
        proc.terminate()
        proc.wait(10)


def test_registrar_survives_an_answer_that_is_not_etcd_json(monkeypatch):
    """Something at the etcd address answers 200 with HTML (a web server on that port, a
    proxy's page), or TLS 1.3 delivers etcd's refusal of the client certificate as a bare
    ssl.SSLError after the handshake (test_register_and_discover_over_tls failed now
    and then on it): call() let either escape, the registration task died with it
    and the instance stayed unregistered for good, nothing logged (failed before: never
    registered). Now it is an EtcdError: logged, retried, registered once etcd answers."""
    from kvpush.discovery import register
    from kvpush.discovery.register import Registrar

    monkeypatch.setattr(register, "RETRY_S", 0.05)
    calls: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if len(calls) == 1:  # what a refused client certificate looks like under TLS 1.3
            raise ssl.SSLError(1, "[SSL: SSLV3_ALERT_BAD_CERTIFICATE] sslv3 alert bad "
                               "certificate")
        if len(calls) <= 3:
            return httpx.Response(200, text="<html>not etcd</html>")
        if request.url.path == "/v3/lease/grant":
            return httpx.Response(200, json={"ID": "7", "TTL": "3"})
        if request.url.path == "/v3/lease/keepalive":
            return httpx.Response(200, json={"result": {"TTL": "3"}})
        return httpx.Response(200, json={"header": {"revision": "1"}})

    async def go() -> None:
        reg = Registrar(parse_target("etcd://127.0.0.1:1/p"),
                        card_from_info("http://127.0.0.1:8002", INFO), ttl_s=3)
        await reg.client._http.aclose()
        reg.client._http = httpx.AsyncClient(base_url="http://127.0.0.1:1",
                                             transport=httpx.MockTransport(answer))
        reg.start()
        try:
            await asyncio.wait_for(reg.registered.wait(), 5)
        finally:
            await reg.close()

    asyncio.run(go())
    assert calls[:4] == ["/v3/lease/grant"] * 4


def test_a_router_start_cut_short_stops_its_etcd_watch():
    """Ctrl-C while a --discover router waits for its first view of etcd: start()
    closed the HTTP client but left the etcd link running (its task retrying an
    unreachable etcd every 0.5 s, its own client open) with nobody to close it (failed
    before: the link's task still running)."""
    from kvpush.router.app import Router
    from server_helpers import free_port

    async def go() -> None:
        router = Router(RouterConfig(mode="push", prefill=(), decode=(), discover=parse_target(
            f"etcd://127.0.0.1:{free_port()}/x"), kv_secret=SECRET))
        start = asyncio.create_task(router.start())
        for _ in range(200):  # bounded: the link starts at once
            if router.discovery is not None:
                break
            await asyncio.sleep(0.01)
        link = router.discovery
        assert link is not None and link._task is not None
        task = link._task
        start.cancel()
        await asyncio.wait({start})
        await asyncio.sleep(0.05)
        assert task.done(), "the etcd link outlived a cancelled start"
        assert router.discovery is None

    asyncio.run(go())
