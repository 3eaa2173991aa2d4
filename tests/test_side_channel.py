"""SideChannel: real ZMQ sockets on 127.0.0.1, signing, bounded waits, idle CPU; and the
tests' FaultyChannel (kvpush_testing.links) that drops and delays its sends."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import zmq

from kvpush.cluster.launcher import free_port as launcher_free_port
from kvpush.crypto.curve import derive_curve_keys, make_client
from kvpush.kv_transfer.wire.side_channel import ChannelAuth, SideChannel, SideChannelError
from kvpush_testing.faults import FaultPlan
from kvpush_testing.links import FaultyChannel

HOST = "127.0.0.1"


@pytest.fixture
def channels() -> Iterator[Callable[..., SideChannel]]:
    """make(**kwargs) -> SideChannel on 127.0.0.1, a free port; all closed afterwards."""
    made: list[SideChannel] = []

    def make(port: int = 0, faults: FaultPlan | None = None, type_of=None, **kwargs):
        ch = SideChannel(HOST, port, **kwargs)
        made.append(ch)
        if faults is None:
            return ch
        return FaultyChannel(ch, faults, type_of) if type_of else FaultyChannel(ch, faults)

    yield make
    for ch in made:
        ch.close()


def recv_until(ch: SideChannel, n: int, timeout: float = 5.0, others=()) -> list[tuple[str, bytes]]:
    """Receive until n messages arrived (bounded); ``others`` get recv(0) to flush outboxes."""
    got: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + timeout
    while len(got) < n:
        assert time.monotonic() < deadline, f"only {len(got)} of {n} messages arrived: {got}"
        for o in others:
            o.recv(0)
        got += ch.recv(10)
    return got


def free_port() -> int:
    return launcher_free_port(HOST)


def thread_cpu_s() -> float:
    """CPU time (user + system) of the calling thread, from /proc."""
    tid = threading.get_native_id()
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return ticks / os.sysconf("SC_CLK_TCK")


def kind(payload: bytes) -> str:
    return payload.split(b":", 1)[0].decode()


def test_two_channels_exchange_both_ways(channels):
    a, b = channels(), channels()
    assert a.port > 0 and a.address == f"{HOST}:{a.port}" and a.address != b.address
    for i in range(5):
        assert a.send(b.address, b"ping:%d" % i)
    got = recv_until(b, 5)
    assert got == [(a.address, b"ping:%d" % i) for i in range(5)]  # in order, with sender
    for sender, payload in got:
        assert b.send(sender, payload.replace(b"ping", b"pong"))
    assert recv_until(a, 5) == [(b.address, b"pong:%d" % i) for i in range(5)]
    big = os.urandom(3 << 20)
    assert a.send(b.address, big)
    assert recv_until(b, 1) == [(a.address, big)]
    assert a.stats.sent == 6 and b.stats.received == 6 and a.stats.send_dropped == 0


def test_drop_faults_by_message_type(channels):
    plan = FaultPlan(drop_messages={"Ping": 1})
    a, b = channels(faults=plan, type_of=kind), channels()
    for p in (b"Ping:1", b"Ping:2", b"Pong:1"):
        assert a.send(b.address, p)  # a lost message still "went out"
    assert [p for _, p in recv_until(b, 2)] == [b"Ping:2", b"Pong:1"]
    assert plan.count("message_drops:Ping") == 1 and plan.count("message_drops") == 1
    plan.arm(drop_messages={"*": 2})
    for p in (b"Done:1", b"Ping:3", b"Pong:2"):
        a.send(b.address, p)
    assert [p for _, p in recv_until(b, 1)] == [b"Pong:2"]
    assert b.recv(50) == []
    assert plan.count("message_drops") == 3 and plan.count("message_drops:Done") == 1


def test_delay_fault_holds_messages(channels):
    plan = FaultPlan(message_delay_s=0.2)
    a, b = channels(faults=plan), channels()
    t0 = time.monotonic()
    assert a.send(b.address, b"late")
    assert b.recv(50) == []  # not yet
    got = recv_until(b, 1, others=(a,))  # a's recv flushes its outbox when due
    assert got == [(a.address, b"late")]
    assert 0.2 <= time.monotonic() - t0 < 2.0
    assert plan.count("message_delays") == 1


def test_delayed_message_is_sent_by_a_waiting_recv(channels):
    """recv waits no longer than a delayed send is due, and sends it then (its owner
    loops, as the transfer thread does)."""
    plan = FaultPlan(message_delay_s=0.1)
    a, b = channels(faults=plan), channels()
    a.send(b.address, b"x")
    t0 = time.monotonic()
    assert a.recv(3000) == []  # flushed at ~0.1 s: the wait ends there
    assert 0.09 <= time.monotonic() - t0 < 1.0
    assert b.recv(1000) == [(a.address, b"x")]


def test_send_to_missing_peer_never_blocks(channels):
    a = channels(sndhwm=10)
    nowhere = f"{HOST}:{free_port()}"
    t0 = time.monotonic()
    results = [a.send(nowhere, b"hello %d" % i) for i in range(200)]
    assert time.monotonic() - t0 < 1.0
    assert results[0] and not results[-1]  # queued up to the HWM, then dropped
    assert a.stats.send_dropped == results.count(False) >= 150
    a.forget(nowhere)  # discard what was queued; sending again is bounded too
    assert a.send(nowhere, b"again")
    assert a.send("not-an-address", b"x") is False


def test_dropped_sends_are_counted_by_reason_and_connect_errors_raise(channels):
    """A full queue, a connection ZMQ cannot open and a closed channel each count under
    their reason; ``connect`` raises with ZMQ's reason instead of dropping silently."""
    a = channels(sndhwm=5)
    nowhere = f"{HOST}:{free_port()}"
    sent = [a.send(nowhere, b"x") for _ in range(50)]
    assert sent.count(False) == a.stats.send_dropped_by_reason["queue_full"] >= 40
    with pytest.raises(SideChannelError, match="Invalid argument"):
        a.connect("-bogus:5000")  # passes kv_transfer_params' host check, not ZMQ's
    with pytest.raises(SideChannelError, match="host:port"):
        a.connect("not-an-address")
    assert a.send("-bogus:5000", b"x") is False
    assert a.stats.send_dropped_by_reason["connect_failed"] == 1
    assert a.num_destinations == 1  # nowhere's; nothing left open by the failures
    a.connect(nowhere)  # open already: a no-op
    a.forget(nowhere)
    assert a.num_destinations == 0 and not a._links.links
    a.close()
    assert a.send(nowhere, b"x") is False and a.stats.send_dropped_by_reason["closed"] == 1
    assert a.stats.send_dropped == sum(a.stats.send_dropped_by_reason.values())


