"""Pull lends end for everyone at once (issue 40, finding 2): a decode leg that comes
after prefill's lend ended, or a second READ of one lend, never reads blocks prefill has
reused for another prompt; it recomputes (or fails, by policy), answers right and caches
nothing foreign. Real prefill and decode engines, real side channels with a secret."""

from __future__ import annotations

import time
import uuid

import pytest

from engine_helpers import greedy, hf_greedy, random_prompts
from kvpush.config import EngineConfig, KVTransferConfig
from kvpush.engine.llm_engine import LLMEngine
from kvpush.engine.outputs import FinishReason
from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.transfer_thread.lend_claims import LendClaims
from kvpush.kv_transfer.wire import messages as m
from pd_helpers import PDDriver
from test_worker_fences import P, worker

pytestmark = pytest.mark.timeout(120)

SECRET = b"0123456789abcdef0123456789abcdef"
LEASE = 1.0


def instance(model_dir, role: str, policy: str = "recompute", num_blocks: int = 128,
             lease: float = LEASE, faults=None) -> LLMEngine:
    kvt = KVTransferConfig(role=role, mode="pull", engine_id=f"{role}-{uuid.uuid4().hex[:6]}",
                           transport="inproc", lease_timeout_s=lease,
                           heartbeat_interval_s=0.1, side_channel_secret=SECRET,
                           load_failure_policy=policy)
    cfg = EngineConfig.build(model_dir, kv_transfer=kvt, block_size=16,
                             num_blocks=num_blocks, max_model_len=256)
    return LLMEngine(cfg, faults=faults)


def prefill_only(drv: PDDriver, rid: str, prompt: list[int], timeout: float = 20) -> dict:
    """Prefill's leg alone; its answer's kv_transfer_params (the lend)."""
    drv.send_prefill(rid, prompt, greedy(4))
    drv.run(until=lambda: drv.p_legs[rid].finished, timeout=timeout)
    assert drv.p_legs[rid].kv_transfer_params is not None
    return drv.p_legs[rid].kv_transfer_params


