"""LinkWatch: which of a SideChannel's outgoing connections have dropped.

Each DEALER gets a ZMQ socket monitor, read without blocking by :meth:`LinkWatch.pump`. A
link is up once its ZMTP handshake succeeded (failed handshakes go to ``refusals``
for the channel to count). A peer whose process ends closes our link; a frozen one keeps
it open until heartbeats or TCP keepalive give up. A peer seen gone stays gone, also after
its DEALER is forgotten, until a link to it is up again; links that never came up are not
kept, and at most ``MAX_LINKS`` unwatched ones are (oldest first out). Same thread as the
channel (ZMQ sockets are not thread-safe).
"""

from __future__ import annotations

import contextlib
import itertools
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import zmq

from kvpush.crypto.curve import HANDSHAKE_FAILED, handshake_reason

_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED
_ids = itertools.count()
#: links remembered once their DEALER is closed (peers seen gone), oldest dropped first
MAX_LINKS = 4096
#: pyzmq's flags as plain ints: ``& zmq.POLLIN`` is a Python enum operation (0.6 us hot)
POLLIN, NOBLOCK = int(zmq.POLLIN), int(zmq.NOBLOCK)


def monitor_events(mon: zmq.Socket) -> Iterator[tuple[int, int]]:
    """(event, value) of each event pending on a ZMQ monitor socket (never blocks). It
    asks ``ZMQ_EVENTS`` first: that keeps the GIL, where a receive gives it up (and on a
    busy core waits up to a switch interval to get it back) only to raise ``Again``."""
    while mon.getsockopt(zmq.EVENTS) & POLLIN:
        try:
            frames = mon.recv_multipart(flags=NOBLOCK)
        except zmq.Again:
            return
        if len(frames) == 2 and len(frames[0]) == 6:
            yield struct.unpack("=HI", frames[0])


@dataclass
class Link:
    """What the monitor of our DEALER to one address saw of its connection."""

    up: bool = False
    ever_up: bool = False


class LinkWatch:
    def __init__(self, poller: zmq.Poller) -> None:
        self._poller = poller
        self._monitors: dict[zmq.Socket, str] = {}  # monitor socket -> address
        self._monitor_of: dict[str, zmq.Socket] = {}
        self.links: dict[str, Link] = {}
        self._dropped: list[str] = []
        self.drops = 0  # every drop seen (the channel's stats.link_drops)
        self.refusals: list[tuple[str, str]] = []  # (address, reason): handshakes refused

    def attach(self, sock: zmq.Socket, address: str) -> None:
        """Watch ``sock`` (a DEALER to ``address``); call before it connects."""
        mon = sock.get_monitor_socket(_EVENTS, f"inproc://kvpush-link-{next(_ids)}")
        mon.setsockopt(zmq.LINGER, 0)
        self._monitors[mon] = address
        self._monitor_of[address] = mon
        self._poller.register(mon, zmq.POLLIN)
        self.links.setdefault(address, Link())

    def detach(self, sock: zmq.Socket | None, address: str, forget: bool) -> None:
        """Stop watching the DEALER to ``address`` (before the channel closes it);
        ``forget``: closed by us, so a link that was up says nothing of the peer."""
        mon = self._monitor_of.pop(address, None)
        if mon is not None:
            self._monitors.pop(mon, None)
            self._poller.unregister(mon)
            if sock is not None:
                with contextlib.suppress(zmq.ZMQError):
                    sock.disable_monitor()
            mon.close(linger=0)
        link = self.links.get(address)
        if forget and link is not None and (link.up or not link.ever_up):
            del self.links[address]  # says nothing of the peer: it was never seen gone
        if len(self.links) > MAX_LINKS:
            for old in [a for a in self.links if a not in self._monitor_of][
                    : len(self.links) - MAX_LINKS]:
                del self.links[old]

    def owns(self, sock: object) -> bool:
        return sock in self._monitors

    def pump(self) -> None:
        """Apply every pending monitor event (never blocks)."""
        for mon, address in list(self._monitors.items()):
            for event, value in monitor_events(mon):
                link = self.links.setdefault(address, Link())
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    link.up = link.ever_up = True
                elif event & HANDSHAKE_FAILED:
                    if len(self.refusals) < 1024:  # the channel takes them on each recv
                        self.refusals.append((address, handshake_reason(event, value)))
                elif event == zmq.EVENT_DISCONNECTED and link.up:
                    link.up = False
                    self.drops += 1
                    if address not in self._dropped:
                        self._dropped.append(address)

    def take_dropped(self) -> list[str]:
        self.pump()
        out, self._dropped = self._dropped, []
        return out

    def gone(self, address: str) -> bool:
        self.pump()
        link = self.links.get(address)
        return link is not None and link.ever_up and not link.up
