"""TransferWorker without its thread (worker_helpers: a fake channel and transport, an
injected clock): how push prefill matches registrations to the blocks the step loop
states ready, answers Aborts, refuses late WRITEs and ends a push on its lease; how
decode registers, re-sends, checks prefill and fences its blocks until prefill's word
(its answer, its connection's drop, the fence timeout) — deterministic, no sockets, no
sleeps."""

from __future__ import annotations

import msgspec
import pytest

from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.transfer_thread.context import MAX_RESENDS
from kvpush.kv_transfer.transfer_thread.push_prefill import FULL_HIT
from kvpush.kv_transfer.wire import messages as m
from worker_helpers import (
    BASE,
    CHAIN,
    FENCE,
    LEASE,
    OTHER,
    D,
    P,
    begin_push,
    begin_receive,
    claiming,
    computed,
    hello,
    make,
    prefilled,
    register,
    registered,
    sending,
)

OK, FAILED = c.Outcome.OK, c.Outcome.FAILED
REJECTED, NOT_NEEDED = c.Outcome.REJECTED, c.Outcome.NOT_NEEDED
SILENT = "lease expired: prefill stopped answering"
RESEND_S = LEASE / 4  # how long an unanswered registration or claim waits


# ---- push prefill -----------------------------------------------------------------------
def test_prefill_acks_an_abort_for_an_unknown_id_at_once_and_refuses_its_writes():
    h = make("prefill")
    h.receive(m.Abort("never-seen", "client gone"))
    assert h.channel.sent == [(D, m.AbortAck("never-seen"))]
    assert h.events == [] and h.counters.aborts_received == 1  # counted, nothing to do
    h.state(computed("never-seen"))
    assert h.posted() == [] and h.counters.writes_refused == 1
    assert len(h.worker.table) == 0


def test_prefill_acks_only_once_its_in_flight_writes_drained():
    h = make("prefill")
    sending(h, "t")
    assert len(h.posted()) == 1
    h.receive(m.Abort("t", "client gone"))
    assert h.sent(m.AbortAck) == []  # a WRITE may still land in decode's blocks
    assert h.kinds() == ["Failing"]  # the prefill stops now, its blocks stay held
    h.state(computed("t"))  # stated before the step loop heard
    assert len(h.posted()) == 1 and h.counters.writes_refused == 1
    h.land()
    assert h.sent(m.AbortAck, D) == [m.AbortAck("t")] and h.sent(m.PushDone) == []
    assert h.overs() == [("t", FAILED, "aborted by decode: client gone")]
    # over, its id remembered: blocks stated later are refused, its End changes nothing
    h.state(computed("t"), c.End("t", "aborted"))
    assert len(h.posted()) == 1 and h.counters.writes_refused == 2
    # decode has its one answer, the step loop one Failing and one Over
    assert len(h.sent(m.AbortAck)) == 1 and h.kinds() == ["Failing", "Over"]
    assert len(h.worker.table) == 0


def test_prefill_refuses_writes_once_a_transfer_finished():
    h = make("prefill")
    sending(h, "t")
    h.state(prefilled("t", first_token=5))
    assert h.sent(m.PushDone) == []  # its WRITE has not landed
    h.land()
    assert [(d.ok, d.first_token) for d in h.sent(m.PushDone)] == [(True, 5)]
    assert h.overs() == [("t", OK, None)]
    h.state(computed("t"))
    assert len(h.posted()) == 1 and h.counters.writes_refused == 1
    # a registration sent again (decode thought it lost) is told the transfer is over
    h.receive(register("t"))
    assert [d.ok for d in h.sent(m.PushDone)] == [True, False] and len(h.posted()) == 1
    # an Abort arriving after PushDone is answered too (nothing is in flight)
    h.receive(m.Abort("t", "client gone"))
    assert h.sent(m.AbortAck) == [m.AbortAck("t")] and len(h.overs()) == 1
    # handed over, then the router gives up: decode waits for this KV, it decides
    sending(h, "u")
    h.state(prefilled("u"), c.End("u", "router gave up"))
    h.land()
    assert [(d.transfer_id, d.ok) for d in h.sent(m.PushDone)][-1] == ("u", True)
    assert h.overs()[-1] == ("u", OK, None) and h.failings() == []


