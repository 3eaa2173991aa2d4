"""kv_transfer_params are the cluster's, not a client's (issue 30, findings 1 and 2).

* A client that reaches decode directly cannot make it READ blocks prefill never lent to
  that transfer (another request's KV): unsigned params are a 403, at the instances and
  at the router.
* KV is bound to its prompt: even params the router signed (a buggy router, mismatched
  tokenizers) cannot make decode store one prompt's KV under another prompt's hashes;
  prefill refuses to WRITE (push) and decode refuses to READ (pull) when the prompts'
  hash chains differ, and the next request for the prompt gets the right answer.

Every test checks that the free-block counts return to their start.
"""

from __future__ import annotations

import uuid

import httpx
import pytest

from kvpush.crypto.auth import GRANT_KEY, SIGNATURE_KEY, ParamsForbidden, ParamsSigner
from router_helpers import RouterThread, start_instances
from server_helpers import sign_kv

FLAGS = ("--block-size", "16", "--num-blocks", "64", "--max-model-len", "256",
         "--lease-timeout", "3", "--heartbeat-interval", "0.3")
POPULAR = list(range(5, 45))  # 40 token ids: two full blocks and a partial one
JUNK = list(range(100, 140))  # as many tokens, other ids


# ---- the signature itself -----------------------------------------------------------

def test_signer_accepts_only_its_own_fresh_grants_for_this_instance():
    signer = ParamsSigner(b"s" * 32)
    kv = {"do_remote_prefill": True, "transfer_id": "t1", "remote_host": "127.0.0.1",
          "remote_port": 5000, "remote_engine_id": "prefill-1", "remote_block_ids": [3, 4]}
    signed = signer.sign(kv, role="decode", engine_id="decode-1", peer_engine_id="prefill-1")
    grant = signer.verify(signed, role="decode", engine_id="decode-1")
    assert grant.peer_engine_id == "prefill-1" and grant.engine_id == "decode-1"
    import json

    assert signer.verify(json.loads(json.dumps(signed)), role="decode", engine_id="decode-1")

    def code(params, **kw) -> str:
        with pytest.raises(ParamsForbidden) as e:
            signer.verify(params, **{"role": "decode", "engine_id": "decode-1", **kw})
        assert e.value.status_code == 403
        return e.value.code

    assert code(kv) == "kv_transfer_params_unsigned"
    for field, value in [("remote_block_ids", [0, 1]), ("remote_port", 5001),
                         ("transfer_id", "t2")]:
        assert code({**signed, field: value}) == "kv_transfer_params_bad_signature"
    assert code({**signed, "extra": 1}) == "kv_transfer_params_bad_signature"
    other = ParamsSigner(b"o" * 32).sign(kv, role="decode", engine_id="decode-1")
    assert code(other) == "kv_transfer_params_bad_signature"
    assert code(signed, engine_id="decode-2") == "kv_transfer_params_wrong_instance"
    assert code(signed, role="prefill") == "kv_transfer_params_wrong_instance"
    later = signed[GRANT_KEY]["expires_ms"] + 1
    assert code(signed, now_ms=later) == "kv_transfer_params_expired"
    forever = signer.sign(kv, role="decode", engine_id="decode-1", now_ms=2**53)
    assert forever[GRANT_KEY]["expires_ms"] > 2**53 and SIGNATURE_KEY in forever
    assert code(forever) == "kv_transfer_params_expired"
    assert "s" * 8 not in repr(signer)


# ---- real clusters --------------------------------------------------------------------

@pytest.fixture(scope="module", params=[pytest.param("pull", marks=pytest.mark.slow), "push"])
def cluster(request, tiny_llama, tmp_path_factory):
    mode = request.param
    log_dir = tmp_path_factory.mktemp(f"trust-{mode}")
    flags = ("--kv-transfer", mode, *FLAGS)
    p, d = start_instances(tiny_llama, [("P", ("--role", "prefill", *flags)),
                                        ("D", ("--role", "decode", *flags))], log_dir)
    router = RouterThread(mode, [p.url], [d.url])
    yield mode, p, d, router
    router.stop()
    p.stop()
    d.stop()


