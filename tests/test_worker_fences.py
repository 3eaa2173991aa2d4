"""TransferWorker without its thread, on a fake channel and transport: how prefill
matches registrations to the blocks the step loop states computed, answers Aborts,
refuses late WRITEs and ends a push on its lease, and how decode's fences end (peer
gone, timeout) — deterministic, no sockets."""

from __future__ import annotations

import time

from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.transfer_thread.worker import Peer, TransferWorker
from kvpush.kv_transfer.transports.transport import XferState
from kvpush.kv_transfer.wire import messages as m

D, P = "10.0.0.2:5700", "10.0.0.1:5600"
LEASE, FENCE = 2.0, 30.0
#: a command's blocks (ours, the peer's) and layers: the one layer of hello() below
BLOCKS = (list(range(8)), list(range(8)), range(1))


class FakeChannel:
    def __init__(self) -> None:
        self.sent: list[tuple[str, m.Message]] = []
        self.gone: set[str] = set()
        self.dropped: list[str] = []
        self.forgotten: list[str] = []

    def send(self, address: str, payload: bytes) -> bool:
        self.sent.append((address, m.decode(payload)))
        return True

    def of(self, kind: type) -> list:
        return [msg for _, msg in self.sent if isinstance(msg, kind)]

    def wake(self) -> None:
        pass

    def connect(self, address: str) -> None:
        pass

    def peer_gone(self, address: str) -> bool:
        return address in self.gone

    def take_dropped(self) -> list[str]:
        out, self.dropped = self.dropped, []
        return out

    def forget(self, address: str) -> None:
        self.forgotten.append(address)

    def close(self) -> None:
        pass


class FakeTransport:
    def __init__(self) -> None:
        self.states: dict[int, XferState] = {}
        self.posts = 0
        self.posted: list[tuple] = []  # (op, peer, local, remote)

    def post(self, op, peer, local, remote) -> int:
        self.posted.append((op, peer, local, remote))
        self.posts += 1
        self.states[self.posts] = XferState.PENDING
        return self.posts

    def state(self, handle: int) -> XferState:
        return self.states[handle]

    def release(self, handle: int) -> None:
        self.states.pop(handle, None)

    def progress(self) -> None:
        pass

    def add_peer(self, metadata: bytes) -> str:
        return "agent"

    def close(self) -> None:
        pass


def hello(role: str, address: str, mode: str = "push") -> m.Hello:
    return m.Hello(version=m.PROTOCOL_VERSION, engine_id=role, role=role, address=address,
                   transport="inproc", agent_metadata=b"", model="x", dtype="float32",
                   block_size=16, layout="x", num_layers=1, num_kv_heads=1, head_dim=1,
                   kv_transfer=mode, base_address=4096, num_blocks=8, block_bytes=8,
                   layer_bytes=64)


def worker(role: str, mode: str = "push"
           ) -> tuple[TransferWorker, FakeChannel, FakeTransport, list[tuple]]:
    mine, theirs = (P, D) if role == "prefill" else (D, P)
    ch, tr, events = FakeChannel(), FakeTransport(), []
    w = TransferWorker(hello(role, mine, mode), ch, tr, events.append, LEASE, 0.5,
                       fence_timeout_s=FENCE)
    other = "decode" if role == "prefill" else "prefill"
    w.peers[theirs] = Peer(theirs, hello=hello(other, theirs, mode), agent=other)
    return w, ch, tr, events


def abort_frame(tid: str) -> bytes:
    return m.encode(m.Abort(tid, "client gone"))


#: a prompt of 8 blocks of hello()'s 16 tokens, and its (stand-in) hash chain
PROMPT_TOKENS, CHAIN = 8 * 16, [bytes([i]) * 16 for i in range(8)]


def registration(tid: str, blocks: list[int] | None = None, **kw) -> bytes:
    """Decode's PushRegister for ``tid`` (a frame), into ``blocks`` (BLOCKS' theirs)."""
    return m.encode(m.PushRegister(tid, "decode", D, list(BLOCKS[1] if blocks is None
                                                            else blocks), 0,
                                   PROMPT_TOKENS, prompt_hashes=CHAIN, **kw))