def test_prefill_lease_ends_a_push_on_the_transfer_thread():
    """Prefill's lease ends: with nothing of ours in flight decode gets PushDone(ok=False)
    at once and the step loop one Over; with WRITEs in flight, the step loop hears
    Failing (the prefill stops) and PushDone(ok=False) waits until they drained."""
    h = make("prefill")
    sending(h, "t", blocks=False)
    h.advance(LEASE + 0.1)
    [done] = h.sent(m.PushDone)
    assert not done.ok and "lease expired" in done.error
    assert h.overs() == [("t", FAILED, "lease expired: decode stopped answering")]
    h.state(prefilled("t"), c.End("t", "aborted"))  # the step loop's facts that crossed it
    assert h.posted() == [] and len(h.sent(m.PushDone)) == 1 and h.kinds() == ["Over"]
    h.state(begin_push("u"))  # never registered
    h.advance(LEASE + 0.1)
    assert h.overs()[-1] == ("u", FAILED, "lease expired: decode never registered")
    assert len(h.sent(m.PushDone)) == 1  # nobody to tell
    sending(h, "v")  # a WRITE in flight
    h.advance(LEASE + 0.1)
    assert h.failings() == [("v", "lease expired: decode stopped answering")]
    assert len(h.sent(m.PushDone)) == 1 and len(h.overs()) == 2
    h.land()
    assert not h.sent(m.PushDone)[-1].ok and h.overs()[-1][:2] == ("v", FAILED)
    assert len(h.worker.table) == 0 and h.counters.leases_expired == 3


def test_prefill_matches_a_registration_that_came_first():
    """Decode's registration before prefill's leg: kept, then matched when the leg
    begins (decode's heartbeats keep it alive from then on); blocks stated before a
    registration are kept and written as it lands, clipped to what decode registered
    (its cached blocks skipped)."""
    h = make("prefill")
    h.receive(register("t"))
    assert h.events == [] and h.posted() == []
    h.state(begin_push("t"), computed("t", 0, [0, 1]))
    assert [p[2:] for p in h.posted()] == [([(BASE, 16)], [(BASE, 16)])]
    for _ in range(3):  # three leases: decode's heartbeats renew it now
        h.advance(LEASE * 0.9)
        h.receive(m.Heartbeat("decode", ["t"], []))
    assert h.events == [] and h.sent(m.PushDone) == [] and h.sent(m.Abort) == []
    # registration second: blocks 0-1 and 2-3 stated, decode holds block 0 already
    h.state(begin_push("u"), computed("u", 0, [0, 1]), computed("u", 2, [2, 3]))
    assert len(h.posted()) == 1
    h.receive(register("u", [7, 6, 5, 4, 3, 2, 1, 0], skip=1))
    assert [p[2:] for p in h.posted()[1:]] == [
        ([(BASE + 8, 8)], [(BASE + 48, 8)]),  # block 1 -> 6 (0 skipped)
        ([(BASE + 16, 8), (BASE + 24, 8)], [(BASE + 40, 8), (BASE + 32, 8)])]  # 2-3 -> 5, 4
    assert h.counters.registrations_after_blocks == 1 and h.events == []


def test_a_registration_sent_again_while_writes_drain_changes_nothing():
    """Decode re-sends its registration (prefill's heartbeat still listed the transfer)
    while the WRITEs of a handed-over or ended transfer drain: nothing is matched or
    written again, and neither Abort nor PushDone goes before they drained (decode would
    free blocks the WRITEs still reach)."""
    h = make("prefill")
    sending(h, "t")
    h.state(prefilled("t"))  # handed over, its WRITE pending
    h.receive(register("t"))
    assert h.channel.sent == [] and len(h.posted()) == 1
    h.state(c.End("t", "router gave up"))  # handed over: decode decides, nothing changes
    assert h.channel.sent == [] and h.events == []
    sending(h, "u")
    h.advance(LEASE + 0.1)  # "t" (draining) and "u" (prefilling) run out
    h.receive(register("u"))
    assert h.sent(m.PushDone) == [] and h.sent(m.Abort) == [] and len(h.posted()) == 2
    assert h.failings() == [("u", "lease expired: decode stopped answering")]
    h.land(1)
    h.land(2)
    assert sorted((d.transfer_id, d.ok) for d in h.sent(m.PushDone)) == [("t", False),
                                                                          ("u", False)]
    assert sorted(o[:2] for o in h.overs()) == [("t", FAILED), ("u", FAILED)]
    assert len(h.worker.table) == 0


