"""Security of the KV path between real prefill and decode engines (in-process transport,
real ZMQ side channels on 127.0.0.1): the shared secret, hostile side-channel messages
(sent by a rogue SideChannel to the transfer thread's real one), and every block id and
length a peer sends checked before any transfer."""

from __future__ import annotations

import time
import uuid

import msgspec
import pytest

from engine_helpers import greedy, random_prompts
from kvpush.config import EngineConfig, KVTransferConfig
from kvpush.engine.llm_engine import LLMEngine
from kvpush.engine.outputs import FinishReason
from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.transfer_thread.push_prefill import registration_problem
from kvpush.kv_transfer.wire import messages as m
from kvpush.kv_transfer.wire.side_channel import SideChannel
from kvpush_testing.links import InProcLinks
from pd_helpers import PDDriver

pytestmark = pytest.mark.timeout(120)

SECRET = b"0123456789abcdef0123456789abcdef"
OTHER = b"fedcba9876543210fedcba9876543210"


def instance(model_dir, role: str, mode: str = "push", secret: bytes | None = None,
             lease: float = 5.0) -> LLMEngine:
    kvt = KVTransferConfig(role=role, mode=mode, engine_id=f"{role}-{uuid.uuid4().hex[:6]}",
                           lease_timeout_s=lease, heartbeat_interval_s=0.1,
                           side_channel_secret=secret)
    cfg = EngineConfig.build(model_dir, kv_transfer=kvt, block_size=16, num_blocks=128,
                             max_model_len=512)
    return LLMEngine(cfg, links=InProcLinks())


def pair(model_dir, mode="push", p_secret=None, d_secret=None, lease=5.0) -> PDDriver:
    return PDDriver(instance(model_dir, "prefill", mode, p_secret, lease),
                    instance(model_dir, "decode", mode, d_secret, lease))


def assert_clean(drv: PDDriver) -> None:
    drv.settle()
    for eng in (drv.p, drv.d):
        s = eng.stats()
        assert s.num_free_blocks == s.num_total_blocks


def rejected(eng: LLMEngine, reason: str | None = None) -> int:
    """Side-channel messages ``eng`` refused (for ``reason``, or all), as its step loop
    last heard from its transfer thread."""
    by_reason = eng.connector.counters.side_channel_rejected
    return sum(by_reason.values()) if reason is None else by_reason.get(reason, 0)