def sending(w: TransferWorker, tid: str, *, computed: bool = True) -> None:
    """Push ``tid`` as the step loop and decode state it: the leg added, decode's
    registration, and (``computed``) BLOCKS' blocks computed: one WRITE posted."""
    w.handle(c.PushAdded(tid, PROMPT_TOKENS, CHAIN))
    w.receive(registration(tid), D)
    if computed:
        w.handle(c.BlocksComputed(tid, 0, BLOCKS[0], BLOCKS[2]))


def registered(w: TransferWorker, tid: str, address: str = P) -> m.PushRegister:
    """Decode: receive ``tid`` from prefill at ``address`` added, its blocks allocated:
    the registration goes out (the peer is ready)."""
    reg = m.PushRegister(tid, "decode", D, BLOCKS[1], 0, PROMPT_TOKENS, prompt_hashes=CHAIN)
    w.handle(c.ReceiveAdded(tid, address, "prefill"))
    w.handle(c.BlocksAllocated(tid, register=reg))
    return reg


def prefilled(w: TransferWorker, tid: str, first_token: int = 3) -> None:
    """The step loop: prefill of ``tid`` is over with token #1 ``first_token``."""
    w.handle(c.PushPrefilled(tid, m.PushDone(tid, ok=True, first_token=first_token)))


def kinds(events: list) -> list[str]:
    return [type(ev).__name__ for ev in events]


def test_prefill_acks_an_abort_for_an_unknown_id_at_once_and_refuses_its_writes():
    w, ch, tr, events = worker("prefill")
    w.receive(abort_frame("never-seen"), D)
    assert ch.of(m.AbortAck) == [m.AbortAck("never-seen")]
    assert ch.sent[0][0] == D
    assert events == [] and w.counters["aborts_received"] == 1  # counted, nothing to do
    w.handle(c.BlocksComputed("never-seen", 0, *BLOCKS[::2]))
    assert tr.posts == 0 and w.counters["writes_refused"] == 1
    assert "never-seen" not in w.writes


def test_prefill_acks_only_once_its_in_flight_writes_drained():
    w, ch, tr, events = worker("prefill")
    sending(w, "t")
    assert tr.posts == 1
    w.receive(abort_frame("t"), D)
    assert ch.of(m.AbortAck) == []  # a WRITE may still land in decode's blocks
    assert kinds(events) == ["PushFailing"]  # the prefill stops now
    w.handle(c.BlocksComputed("t", 0, *BLOCKS[::2]))  # stated before the step loop heard
    assert tr.posts == 1 and w.counters["writes_refused"] == 1
    tr.states[1] = XferState.DONE
    w.inflight.poll()
    assert ch.of(m.AbortAck) == [m.AbortAck("t")]
    assert ch.of(m.PushDone) == []
    done = [ev for ev in events if isinstance(ev, c.WritesDone)]
    assert len(done) == 1 and done[0].failed == "aborted by decode"
    # the group is gone, the id is remembered: blocks stated later are still refused
    w.handle(c.BlocksComputed("t", 0, *BLOCKS[::2]))
    w.handle(c.PushEnded("t", "aborted"))  # (the prefill's end, stated: nothing to do)
    assert tr.posts == 1 and w.counters["writes_refused"] == 2
    # the transfer thread cancelled on the Abort itself: nothing comes back from the
    # step loop, decode has its one answer, the step loop its one WritesDone
    assert len(ch.of(m.AbortAck)) == 1
    assert kinds(events).count("WritesDone") == 1 and "t" not in w.writes