def test_decode_abort_before_the_leg_ends_the_transfer_for_good():
    """Decode aborts before prefill's leg arrives: the leg, whenever it comes (and every
    replay of it), is refused at once, and a registration overtaken by the Abort gets
    PushDone(ok=False), never ok=True with nothing written."""
    h = make("prefill")
    h.receive(m.Abort("t", "client gone"))
    assert h.sent(m.AbortAck) == [m.AbortAck("t")]
    h.state(begin_push("t"))
    [(tid, outcome, why)] = h.overs()
    assert (tid, outcome) == ("t", REJECTED)
    assert why.startswith("transfer t already ended: aborted by decode")
    h.receive(register("t"))
    h.state(computed("t"), prefilled("t"))
    assert [d.ok for d in h.sent(m.PushDone)] == [False] and h.posted() == []
    h.state(begin_push("t"))  # replayed again: refused again
    assert [o[1] for o in h.overs()] == [REJECTED, REJECTED] and len(h.worker.table) == 0


def test_prefill_refuses_a_bad_registration_and_writes_nothing():
    h = make("prefill")
    h.state(begin_push("t"), computed("t"))
    h.receive(register("t", [0, 1, 2, 3, 4, 5, 6, 99]))
    [done] = h.sent(m.PushDone)
    assert not done.ok and "outside" in done.error and h.posted() == []
    [(tid, outcome, why)] = h.overs()
    assert (tid, outcome) == ("t", FAILED) and "invalid registration" in why
    h.state(begin_push("u"))  # another prompt than decode's
    h.receive(register("u", prompt_hashes=CHAIN[:7] + (b"x" * 16,)))
    assert "differs from prefill's from block 7" in h.sent(m.PushDone)[-1].error
    h.state(begin_push("v"))  # decode has it all cached: nothing to send
    h.receive(register("v", full_hit=True))
    assert h.overs()[-1] == ("v", NOT_NEEDED, FULL_HIT)
    assert len(h.sent(m.PushDone)) == 2 and h.posted() == [] and len(h.worker.table) == 0


def test_an_early_registration_whose_leg_never_comes_is_aborted_and_counted():
    """Decode registered but prefill's leg never arrives: its deadline is fixed (decode's
    heartbeats do not move it); then prefill tells decode (Abort, counted in
    aborts_sent), keeps nothing, and refuses the leg should it come after all."""
    h = make("prefill")
    h.receive(register("t"))
    h.advance(LEASE * 0.6)
    h.receive(m.Heartbeat("decode", ["t"], []))
    h.advance(LEASE * 0.5)
    assert h.sent(m.Abort) == [m.Abort("t", "lease expired")]
    assert (h.counters.aborts_sent, h.counters.leases_expired) == (1, 1)
    assert h.events == [] and len(h.worker.table) == 0  # the step loop never had it
    h.state(begin_push("t"))
    assert [o[:2] for o in h.overs()] == [("t", REJECTED)]