def wait_for(drv: PDDriver, cond, what: str, timeout: float = 10.0) -> None:
    """Pump both engines until ``cond()`` (the transfer threads' counters come with
    their heartbeats)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        if not drv.pump():
            time.sleep(0.005)


def rogue_peer(drv: PDDriver, rogue: SideChannel) -> None:
    """``rogue`` (no secret) handshakes with prefill as a decode instance would: its
    Hello copies decode's but names itself; it waits for prefill's answer."""
    d = drv.d.connector.hello
    hello = msgspec.structs.replace(d, engine_id="rogue", address=rogue.address)
    rogue.send(drv.p.connector.address, m.encode(hello))
    deadline = time.monotonic() + 10
    while True:
        assert time.monotonic() < deadline, "prefill did not answer the rogue's Hello"
        drv.pump()
        got = [m.decode(p) for _, p in rogue.recv(10)]
        if any(isinstance(msg, m.Hello) for msg in got):
            return


# ---- the shared secret --------------------------------------------------------------

@pytest.mark.parametrize("mode", ["push", "pull"])
def test_same_secret_transfers_and_nothing_is_rejected(tiny_qwen3, mode):
    drv = pair(tiny_qwen3, mode, SECRET, SECRET)
    try:
        assert drv.p.connector.worker.channel.auth is not None
        for i, prompt in enumerate(random_prompts([40, 70], seed=3)):
            drv.submit(f"r{i}", prompt, greedy(4))
        drv.run(timeout=30)
        for leg in drv.d_legs.values():
            assert leg.finish_reason is FinishReason.LENGTH and len(leg.tokens) == 4
        assert_clean(drv)
        wait_for(drv, lambda: drv.p.connector.counters.side_channel_rejected
                 and drv.d.connector.counters.side_channel_rejected, "the counters")
        assert rejected(drv.p) == rejected(drv.d) == 0
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
        # the Hello (and anything else) refused
        wait_for(drv, lambda: rejected(drv.p, reason) >= 1, f"prefill's {reason} count")
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
        # mismatch ("unsigned", naming the missing secret), or, when prefill closes first,
        # a handshake broken off without detail ("closed_in_handshake"), which says what
        # it can: no side channel of ours at that address or one without our secret
        wait_for(drv, lambda: rejected(drv.d, "unsigned")
                 + rejected(drv.d, "closed_in_handshake") >= 1, "decode's refusals")
        assert ("no side-channel secret configured" in caplog.text
                or "or one without our cluster secret" in caplog.text)
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
        wait_for(drv, lambda: drv.p.connector.counters.side_channel_rejected, "the counters")
        before, posts = rejected(drv.p), drv.p.connector.worker.transport.stats.posts
        forger.send(drv.p.connector.address, m.encode(reg))
        wait_for(drv, lambda: rejected(drv.p) > before, "the forgery refused")
        rec = drv.p.connector.worker.table.get("t")  # (the transfer thread's: a read)
        assert rec is not None and rec.reg is None  # still waits for a real one
        assert drv.p.connector.worker.transport.stats.posts == posts  # nothing written
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
        hello = msgspec.structs.replace(p.hello, engine_id="rogue", address=rogue.address,
                                        agent_metadata=b"\x00garbage")
        for frame in (b"", b"\xff" * 64, m.encode(hello), b"\x81\xa4type\xa5Hello"):
            rogue.send(p.address, frame)
        wait_for(drv, lambda: p.counters.messages_bad >= 3
                 and p.counters.side_channel_peers.get("refused") == 1, "the frames counted")
        refusal = rogue.recv(2000)
        assert refusal and "unusable transport metadata" in m.decode(refusal[0][1]).reason
        drv.submit("r", random_prompts([50])[0], greedy(3))
        drv.run(timeout=20)  # (a dead transfer thread would have raised here)
        assert drv.d_legs["r"].finish_reason is FinishReason.LENGTH
        assert_clean(drv)
    finally:
        rogue.close()
        drv.close()


# ---- block ids and lengths from a peer ------------------------------------------------

def test_registration_problem_cases():
    chain = [b"a" * 16, b"b" * 16, b"c" * 16]

    def reg(ids, skip=0, n=40, full_hit=False, hashes=chain):
        return m.PushRegister("t", "d", "h:1", ids, skip, n, full_hit, hashes)

    assert registration_problem(reg([3, 4, 5]), 10, 16, 40, chain) is None
    cases = {
        "outside": reg([3, 4, 10]),
        "outside [0": reg([-1, 4, 5]),
        "twice": reg([3, 3, 5]),
        "skips 4 of its 3": reg([3, 4, 5], skip=4),
        "skips -1": reg([3, 4, 5], skip=-1),
        "prompt has 0 tokens": reg([3], n=0),
        "need 3": reg([3, 4], n=40),
        "did not tokenize the same prompt": reg([3, 4, 5], n=41),
        "from block 1 on": reg([3, 4, 5], hashes=[chain[0], b"x" * 16, chain[2]]),
        "sent no hash chain": reg([3, 4, 5], hashes=[]),
    }
    for words, r in cases.items():
        problem = registration_problem(r, 10, 16, 40, chain)
        assert problem and words in problem, (words, problem)


def test_bad_registrations_write_nothing(tiny_qwen3):
    """Every kind of bad registration, from a peer that passed the handshake: prefill
    posts no WRITE, tells the sender why, frees the leg's blocks, and serves on."""
    drv = pair(tiny_qwen3, "push")
    rogue = SideChannel("127.0.0.1", 0)
    try:
        drv.submit("warm", random_prompts([40])[0], greedy(2))  # decode's handshake
        drv.run(timeout=20)
        assert_clean(drv)
        rogue_peer(drv, rogue)
        d_blocks = drv.d.connector.hello.layout.num_blocks
        prompt = random_prompts([40], seed=9)[0]  # 3 blocks of 16
        bad = [
            [d_blocks, 1, 2],  # beyond the region its Hello announced
            [0, -3, 2],  # negative
            [5, 5, 6],  # duplicate
            [10**12, 1, 2],  # far beyond
        ]
        transport = drv.p.connector.worker.transport
        posts = transport.stats.posts
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
            rogue.send(drv.p.connector.address, m.encode(m.PushRegister(
                tid, "rogue", rogue.address, blocks, skip, n)))
            answers: list[m.Message] = []
            deadline = time.monotonic() + 10
            while not any(isinstance(a, m.PushDone) for a in answers):
                assert time.monotonic() < deadline, f"no answer to {tid}'s registration"
                drv.pump()
                answers += [m.decode(p) for _, p in rogue.recv(5)]
            [done] = [a for a in answers if isinstance(a, m.PushDone)]
            assert done.transfer_id == tid and not done.ok
            assert done.error.startswith("invalid registration"), done
            drv.run(until=lambda t=tid: drv.p_legs[t].finished
                    and t not in drv.p.connector.holds.by_tid, timeout=20)
        assert transport.stats.posts == posts  # not one WRITE
        assert_clean(drv)
        drv.submit("after", prompt, greedy(3))  # and it goes on serving
        drv.run(timeout=20)
        assert drv.d_legs["after"].finish_reason is FinishReason.LENGTH
        assert_clean(drv)
    finally:
        rogue.close()
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
        reads = drv.d.connector.worker.transport.stats.posts
        for tid in ("x1", "x2"):  # peer unknown, then known
            drv.send_decode(tid, prompt, greedy(2), {**params, "transfer_id": tid})
            drv.run(timeout=20)
            leg = drv.d_legs[tid]
            assert leg.finish_reason is FinishReason.ERROR and words in leg.error
            assert leg.rejected  # the client's mistake: HTTP 400, not 500
        assert drv.d.connector.worker.transport.stats.posts == reads
        assert_clean(drv)
    finally:
        drv.close()


