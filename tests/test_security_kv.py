"""Security of the KV path between real prefill and decode engines (in-process transport,
real ZMQ side channels on 127.0.0.1): the shared secret, hostile side-channel messages,
and every block id and length a peer sends checked before any transfer."""

from __future__ import annotations

import time
import uuid

import pytest

from engine_helpers import greedy, random_prompts
from kvpush.config import EngineConfig, KVTransferConfig
from kvpush.engine.llm_engine import LLMEngine
from kvpush.engine.outputs import FinishReason
from kvpush.kv_transfer.commands import Call
from kvpush.kv_transfer.step_loop.state import RecvState
from kvpush.kv_transfer.transfer_thread.push_sends import registration_problem
from kvpush.kv_transfer.wire import messages as m
from kvpush.kv_transfer.wire.side_channel import SideChannel
from pd_helpers import PDDriver

pytestmark = pytest.mark.timeout(120)

SECRET = b"0123456789abcdef0123456789abcdef"
OTHER = b"fedcba9876543210fedcba9876543210"


def instance(model_dir, role: str, mode: str = "push", secret: bytes | None = None,
             lease: float = 5.0) -> LLMEngine:
    kvt = KVTransferConfig(role=role, mode=mode, engine_id=f"{role}-{uuid.uuid4().hex[:6]}",
                           transport="inproc", lease_timeout_s=lease,
                           heartbeat_interval_s=0.1, side_channel_secret=secret)
    cfg = EngineConfig.build(model_dir, kv_transfer=kvt, block_size=16, num_blocks=128,
                             max_model_len=512)
    return LLMEngine(cfg)


def pair(model_dir, mode="push", p_secret=None, d_secret=None, lease=5.0) -> PDDriver:
    return PDDriver(instance(model_dir, "prefill", mode, p_secret, lease),
                    instance(model_dir, "decode", mode, d_secret, lease))


def assert_clean(drv: PDDriver) -> None:
    drv.settle()
    for eng in (drv.p, drv.d):
        s = eng.stats()
        assert s.num_free_blocks == s.num_total_blocks


def rejected(eng: LLMEngine, reason: str) -> int:
    return eng.connector.stats()[f"worker_side_channel_rejected_{reason}"]


# ---- the shared secret --------------------------------------------------------------

@pytest.mark.parametrize("mode", ["push", "pull"])
def test_same_secret_transfers_and_nothing_is_rejected(tiny_qwen3, mode):
    drv = pair(tiny_qwen3, mode, SECRET, SECRET)
    try:
        assert drv.p.connector.channel.auth is not None
        for i, prompt in enumerate(random_prompts([40, 70], seed=3)):
            drv.submit(f"r{i}", prompt, greedy(4))
        drv.run(timeout=30)
        for leg in drv.d_legs.values():
            assert leg.finish_reason is FinishReason.LENGTH and len(leg.tokens) == 4
        assert drv.p.connector.channel.stats.rejected == 0
        assert drv.d.connector.channel.stats.rejected == 0
        assert_clean(drv)
    finally:
        drv.close()


@pytest.mark.parametrize("p_secret,d_secret,reason", [
    (SECRET, OTHER, "bad_signature"),  # different secrets
    (SECRET, None, "unsigned"),  # decode has none: prefill refuses its Hello
])
def test_secret_mismatch_is_rejected_counted_and_named(tiny_qwen3, caplog, p_secret,
                                                       d_secret, reason):
    drv = pair(tiny_qwen3, "push", p_secret, d_secret, lease=1.0)
    try:
        drv.submit("r", random_prompts([40])[0], greedy(3))
        drv.run(timeout=20)  # decode's lease runs out: no handshake ever completed
        leg = drv.d_legs["r"]
        assert leg.finish_reason is FinishReason.ERROR
        assert "lease expired" in leg.error
        assert rejected(drv.p, reason) >= 1  # the Hello (and anything else) refused
        assert not drv.p.connector.worker.peers.has_ready()  # never acted on
        text = caplog.text
        assert ("DIFFERENT side-channel secret" if reason == "bad_signature"
                else "no side-channel secret configured") in text
        assert SECRET.decode() not in text and OTHER.decode() not in text
        # the side that cannot tell (its Hello got no answer) points at the secret too
        assert "no answer to the side-channel handshake" in text
        drv.p.abort_request("p-r")
        assert_clean(drv)
    finally:
        drv.close()