def test_prefill_refuses_writes_once_a_transfer_finished():
    w, ch, tr, _ = worker("prefill")
    sending(w, "t")
    prefilled(w, "t")
    tr.states[1] = XferState.DONE
    w.inflight.poll()
    assert [d.ok for d in ch.of(m.PushDone)] == [True]
    w.handle(c.BlocksComputed("t", 0, *BLOCKS[::2]))
    assert tr.posts == 1 and w.counters["writes_refused"] == 1 and "t" not in w.writes
    # a registration sent again (decode thought it lost) is told the transfer is over
    w.receive(registration("t"), D)
    assert [d.ok for d in ch.of(m.PushDone)] == [True, False] and tr.posts == 1
    # an Abort arriving after PushDone is answered too (nothing is in flight)
    w.receive(abort_frame("t"), D)
    assert ch.of(m.AbortAck) == [m.AbortAck("t")]


def test_prefill_lease_ends_a_push_on_the_transfer_thread():
    """Prefill's lease ends: with nothing of ours in flight decode gets PushDone(ok=False)
    at once and the step loop one WritesDone; with WRITEs in flight, the prefill is told
    to stop (PushFailing) and PushDone(ok=False) waits until they drained."""
    w, ch, tr, events = worker("prefill")
    sending(w, "t", computed=False)
    w._expire(time.monotonic() + LEASE + 1)
    [done] = ch.of(m.PushDone)
    assert not done.ok and "lease expired" in done.error
    assert kinds(events) == ["WritesDone"] and "lease expired" in events[0].failed
    prefilled(w, "t")  # the step loop's facts that crossed it change nothing
    w.handle(c.PushEnded("t", "aborted"))
    assert tr.posts == 0 and len(ch.of(m.PushDone)) == 1 and len(events) == 1
    w.handle(c.PushAdded("u", PROMPT_TOKENS, CHAIN))  # never registered
    w._expire(time.monotonic() + LEASE + 1)
    assert events[-1] == c.WritesDone("u", "lease expired: decode never registered")
    assert len(ch.of(m.PushDone)) == 1  # nobody to tell
    sending(w, "v")  # a WRITE in flight
    w._expire(time.monotonic() + LEASE + 1)
    assert kinds(events)[-1] == "PushFailing" and len(ch.of(m.PushDone)) == 1
    tr.states[tr.posts] = XferState.DONE
    w.inflight.poll()
    assert not ch.of(m.PushDone)[-1].ok and kinds(events)[-1] == "WritesDone"
    assert not w.leases and not w.push.out and not w.writes


def test_prefill_matches_a_registration_that_came_first():
    """Decode's registration before prefill's leg: held under a fixed deadline, then
    matched when the leg is added; blocks computed before a registration are kept and
    written as it lands, clipped to what decode registered (its cached blocks skipped)."""
    w, ch, tr, events = worker("prefill")
    w.receive(registration("t"), D)
    assert w.push.out["t"].state.value == "early" and not w.leases["t"].renewable
    w.handle(c.PushAdded("t", PROMPT_TOKENS, CHAIN))
    assert w.leases["t"].renewable and w.leases["t"].address == D
    w.handle(c.BlocksComputed("t", 0, [0, 1], range(1)))
    assert tr.posted[-1][2:] == ([(4096, 16)], [(4096, 16)])
    # registration second: blocks 0-1 and 2-3 stated, decode holds block 0 already
    w.handle(c.PushAdded("u", PROMPT_TOKENS, CHAIN))
    w.handle(c.BlocksComputed("u", 0, [0, 1], range(1)))
    w.handle(c.BlocksComputed("u", 2, [2, 3], range(1)))
    assert tr.posts == 1
    w.receive(m.encode(m.PushRegister("u", "decode", D, [7, 6, 5, 4, 3, 2, 1, 0], 1,
                                      PROMPT_TOKENS, prompt_hashes=CHAIN)), D)
    assert [p[2:] for p in tr.posted[1:]] == [
        ([(4096 + 8, 8)], [(4096 + 48, 8)]),  # block 1 -> 6 (0 skipped)
        ([(4096 + 16, 8), (4096 + 24, 8)], [(4096 + 40, 8), (4096 + 32, 8)])]  # 2-3 -> 5, 4
    assert w.counters["registrations_after_blocks"] == 1 and events == []