SECRET = b"a shared secret of 32 bytes....."


def wait_rejected(ch: SideChannel, n: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while ch.stats.rejected < n:
        assert time.monotonic() < deadline, f"only {ch.stats.rejected} rejected"
        assert ch.recv(20) == []


def test_signing_rejects_unsigned_and_wrong_signatures(channels, caplog):
    b = channels(secret=SECRET)
    good = channels(secret=SECRET)
    unsigned = channels()
    forged = channels(secret=b"another secret of 32 bytes......")
    assert good.send(b.address, b"ok")
    assert unsigned.send(b.address, b"nope")
    assert forged.send(b.address, b"nope either")
    assert recv_until(b, 1) == [(good.address, b"ok")]
    # refused at the CURVE handshake (counted per attempt: ZMQ retries the connection)
    deadline = time.monotonic() + 5
    while not (b.stats.rejected_by_reason["unsigned"] >= 1
               and b.stats.rejected_by_reason["bad_signature"] >= 1):
        assert time.monotonic() < deadline, b.stats.rejected_by_reason
        assert b.recv(20) == []
    # the side that can tell names the likely cause
    text = caplog.text
    assert "no side-channel secret configured" in text
    assert "DIFFERENT side-channel secret" in text
    assert SECRET.decode() not in text
    assert b.send(good.address, b"signed reply")
    assert recv_until(good, 1) == [(b.address, b"signed reply")]
    # the unsigned peer (no secret) cannot even receive from us (the handshake fails:
    # nothing leaves in clear); our DEALER counts its refusal
    assert b.send(unsigned.address, b"to the unsigned one")
    def refused() -> int:  # the client may see the mismatch or only the closed connection
        return (b.stats.rejected_by_reason["unsigned"]
                + b.stats.rejected_by_reason["closed_in_handshake"])
    before = refused()
    deadline = time.monotonic() + 5
    while refused() == before:
        assert time.monotonic() < deadline
        assert unsigned.recv(10) == [] and b.recv(10) == []
    assert unsigned.recv(50) == [] and forged.recv(0) == []


def test_signature_covers_sender_payload_and_header():
    auth = ChannelAuth(SECRET)
    frame = auth.seal(b"127.0.0.1:1", b"stream-1", 1, b"hello")
    assert ChannelAuth(SECRET).check(b"127.0.0.1:1", b"hello", frame) is None
    assert ChannelAuth(SECRET).check(b"127.0.0.1:2", b"hello", frame) == "bad_signature"
    assert ChannelAuth(SECRET).check(b"127.0.0.1:1", b"hellO", frame) == "bad_signature"
    tampered = frame[:12] + bytes([frame[12] ^ 1]) + frame[13:]  # the counter
    assert ChannelAuth(SECRET).check(b"127.0.0.1:1", b"hello", tampered) == "bad_signature"
    assert ChannelAuth(SECRET).check(b"127.0.0.1:1", b"hello", frame[:-1]) == "malformed"
    assert ChannelAuth(SECRET).check(b"127.0.0.1:1", b"hello", None) == "unsigned"
    assert "secret" not in repr(auth) or SECRET.decode() not in repr(auth)


def test_replays_and_stale_messages_are_rejected():
    now = [1000.0]
    sender, stream = b"127.0.0.1:1", b"stream-1"
    tx = ChannelAuth(SECRET, window_s=60, clock=lambda: now[0])
    rx = ChannelAuth(SECRET, window_s=60, clock=lambda: now[0])
    f1 = tx.seal(sender, stream, 1, b"one")
    f2 = tx.seal(sender, stream, 2, b"two")
    assert rx.check(sender, b"one", f1) is None
    assert rx.check(sender, b"one", f1) == "replayed"
    assert rx.check(sender, b"two", f2) is None
    assert rx.check(sender, b"one", f1) == "replayed"  # older counter on a known stream
    # another stream of the same sender (a restarted sender, another socket) is new
    assert rx.check(sender, b"x", tx.seal(sender, b"stream-2", 1, b"x")) is None
    # a message outside the window from a stream the receiver does not know: stale
    old = tx.seal(sender, b"stream-3", 1, b"old")
    now[0] += 61
    assert rx.check(sender, b"old", old) == "stale"
    # the receiver forgets idle streams, but what they sent is stale by then
    now[0] += 62  # two windows (+1 s) since stream-1 was last seen
    assert rx.check(sender, b"z", tx.seal(sender, b"stream-4", 1, b"z")) is None  # prunes
    assert rx.check(sender, b"two", f2) == "stale"
    assert (sender, stream) not in rx._streams


def test_a_replayed_frame_on_the_wire_is_rejected(channels):
    """Frames captured from an authentic sender and sent again by a raw socket with the
    same routing id are refused as replays (the raw socket passes the CURVE handshake:
    it has the secret's keys, as a member would; without them it never connects)."""
    b = channels(secret=SECRET)
    a = channels(secret=SECRET)
    assert a.send(b.address, b"first")
    assert recv_until(b, 1) == [(a.address, b"first")]
    frame = a.auth.seal(a.address.encode(), a._streams[b.address][0], 1, b"first")
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    make_client(raw, derive_curve_keys(SECRET))
    raw.setsockopt(zmq.ROUTING_ID, b"127.0.0.1:1")  # a's own id is taken by a
    raw.connect(f"tcp://{b.address}")
    try:
        raw.send_multipart([b"first", frame])  # signed for a's id, sent under another
        raw.send_multipart([b"unsigned"])
        wait_rejected(b, 2)
        assert b.stats.rejected_by_reason["bad_signature"] == 1
        assert b.stats.rejected_by_reason["unsigned"] == 1
    finally:
        raw.close(0)
    assert a.send(b.address, b"second")  # the authentic stream goes on
    assert recv_until(b, 1) == [(a.address, b"second")]


def test_delayed_messages_stay_in_order_with_signing(channels):
    """Messages are signed when they go out, so fault-injected delays keep counters in
    wire order (no false replays)."""
    plan = FaultPlan()
    plan.arm(message_delay_s=0.02)
    a = channels(secret=SECRET, faults=plan)
    b = channels(secret=SECRET)
    for i in range(20):
        assert a.send(b.address, b"%d" % i)
    got = recv_until(b, 20, others=[a])
    assert [p for _, p in got] == [b"%d" % i for i in range(20)]
    assert b.stats.rejected == 0


def test_recv_timeout_is_bounded_and_idle_costs_no_cpu(channels):
    a = channels()
    t0 = time.monotonic()
    assert a.recv(200) == []
    assert 0.19 <= time.monotonic() - t0 < 0.5
    t0 = time.monotonic()
    assert a.recv(0) == []
    assert time.monotonic() - t0 < 0.05
    cpu0, t0 = thread_cpu_s(), time.monotonic()
    while time.monotonic() - t0 < 0.5:
        assert a.recv(100) == []
    assert thread_cpu_s() - cpu0 < 0.05


def test_wake_from_another_thread_ends_the_wait(channels):
    a = channels()
    timer = threading.Timer(0.1, a.wake)
    timer.start()
    t0 = time.monotonic()
    try:
        assert a.recv(5000) == []
    finally:
        timer.cancel()
    assert time.monotonic() - t0 < 1.0
    assert a.recv(0) == []  # the wake was consumed


def test_restarted_peer_on_same_address_is_heard(channels):
    """ROUTER_HANDOVER: a new channel reusing a closed one's address gets through."""
    b = channels()
    a = channels()
    port = a.port
    a.send(b.address, b"first")
    assert recv_until(b, 1) == [(a.address, b"first")]
    a.close()
    a2 = channels(port=port)
    assert a2.address == a.address
    a2.send(b.address, b"second")
    assert recv_until(b, 1) == [(a2.address, b"second")]


def test_malformed_frames_are_counted(channels):
    b = channels()
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.ROUTING_ID, b"raw:1")
    try:
        raw.connect(f"tcp://{b.address}")
        raw.send_multipart([b"a", b"b", b"c"])  # 3 payload frames: too many
        raw.send(b"fine")
        got = recv_until(b, 1)
        assert [p for _, p in got] == [b"fine"] and b.stats.malformed == 1
    finally:
        raw.close()