def test_prefill_without_secret_is_named_on_the_decode_side(tiny_qwen3, caplog):
    """Decode signs, prefill does not check and answers unsigned: decode refuses the
    answers and says the peer has no secret."""
    drv = pair(tiny_qwen3, "push", None, SECRET, lease=1.0)
    try:
        drv.submit("r", random_prompts([40])[0], greedy(3))
        drv.run(timeout=20)
        assert drv.d_legs["r"].finish_reason is FinishReason.ERROR
        # decode's CURVE client meets prefill's plain server: ZMQ reports the mechanism
        # mismatch ("unsigned"), or, when prefill closes first, a handshake broken off
        # without detail ("handshake_refused"); both name the missing secret
        assert rejected(drv.d, "unsigned") + rejected(drv.d, "handshake_refused") >= 1
        assert ("no side-channel secret configured" in caplog.text
                or "the peer has no side-channel secret or a DIFFERENT one" in caplog.text)
        drv.p.abort_request("p-r")
        assert_clean(drv)
    finally:
        drv.close()


def test_forged_registration_is_never_acted_on(tiny_qwen3):
    """A registration from a process without the secret (a raw side channel that knows
    decode's address and the transfer id) is refused before it is decoded."""
    drv = pair(tiny_qwen3, "push", SECRET, SECRET, lease=1.0)
    forger = SideChannel("127.0.0.1", 0)
    try:
        drv.submit("warm", random_prompts([40])[0], greedy(2))
        drv.run(timeout=20)
        prompt = random_prompts([40], seed=5)[0]
        drv.send_prefill("t", prompt, greedy(2))
        reg = m.PushRegister("t", drv.d.connector.engine_id, drv.d.connector.address,
                             [0, 1, 2], 0, len(prompt))
        before = drv.p.connector.channel.stats.rejected
        forger.send(drv.p.connector.address, m.encode(reg))
        deadline = time.monotonic() + 5
        out = drv.p.connector.worker.push.out  # (the transfer thread's: read to poll)
        while drv.p.connector.channel.stats.rejected == before or "t" not in out:
            assert time.monotonic() < deadline
            drv.pump()
            time.sleep(0.005)
        assert out["t"].reg is None  # still waits for a real one
        drv.p.abort_request("p-t")
        assert_clean(drv)
    finally:
        forger.close()
        drv.close()


def test_hostile_frames_do_not_kill_the_transfer_thread(tiny_qwen3):
    """Without a secret (trusted network), garbage and a Hello with unusable transport
    metadata are dropped and counted; the transfer thread keeps serving."""
    drv = pair(tiny_qwen3, "push")
    rogue = SideChannel("127.0.0.1", 0)
    try:
        p = drv.p.connector
        hello = m.Hello(**{**{f: getattr(p.hello, f) for f in p.hello.__struct_fields__},
                           "engine_id": "rogue", "address": rogue.address,
                           "agent_metadata": b"\x00garbage"})
        for frame in (b"", b"\xff" * 64, m.encode(hello), b"\x81\xa4type\xa5Hello"):
            rogue.send(p.address, frame)
        deadline = time.monotonic() + 5
        while p.worker.counters["messages_bad"] < 3 or rogue.address not in p.worker.peers \
                or p.worker.peers[rogue.address].refused is None:
            assert time.monotonic() < deadline, p.worker.counters
            drv.pump()
            time.sleep(0.005)
        refusal = rogue.recv(2000)
        assert refusal and "unusable transport metadata" in m.decode(refusal[0][1]).reason
        assert p.worker._thread.is_alive()
        drv.submit("r", random_prompts([50])[0], greedy(3))
        drv.run(timeout=20)
        assert drv.d_legs["r"].finish_reason is FinishReason.LENGTH
        assert_clean(drv)
    finally:
        rogue.close()
        drv.close()


# ---- block ids and lengths from a peer ------------------------------------------------