def test_prefill_polls_fast_only_once_a_completion_is_waited_for():
    """WRITEs posted layer by layer during a forward pass are progressed at the idle
    pace; once the transfer is handed over (PushDone waits on them) or aborted (the
    AbortAck does), the loop's wait is ``busy_poll_s``."""
    h = make("prefill", busy_poll_s=0.005)
    h.run_once()  # (its first heartbeat: the next is far off)
    sending(h, "t")
    h.run_once()
    assert h.channel.waits_ms[-1] == 20  # nobody waits on it yet
    h.state(prefilled("t", 5))
    h.run_once()
    assert h.channel.waits_ms[-1] == 5
    h.land()
    h.run_once()
    assert h.sent(m.PushDone) and h.channel.waits_ms[-1] == 20
    sending(h, "u")  # decode aborts while a WRITE is in flight
    h.receive(m.Abort("u", "client gone"))
    h.run_once()
    assert h.channel.waits_ms[-1] == 5  # the AbortAck waits on it


def test_the_transfer_thread_builds_descriptors_from_block_ids():
    """Block ids and layers cross (BlocksReady, the registration, the lend); the transfer
    thread turns them into descriptors from the two Hellos (one per layer per run
    consecutive on both sides), and a block outside our region fails the transfer
    instead of posting."""
    h = make("prefill")
    h.state(begin_push("t"))
    h.receive(register("t", [2, 3, 4, 0, 1, 5, 6, 7]))
    h.state(computed("t", 0, [0, 1, 5]))
    [(op, agent, local, remote)] = h.posted()
    assert (op, agent) == ("WRITE", "decode")
    assert local == [(BASE, 16), (BASE + 40, 8)]  # blocks 0-1, then 5 (8 bytes a block)
    assert remote == [(BASE + 16, 16), (BASE + 32, 8)]  # 2-3, then 4
    sending(h, "bad", blocks=False)
    h.state(computed("bad", 0, [8]), prefilled("bad", 1))  # we have 8 blocks: 0-7
    [done] = [d for d in h.sent(m.PushDone) if d.transfer_id == "bad"]
    assert not done.ok and "not posted" in done.error and len(h.posted()) == 1
    assert h.overs()[-1][:2] == ("bad", FAILED)
    r = make("decode", "pull")
    claim = claiming(r, "u", lent=(6,), blocks=[3])
    assert r.sent(m.PullClaim) == [m.PullClaim("u", claim)] and r.posted() == []
    r.receive(m.PullClaimed("u", True, claim=claim))  # live: READ it
    [(op, agent, local, remote)] = r.posted()
    assert (op, agent, local, remote) == ("READ", "prefill", [(BASE + 24, 8)],
                                          [(BASE + 48, 8)])
    r.land()
    assert r.sent(m.PullDone) == [m.PullDone("u", ok=True)] and r.overs() == [("u", OK, None)]


# ---- decode: registrations and checks ---------------------------------------------------
def test_decode_sends_a_lost_registration_again_then_gives_up():
    """Prefill's heartbeat lists a transfer as awaiting its registration: decode sends
    it again (at most every quarter lease, MAX_RESENDS times), then tells prefill Abort
    and the step loop Failing, and fences the blocks (prefill may have got one after
    all); a receive that ended is never re-sent."""
    h = make("decode")
    registered(h, "t")
    registered(h, "u")
    assert [r.transfer_id for r in h.sent(m.PushRegister)] == ["t", "u"]
    beat = m.Heartbeat("prefill", ["t", "u"], ["t", "u", "other"])
    h.receive(beat)
    assert len(h.sent(m.PushRegister)) == 2  # just sent: it may only be slow
    h.state(c.End("u", "client gone"))  # "u" ended here: never sent again
    assert h.sent(m.Abort) == [m.Abort("u", "client gone")]
    for i in range(MAX_RESENDS):
        h.advance(RESEND_S)
        h.receive(beat)
        assert [r.transfer_id for r in h.sent(m.PushRegister)[2:]] == ["t"] * (i + 1)
    assert h.events == []
    h.advance(RESEND_S)
    h.receive(beat)
    why = f"registration lost {MAX_RESENDS + 1} times"
    assert [a for a in h.sent(m.Abort) if a.transfer_id == "t"] == [m.Abort("t", why)]
    assert h.failings() == [("t", why)] and h.overs() == []
    assert h.counters.aborts_sent == 2  # "u"'s on its end, "t"'s on giving up
    assert h.counters.fences == 2
    h.receive(beat)  # fenced: nothing more is sent for it
    assert len(h.sent(m.PushRegister)) == 2 + MAX_RESENDS
    h.receive(m.AbortAck("t"))  # prefill's word ends the fence
    assert h.overs() == [("t", FAILED, why)]