def test_a_registration_sent_again_while_writes_drain_changes_nothing():
    """Decode re-sends its registration (prefill's heartbeat still listed the transfer)
    while the WRITEs of a handed-over or ended transfer drain: no early entry, no lease
    replaced, no Abort or PushDone before they drained (decode would free blocks the
    WRITEs still reach)."""
    w, ch, tr, events = worker("prefill")
    sending(w, "t")
    prefilled(w, "t")  # handed over, its WRITE pending
    lease = w.leases["t"]
    w.receive(registration("t"), D)
    assert "t" not in w.push.out and w.leases["t"] is lease and ch.sent == []
    w.handle(c.PushEnded("t", "router gave up"))  # decode decides: nothing changes
    assert ch.sent == []
    sending(w, "u")
    w._expire(time.monotonic() + LEASE + 1)  # "t" (draining) and "u" (prefilling) run out
    w.receive(registration("u"), D)
    assert ch.of(m.PushDone) == [] and ch.of(m.Abort) == []
    for h in list(tr.states):
        tr.states[h] = XferState.DONE
    w.inflight.poll()
    assert sorted((d.transfer_id, d.ok) for d in ch.of(m.PushDone)) == [("t", False),
                                                                          ("u", False)]
    assert kinds(events).count("WritesDone") == 2 and not w.push.out and not w.leases


def test_decode_abort_before_the_leg_ends_the_transfer_for_good():
    """Decode aborts before prefill's leg arrives: the leg, when it comes, is ended at
    once (one WritesDone), and a registration overtaken by the Abort gets PushDone(ok=
    False), never ok=True with nothing written."""
    w, ch, tr, events = worker("prefill")
    w.receive(abort_frame("t"), D)
    assert ch.of(m.AbortAck) == [m.AbortAck("t")]
    w.handle(c.PushAdded("t", PROMPT_TOKENS, CHAIN))
    assert [ev for ev in events if isinstance(ev, c.WritesDone)][0].failed.startswith(
        "transfer t already ended")
    w.receive(registration("t"), D)
    w.handle(c.BlocksComputed("t", 0, *BLOCKS[::2]))
    prefilled(w, "t")
    assert [d.ok for d in ch.of(m.PushDone)] == [False] and tr.posts == 0
    assert kinds(events).count("WritesDone") == 1 and not w.push.out and not w.leases


