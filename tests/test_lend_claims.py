"""Pull lends end for everyone at once (issue 40, finding 2): a decode leg that comes
after prefill's lend ended, or a second READ of one lend, never reads blocks prefill has
reused for another prompt; it recomputes (or fails, by policy), answers right and caches
nothing foreign. The claim protocol on one transfer thread (worker_helpers: injected
clock, fake channel), then end to end: real prefill and decode engines, real side
channels with a secret."""

from __future__ import annotations

import time
import uuid

import pytest

from engine_helpers import greedy, hf_greedy, random_prompts
from kvpush.config import EngineConfig, KVTransferConfig
from kvpush.engine.llm_engine import LLMEngine
from kvpush.engine.outputs import FinishReason
from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.transfer_thread.context import MAX_RESENDS
from kvpush.kv_transfer.wire import messages as m
from kvpush_testing.faults import FaultPlan
from kvpush_testing.links import InProcLinks
from pd_helpers import PDDriver
from worker_helpers import LEASE, OTHER, D, allocated, begin_receive, claiming, make

pytestmark = pytest.mark.timeout(120)

OK, FAILED = c.Outcome.OK, c.Outcome.FAILED
RESEND_S = LEASE / 4  # how long an unanswered claim waits


# ---- one transfer thread: prefill lends ------------------------------------------------
def claimed(h, address: str) -> list[tuple[str, bool, int, str | None]]:
    """Prefill's answers to ``address``'s claims: (transfer id, ok, claim id, error)."""
    return [(x.transfer_id, x.ok, x.claim, x.error) for x in h.sent(m.PullClaimed, address)]


def test_a_lend_is_claimed_once_only_while_live_and_ended_by_its_claimer_only():
    """Prefill says yes to one claimer of a lend (again to that claimer's repeat of its
    claim, its answer may have been lost), no to everyone else and to any claim once the
    lend ended; once claimed, only the claimer's PullDone or Abort ends it, unclaimed,
    any decode's."""
    h = make("prefill", "pull")
    h.meet(OTHER)  # a second decode instance
    h.state(c.Prefilled("t"), c.Prefilled("v"))
    h.receive(m.PullClaim("t", 7), D)
    h.receive(m.PullClaim("t", 8), OTHER)
    h.receive(m.PullClaim("u", 9), D)  # never lent
    [(_, yes, seven, _), (_, no, nine, ended)] = claimed(h, D)
    [(_, other_ok, eight, taken)] = claimed(h, OTHER)
    assert (yes, seven, other_ok, eight, no, nine) == (True, 7, False, 8, False, 9)
    assert "claimed already" in taken and "ended" in ended
    h.receive(m.PullClaim("t", 7), D)  # its answer was lost: again
    assert claimed(h, D)[-1] == ("t", True, 7, None)
    h.receive(m.PullClaim("t", 5), D)  # another claim of the same decode (a replay)
    assert claimed(h, D)[-1][1] is False and "claimed already" in claimed(h, D)[-1][3]
    h.receive(m.PullDone("t"), OTHER)  # not the claimer's word
    h.receive(m.Abort("t", "mine"), OTHER)
    assert h.events == [] and h.counters.messages_bad == 2
    h.receive(m.PullDone("t"), D)
    assert h.overs() == [("t", OK, None)]
    h.receive(m.PullClaim("t", 7), D)  # read once: over for everyone, its claimer too
    assert claimed(h, D)[-1][:2] == ("t", False) and "ended" in claimed(h, D)[-1][3]
    h.receive(m.Abort("v", "client gone"), OTHER)  # unclaimed: any decode's word ends it
    assert h.overs()[-1] == ("v", FAILED, "decode gave up on the lend")
    assert h.counters.aborts_received == 1 and len(h.worker.table) == 0


def test_a_lend_ends_at_its_lease_and_is_refused_from_then_on():
    """Any peer's heartbeat naming the lend renews it (it is not claimed yet, whoever
    will claim it may be any decode); without, its lease ends it and a claim that comes
    later is refused (its blocks go back to the pool and may hold another prompt)."""
    h = make("prefill", "pull")
    h.state(c.Prefilled("t"))
    h.advance(LEASE * 0.6)
    h.receive(m.Heartbeat("decode", ["t"], []))
    h.advance(LEASE * 0.6)
    assert h.events == []
    h.advance(LEASE * 0.5)
    assert h.overs() == [("t", FAILED, "lease expired: decode never read the lend")]
    assert h.counters.leases_expired == 1
    h.receive(m.PullClaim("t", 3))
    assert claimed(h, D)[-1][:2] == ("t", False) and "ended" in claimed(h, D)[-1][3]