def _body(prompt: list[int], kv: dict | None = None, max_tokens: int = 8) -> dict:
    b = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if kv is not None:
        b["kv_transfer_params"] = kv
    return b


def _text(url: str, body: dict) -> str:
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _all_free(*instances) -> None:
    for inst in instances:
        inst.wait_all_free(timeout=20)


def test_client_params_are_refused_everywhere(cluster):
    """Finding 1: a client's own params pointing decode at prefill's blocks (which hold
    another request's prompt) are a 403 at decode, at prefill and at the router; decode
    READs nothing and the answers do not leak the other prompt's KV."""
    mode, p, d, router = cluster
    _text(router.url, _body(POPULAR))  # the victim: its KV stays in prefill's blocks
    _all_free(p, d)
    p_info, d_info = p.get("/kv/info"), d.get("/kv/info")
    tid = uuid.uuid4().hex
    attack = {"do_remote_prefill": True, "transfer_id": tid, "remote_request_id": tid,
              "remote_host": p_info["side_channel_host"],
              "remote_port": p_info["side_channel_port"],
              "remote_engine_id": p_info["engine_id"], "remote_block_ids": [0, 1, 2, 3]}
    before = httpx.get(d.url + "/metrics", timeout=5).text
    for url, kv in [(d.url, attack), (p.url, {"do_remote_decode": True, "transfer_id": tid}),
                    (router.url, attack)]:
        r = httpx.post(url + "/v1/completions", json=_body(POPULAR[:-1] + [7], kv),
                       timeout=30)
        assert r.status_code == 403, (url, r.text)
        err = r.json()["error"]
        assert err["type"] == "permission_error" and err["param"] == "kv_transfer_params"
        assert "kv_transfer_params" in err["message"]
    # a signature made with another secret, or one made for another instance, is no
    # better than none
    forged = ParamsSigner(b"not the cluster secret!").sign(
        attack, role="decode", engine_id=d_info["engine_id"],
        peer_engine_id=p_info["engine_id"])
    for kv in (forged, sign_kv(attack, p_info, "decode", p_info)):
        r = httpx.post(d.url + "/v1/completions", json=_body(POPULAR, kv), timeout=30)
        assert r.status_code == 403, r.text
    after = httpx.get(d.url + "/metrics", timeout=5).text
    ok = "kvpush_kv_transfers_ok_total"
    assert [ln for ln in before.splitlines() if ln.startswith(ok)] == \
        [ln for ln in after.splitlines() if ln.startswith(ok)]
    _all_free(p, d)
    assert _text(router.url, _body(POPULAR)) == _text(p.url, _body(POPULAR))


