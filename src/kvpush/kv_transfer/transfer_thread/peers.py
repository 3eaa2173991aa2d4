"""PeerTable: the transfer thread's side-channel peers, their handshakes and bounds.

A peer is another kvpush instance, known by its side-channel address (``"host:port"``,
the routing id its messages arrive with). The two exchange ``Hello`` (compatibility,
transport metadata, layout) first; messages for a peer in handshake wait in a bounded
queue. Each address costs three sockets, so the table is bounded:

* **never ready**: a handshake unanswered for ``handshake_timeout_s`` is given up once
  no transfer uses the address: its connection closed, its queue dropped (counted),
  ``on_refused`` told. Until then the Hello is sent again at a doubling interval.
* **idle**: a ready peer no transfer uses (``busy``), silent both ways for
  ``idle_timeout_s``, is evicted with its transport peer; the next transfer handshakes
  again.
* **cap**: at most ``max_peers``. A new address beyond it evicts a refused or unused
  ready peer (refused first, then the least recently active); else it is refused at once
  (``on_refused`` with the reason) and nothing is opened.
* **refusals** count only from the address we are in handshake with; a refusal, theirs
  or ours, lasts ``refusal_ttl_s``; a compatible Hello from a refused peer clears it.
  Connection errors (a malformed address, ZMQ out of sockets) refuse at once.

A ``PushRegister`` from a sender not ready here (we evicted it as idle) is held until
its Hello is in, so a registration is always checked against its sender's Hello. The
sweep rides the heartbeat. Same thread as the worker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import msgspec

from kvpush.kv_transfer.wire import messages as m
from kvpush.kv_transfer.wire.side_channel import SideChannelError

log = logging.getLogger("kvpush.kv_transfer.transfer_thread.worker")

MAX_PEERS = 128
MAX_QUEUED = 256  # messages queued for one peer in handshake
MAX_HELD = 64  # messages from one sender held until its handshake completes
HELLO_RETRY_S = 1.0  # first interval between Hellos sent again (doubling)

#: why the table dropped a message for a peer
DROP_REASONS = ("peer_refused", "connect_failed", "peer_table_full", "handshake_timeout",
                "handshake_queue_full")
#: why a peer left the table
EVICT_REASONS = ("handshake_timeout", "idle", "refusal_expired", "room")
STATES = ("handshake", "ready", "refused")


@dataclass(eq=False)
class Peer:
    address: str
    hello: m.Hello | None = None
    agent: str | None = None  # its transport peer, once added
    sent_hello: bool = False
    refused: str | None = None  # why the handshake failed (either side refused)
    queued: list[m.Message] = field(default_factory=list)  # ours, for once it is ready
    held: list[m.Message] = field(default_factory=list)  # theirs, for once it is ready
    since: float = 0.0  # handshake began
    last_active: float = 0.0  # last send or receipt
    refused_until: float = 0.0
    next_hello: float = 0.0
    hello_interval: float = HELLO_RETRY_S

    @property
    def ready(self) -> bool:
        return self.agent is not None and self.refused is None

    @property
    def state(self) -> str:
        if self.refused is not None:
            return "refused"
        return "ready" if self.agent is not None else "handshake"


class PeerTable(Mapping[str, Peer]):
    """address -> Peer. ``on_ready(address, hello)`` / ``on_refused(address, reason)``
    tell the transfers waiting on a peer; ``deliver(msg, sender)`` handles a held
    message; ``busy()`` names the addresses transfers use."""

    def __init__(self, own: m.Hello, channel, transport, *,
                 on_ready: Callable[[str, m.Hello], None],
                 on_refused: Callable[[str, str], None],
                 deliver: Callable[[m.Message, str], None],
                 busy: Callable[[], set[str]],
                 handshake_timeout_s: float, idle_timeout_s: float, refusal_ttl_s: float,
                 max_peers: int = MAX_PEERS, clock: Callable[[], float] = time.monotonic,
                 ) -> None:
        if max_peers < 1:
            raise ValueError(f"max_peers must be at least 1, got {max_peers}")
        self.own, self.channel, self.transport = own, channel, transport
        self.on_ready, self.on_refused, self.deliver, self.busy = (
            on_ready, on_refused, deliver, busy)
        self.handshake_timeout_s, self.idle_timeout_s = handshake_timeout_s, idle_timeout_s
        self.refusal_ttl_s, self.max_peers, self.clock = refusal_ttl_s, max_peers, clock
        self._peers: dict[str, Peer] = {}
        self.dropped = dict.fromkeys(DROP_REASONS, 0)
        self.evicted = dict.fromkeys(EVICT_REASONS, 0)
        self._last_log: dict[str, float] = {}

    def __getitem__(self, address: str) -> Peer:
        return self._peers[address]

    def __iter__(self) -> Iterator[str]:
        return iter(self._peers)

    def __len__(self) -> int:
        return len(self._peers)

    def ready_peer(self, address: str | None) -> Peer | None:
        peer = self._peers.get(address) if address else None
        return peer if peer is not None and peer.ready else None

    def has_ready(self) -> bool:
        return any(peer.ready for peer in self._peers.values())

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(STATES, 0)
        for peer in self._peers.values():
            out[peer.state] += 1
        return out

    def ensure(self, address: str) -> Peer | None:
        """Start the handshake with ``address`` unless done or under way; None (and
        ``on_refused`` told) when it cannot be had now."""
        return self._ensure(address)[0]

    def _ensure(self, address: str) -> tuple[Peer | None, str]:
        now = self.clock()
        peer = self._peers.get(address)
        if peer is None:
            peer, why = self._add(address, now, announce=True)
            if peer is None:
                return None, why
        if peer.refused is not None:
            if now < peer.refused_until:
                self.on_refused(address, peer.refused)
                return None, "peer_refused"
            peer.refused = peer.hello = None  # the refusal expired: try again
            peer.sent_hello, peer.since = False, now
            peer.hello_interval = self._hello_retry_s()
        peer.last_active = now
        if not peer.ready and not peer.sent_hello:
            self._say_hello(peer, now)
        return peer, ""

    def send(self, address: str, msg: m.Message) -> None:
        """Send ``msg`` now if the peer is ready, else once it is (the handshake is
        started); dropped, counted, when it cannot be."""
        peer = self._peers.get(address)
        if peer is not None and peer.ready:
            peer.last_active = self.clock()
            self.channel.send(address, m.encode(msg))
            return
        peer, why = self._ensure(address)
        if peer is None:
            self.dropped[why] += 1
        elif len(peer.queued) >= MAX_QUEUED:
            self.dropped["handshake_queue_full"] += 1
        else:
            peer.queued.append(msg)

    def _add(self, address: str, now: float, announce: bool) -> tuple[Peer | None, str]:
        reason, why = None, "peer_refused"
        if address == self.own.address:
            reason = f"{address} is this instance's own side channel"
        elif len(self._peers) >= self.max_peers and not self._make_room():
            why = "peer_table_full"
            reason = (f"cannot add side-channel peer {address}: this instance already has "
                      f"{len(self._peers)} peers (the limit), each in handshake or in use "
                      f"by a transfer")
        else:
            try:
                self.channel.connect(address)
            except SideChannelError as e:
                why = "connect_failed"
                reason = f"cannot open a side-channel connection to {address}: {e}"
        if reason is not None:
            self._log_limited(why, reason)
            if announce:
                self.on_refused(address, reason)
            return None, why
        peer = self._peers[address] = Peer(address, since=now, last_active=now,
                                           hello_interval=self._hello_retry_s())
        return peer, ""

    def _hello_retry_s(self) -> float:
        return min(HELLO_RETRY_S, self.handshake_timeout_s / 4)

    def _say_hello(self, peer: Peer, now: float) -> None:
        peer.sent_hello = True
        peer.next_hello = now + peer.hello_interval
        self.channel.send(peer.address, m.encode(self.own))

    def on_hello(self, msg: m.Hello, sender: str = "") -> bool:
        """A peer's Hello: make it ready (answering it) or refuse it; False when it was
        not acted on (it names another sender, or us)."""
        address = msg.address
        if (sender and sender != address) or address == self.own.address:
            self._log_limited("hello", f"ignored a Hello from {sender[:80]!r} that names "
                                       f"side channel {address[:80]!r}")
            return False
        now = self.clock()
        peer = self._peers.get(address)
        if peer is None:
            peer, why = self._add(address, now, announce=False)
            if peer is None:  # our answer cannot go out
                self.dropped[why] += 1
                return True
        peer.last_active = now
        problems = m.compatibility_problems(self.own, msg)
        if problems:
            self.refuse(peer, f"peer {msg.engine_id} at {address} is incompatible: "
                        + "; ".join(problems), tell=True)
            return True
        try:
            peer.agent = self.transport.add_peer(msg.agent_metadata)
        except Exception as e:  # noqa: BLE001 - the peer's metadata, not our state
            self.refuse(peer, f"peer {msg.engine_id} at {address} sent unusable transport "
                              f"metadata: {e}", tell=True)
            return True
        peer.hello, peer.refused = msg, None
        if not msg.reply:
            self.channel.send(address, m.encode(msgspec.structs.replace(self.own,
                                                                         reply=True)))
            peer.sent_hello = True
        queued, peer.queued = peer.queued, []
        for q in queued:
            self.channel.send(address, m.encode(q))
        self.on_ready(address, msg)
        held, peer.held = peer.held, []
        for h in held:
            self.deliver(h, address)
        return True

    def on_refused_hello(self, msg: m.HelloRefused, sender: str) -> None:
        """A peer refused our Hello: only the one we are in handshake with counts."""
        peer = self._peers.get(sender) if sender else None
        if peer is None or peer.ready or peer.refused is not None or not peer.sent_hello:
            self._log_limited("refusal", f"ignored a HelloRefused from {sender[:80]!r} "
                                         f"(engine {msg.engine_id[:80]!r}): no handshake "
                                         f"with it is under way")
            return
        self.refuse(peer, msg.reason, tell=False)

    def hold(self, sender: str, msg: m.Message) -> bool:
        """Whether ``msg`` from ``sender`` waits for the sender's handshake (started now):
        a sender neither ready nor refused."""
        peer = self._peers.get(sender)
        if peer is not None and (peer.ready or peer.refused is not None):
            return False
        peer = self.ensure(sender)
        if peer is None or len(peer.held) >= MAX_HELD:
            return False
        peer.held.append(msg)
        return True

    def touch(self, sender: str) -> None:
        peer = self._peers.get(sender)
        if peer is not None:
            peer.last_active = self.clock()

    def refuse(self, peer: Peer, reason: str, tell: bool) -> None:
        """The handshake with ``peer`` failed (``tell``: we refused it: say so)."""
        peer.refused = reason
        peer.refused_until = self.clock() + self.refusal_ttl_s
        self.dropped["peer_refused"] += len(peer.queued)
        peer.queued.clear()
        peer.held.clear()
        if tell:
            self.channel.send(peer.address, m.encode(m.HelloRefused(self.own.engine_id,
                                                                     reason)))
        self._log_limited("refused", reason)
        self.on_refused(peer.address, reason)

    def sweep(self, now: float) -> None:
        """Send unanswered Hellos again; evict peers whose handshake went unanswered, whose
        refusal expired, or that sat idle."""
        if not self._peers:
            return
        busy = self.busy()
        for peer in list(self._peers.values()):
            if peer.refused is not None:
                if now >= peer.refused_until and peer.address not in busy:
                    self._evict(peer, "refusal_expired")
            elif not peer.ready:
                if now - peer.since >= self.handshake_timeout_s and peer.address not in busy:
                    reason = (f"no answer to the side-channel handshake from {peer.address} "
                              f"within {self.handshake_timeout_s:g} s (unreachable, not a "
                              f"kvpush instance, or it refuses our messages: a different "
                              f"side-channel secret?)")
                    self._evict(peer, "handshake_timeout")
                    self.on_refused(peer.address, reason)
                elif peer.sent_hello and now >= peer.next_hello:
                    peer.hello_interval *= 2
                    self._say_hello(peer, now)
            elif peer.address not in busy and now - peer.last_active >= self.idle_timeout_s:
                self._evict(peer, "idle")

    def _make_room(self) -> bool:
        busy = self.busy()
        spare = [p for p in self._peers.values() if p.address not in busy and not p.queued
                 and (p.ready or p.refused is not None)]
        if not spare:
            return False
        self._evict(min(spare, key=lambda p: (p.refused is None, p.last_active)), "room")
        return True

    def _evict(self, peer: Peer, why: str) -> None:
        del self._peers[peer.address]
        self.evicted[why] += 1
        if peer.queued:
            self.dropped["handshake_timeout" if why == "handshake_timeout"
                         else "peer_refused"] += len(peer.queued)
        if peer.agent is not None and not any(p.agent == peer.agent
                                              for p in self._peers.values()):
            try:
                self.transport.remove_peer(peer.agent)
            except Exception:  # noqa: BLE001 - the peer is gone from the table anyway
                log.exception("removing transport peer %s failed", peer.agent)
        self.channel.forget(peer.address)
        log.info("side-channel peer %s evicted (%s)", peer.address, why)

    def _log_limited(self, key: str, msg: str) -> None:
        """log.error at most once per ``key`` per 10 s: bogus addresses must not flood."""
        now = time.monotonic()
        if now - self._last_log.get(key, -1e9) < 10.0:
            return
        self._last_log[key] = now
        log.error(msg)