# ---- one transfer thread: decode claims -----------------------------------------------
def test_decode_claims_then_reads_or_gives_up():
    """Decode's half: the claim goes out once the blocks are allocated; an answer from
    another sender is ignored; a refusal ends the receive with the reason and nothing is
    READ; a receive that ends while claiming tells prefill."""
    h = make("decode", "pull")
    claims = {tid: claiming(h, tid, lent=(3,), blocks=[0]) for tid in ("t", "u")}
    assert [x.transfer_id for x in h.sent(m.PullClaim)] == ["t", "u"]
    h.receive(m.PullClaimed("t", True, claim=claims["t"]), OTHER)  # not prefill
    assert h.posted() == [] and h.events == [] and h.counters.messages_bad == 1
    h.receive(m.PullClaimed("t", False, "gone", claims["t"]))
    assert h.overs() == [("t", FAILED, "prefill refused the READ: gone")]
    h.state(c.End("u", "client gone"))
    assert h.sent(m.Abort) == [m.Abort("u", "client gone")]
    assert h.overs()[-1] == ("u", FAILED, "client gone")
    h.receive(m.PullClaimed("u", True, claim=claims["u"]))  # too late: nothing is READ
    assert h.posted() == [] and len(h.worker.table) == 0 and len(h.overs()) == 2


def test_a_late_leg_never_claims_a_lend_that_ended():
    """A leg whose signed lend end has passed fails (and recomputes, by policy) without
    claiming or reading; one with nothing to read lets the lend go at once."""
    h = make("decode", "pull")
    h.state(begin_receive("t", lent=(6,), prompt_tokens=16, lend_expires_ms=1),
            allocated("t", [3]))
    [(tid, outcome, why)] = h.overs()
    assert (tid, outcome) == ("t", FAILED) and "came too late" in why
    h.state(begin_receive("u", lent=(6,), prompt_tokens=16), allocated("u", [3], cached=1,
                                                                       full_hit=True))
    assert h.overs()[-1] == ("u", OK, None) and h.sent(m.PullDone) == [m.PullDone("u")]
    assert h.sent(m.PullClaim) == [] and h.posted() == []


def test_an_answer_to_an_earlier_receives_claim_is_never_taken():
    """A leg replayed with the same transfer id claims again; prefill's late "yes" to
    the earlier receive's claim (that lend may be over and its blocks reused) is not
    taken for the new one's (a review found it READ then): only the answer carrying
    its own claim id is."""
    h = make("decode", "pull")
    first = claiming(h, "t")
    h.state(c.End("t", "client gone"))  # over while its claim is out
    second = claiming(h, "t")  # the replayed leg
    assert first != second
    h.receive(m.PullClaimed("t", True, claim=first))  # late, the first's
    assert h.posted() == [] and len(h.events) == 1  # (the first receive's Over)
    h.receive(m.PullClaimed("t", True, claim=second))
    assert len(h.posted("READ")) == 1


def test_decode_claims_again_when_prefill_does_not_answer_then_gives_up():
    """A lost claim (or answer) would hang the receive: each side's heartbeats keep the
    other's lease alive. Decode sends the same claim again a quarter lease apart,
    MAX_RESENDS times, then gives up: Abort to prefill, Over(failed); a late answer
    posts nothing."""
    h = make("decode", "pull")
    claim = claiming(h, "t")
    beat = m.Heartbeat("prefill", ["t"], [])
    h.advance(RESEND_S / 2)
    h.receive(beat)
    assert len(h.sent(m.PullClaim)) == 1  # just sent: it may only be slow
    for i in range(MAX_RESENDS):
        h.advance(RESEND_S)
        h.receive(beat)
        assert h.sent(m.PullClaim) == [m.PullClaim("t", claim)] * (i + 2)
        assert h.events == []
    h.advance(RESEND_S)
    assert h.sent(m.Abort) == [m.Abort("t", "claim unanswered")]
    [(tid, outcome, why)] = h.overs()
    assert (tid, outcome) == ("t", FAILED)
    assert f"never answered the lend's claim (sent {MAX_RESENDS + 1} times)" in why
    h.receive(m.PullClaimed("t", True, claim=claim))
    assert h.posted() == [] and len(h.events) == 1 and len(h.worker.table) == 0