def test_registration_problem_cases():
    def reg(ids, skip=0, n=40, full_hit=False):
        return m.PushRegister("t", "d", "h:1", ids, skip, n, full_hit)

    ok = reg([3, 4, 5])
    assert registration_problem(ok, 10, 16, 40) is None
    assert registration_problem(ok, 10, 16, None) is None
    cases = {
        "outside": reg([3, 4, 10]),
        "outside [0": reg([-1, 4, 5]),
        "twice": reg([3, 3, 5]),
        "skips 4 of its 3": reg([3, 4, 5], skip=4),
        "skips -1": reg([3, 4, 5], skip=-1),
        "num_prompt_tokens 0": reg([3], n=0),
        "need 3": reg([3, 4], n=40),
        "did not tokenize the same prompt": reg([3, 4, 5], n=41),
    }
    for words, r in cases.items():
        problem = registration_problem(r, 10, 16, 40)
        assert problem and words in problem, (words, problem)


def test_bad_registrations_write_nothing(tiny_qwen3):
    """Every kind of bad registration: prefill posts no WRITE, tells decode, frees."""
    drv = pair(tiny_qwen3, "push")
    try:
        drv.submit("warm", random_prompts([40])[0], greedy(2))  # the handshake
        drv.run(timeout=20)
        assert_clean(drv)
        d_blocks = drv.d.connector.hello.num_blocks
        prompt = random_prompts([40], seed=9)[0]  # 3 blocks of 16
        bad = [
            [d_blocks, 1, 2],  # beyond decode's region
            [0, -3, 2],  # negative
            [5, 5, 6],  # duplicate
            [10**12, 1, 2],  # far beyond
        ]
        posts = drv.p.connector.transport.stats.posts
        for i, ids in enumerate(bad + ["skip", "short", "tokens"]):
            tid = f"bad{i}"
            skip, n, blocks = 0, len(prompt), ids
            if ids == "skip":
                blocks, skip = [1, 2, 3], 4
            elif ids == "short":
                blocks = [1, 2]
            elif ids == "tokens":
                blocks, n = [1, 2, 3], len(prompt) - 1
            drv.send_prefill(tid, prompt, greedy(2))
            reg = m.PushRegister(tid, drv.d.connector.engine_id, drv.d.connector.address,
                                 blocks, skip, n)
            worker = drv.p.connector.worker  # as if it came on the side channel
            worker.submit(Call(lambda r=reg, w=worker: w.push.on_register(r)))
            drv.run(until=lambda t=tid: drv.p_legs[t].finished
                    and t not in drv.p.connector.sender.sends, timeout=20)
            assert "invalid registration" in drv.p.connector.ended[tid]
        assert drv.p.connector.transport.stats.posts == posts  # not one WRITE
        assert_clean(drv)
        drv.submit("after", prompt, greedy(3))  # and it goes on serving
        drv.run(timeout=20)
        assert drv.d_legs["after"].finish_reason is FinishReason.LENGTH
        assert_clean(drv)
    finally:
        drv.close()


@pytest.mark.parametrize("kv,words", [
    ({"remote_engine_id": "somebody-else"}, "not remote_engine_id"),
    ({"remote_block_ids": [0, 1, 10**6]}, "outside"),
])
def test_pull_params_checked_against_a_known_prefill(tiny_qwen3, kv, words):
    """Bad remote ids or engine are a 400 before any READ or claim: decode's transfer
    thread checks them against prefill's Hello, met by the handshake the first time,
    known the second."""
    drv = pair(tiny_qwen3, "pull")
    try:
        prompt = random_prompts([40])[0]
        params = {**drv.d_params("x1"), "remote_block_ids": [0, 1, 2], **kv}
        reads = drv.d.connector.transport.stats.posts
        for tid in ("x1", "x2"):  # peer unknown, then known
            drv.send_decode(tid, prompt, greedy(2), {**params, "transfer_id": tid})
            drv.run(timeout=20)
            leg = drv.d_legs[tid]
            assert leg.finish_reason is FinishReason.ERROR and words in leg.error
            assert leg.rejected  # the client's mistake: HTTP 400, not 500
        assert drv.d.connector.transport.stats.posts == reads
        assert drv.p.connector.worker.claims.claimed == {}
        assert_clean(drv)
    finally:
        drv.close()


