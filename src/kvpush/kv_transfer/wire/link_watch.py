"""LinkWatch: which of a SideChannel's outgoing connections have dropped.

Every DEALER of a :class:`~kvpush.kv_transfer.wire.side_channel.SideChannel` (one per
destination address) gets a ZMQ socket monitor for its TCP connection's CONNECTED and
DISCONNECTED events (a link is up once its ZMTP handshake succeeded: with CURVE, a TCP
connection whose handshake is refused was never up, and its refusals are kept in
``refusals`` as (address, reject reason) for the channel to count), read without
blocking by :meth:`LinkWatch.pump` (the channel's ``recv`` does, and its poller wakes
on them). A peer whose process ends closes its
sockets, so our connection to it drops; a peer that is only frozen (SIGSTOP, a stalled
host) keeps it open, since its kernel still answers. TCP keepalive (set on the DEALER
by the channel) makes a path that breaks drop too, eventually.

What a link did is kept per address, also after the channel forgets the DEALER while
the link is down: a peer seen gone stays gone until a connection to it is up again.
Forgetting a link that never came up (an address nobody answered at) keeps nothing, and
at most ``MAX_LINKS`` links no longer watched are remembered (oldest forgotten first), so
that addresses tried once cannot grow this table without bound.
Same thread as the channel (ZMQ sockets are not thread-safe).
"""

from __future__ import annotations

import contextlib
import itertools
import struct
from dataclasses import dataclass

import zmq

from kvpush.kv_transfer.wire.curve import HANDSHAKE_FAILED, handshake_reason

_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED
_ids = itertools.count()

#: links remembered once their DEALER is closed (peers seen gone), oldest dropped first
MAX_LINKS = 4096


@dataclass
class Link:
    """What the monitor of our DEALER to one address saw of its TCP connection."""

    up: bool = False
    ever_up: bool = False
    drops: int = 0


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
        """Stop watching the DEALER to ``address`` (before the channel closes it).
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

    @property
    def active(self) -> bool:
        return bool(self._monitors)

    def pump(self) -> None:
        """Apply every pending monitor event (never blocks)."""
        for mon, address in list(self._monitors.items()):
            while True:
                try:
                    frames = mon.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) != 2 or len(frames[0]) != 6:
                    continue
                event, value = struct.unpack("=HI", frames[0])
                link = self.links.setdefault(address, Link())
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    link.up = link.ever_up = True
                elif event & HANDSHAKE_FAILED:
                    if len(self.refusals) < 1024:  # the channel takes them on each recv
                        self.refusals.append((address, handshake_reason(event, value)))
                elif event == zmq.EVENT_DISCONNECTED and link.up:
                    link.up = False
                    link.drops += 1
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