def test_kv_is_bound_to_its_prompt(cluster):
    """Finding 2: the same transfer id with a junk prompt at prefill and a popular one at
    decode, both signed (so only the binding can stop it): decode's leg fails with a
    clear error, nothing junk lands in decode's prefix cache, and the next request for
    the popular prompt gets the answer computed from its own KV."""
    mode, p, d, router = cluster
    p_info, d_info = p.get("/kv/info"), d.get("/kv/info")
    tid = uuid.uuid4().hex
    p_kv = sign_kv({"do_remote_decode": True, "transfer_id": tid}, p_info, "prefill")
    p_leg = _body(JUNK, p_kv, max_tokens=1)
    if mode == "pull":
        r = httpx.post(p.url + "/v1/completions", json=p_leg, timeout=60)
        assert r.status_code == 200, r.text
        lend = r.json()["kv_transfer_params"]
        assert len(lend["prompt_hashes"]) == 3  # two full blocks and the partial one
        d_kv = sign_kv(lend, d_info, "decode", p_info)
        r = httpx.post(d.url + "/v1/completions", json=_body(POPULAR, d_kv), timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "kv_prompt_mismatch" and "block 0" in err["message"]
        r = httpx.post(p.url + "/kv/abort", timeout=10, json=sign_kv(
            {"transfer_id": tid, "kvpush_action": "abort"}, p_info, "prefill"))
        assert r.status_code == 200, r.text  # the router's abort, signed for prefill
    else:
        d_kv = sign_kv({"do_remote_prefill": True, "transfer_id": tid,
                        "remote_request_id": tid, "remote_host": p_info["side_channel_host"],
                        "remote_port": p_info["side_channel_port"],
                        "remote_engine_id": p_info["engine_id"]}, d_info, "decode", p_info)
        with httpx.Client(timeout=60) as client:
            d_req = client.build_request("POST", d.url + "/v1/completions",
                                         json=_body(POPULAR, d_kv))
            p_req = client.build_request("POST", p.url + "/v1/completions", json=p_leg)
            import concurrent.futures as cf

            with cf.ThreadPoolExecutor(2) as ex:  # both legs at once, as the router
                fd, fp = ex.submit(client.send, d_req), ex.submit(client.send, p_req)
                rd, _ = fd.result(), fp.result()
        assert rd.status_code >= 400, rd.text
        msg = rd.json()["error"]["message"]
        assert "prompt differs" in msg and "block 0" in msg, msg
    _all_free(p, d)
    # the popular prompt, through the router: decode's cache holds nothing junk for it
    assert _text(router.url, _body(POPULAR)) == _text(p.url, _body(POPULAR))
    assert _text(router.url, _body(POPULAR)) == _text(p.url, _body(POPULAR))
    _all_free(p, d)


# ---- secure by default: the CLI --------------------------------------------------------

def test_pd_roles_need_the_secret_unless_told_otherwise(tmp_path, monkeypatch, capsys):
    from kvpush.cli import build_parser

    monkeypatch.delenv("KVPUSH_KV_SECRET", raising=False)
    parser = build_parser()
    args = parser.parse_args(["serve", str(tmp_path / "no-model"), "--role", "decode"])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "kvpush make-secret" in err and "--insecure-kv-params" in err
    # the opt-out passes that check (and then fails on the missing model, not on it)
    args = parser.parse_args(["serve", str(tmp_path / "no-model"), "--role", "decode",
                              "--insecure-kv-params"])
    args.func(args)
    assert "make-secret" not in capsys.readouterr().err
    # `kvpush make-secret` writes a fresh 600 file, refuses to overwrite without --force
    key = tmp_path / "cluster.key"
    args = parser.parse_args(["make-secret", str(key)])
    assert args.func(args) == 0
    first = key.read_text().strip()
    assert len(first) == 64 and (key.stat().st_mode & 0o777) == 0o600
    assert args.func(args) == 2 and "exists" in capsys.readouterr().err
    args = parser.parse_args(["make-secret", str(key), "--force"])
    assert args.func(args) == 0 and key.read_text().strip() != first


def test_router_without_the_secret_refuses_instances_that_need_it():
    from kvpush.discovery.instance_spec import parse_instance
    from kvpush.router.config import RouterConfig
    from kvpush.router.pool import Pool
    from stand_in import make_kv_info

    def problem(secret: bytes | None, signed: bool) -> str | None:
        cfg = RouterConfig(mode="push", prefill=(parse_instance("127.0.0.1:9"),),
                           decode=(parse_instance("127.0.0.1:10"),), kv_secret=secret)
        pool = Pool(cfg)
        inst = pool.by_role["decode"][0]
        return pool.verify(inst, make_kv_info(role="decode", kv_transfer="push",
                                              kv_params_signed=signed, request_plane="h:1",
                                              request_plane_members=signed))

    why = problem(None, True)
    assert why is not None and "--kv-secret-file" in why
    assert problem(b"x" * 32, True) is None
    assert problem(None, False) is None  # instances run with --insecure-kv-params