def test_decode_checks_the_params_against_prefills_hello_before_anything_is_sent():
    """A receive whose request names another engine, or lent blocks outside prefill's
    region, is refused as a client error (a 400) once prefill's Hello is known, whether
    it came before the leg or after; nothing is registered, claimed or READ."""
    h = make("decode", "pull")
    h.state(begin_receive("t", engine_id="somebody-else", lent=(0, 1)))
    h.state(begin_receive("u", lent=(0, 8)), c.BlocksReady("u", 0, [0, 1]))  # blocks 0-7
    [(t, t_outcome, t_why), (u, u_outcome, u_why)] = h.overs()
    assert (t, t_outcome, u, u_outcome) == ("t", REJECTED, "u", REJECTED)
    assert "not remote_engine_id 'somebody-else'" in t_why and "outside" in u_why
    assert h.channel.sent == [] and h.posted() == [] and len(h.worker.table) == 0
    late = make("decode", "pull", ready=False)
    late.state(begin_receive("t", engine_id="somebody-else", lent=(0, 1)),
               c.BlocksReady("t", 0, [0, 1]))
    assert [type(x) for _, x in late.channel.sent] == [m.Hello] and late.events == []
    late.meet()
    assert [o[:2] for o in late.overs()] == [("t", REJECTED)]
    assert late.sent(m.PullClaim) == [] and late.posted() == []


def test_decode_registers_once_a_new_prefill_answered_its_handshake():
    h = make("decode")
    h.state(begin_receive("t", OTHER), c.BlocksReady("t", 1, list(range(8))))
    assert [(a, type(x)) for a, x in h.channel.sent] == [(OTHER, m.Hello)]  # ours only
    h.meet(OTHER)
    assert h.sent(m.PushRegister, OTHER) == [m.PushRegister(
        "t", "decode", D, list(range(8)), 1, 128, False, list(CHAIN))]
    assert h.events == []


def test_decode_push_ends_on_prefills_push_done():
    """PushDone from the receive's prefill ends it: ok, with token #1 for the step loop;
    not ok, failed with prefill's reason."""
    h = make("decode")
    registered(h, "t")
    registered(h, "u")
    done = m.PushDone("t", ok=True, first_token=7, num_descriptors=2, num_bytes=16)
    h.receive(done)
    [over] = h.events
    assert (over.tid, over.outcome, over.first) == ("t", OK, done)
    assert (over.record.ok, over.record.num_bytes) == (True, 16)
    h.receive(m.PushDone("u", ok=False, error="WRITE failed to complete"))
    assert h.overs()[-1] == ("u", FAILED, "WRITE failed to complete")
    assert len(h.worker.table) == 0 and h.sent(m.Abort) == []


def test_decode_answers_no_abort_and_ends_the_receive_it_names():
    h = make("decode")
    h.receive(m.Abort("t", "client gone"))  # no such receive: counted, nothing else
    assert h.channel.sent == [] and h.events == [] and h.counters.aborts_received == 1
    registered(h, "t")
    h.receive(m.Abort("t", "client gone"), OTHER)  # another instance: not its word
    assert h.events == [] and h.counters.messages_bad == 1
    assert h.counters.aborts_received == 1
    h.receive(m.Abort("t", "client gone"))  # prefill has nothing of its own in flight
    assert h.overs() == [("t", FAILED, "aborted by prefill: client gone")]
    assert h.sent(m.Abort) == [] and len(h.worker.table) == 0