def test_a_push_fact_that_raises_still_ends_its_transfer(monkeypatch, caplog):
    """A bug in handling one of the step loop's facts must not leak the blocks: the
    transfer is ended and the step loop hears it (WritesDone), decode gets its answer
    once the WRITEs in flight drained, and the other commands of the message still
    run."""
    w, ch, tr, events = worker("prefill")
    sending(w, "t")

    def broken(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(w.push, "prefilled", broken)
    w.handle(c.StepMessage((c.PushPrefilled("t", m.PushDone("t", ok=True)),
                            c.PushAdded("u", PROMPT_TOKENS, CHAIN))))
    assert "u" in w.push.out and "t" not in w.push.out  # the next command ran
    assert "transfer command PushPrefilled failed" in caplog.text
    tr.states[1] = XferState.DONE
    w.inflight.poll()
    [done] = ch.of(m.PushDone)
    assert not done.ok and "transfer thread error: boom" in done.error
    [ended] = [ev for ev in events if isinstance(ev, c.WritesDone)]
    assert ended.tid == "t" and "boom" in ended.failed


def test_prefill_refuses_a_bad_registration_and_writes_nothing():
    w, ch, tr, events = worker("prefill")
    w.handle(c.PushAdded("t", PROMPT_TOKENS, CHAIN))
    w.handle(c.BlocksComputed("t", 0, *BLOCKS[::2]))
    w.receive(m.encode(m.PushRegister("t", "decode", D, [0, 1, 2, 3, 4, 5, 6, 99], 0,
                                      PROMPT_TOKENS, prompt_hashes=CHAIN)), D)
    [done] = ch.of(m.PushDone)
    assert not done.ok and "outside" in done.error and tr.posts == 0
    assert kinds(events) == ["WritesDone"] and "invalid registration" in events[0].failed
    w.handle(c.PushAdded("u", PROMPT_TOKENS, CHAIN))  # another prompt than decode's
    w.receive(m.encode(m.PushRegister("u", "decode", D, BLOCKS[1], 0, PROMPT_TOKENS,
                                      prompt_hashes=CHAIN[:7] + [b"x" * 16])), D)
    assert "differs from prefill's from block 7" in ch.of(m.PushDone)[-1].error
    w.handle(c.PushAdded("v", PROMPT_TOKENS, CHAIN))  # decode has it all cached
    w.receive(registration("v", full_hit=True), D)
    assert events[-1] == c.WritesDone("v", None, prefill_not_needed=True)
    assert len(ch.of(m.PushDone)) == 2 and tr.posts == 0 and not w.leases


def test_decode_sends_a_lost_registration_again_then_gives_up():
    """Prefill's heartbeat lists a transfer as awaiting its registration: decode's
    transfer thread sends it again (at most every quarter lease, three times), then
    tells prefill Abort and the step loop ReceiveFailing, and fences the blocks (prefill
    may have got one after all); a receive that ended is never re-sent."""
    from kvpush.kv_transfer.transfer_thread.registrations import MAX_REGISTER_RESENDS

    w, ch, _, events = worker("decode")
    reg = registered(w, "t")
    registered(w, "u")
    assert ch.of(m.PushRegister) == [reg, ch.of(m.PushRegister)[1]]
    beat = m.encode(m.Heartbeat("prefill", [], ["t", "u", "other"]))
    w.receive(beat, P)
    assert len(ch.of(m.PushRegister)) == 2  # just sent: it may only be slow
    w.handle(c.ReceiveEnded("u", "client gone"))  # "u" ended here: never sent again
    assert ch.of(m.Abort) == [m.Abort("u", "client gone")] and "u" in w.fences.fences
    for i in range(MAX_REGISTER_RESENDS):
        w.registered.sent["t"].at -= LEASE  # a quarter lease (and more) has passed
        w.receive(beat, P)
        assert [r.transfer_id for r in ch.of(m.PushRegister)[2:]] == ["t"] * (i + 1)
    assert events == []
    w.registered.sent["t"].at -= LEASE
    w.receive(beat, P)
    assert ch.of(m.Abort)[1:] == [m.Abort("t", "registration lost 4 times")]
    assert events == [c.ReceiveFailing("t", "registration lost 4 times")]
    assert w.counters["aborts_sent"] == 2  # "u"'s on its end, "t"'s on giving up
    assert not w.registered.sent and "t" in w.fences.fences and "t" not in w.leases


def test_decode_checks_the_params_against_prefills_hello_before_anything_is_sent():
    """A receive whose request names another engine, or lent blocks outside prefill's
    region, ends as a client error (a 400) once prefill's Hello is known; nothing is
    registered, claimed or READ."""
    w, ch, tr, events = worker("decode", "pull")
    w.handle(c.ReceiveAdded("t", P, "somebody-else", [0, 1]))
    w.handle(c.ReceiveAdded("u", P, "prefill", [0, 8]))  # prefill has blocks 0-7
    w.handle(c.BlocksAllocated("u", local_blocks=[0, 1], remote_blocks=[0, 8]))
    assert [(ev.tid, ev.ok, ev.client_error) for ev in events] == [("t", False, True),
                                                                    ("u", False, True)]
    assert "not remote_engine_id 'somebody-else'" in events[0].why
    assert "outside" in events[1].why
    assert ch.sent == [] and tr.posts == 0 and not w.leases and not w.receives.recvs


def test_decode_registers_once_a_new_prefill_answered_its_handshake():
    w, ch, _, events = worker("decode")
    far = "10.0.0.9:1"
    reg = m.PushRegister("t", "decode", D, BLOCKS[1], 0, PROMPT_TOKENS)
    w.handle(c.ReceiveAdded("t", far, "prefill"))
    w.handle(c.BlocksAllocated("t", register=reg))
    assert [type(msg) for _, msg in ch.sent] == [m.Hello]  # our Hello only
    w.receive(m.encode(hello("prefill", far)), far)
    assert ch.of(m.PushRegister) == [reg] and events == []


def test_decode_answers_no_abort_and_ends_the_receive_it_names():
    w, ch, _, events = worker("decode")
    w.receive(abort_frame("t"), P)  # no such receive: counted, nothing else
    assert ch.sent == [] and events == [] and w.counters["aborts_received"] == 1
    registered(w, "t")
    w.receive(abort_frame("t"), "10.0.0.9:1")  # another instance: not its word
    assert events == [] and w.counters["messages_bad"] == 1
    w.receive(abort_frame("t"), P)  # prefill has nothing of its own in flight
    assert events == [c.ReceiveOver("t", False, "aborted by prefill: client gone")]
    assert not w.leases and ch.of(m.Abort) == []


def test_decode_fence_repeats_its_abort_then_times_out():
    w, ch, _, events = worker("decode")
    registered(w, "t")
    t0 = time.monotonic()
    w.handle(c.ReceiveEnded("t", "client gone"))
    assert ch.of(m.Abort) == [m.Abort("t", "client gone")]
    assert "t" not in w.leases and "t" in w.fences.fences  # the lease ends, the fence holds
    w._expire(t0 + 1.5 * LEASE)
    assert ch.of(m.Abort)[1:] == [m.Abort("t", "lease expired")] and events == []
    w._expire(t0 + FENCE + 1)
    assert events == [c.ReceiveOver("t", False, "client gone")] and not w.fences.fences
    assert (w.counters["fences"], w.counters["fence_timeouts"]) == (1, 1)


def test_decode_lease_expiry_fences_a_registered_receive():
    """Prefill went silent: the request fails now (ReceiveFailing), its blocks stay
    fenced until prefill's word; an unregistered receive just ends."""
    w, ch, _, events = worker("decode")
    registered(w, "t")
    w.handle(c.ReceiveAdded("u", P, "prefill"))  # no blocks yet: nothing sent to land
    w._expire(time.monotonic() + LEASE + 1)
    assert sorted(events, key=lambda ev: ev.tid) == [
        c.ReceiveFailing("t", "lease expired: prefill stopped answering"),
        c.ReceiveOver("u", False, "lease expired: prefill stopped answering")]
    assert "t" in w.fences.fences and {a.transfer_id for a in ch.of(m.Abort)} == {"t", "u"}
    w.receive(m.encode(m.PushDone("t", ok=True, first_token=1)), P)  # its word, at last
    assert events[-1] == c.ReceiveOver("t", False, "lease expired: prefill stopped "
                                       "answering")
    assert not w.fences.fences and not w.receives.recvs


def test_decode_fence_released_when_prefill_connection_drops():
    w, ch, _, events = worker("decode")
    other = "10.0.0.9:1"
    w.peers[other] = Peer(other, hello=hello("prefill", other), agent="other")
    for tid, address in (("t", P), ("u", P), ("other", other)):
        registered(w, tid, address)
        w.handle(c.ReceiveEnded(tid, "client gone"))
    w.fences.peer_dropped(P)
    assert sorted(events, key=lambda ev: ev.tid) == [c.ReceiveOver("t", False, "client gone"),
                                                     c.ReceiveOver("u", False, "client gone")]
    assert list(w.fences.fences) == ["other"] and w.counters["fences_peer_gone"] == 2
    assert ch.forgotten == [P]  # nothing queued for it may reach it later


def test_decode_fence_on_a_connection_already_down_ends_at_once():
    w, ch, _, events = worker("decode")
    ch.gone.add(P)
    registered(w, "t")
    w.handle(c.ReceiveEnded("t", "client gone"))
    assert events == [c.ReceiveOver("t", False, "client gone")] and not w.fences.fences


def test_prefills_answer_ends_a_fence():
    """Prefill answers (AbortAck): the receive is over, the fence gone; an answer from
    another instance changes nothing."""
    w, _, _, events = worker("decode")
    registered(w, "t")
    w.handle(c.ReceiveEnded("t", "client gone"))
    w.receive(m.encode(m.AbortAck("t")), "10.0.0.9:1")
    assert events == [] and "t" in w.fences.fences
    w.receive(m.encode(m.AbortAck("t")), P)
    assert events == [c.ReceiveOver("t", False, "client gone")]
    w._expire(time.monotonic() + FENCE + 1)
    assert not w.fences.fences and len(events) == 1


def test_prefill_polls_fast_only_once_a_completion_is_waited_for():
    """WRITEs posted layer by layer during a forward pass are progressed at the idle
    period; once the transfer is finalized (PushDone ready) or aborted, completions
    are checked every millisecond."""
    w, ch, tr, events = worker("prefill")
    w._next_heartbeat = time.monotonic() + 60
    sending(w, "t")
    assert w.handles == {tr.posts: "t"}
    assert w._timeout(time.monotonic()) >= 0.02 - 1e-9  # nobody waits on it yet
    prefilled(w, "t", 5)
    assert w._timeout(time.monotonic()) == w.busy_poll_s
    tr.states[tr.posts] = XferState.DONE
    w.inflight.poll()
    assert ch.of(m.PushDone) and w._timeout(time.monotonic()) >= 0.02 - 1e-9

    sending(w, "u")  # decode aborts while a WRITE is in flight
    w.receive(abort_frame("u"), D)
    assert w._timeout(time.monotonic()) == w.busy_poll_s  # the AbortAck waits on it


def test_the_transfer_thread_builds_descriptors_from_block_ids():
    """Block ids and layers cross (BlocksComputed, the registration, BlocksAllocated); the
    transfer thread turns them into descriptors from the two Hellos (one per layer per
    run consecutive on both sides), and a block outside our region fails the transfer
    instead of posting."""
    w, ch, tr, _ = worker("prefill")
    w.handle(c.PushAdded("t", PROMPT_TOKENS, CHAIN))
    w.receive(registration("t", [2, 3, 4, 0, 1, 5, 6, 7]), D)
    w.handle(c.BlocksComputed("t", 0, [0, 1, 5], range(1)))
    [(op, _, local, remote)] = tr.posted
    assert op == "WRITE"
    assert local == [(4096, 16), (4096 + 40, 8)]  # blocks 0-1, then 5 (8 bytes a block)
    assert remote == [(4096 + 16, 16), (4096 + 32, 8)]  # 2-3, then 4
    sending(w, "bad", computed=False)
    w.handle(c.BlocksComputed("bad", 0, [8], range(1)))  # we have 8 blocks: 0-7
    prefilled(w, "bad", 1)
    [done] = [msg for msg in ch.of(m.PushDone) if msg.transfer_id == "bad"]
    assert not done.ok and "not posted" in done.error and len(tr.posted) == 1
    r, rch, rtr, events = worker("decode", "pull")
    r.handle(c.ReceiveAdded("u", P, "prefill", [6]))
    r.handle(c.BlocksAllocated("u", local_blocks=[3], remote_blocks=[6]))
    claim = r.receives.recvs["u"].claim
    assert rch.of(m.PullClaim) == [m.PullClaim("u", claim)] and rtr.posted == []
    r.receive(m.encode(m.PullClaimed("u", True, claim=claim)), P)  # live: READ it
    [(op, _, local, remote)] = rtr.posted
    assert (op, local, remote) == ("READ", [(4096 + 24, 8)], [(4096 + 48, 8)])


def _reading(w: TransferWorker, tid: str = "u") -> None:
    """Pull decode: receive ``tid`` claimed and its READ posted (handle 1)."""
    w.handle(c.ReceiveAdded(tid, P, "prefill", [6]))
    w.handle(c.BlocksAllocated(tid, local_blocks=[3], remote_blocks=[6]))
    w.receive(m.encode(m.PullClaimed(tid, True, claim=w.receives.recvs[tid].claim)), P)


def test_a_draining_read_outlives_its_lease():
    """A pull whose request ended (or whose prefill aborted) while our READ is in
    flight is over only when the READ ends, not at its lease: the READ may still land
    in the blocks (a review found the lease freeing them)."""
    for end in ("step loop", "prefill's Abort"):
        w, ch, tr, events = worker("decode", "pull")
        _reading(w)
        if end == "step loop":
            w.handle(c.ReceiveEnded("u", "client gone"))
        else:
            w.receive(m.encode(m.Abort("u", "gone")), P)
        w._expire(time.monotonic() + LEASE + 1)
        assert tr.states[1] is XferState.PENDING
        assert not [ev for ev in events if isinstance(ev, c.ReceiveOver)], end
        tr.states[1] = XferState.DONE
        w.inflight.poll()
        [over] = [ev for ev in events if isinstance(ev, c.ReceiveOver)]
        assert not over.ok and ch.of(m.PullDone) == [m.PullDone("u", ok=True)], end


def test_heartbeats_and_answers_count_only_from_the_receives_prefill():
    """Another instance cannot keep a receive's lease alive, spend its registration
    re-sends, or end it with an answer of its own."""
    w, ch, _, events = worker("decode")
    registered(w, "t")
    other = "10.0.0.9:1"
    deadline = w.leases["t"].deadline
    time.sleep(0.01)
    w.receive(m.encode(m.Heartbeat("x", ["t"], ["t"])), other)
    assert w.leases["t"].deadline == deadline and len(ch.of(m.PushRegister)) == 1
    w.receive(m.encode(m.PushDone("t", ok=True, first_token=1)), other)
    w.receive(m.encode(m.Abort("t", "no")), other)
    assert events == [] and w.counters["messages_bad"] == 2
    assert w.counters["aborts_received"] == 0
    w.receive(m.encode(m.Heartbeat("prefill", ["t"], [])), P)
    assert w.leases["t"].deadline > deadline


def test_a_refusal_met_while_telling_prefill_ends_the_receive_once():
    """Ending a registered receive sends prefill an Abort; if that send finds the peer
    refused (its state forced here), the refusal has ended the receive: exactly one
    ReceiveOver, and no fence left behind for a receive that no longer exists."""
    w, ch, tr, events = worker("decode")
    registered(w, "t")
    peer = w.peers[P]
    peer.hello, peer.refused, peer.refused_until = None, "incompatible", 1e18
    w.handle(c.ReceiveEnded("t", "client gone"))
    assert kinds(events) == ["ReceiveOver"] and not w.receives.recvs
    assert not w.fences.fences and w.counters["fences"] == 0


def test_an_early_registration_whose_leg_never_comes_is_aborted_and_counted():
    """Decode registered but prefill's leg never arrives: at the fixed deadline prefill
    tells decode (Abort, counted in aborts_sent) and keeps nothing."""
    w, ch, tr, events = worker("prefill")
    w.receive(registration("t"), D)
    w._expire(time.monotonic() + LEASE + 1)
    assert ch.of(m.Abort) == [m.Abort("t", "lease expired")]
    assert w.counters["aborts_sent"] == 1 and not w.push.out and not w.leases
    assert events == []  # (the step loop never had the transfer)


def test_a_peer_of_another_protocol_version_is_refused_at_the_handshake():
    """Version 2 changed what a pull claim's answer must carry: a version-1 peer is
    refused plainly at its Hello instead of having every claim ignored."""
    w, ch, _, _ = worker("decode", "pull")
    old = m.Hello(**{**{f: getattr(hello("prefill", "10.0.0.9:1", "pull"), f)
                        for f in m.Hello.__struct_fields__}, "version": 1})
    w.receive(m.encode(old), "10.0.0.9:1")
    [refusal] = ch.of(m.HelloRefused)
    assert f"protocol version 1 != {m.PROTOCOL_VERSION}" in refusal.reason
    assert not w.peers.is_ready("10.0.0.9:1")