def test_close_is_idempotent_and_stops_sending(channels):
    a, b = channels(), channels()
    a.close()
    a.close()
    assert a.send(b.address, b"x") is False
    assert a.recv(10) == []
    a.wake()  # harmless after close


def test_a_peer_that_closes_its_sockets_is_seen_to_drop(channels):
    """The link watch: our DEALER's connection to a peer whose process ends (its
    sockets close) is reported dropped, ends a waiting recv early, and is remembered
    as gone (also after forget); an open, idle connection costs no CPU."""
    a, b = channels(), channels()
    assert not a.peer_gone(b.address) and a.take_dropped() == []
    a.send(b.address, b"hi")
    assert recv_until(b, 1) == [(a.address, b"hi")]
    deadline = time.monotonic() + 5
    while not a._links.links[b.address].up:  # the monitor's CONNECTED, read by recv
        assert time.monotonic() < deadline
        a.recv(10)
    assert not a.peer_gone(b.address) and a.take_dropped() == []
    cpu0, t0 = thread_cpu_s(), time.monotonic()
    while time.monotonic() - t0 < 0.5:
        assert a.recv(100) == []
    assert thread_cpu_s() - cpu0 < 0.05
    b.close()
    t0 = time.monotonic()
    assert a.recv(5000) == []  # the drop ends the wait
    assert time.monotonic() - t0 < 2.0
    assert a.take_dropped() == [b.address] and a.take_dropped() == []
    assert a.peer_gone(b.address) and a.stats.link_drops == 1
    a.forget(b.address)
    assert a.peer_gone(b.address)