# ---- end to end ---------------------------------------------------------------------------
SECRET = b"0123456789abcdef0123456789abcdef"
E2E_LEASE = 1.0


def instance(model_dir, role: str, policy: str = "recompute", num_blocks: int = 128,
             lease: float = E2E_LEASE, mode: str = "pull",
             faults: FaultPlan | None = None) -> LLMEngine:
    kvt = KVTransferConfig(role=role, mode=mode, engine_id=f"{role}-{uuid.uuid4().hex[:6]}",
                           lease_timeout_s=lease, heartbeat_interval_s=0.1,
                           side_channel_secret=SECRET, load_failure_policy=policy)
    cfg = EngineConfig.build(model_dir, kv_transfer=kvt, block_size=16,
                             num_blocks=num_blocks, max_model_len=256)
    eng = LLMEngine(cfg, links=InProcLinks(faults))
    eng.transfer_records = []
    eng.connector.record_sink = eng.transfer_records.append
    return eng


def prefill_only(drv: PDDriver, rid: str, prompt: list[int], timeout: float = 20) -> dict:
    """Prefill's leg alone; its answer's kv_transfer_params (the lend)."""
    drv.send_prefill(rid, prompt, greedy(4))
    drv.run(until=lambda: drv.p_legs[rid].finished, timeout=timeout)
    assert drv.p_legs[rid].kv_transfer_params is not None
    return drv.p_legs[rid].kv_transfer_params


def assert_clean(*engines: LLMEngine) -> None:
    for eng in engines:
        s = eng.stats()
        assert s.num_free_blocks == s.num_total_blocks, (eng.connector.role, s)


def failures(eng: LLMEngine) -> list[str]:
    return [r.error or "" for r in eng.transfer_records if not r.ok]


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
    # prefill's lease ends: the lent blocks go back
    drv.run(until=lambda: not drv.p.connector.holds.by_tid, timeout=E2E_LEASE + 5)
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


def test_a_lost_claim_answer_is_recovered(tiny_qwen3):
    """End to end: prefill's answer to the claim is lost once; decode claims again,
    prefill answers its claimer again, the READ happens and the answer is right."""
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
        assert not failures(d)  # the READ happened: nothing was recomputed
        drv.settle()
        assert_clean(p, d)
    finally:
        drv.close()


def test_a_finished_push_refuses_every_replayed_prefill_leg(tiny_qwen3):
    """Finding 7: a replayed prefill leg of a finished push was refused once, and the
    second replay got a 200 (prefill computed and lent nothing, but held blocks for a
    lease). Now every replay is refused (a 400), for as long as its grant may be
    valid, and holds nothing."""
    drv = PDDriver(instance(tiny_qwen3, "prefill", mode="push", lease=5.0, num_blocks=64),
                   instance(tiny_qwen3, "decode", mode="push", lease=5.0, num_blocks=64))
    try:
        prompt = random_prompts([70], seed=13)[0]
        drv.submit("r", prompt, greedy(3))
        drv.run(timeout=30)
        assert drv.d_legs["r"].finish_reason is FinishReason.LENGTH
        drv.settle()
        for _ in range(3):
            drv.send_prefill("r", prompt, greedy(3))
            # the transfer thread's verdict, waited for before a step (none is run)
            deadline = time.monotonic() + 10
            outs: list = []
            while not outs:
                assert time.monotonic() < deadline, "the replayed leg was not refused"
                outs = [o for o in drv.p.process_inbox(block=True, timeout=0.05)
                        if o.request_id == "p-r"]
            [out] = outs
            assert out.finished and not out.new_token_ids, out
            assert out.failure.rejected and "already ended" in out.failure.message, out
            drv.settle()
        assert_clean(drv.p, drv.d)
    finally:
        drv.close()