def pump_for(drv: PDDriver, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not drv.pump():
            time.sleep(0.005)


def assert_clean(*engines: LLMEngine) -> None:
    for eng in engines:
        s = eng.stats()
        assert s.num_free_blocks == s.num_total_blocks, (eng.connector.role, s)


def failures(eng: LLMEngine) -> list[str]:
    return [r.error or "" for r in eng.connector.ctx.records if not r.ok]


@pytest.fixture
def late_pair(tiny_qwen3):
    """Prefill with 16 blocks (a 240-token prompt needs 15), so a second prompt reuses
    the first one's lent blocks once its lend ended."""
    drv = PDDriver(instance(tiny_qwen3, "prefill", num_blocks=16), instance(tiny_qwen3, "decode"))
    yield drv
    drv.close()


def _lend_then_reuse(drv: PDDriver, prompt: list[int]) -> dict:
    params = prefill_only(drv, "a", prompt)
    assert isinstance(params.get("lend_expires_ms"), int)
    pump_for(drv, LEASE + 0.5)  # prefill's lease ends: the lent blocks go back
    assert not drv.p.connector.sender.lent
    other = random_prompts([240], seed=11)[0]
    prefill_only(drv, "b", other)  # another user's prompt, in the same blocks now
    return params


@pytest.mark.parametrize("skewed", [False, True], ids=["late", "late_clock_skewed"])
def test_a_late_decode_leg_never_reads_a_lend_that_ended(tiny_qwen3, late_pair, skewed):
    """A decode leg that comes after the lend ended recomputes: the right answer, no
    READ of the reused blocks. ``skewed``: its lend_expires_ms says the lend is still
    on (decode's clock behind prefill's): prefill's refusal of the claim decides."""
    drv = late_pair
    prompt = random_prompts([100], seed=10)[0]
    params = _lend_then_reuse(drv, prompt)
    if skewed:
        params = {k: v for k, v in params.items()
                  if k not in ("kvpush_grant", "kvpush_signature")}
        params["lend_expires_ms"] = int((time.time() + 3600) * 1000)
    drv.send_decode("a", prompt, greedy(6), params)  # (re)signed for decode, as the router
    drv.run(until=lambda: drv.d_legs["a"].finished, timeout=30)
    leg = drv.d_legs["a"]
    assert leg.finish_reason is FinishReason.LENGTH, leg.error
    assert leg.tokens == hf_greedy(tiny_qwen3, prompt, 6)  # not from the other prompt's KV
    why = " | ".join(failures(drv.d))
    assert ("refused the READ: the lend has ended" if skewed else "lend of this KV ended") in why
    drv.p.abort_request("p-b")
    drv.settle()
    assert_clean(drv.p, drv.d)
    # nothing foreign was cached: the same prompt again (a fresh lend) answers the same
    drv.submit("again", prompt, greedy(6))
    drv.run(timeout=30)
    assert drv.d_legs["again"].tokens == leg.tokens


def test_a_late_leg_fails_clearly_under_the_fail_policy(tiny_qwen3):
    drv = PDDriver(instance(tiny_qwen3, "prefill", num_blocks=16),
                   instance(tiny_qwen3, "decode", policy="fail"))
    try:
        prompt = random_prompts([100], seed=10)[0]
        params = _lend_then_reuse(drv, prompt)
        drv.send_decode("a", prompt, greedy(6), params)
        drv.run(until=lambda: drv.d_legs["a"].finished, timeout=30)
        leg = drv.d_legs["a"]
        assert leg.finish_reason is FinishReason.ERROR and not leg.tokens
        assert "lend of this KV ended" in leg.error and "came too late" in leg.error
        drv.p.abort_request("p-b")
        drv.settle()
        assert_clean(drv.p, drv.d)
    finally:
        drv.close()


def test_a_lend_is_read_once(tiny_qwen3):
    """The same signed set replayed to another decode instance after the first READ: its
    claim is refused (the lend ended when the first decode said PullDone), it recomputes."""
    p, d, d2 = (instance(tiny_qwen3, "prefill", lease=5.0), instance(tiny_qwen3, "decode"),
                instance(tiny_qwen3, "decode"))
    drv, drv2 = PDDriver(p, d), PDDriver(p, d2)
    try:
        prompt = random_prompts([100], seed=12)[0]
        drv.submit("a", prompt, greedy(6))
        drv.run(timeout=30)
        first = drv.d_legs["a"]
        assert first.finish_reason is FinishReason.LENGTH
        params = drv.p_legs["a"].kv_transfer_params
        assert params["lend_expires_ms"] > time.time() * 1000  # still "on" by its clock
        replay = {k: v for k, v in params.items()
                  if k not in ("kvpush_grant", "kvpush_signature")}
        drv2.send_decode("a", prompt, greedy(6), replay)
        drv2.run(until=lambda: drv2.d_legs["a"].finished, timeout=30)
        assert drv2.d_legs["a"].tokens == first.tokens == hf_greedy(tiny_qwen3, prompt, 6)
        assert any("refused the READ" in f for f in failures(d2))
        drv.settle()
        drv2.settle()
        assert_clean(p, d, d2)
    finally:
        drv.close()
        d2.shutdown()


def test_claims_unit():
    """LendClaims alone (prefill): once per lend, only while live, only the claimer
    ends it."""
    sent: list[tuple[str, m.Message]] = []
    lender = LendClaims(lambda a, msg: sent.append((a, msg)))
    lender.claim(m.PullClaim("t", 7), "d1:1", live=True)
    lender.claim(m.PullClaim("t", 8), "d2:1", live=True)
    lender.claim(m.PullClaim("u", 9), "d1:1", live=False)
    assert [(a, x.ok, x.claim) for a, x in sent] == [("d1:1", True, 7), ("d2:1", False, 8),
                                                     ("d1:1", False, 9)]
    assert "claimed already" in sent[1][1].error and "ended" in sent[2][1].error
    assert lender.from_claimer("t", "d1:1") and not lender.from_claimer("t", "d2:1")
    lender.claim(m.PullClaim("t", 7), "d1:1", live=True)  # its answer was lost: again
    assert sent[-1] == ("d1:1", m.PullClaimed("t", True, claim=7))
    lender.claim(m.PullClaim("t", 5), "d1:1", live=True)  # another claim (a replay)
    assert not sent[-1][1].ok and "claimed already" in sent[-1][1].error
    assert lender.from_claimer("v", "d2:1")  # not claimed: as before
    lender.forget("t")
    assert lender.from_claimer("t", "d2:1")


def test_decode_claims_then_reads_or_gives_up():
    """Decode's half (receives.py): the claim goes out once the blocks are allocated;
    an answer from another sender is ignored; a refusal ends the receive with the
    reason and nothing is READ; a receive that ends while claiming tells prefill."""
    w, ch, tr, events = worker("decode", "pull")
    for tid in ("t", "u"):
        w.handle(c.ReceiveAdded(tid, P, "prefill", [3]))
        w.handle(c.BlocksAllocated(tid, local_blocks=[0], remote_blocks=[3]))
    assert [x.transfer_id for x in ch.of(m.PullClaim)] == ["t", "u"]
    claim = w.receives.recvs["t"].claim
    w.receive(m.encode(m.PullClaimed("t", True, claim=claim)), "10.0.0.9:1")  # not prefill
    assert tr.posts == 0 and events == []
    w.receive(m.encode(m.PullClaimed("t", False, "gone", claim)), P)
    assert events == [c.ReceiveOver("t", False, "prefill refused the READ: gone")]
    w.handle(c.ReceiveEnded("u", "client gone"))
    assert ch.of(m.Abort) == [m.Abort("u", "client gone")]
    assert events[-1] == c.ReceiveOver("u", False, "client gone")
    w.receive(m.encode(m.PullClaimed("u", True)), P)  # too late: nothing is READ
    assert tr.posts == 0 and not w.leases and not w.receives.recvs


def test_an_answer_to_an_earlier_receives_claim_is_never_taken():
    """A leg replayed with the same transfer id claims again; prefill's late "yes" to
    the earlier receive's claim (that lend may be over and its blocks reused) is not
    taken for the new one's (a review found it READ then): only the answer carrying
    its own claim id is."""
    w, ch, tr, events = worker("decode", "pull")

    def claiming() -> int:
        w.handle(c.ReceiveAdded("t", P, "prefill", [3]))
        w.handle(c.BlocksAllocated("t", local_blocks=[0], remote_blocks=[3]))
        return w.receives.recvs["t"].claim

    first = claiming()
    w.handle(c.ReceiveEnded("t", "client gone"))  # over while its claim is out
    second = claiming()  # the replayed leg
    assert first != second
    w.receive(m.encode(m.PullClaimed("t", True, claim=first)), P)  # late, the first's
    assert tr.posts == 0
    w.receive(m.encode(m.PullClaimed("t", True, claim=second)), P)
    assert tr.posts == 1


def test_decode_claims_again_when_prefill_does_not_answer_then_gives_up():
    """A lost claim (or answer) would hang the receive: each side's heartbeats keep the
    other's lease alive. Decode sends it again a quarter lease apart, three times, then
    gives up: Abort to prefill, ReceiveOver(failed); a late answer posts nothing."""
    from kvpush.kv_transfer.transfer_thread.receives import MAX_CLAIM_RESENDS

    w, ch, tr, events = worker("decode", "pull")
    w.handle(c.ReceiveAdded("t", P, "prefill", [3]))
    w.handle(c.BlocksAllocated("t", local_blocks=[0], remote_blocks=[3]))
    now = time.monotonic()
    w.receives.claims_unanswered(now)  # just sent: it may only be slow
    assert len(ch.of(m.PullClaim)) == 1
    for i in range(MAX_CLAIM_RESENDS):
        now += LEASE
        w.receives.claims_unanswered(now)
        assert len(ch.of(m.PullClaim)) == i + 2 and events == []
    w.receives.claims_unanswered(now + LEASE)
    assert ch.of(m.Abort) == [m.Abort("t", "claim unanswered")]
    assert [(ev.tid, ev.ok) for ev in events] == [("t", False)]
    assert "never answered the lend's claim (sent 4 times)" in events[0].why
    w.receive(m.encode(m.PullClaimed("t", True)), P)
    assert tr.posts == 0 and len(events) == 1 and not w.leases


def test_a_lost_claim_answer_is_recovered(tiny_qwen3):
    """End to end: prefill's answer to the claim is lost once; decode claims again,
    prefill answers its claimer again, the READ happens and the answer is right."""
    from kvpush_testing.faults import FaultPlan

    faults = FaultPlan()
    p = instance(tiny_qwen3, "prefill", faults=faults)
    d = instance(tiny_qwen3, "decode", faults=faults)
    drv = PDDriver(p, d)
    try:
        prompt = random_prompts([40], seed=12)[0]
        faults.arm(drop_messages={"PullClaimed": 1})
        drv.submit("r", prompt, greedy(4))
        drv.run(timeout=20)
        leg = drv.d_legs["r"]
        assert leg.finish_reason is FinishReason.LENGTH, leg
        assert faults.count("message_drops:PullClaimed") == 1
        assert leg.tokens == hf_greedy(tiny_qwen3, prompt, 4)
        drv.settle()
        assert_clean(p, d)
    finally:
        drv.close()


def test_a_finished_push_refuses_every_replayed_prefill_leg(tiny_qwen3):
    """Finding 7: a replayed prefill leg of a finished push was refused once, and the
    second replay got a 200 (prefill computed and lent nothing, but held blocks for a
    lease). Now every replay is refused, for as long as its grant may be valid."""
    from kvpush.engine.outputs import RequestError

    def push(role):
        kvt = KVTransferConfig(role=role, mode="push", engine_id=f"{role}-{uuid.uuid4().hex[:6]}",
                               transport="inproc", lease_timeout_s=5.0,
                               heartbeat_interval_s=0.1, side_channel_secret=SECRET)
        return LLMEngine(EngineConfig.build(tiny_qwen3, kv_transfer=kvt, block_size=16,
                                            num_blocks=64, max_model_len=256))

    drv = PDDriver(push("prefill"), push("decode"))
    try:
        prompt = random_prompts([70], seed=13)[0]
        drv.submit("r", prompt, greedy(3))
        drv.run(timeout=30)
        assert drv.d_legs["r"].finish_reason is FinishReason.LENGTH
        drv.settle()
        for _ in range(3):
            with pytest.raises(RequestError, match="already ended"):
                drv.send_prefill("r", prompt, greedy(3))
        assert_clean(drv.p, drv.d)
    finally:
        drv.close()