def test_a_pass_receives_only_the_frames_that_are_there(channels, monkeypatch):
    """A ZMQ receive gives up the GIL, and on a busy core may wait a switch interval to
    get it back: recv and take_dropped ask ZMQ_EVENTS first (which keeps it), so a pass
    that finds one message makes one receive, none for idle monitors or the empty queue."""
    secret = b"k" * 32
    a, b = channels(secret=secret), channels(secret=secret)
    a.send(b.address, b"hi")
    assert recv_until(b, 1) == [(a.address, b"hi")]
    b.send(a.address, b"ho")
    assert recv_until(a, 1) == [(b.address, b"ho")]
    deadline = time.monotonic() + 5
    while not (a._links.links[b.address].up and b._links.links[a.address].up):
        assert time.monotonic() < deadline, "the links did not come up"
        assert a.recv(1) == [] and b.recv(1) == []  # (their monitors' events read)
    a.send(b.address, b"again")
    while not b.pending():
        assert time.monotonic() < deadline, "the message did not arrive"
        time.sleep(0.001)
    receives: list[zmq.Socket] = []
    real = zmq.Socket.recv_multipart

    def counted(sock, *args, **kwargs):
        receives.append(sock)
        return real(sock, *args, **kwargs)

    monkeypatch.setattr(zmq.Socket, "recv_multipart", counted)
    assert b.recv(0) == [(a.address, b"again")]
    assert b.take_dropped() == []
    assert len(receives) == 1
    assert b.recv(0) == [] and b.take_dropped() == [] and len(receives) == 1