def test_a_transfer_id_stays_taken_until_its_receive_is_over(tiny_qwen3):
    """A decode leg ended before it had blocks is done on the step loop at once, but its
    transfer thread still answers for it (its Over): a leg reusing the id before that
    answer is refused (else it would take the old answer as its own, and free blocks
    prefill then WRITEs into); after it, the id can be used again."""
    from kvpush.errors import RequestError

    drv = pair(tiny_qwen3, "push", lease=1.0)
    try:
        prompt = random_prompts([40], seed=6)[0]
        params = drv.signed(drv.d, drv.d_params("t"), drv.p)
        holds = drv.d.connector.holds
        drv.d.add_request("d-t1", prompt, greedy(2), params)
        drv.d.abort_request("d-t1")  # before the step loop gave it blocks
        hold = holds.by_tid["t"]
        assert hold.request_id is None and hold.blocks == []
        with pytest.raises(RequestError, match="already in use"):
            drv.d.add_request("d-t2", prompt, greedy(2), params)
        wait_for(drv, lambda: "t" not in holds.by_tid, "the receive's Over")
        drv.d.add_request("d-t3", prompt, greedy(2), params)  # free again
        drv.d.abort_request("d-t3")
        assert_clean(drv)
    finally:
        drv.close()


def test_duplicate_or_negative_remote_block_ids_are_a_400_at_once(tiny_qwen3):
    from kvpush.errors import RequestError

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


class CorruptFirstToken:
    """Prefill's role object, but the token #1 it sends decode is ``bad`` (a peer that
    sends nonsense: the wrapper stands in for it, the frame crosses the real channel)."""

    def __init__(self, role, bad: dict) -> None:
        self._role, self._bad = role, bad

    def prefilled(self, f: c.Prefilled) -> None:
        self._role.prefilled(c.Prefilled(f.tid, msgspec.structs.replace(f.done, **self._bad)))

    def __getattr__(self, name: str):
        return getattr(self._role, name)


@pytest.mark.parametrize("bad", [
    "token-out-of-vocab", "top-id-out-of-vocab", "top-logprob-positive", "top-too-long"])
def test_invalid_first_token_from_prefill_fails_the_request(tiny_qwen3, bad):
    """A PushDone whose token #1, or any of its top alternatives, is out of range fails
    the request (decode never hands it out) and frees its blocks."""
    drv = pair(tiny_qwen3, "push")
    try:
        vocab = drv.d.config.model.vocab_size
        done = {"token-out-of-vocab": {"first_token": vocab},
                "top-id-out-of-vocab": {"first_token": 1,
                                        "first_top_logprobs": [(1, -0.5), (vocab, -1.0)]},
                "top-logprob-positive": {"first_token": 1, "first_top_logprobs": [(1, 0.5)]},
                "top-too-long": {"first_token": 1,
                                 "first_top_logprobs": [(1, -1.0)] * 21}}[bad]
        worker = drv.p.connector.worker
        worker.role = CorruptFirstToken(worker.role, done)  # (read by the thread per fact)
        drv.submit("t", random_prompts([40], seed=4)[0], greedy(3))
        drv.run(timeout=20)
        leg = drv.d_legs["t"]
        assert leg.finish_reason is FinishReason.ERROR and "invalid first token" in leg.error
        assert leg.tokens == []  # never handed out
        assert_clean(drv)
    finally:
        drv.close()