def test_a_transfer_id_stays_taken_until_its_receive_is_over(tiny_qwen3):
    """A decode leg ended before it had blocks is done on the step loop at once, but its
    transfer thread still answers for it (ReceiveOver): a leg reusing the id before
    that answer is refused (else it would take the old answer as its own, and free
    blocks prefill then WRITEs into); after it, the id can be used again."""
    from kvpush.engine.outputs import RequestError

    drv = pair(tiny_qwen3, "push", lease=1.0)
    try:
        prompt = random_prompts([40], seed=6)[0]
        params = drv.signed(drv.d, drv.d_params("t"), drv.p)
        recvs = drv.d.connector.receiver.recvs
        drv.d.add_request("d-t1", prompt, greedy(2), params)
        drv.d.abort_request("d-t1")  # before the step loop gave it blocks
        assert recvs["t"].state is RecvState.ENDED and not recvs["t"].held
        with pytest.raises(RequestError, match="already in use"):
            drv.d.add_request("d-t2", prompt, greedy(2), params)
        deadline = time.monotonic() + 10
        while "t" in recvs:
            assert time.monotonic() < deadline
            drv.pump()
            time.sleep(0.005)
        drv.d.add_request("d-t3", prompt, greedy(2), params)  # free again
        drv.d.abort_request("d-t3")
        assert_clean(drv)
    finally:
        drv.close()


def test_duplicate_or_negative_remote_block_ids_are_a_400_at_once(tiny_qwen3):
    from kvpush.engine.outputs import RequestError

    drv = pair(tiny_qwen3, "pull")
    try:
        for ids in ([0, 1, 1], [0, -1, 2], [0, True, 2], [0, 2**64, 3]):
            with pytest.raises(RequestError, match="remote_block_ids"):
                drv.d.add_request("d-x", [5] * 40, greedy(2),
                                  {**drv.d_params("x"), "remote_block_ids": ids})
        assert not drv.d.scheduler.requests
        assert_clean(drv)
    finally:
        drv.close()


@pytest.mark.parametrize("bad", [
    "token-out-of-vocab", "top-id-out-of-vocab", "top-logprob-positive", "top-too-long"])
def test_invalid_first_token_from_prefill_fails_the_request(tiny_qwen3, bad):
    """A PushDone whose token #1, or any of its top alternatives, is out of range fails
    the request (decode never hands it out) and frees its blocks."""
    drv = pair(tiny_qwen3, "push", lease=1.0)  # prefill's wait for this request ends soon
    try:
        drv.submit("warm", random_prompts([40])[0], greedy(2))
        drv.run(timeout=20)
        prompt = random_prompts([40], seed=4)[0]
        drv.send_decode("t", prompt, greedy(3))
        deadline = time.monotonic() + 10
        recvs = drv.d.connector.receiver.recvs
        while "t" not in recvs or recvs["t"].state is not RecvState.AWAITING_KV:
            assert time.monotonic() < deadline
            drv.pump()
        vocab = drv.d.connector.ctx.vocab_size
        done = {"token-out-of-vocab": {"first_token": vocab},
                "top-id-out-of-vocab": {"first_token": 1,
                                        "first_top_logprobs": [(1, -0.5), (vocab, -1.0)]},
                "top-logprob-positive": {"first_token": 1, "first_top_logprobs": [(1, 0.5)]},
                "top-too-long": {"first_token": 1,
                                 "first_top_logprobs": [(1, -1.0)] * 21}}[bad]
        # as if from prefill, to decode's transfer thread (it owns the receive)
        worker, sender = drv.d.connector.worker, drv.p.connector.address
        msg = m.PushDone("t", ok=True, **done)
        worker.submit(Call(lambda: worker.receives.on_push_done(msg, sender)))
        drv.run(timeout=20)
        leg = drv.d_legs["t"]
        assert leg.finish_reason is FinishReason.ERROR and "invalid first token" in leg.error
        assert_clean(drv)
    finally:
        drv.close()
