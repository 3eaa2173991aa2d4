"""PeerTable: the transfer thread's side-channel peers, their handshakes and their bounds.

A peer is another kvpush instance, known by its side-channel address (``"host:port"``,
also the routing id its messages arrive with). Before anything else goes to it the two
exchange ``Hello`` (compatibility, transport metadata, region layout); messages for a
peer still in handshake wait in a bounded queue and go out once it is ready.

The table is what makes the side channel open connections (a DEALER plus its link
monitor: three ZMQ sockets and as many file descriptors per address), whatever
addresses requests name, so it is what keeps them bounded:

* **never ready**: a handshake unanswered for ``handshake_timeout_s`` (the lease) is
  given up once no lease waits on it (a request waiting on it ends on its own lease,
  which the worker logs as an unanswered handshake): its connection closed, the
  messages waiting for it dropped (counted), ``PeerRefused`` posted for anything still
  waiting. Until then the ``Hello`` is sent again at a doubling interval (one may have
  been lost, or the peer was not up yet).
* **idle**: a ready peer that no transfer uses (lease, WRITE, READ or fence: ``busy``)
  and that nothing was sent to or heard from for ``idle_timeout_s`` is evicted: its
  connection closed, its transport peer removed. The next transfer with it handshakes
  again.
* **cap**: at most ``max_peers`` entries. A new address beyond it first evicts a refused
  or a ready peer no transfer uses (refused first, then the least recently active); if
  none can go, the request that named it fails at once (``PeerRefused``, the reason says
  why) and nothing is opened.
* **refusals** are matched to their sender: a ``HelloRefused`` counts only from the
  address we sent our ``Hello`` to and are still in handshake with (others are logged
  and ignored). A refusal, theirs or ours, lasts ``refusal_ttl_s``: requests for that
  peer fail at once meanwhile; then the entry is evicted and the next request tries the
  handshake again. A compatible ``Hello`` from a refused peer (fixed, restarted) clears
  the refusal at once.
* **connection errors** are not swallowed: when the side channel cannot open a
  connection (a malformed address, ZMQ out of sockets), ``PeerRefused`` carries its
  error at once instead of the request waiting for its lease.

A registration (``PushRegister``) from a sender that is not ready here (this side
evicted it as idle while the other side kept it) is held and a handshake started: it is
delivered once the sender's ``Hello`` is in, so the registration is always checked
against the registering peer's ``Hello``. A READ posted for a peer in handshake waits
for it the same way.

The sweep (``sweep``) rides the transfer thread's heartbeat period; nothing here wakes a
thread or polls. Same thread as the worker (it drives the side channel).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.wire import messages as m
from kvpush.kv_transfer.wire.side_channel import SideChannelError

log = logging.getLogger("kvpush.kv_transfer.transfer_thread.worker")

#: side-channel peers one instance keeps at most (three ZMQ sockets and fds each)
MAX_PEERS = 128
#: messages queued for one peer while its handshake is under way
MAX_QUEUED = 256
#: messages from one sender held until its handshake completes
MAX_HELD = 64
#: first interval between Hellos sent again to a peer that does not answer (doubling)
HELLO_RETRY_S = 1.0

#: why the table dropped a message for a peer (the side channel's own reasons, e.g.
#: ``queue_full``, are counted by the channel): the peer refused us or we refused it,
#: its connection could not be opened, the table was full, its handshake was given up,
#: its handshake queue was full
DROP_REASONS = ("peer_refused", "connect_failed", "peer_table_full", "handshake_timeout",
                "handshake_queue_full")
#: why a peer left the table: its handshake was never answered, it sat idle, its
#: refusal expired, its place was needed for a new peer
EVICT_REASONS = ("handshake_timeout", "idle", "refusal_expired", "room")
#: ``PeerTable.counts()`` keys
STATES = ("handshake", "ready", "refused")


@dataclass
class Peer:
    """One side-channel peer and where its handshake stands."""

    address: str
    hello: m.Hello | None = None  # the peer's Hello once received
    agent: str | None = None  # its transport peer, once added
    sent_hello: bool = False
    refused: str | None = None  # why the handshake failed (either side refused)
    queued: list[m.Message] = field(default_factory=list)  # ours, waiting for ready
    since: float = field(default_factory=time.monotonic)  # handshake began
    last_active: float = field(default_factory=time.monotonic)  # last send or receipt
    refused_until: float = 0.0  # the refusal expires then
    next_hello: float = 0.0  # an unanswered Hello goes again then
    hello_interval: float = HELLO_RETRY_S
    held: list[m.Message] = field(default_factory=list)  # theirs, waiting for ready
    #: called with None once ready, or with the reason when the handshake fails
    deferred: list[Callable[[str | None], None]] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return self.agent is not None and self.refused is None

    @property
    def state(self) -> str:
        if self.refused is not None:
            return "refused"
        return "ready" if self.agent is not None else "handshake"


class PeerTable(Mapping[str, Peer]):
    """The peers of one transfer thread (see module docs). A read-only mapping of
    address -> :class:`Peer`; tests may place a ready peer with ``table[a] = peer``."""

    def __init__(
        self,
        own: m.Hello,
        channel,  # kvpush.kv_transfer.wire.side_channel.SideChannel
        transport,  # kvpush.kv_transfer.transports.transport.KVTransport
        post_event: Callable[[c.TransferEvent], None],
        deliver: Callable[[m.Message, str], None],
        *,
        handshake_timeout_s: float,
        idle_timeout_s: float,
        refusal_ttl_s: float,
        busy: Callable[[], set[str]] = set,
        max_peers: int = MAX_PEERS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``deliver(msg, sender)`` handles a held message once its sender is ready;
        ``busy()`` names the addresses that transfers still use (never evicted)."""
        if max_peers < 1:
            raise ValueError(f"max_peers must be at least 1, got {max_peers}")
        self.own = own
        self.channel = channel
        self.transport = transport
        self.post_event = post_event
        self.deliver = deliver
        self.handshake_timeout_s = handshake_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.refusal_ttl_s = refusal_ttl_s
        self.busy = busy
        self.max_peers = max_peers
        self.clock = clock
        self._peers: dict[str, Peer] = {}
        # every key exists from the start: other threads read these (metrics)
        self.dropped = dict.fromkeys(DROP_REASONS, 0)
        self.evicted = dict.fromkeys(EVICT_REASONS, 0)
        self.refusals_ignored = 0  # HelloRefused from no peer we are in handshake with
        self._last_log: dict[str, float] = {}

    # ---- the mapping ------------------------------------------------------------------
    def __getitem__(self, address: str) -> Peer:
        return self._peers[address]

    def __iter__(self) -> Iterator[str]:
        return iter(self._peers)

    def __len__(self) -> int:
        return len(self._peers)

    def __setitem__(self, address: str, peer: Peer) -> None:
        self._peers[address] = peer

    def is_ready(self, address: str) -> bool:
        peer = self._peers.get(address)
        return peer is not None and peer.ready

    def has_ready(self) -> bool:
        return any(peer.ready for peer in self._peers.values())

    def counts(self) -> dict[str, int]:
        """Peers by state (``STATES``)."""
        out = dict.fromkeys(STATES, 0)
        for peer in self._peers.values():
            out[peer.state] += 1
        return out

    # ---- our side: handshakes and sends ------------------------------------------------
    def ensure(self, address: str) -> Peer | None:
        """Start the handshake with ``address`` unless it is done or under way; None (and
        ``PeerRefused`` posted) when it cannot be had now."""
        return self._ensure(address)[0]

    def _ensure(self, address: str) -> tuple[Peer | None, str]:
        """(the peer, or None and the ``DROP_REASONS`` entry saying why)."""
        now = self.clock()
        peer = self._peers.get(address)
        if peer is None:
            peer, why = self._add(address, now, announce=True)
            if peer is None:
                return None, why
        if peer.refused is not None:
            if now < peer.refused_until:
                self.post_event(c.PeerRefused(address, peer.refused))
                return None, "peer_refused"
            self._restart(peer, now)  # the refusal has expired: try again
        peer.last_active = now
        if not peer.ready and not peer.sent_hello:
            self._say_hello(peer, now)
        return peer, ""

    def send(self, address: str, msg: m.Message) -> None:
        """Send ``msg`` to ``address`` now if the peer is ready, else once it is (the
        handshake is started); dropped, counted, when it cannot be."""
        if isinstance(msg, m.Hello | m.HelloRefused):
            self.channel.send(address, m.encode(msg))
            return
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

    def defer(self, address: str, fn: Callable[[str | None], None]) -> bool:
        """Call ``fn(None)`` once ``address`` is ready, or ``fn(reason)`` if its
        handshake fails; False (``fn`` dropped) unless a handshake is under way."""
        peer = self._peers.get(address)
        if peer is None or peer.ready or peer.refused is not None \
                or len(peer.deferred) >= MAX_QUEUED:
            return False
        peer.deferred.append(fn)
        return True

    def _add(self, address: str, now: float, announce: bool) -> tuple[Peer | None, str]:
        """A new entry for ``address`` with its connection open, or (None, why)."""
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
                self.post_event(c.PeerRefused(address, reason))
            return None, why
        peer = self._peers[address] = Peer(address, since=now, last_active=now,
                                           hello_interval=self._hello_retry_s())
        return peer, ""

    def _hello_retry_s(self) -> float:
        return min(HELLO_RETRY_S, self.handshake_timeout_s / 4)

    def _restart(self, peer: Peer, now: float) -> None:
        peer.refused = peer.hello = None
        peer.sent_hello = False
        peer.since = now
        peer.hello_interval = self._hello_retry_s()

    def _say_hello(self, peer: Peer, now: float) -> None:
        peer.sent_hello = True
        peer.next_hello = now + peer.hello_interval
        self.channel.send(peer.address, m.encode(self.own))

    # ---- their side: Hello, HelloRefused, held messages ---------------------------------
    def on_hello(self, msg: m.Hello, sender: str = "") -> bool:
        """A peer's ``Hello``: make it ready (answering it) or refuse it; False when the
        frame was not acted on (it names another sender, or us)."""
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
            self._refuse(peer, f"peer {msg.engine_id} at {address} is incompatible: "
                         + "; ".join(problems), now, tell=True)
            return True
        try:
            peer.agent = self.transport.add_peer(msg.agent_metadata)
        except Exception as e:  # noqa: BLE001 - the peer's metadata, not our state
            self._refuse(peer, f"peer {msg.engine_id} at {address} sent unusable transport "
                               f"metadata: {e}", now, tell=True)
            return True
        peer.hello, peer.refused = msg, None
        if not msg.reply:
            self.channel.send(address, m.encode(m.Hello(**{**_fields(self.own),
                                                             "reply": True})))
            peer.sent_hello = True
        queued, peer.queued = peer.queued, []
        for q in queued:
            self.channel.send(address, m.encode(q))
        self.post_event(c.PeerReady(address, msg))
        deferred, peer.deferred = peer.deferred, []
        for fn in deferred:
            fn(None)
        held, peer.held = peer.held, []
        for h in held:
            self.deliver(h, address)
        return True

    def on_refused(self, msg: m.HelloRefused, sender: str) -> None:
        """A peer refused our ``Hello``: only the peer that sent it, and only while we
        are in handshake with it (anything else is logged and ignored)."""
        peer = self._peers.get(sender) if sender else None
        if peer is None or peer.ready or peer.refused is not None or not peer.sent_hello:
            self.refusals_ignored += 1
            self._log_limited("refusal", f"ignored a HelloRefused from {sender[:80]!r} "
                                         f"(engine {msg.engine_id[:80]!r}): no handshake "
                                         f"with it is under way")
            return
        self._refuse(peer, msg.reason, self.clock(), tell=False)

    def hold(self, sender: str, msg: m.Message) -> bool:
        """Whether ``msg`` from ``sender`` waits for the sender's handshake (started now)
        instead of being handled at once: a sender that is not ready, not refused."""
        peer = self._peers.get(sender)
        if peer is not None and (peer.ready or peer.refused is not None):
            return False
        peer = self.ensure(sender)
        if peer is None or len(peer.held) >= MAX_HELD:
            return False
        peer.held.append(msg)
        return True

    def touch(self, sender: str) -> None:
        """Something arrived from ``sender``: it is not idle."""
        peer = self._peers.get(sender)
        if peer is not None:
            peer.last_active = self.clock()

    def _refuse(self, peer: Peer, reason: str, now: float, tell: bool) -> None:
        """The handshake with ``peer`` failed (``tell``: we refused it, say so)."""
        peer.refused = reason
        peer.refused_until = now + self.refusal_ttl_s
        self.dropped["peer_refused"] += len(peer.queued)
        peer.queued.clear()
        peer.held.clear()
        if tell:
            self.channel.send(peer.address, m.encode(m.HelloRefused(self.own.engine_id,
                                                                     reason)))
        self._log_limited("refused", reason)
        self.post_event(c.PeerRefused(peer.address, reason))
        deferred, peer.deferred = peer.deferred, []
        for fn in deferred:
            fn(reason)

    # ---- bounds ---------------------------------------------------------------------------
    def sweep(self, now: float) -> None:
        """Send unanswered Hellos again; evict peers whose handshake went unanswered past
        its bound, whose refusal expired, or that sat idle (on the heartbeat period)."""
        if not self._peers:
            return
        busy = self.busy()
        for peer in list(self._peers.values()):
            if peer.refused is not None:
                if now >= peer.refused_until and peer.address not in busy:
                    self._evict(peer, "refusal_expired")
            elif not peer.ready:
                if now - peer.since >= self.handshake_timeout_s and peer.address not in busy:
                    self._give_up(peer)  # (a request waiting on it ends on its lease)
                elif peer.sent_hello and now >= peer.next_hello:
                    peer.hello_interval *= 2
                    self._say_hello(peer, now)
            elif peer.address not in busy and now - peer.last_active >= self.idle_timeout_s:
                self._evict(peer, "idle")

    def _give_up(self, peer: Peer) -> None:
        reason = (f"no answer to the side-channel handshake from {peer.address} within "
                  f"{self.handshake_timeout_s:g} s (unreachable, not a kvpush instance, or "
                  f"it refuses our messages: a different side-channel secret?)")
        self._evict(peer, "handshake_timeout", reason)
        self.post_event(c.PeerRefused(peer.address, reason))

    def _make_room(self) -> bool:
        """Evict one refused, or ready and unused, peer (refused first, then the least
        recently active); False if every peer is in handshake or in use."""
        busy = self.busy()
        spare = [p for p in self._peers.values() if p.address not in busy and not p.queued
                 and not p.deferred and (p.ready or p.refused is not None)]
        if not spare:
            return False
        self._evict(min(spare, key=lambda p: (p.refused is None, p.last_active)), "room")
        return True

    def _evict(self, peer: Peer, why: str, reason: str | None = None) -> None:
        """Drop ``peer``: close its connection, remove its transport peer, tell what
        waited on it (``reason``)."""
        del self._peers[peer.address]
        self.evicted[why] += 1
        if peer.queued:
            self.dropped["handshake_timeout" if why == "handshake_timeout"
                         else "peer_refused"] += len(peer.queued)
        deferred, peer.deferred = peer.deferred, []
        for fn in deferred:
            fn(reason or f"side-channel peer {peer.address} dropped ({why})")
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


def _fields(s) -> dict:
    return {f: getattr(s, f) for f in s.__struct_fields__}