def test_heartbeats_and_answers_count_only_from_the_receives_prefill():
    """Another instance cannot keep a receive's lease alive, spend its registration
    re-sends, or end it with an answer of its own."""
    h = make("decode")
    registered(h, "t")
    h.receive(m.PushDone("t", ok=True, first_token=1), OTHER)
    h.receive(m.Abort("t", "no"), OTHER)
    assert h.events == [] and h.counters.messages_bad == 2
    assert h.counters.aborts_received == 0
    h.advance(LEASE * 0.6)
    h.receive(m.Heartbeat("prefill", ["t"], []))  # prefill's: renewed
    h.advance(LEASE * 0.6)
    assert h.events == []
    h.receive(m.Heartbeat("x", ["t"], ["t"]), OTHER)  # neither renewed nor re-sent
    assert len(h.sent(m.PushRegister)) == 1
    h.advance(LEASE * 0.5)
    assert h.failings() == [("t", SILENT)]


def test_a_refusal_met_while_telling_prefill_ends_the_receive_once():
    """Ending a registered receive (the step loop's End, or its lease) tells prefill
    Abort; if that send finds the peer refused (its state forced here), the refusal has
    ended the receive: exactly one Over, and no fence left behind for a receive that no
    longer exists."""
    for end in ("End", "lease"):
        h = make("decode")
        registered(h, "t")
        peer = h.worker.peers[P]
        peer.hello, peer.refused, peer.refused_until = None, "incompatible", h.clock() + 1e6
        if end == "End":
            h.state(c.End("t", "client gone"))
        else:
            h.advance(LEASE + 0.1)
        assert h.kinds() == ["Over"] and h.overs()[0][:2] == ("t", FAILED), end
        assert len(h.worker.table) == 0 and h.counters.fences == 0, end


def test_a_peer_of_another_protocol_version_is_refused_at_the_handshake():
    """A peer of another protocol version is refused plainly at its Hello (the reason
    says so) instead of having its messages misread or ignored: one whose Hello still
    decodes, and one whose Hello does not (version 2's flat layout fields)."""
    h = make("decode", "pull", ready=False)
    v1 = msgspec.structs.replace(hello("prefill", OTHER, "pull"), version=1)
    h.receive(v1, OTHER)
    [refusal] = h.sent(m.HelloRefused, OTHER)
    assert f"protocol version 1 != {m.PROTOCOL_VERSION}" in refusal.reason
    assert h.worker.peers.ready_peer(OTHER) is None
    v2 = HelloV2(2, "prefill", "prefill", P, "inproc", b"prefill", "x", "float32", 16, "x",
                 1, 1, 1, "pull", BASE, 8, 8, 64)
    h.receive(msgspec.msgpack.encode(v2), P)
    [refusal] = h.sent(m.HelloRefused, P)
    assert f"protocol version 2 != {m.PROTOCOL_VERSION}" in refusal.reason
    assert "upgrade both" in refusal.reason and h.worker.peers.ready_peer(P) is None
    h.receive(msgspec.msgpack.encode(v2), OTHER)  # naming another sender: dropped
    assert len(h.sent(m.HelloRefused)) == 2 and h.counters.messages_bad == 1


class HelloV2(msgspec.Struct, tag="Hello"):
    """Protocol version 2's Hello: the KV layout in flat fields."""

    version: int
    engine_id: str
    role: str
    address: str
    transport: str
    agent_metadata: bytes
    model: str
    dtype: str
    block_size: int
    layout: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_transfer: str
    base_address: int
    num_blocks: int
    block_bytes: int
    layer_bytes: int
    reply: bool = False


# ---- decode: fences ---------------------------------------------------------------------
def test_decode_fence_repeats_its_abort_then_times_out():
    """A registered receive that ends keeps its blocks fenced: no lease ends it (nor does
    a heartbeat move it), its Abort is repeated each lease (not counted again), and the
    fence timeout releases it, counted."""
    h = make("decode")
    registered(h, "t")
    h.state(c.End("t", "client gone"))
    assert h.sent(m.Abort) == [m.Abort("t", "client gone")] and h.events == []
    h.advance(1.5 * LEASE)
    assert h.sent(m.Abort) == [m.Abort("t", "client gone"), m.Abort("t", "lease expired")]
    h.advance(FENCE - 1.5 * LEASE - 0.1)
    assert h.events == [] and len(h.sent(m.Abort)) == 3
    h.receive(m.Heartbeat("prefill", ["t"], []))  # (a fence has no lease to renew)
    h.advance(0.2)
    assert h.overs() == [("t", FAILED, "client gone")] and h.failings() == []
    k = h.counters
    assert (k.fences, k.fence_timeouts, k.fences_peer_gone, k.aborts_sent) == (1, 1, 0, 1)
    assert len(h.worker.table) == 0


