"""A ready peer that falls silent (its process SIGSTOPped: the kernel keeps its TCP
connections open) is seen to drop within the heartbeat timeout, and once it resumes a
message reaches it over a rebuilt connection (a fresh CURVE handshake). Real sockets on
127.0.0.1, the peer a child process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from kvpush.kv_transfer.wire.side_channel import SideChannel

SECRET = b"heartbeat-test-secret-0123456789"
HEARTBEAT = (100, 500)  # ms: interval, timeout (production: 1000, 5000)

_ECHO = f"""
import sys, time
from kvpush.kv_transfer.wire.side_channel import SideChannel
ch = SideChannel("127.0.0.1", 0, secret={SECRET!r}, heartbeat={HEARTBEAT!r})
print(ch.address, flush=True)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    for sender, payload in ch.recv(200):
        if payload == b"quit":
            sys.exit(0)
        ch.send(sender, b"echo:" + payload)
"""

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs SIGSTOP")


def _await_reply(ch: SideChannel, want: bytes, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p == want for _, p in ch.recv(100)):
            return
    raise AssertionError(f"no {want!r} within {timeout} s")


def test_silent_peer_is_dropped_and_reconnected():
    child = subprocess.Popen([sys.executable, "-c", _ECHO], stdout=subprocess.PIPE,
                             env=os.environ.copy())
    ch = SideChannel("127.0.0.1", 0, secret=SECRET, heartbeat=HEARTBEAT)
    address = ""
    try:
        address = child.stdout.readline().decode().strip()
        assert address.startswith("127.0.0.1:"), address
        ch.send(address, b"one")
        _await_reply(ch, b"echo:one", 15)
        assert not ch.peer_gone(address) and ch.take_dropped() == []

        os.kill(child.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        dropped: list[str] = []
        while address not in dropped and time.monotonic() - stopped < 5:
            ch.recv(100)
            dropped += ch.take_dropped()
        noticed = time.monotonic() - stopped
        assert address in dropped, "a stopped peer's connection was not dropped"
        # heartbeat timeout (0.5 s) plus an interval, with room for a loaded host
        assert noticed < 3.0, noticed
        assert ch.peer_gone(address)

        os.kill(child.pid, signal.SIGCONT)
        ch.send(address, b"two")  # queued by the DEALER, which reconnects by itself
        _await_reply(ch, b"echo:two", 15)
        assert not ch.peer_gone(address)
        assert ch.stats.link_drops == 1
    finally:
        os.kill(child.pid, signal.SIGCONT)
        if address:
            ch.send(address, b"quit")
        ch.close()
        try:
            child.wait(5)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(5)


def test_blocked_owner_thread_is_not_dropped():
    """Heartbeats are answered by ZMQ's I/O thread: a peer whose owning thread does not
    read for several timeouts keeps its connection (its leases deal with it)."""
    a = SideChannel("127.0.0.1", 0, secret=SECRET, heartbeat=HEARTBEAT)
    b = SideChannel("127.0.0.1", 0, secret=SECRET, heartbeat=HEARTBEAT)
    try:
        a.send(b.address, b"hi")
        deadline = time.monotonic() + 10
        while not b.recv(100) and time.monotonic() < deadline:
            pass
        b.send(a.address, b"back")
        _await_reply(a, b"back", 10)
        time.sleep(1.5)  # b's owner reads nothing for three timeouts
        a.recv(0)
        assert a.take_dropped() == [] and not a.peer_gone(b.address)
    finally:
        a.close()
        b.close()