def test_decode_lease_expiry_fences_a_registered_receive():
    """Prefill went silent: the request fails now (Failing), its blocks stay fenced until
    prefill's word; a receive that sent nothing that could land just ends."""
    h = make("decode")
    registered(h, "t")
    h.state(begin_receive("u"))  # no blocks yet: nothing sent to land
    h.advance(LEASE + 0.1)
    assert h.failings() == [("t", SILENT)] and h.overs() == [("u", FAILED, SILENT)]
    assert {a.transfer_id for a in h.sent(m.Abort)} == {"t", "u"}
    h.receive(m.PushDone("t", ok=True, first_token=1))  # its word, at last: not a success
    assert h.overs()[-1] == ("t", FAILED, SILENT)
    assert len(h.worker.table) == 0
    assert (h.counters.fences, h.counters.leases_expired) == (1, 2)


def test_decode_fence_released_when_prefill_connection_drops():
    h = make("decode")
    h.meet(OTHER)
    for tid, address in (("t", P), ("u", P), ("o", OTHER)):
        registered(h, tid, address)
        h.state(c.End(tid, "client gone"))
    assert h.events == []
    h.channel.dropped.append(P)
    h.run_once()  # the loop hands the dropped connection to the receives
    assert sorted(h.overs()) == [("t", FAILED, "client gone"), ("u", FAILED, "client gone")]
    assert h.counters.fences_peer_gone == 2
    assert h.channel.forgotten == [P]  # nothing queued for it may reach it later
    h.receive(m.AbortAck("o"), OTHER)  # the other prefill's fence held until its word
    assert h.overs()[-1] == ("o", FAILED, "client gone")


def test_decode_fence_on_a_connection_already_down_ends_at_once():
    h = make("decode")
    h.channel.gone.add(P)
    registered(h, "t")
    h.state(c.End("t", "client gone"))
    assert h.overs() == [("t", FAILED, "client gone")] and len(h.worker.table) == 0
    assert h.counters.fences_peer_gone == 1 and h.channel.forgotten == [P]


def test_prefills_answer_ends_a_fence():
    """Prefill answers (AbortAck): the receive is over, the fence gone; an answer from
    another instance changes nothing."""
    h = make("decode")
    registered(h, "t")
    h.state(c.End("t", "client gone"))
    h.receive(m.AbortAck("t"), OTHER)
    assert h.events == [] and h.counters.messages_bad == 1
    h.receive(m.AbortAck("t"))
    assert h.overs() == [("t", FAILED, "client gone")]
    h.advance(FENCE + 1)
    assert len(h.events) == 1 and len(h.worker.table) == 0


@pytest.mark.parametrize("end", ["step loop", "prefill's Abort"])
def test_a_draining_read_outlives_its_lease(end):
    """A pull whose request ended (or whose prefill aborted) while our READ is in
    flight is over only when the READ ends, not at its lease: the READ may still land
    in the blocks (a review found the lease freeing them)."""
    h = make("decode", "pull")
    h.receive(m.PullClaimed("u", True, claim=claiming(h, "u")))
    assert len(h.posted("READ")) == 1
    if end == "step loop":
        h.state(c.End("u", "client gone"))
        assert h.events == []
    else:
        h.receive(m.Abort("u", "gone"))
        assert h.failings() == [("u", "aborted by prefill: gone")]  # the request stops now
    for _ in range(3):
        h.advance(LEASE + 0.1)
    assert h.overs() == [] and h.sent(m.PullDone) == [] and h.sent(m.Abort) == []
    h.land()
    [(tid, outcome, _)] = h.overs()
    assert (tid, outcome) == ("u", FAILED)
    assert h.sent(m.PullDone) == [m.PullDone("u", ok=True)]  # prefill may free its lend
