"""SideChannel: the ZMQ messaging endpoint between kvpush instances (bytes in, bytes out).

One ROUTER bound at our *address* ``"host:port"`` receives; one DEALER per destination,
opened on first use, sends with our address as routing id, so ``recv`` yields ``(sender,
payload)`` pairs and a reply is ``send(sender, ...)``. Sending never blocks: at most
``sndhwm`` messages queue per destination, the rest are dropped and counted by reason. A
destination holds three ZMQ sockets until forgotten (the owner, ``PeerTable``, bounds
them). ``recv`` waits in the kernel; :meth:`~SideChannel.wake` ends the wait early.

The link watch (link_watch.py) tells a peer whose process is gone from a slow one
(:meth:`~SideChannel.take_dropped`, :meth:`~SideChannel.peer_gone`); a drop ends a waiting
``recv``. ZMTP heartbeats, answered by ZMQ's I/O thread, drop a stopped process or stalled
host too (the DEALER reconnects once it answers); a merely blocked Python thread stays up.

**Threading:** apart from :meth:`~SideChannel.wake`, ONE thread (the transfer thread) uses
an instance: ZMQ sockets are not thread-safe.

With ``secret=``, ZMQ's CURVE admits only holders of the secret (so nobody else can take a
member's routing id over with ``ROUTER_HANDOVER``), and every message carries a
:class:`ChannelAuth` HMAC frame: unsigned, forged, replayed or stale messages and refused
handshakes are dropped before decoding, counted in ``stats.rejected_by_reason`` and logged
rate-limited, and count toward ``MAX_BATCH`` so that a flood cannot hold ``recv``. Without
a secret nothing is checked (trusted networks only; a non-loopback bind logs a warning).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from dataclasses import dataclass, field

import zmq

from kvpush.crypto.auth import REJECT_HINTS, REJECT_REASONS, ChannelAuth, outgoing_refusal
from kvpush.crypto.curve import (
    HANDSHAKE_FAILED,
    ZapGuard,
    derive_curve_keys,
    handshake_reason,
    make_client,
    make_server,
)
from kvpush.kv_transfer.wire.link_watch import NOBLOCK, POLLIN, LinkWatch, monitor_events

log = logging.getLogger(__name__)

MAX_BATCH = 4096  # frames read by one recv at most (accepted or refused)
#: Largest message ZMQ accepts (a registration of 2**20 block ids is about 5 MiB).
MAX_MESSAGE_BYTES = 16 << 20
#: ``stats.send_dropped_by_reason`` keys: destination queue full (peer gone or slow),
#: DEALER not openable (bad address, out of sockets), ZMQ refused otherwise, channel closed.
SEND_DROP_REASONS = ("queue_full", "connect_failed", "send_failed", "closed")
#: Longest wait (ms) between reconnection attempts (ZMQ starts at 100 and doubles): an
#: address nobody listens on costs one connection attempt per second at most; one whose
#: far end closes our connection in the handshake (ZMQ retries at 100 ms), one per SLOW.
RECONNECT_IVL_MAX_MS, SLOW_RECONNECT_MS = 1000, 2000
_SLOW = [(zmq.RECONNECT_IVL, SLOW_RECONNECT_MS), (zmq.RECONNECT_IVL_MAX, SLOW_RECONNECT_MS)]
#: ZMTP heartbeats: a PING each interval; ZMQ closes a connection silent for the timeout
#: (the link watch reports a drop). Nothing waits on them.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000

_warned_unsigned_bind = False


class SideChannelError(Exception):
    """A destination's connection could not be opened (the message names ZMQ's reason)."""


@dataclass
class SideChannelStats:
    """Counters of one channel."""

    sent: int = 0  # accepted by send() (returned True)
    send_dropped: int = 0  # refused by send() (all reasons)
    received: int = 0  # returned by recv
    rejected: int = 0  # refused by the authentication (all reasons)
    malformed: int = 0  # wrong number of frames
    link_drops: int = 0  # connections of ours to a peer seen to drop
    rejected_by_reason: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(REJECT_REASONS, 0))
    send_dropped_by_reason: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(SEND_DROP_REASONS, 0))

    def dropped(self, reason: str) -> None:
        self.send_dropped += 1
        self.send_dropped_by_reason[reason] += 1


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise ValueError(f"side-channel address must be host:port, got {address!r}")
    return host, int(port)


class SideChannel:
    """A ZMQ ROUTER to receive on plus cached DEALERs to send with (see module docs)."""

    def __init__(self, host: str, port: int, *, secret: bytes | None = None,
                 sndhwm: int = 1000, max_message_bytes: int = MAX_MESSAGE_BYTES,
                 auth_window_s: float = 60.0,
                 keepalive: tuple[int, int, int] | None = (10, 5, 3),
                 heartbeat: tuple[int, int] | None = (HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS)):
        """``keepalive``: TCP keepalive (idle s, interval s, probes), so that a broken path
        drops; ``heartbeat``: ZMTP heartbeats (interval ms, timeout ms). None: unset."""
        self.auth = ChannelAuth(secret, auth_window_s) if secret else None
        self.stats = SideChannelStats()
        self._streams: dict[str, tuple[bytes, itertools.count]] = {}  # per destination
        self._last_log: dict[str, float] = {}  # log key -> when last logged
        opts = [(zmq.LINGER, 0), (zmq.MAXMSGSIZE, max_message_bytes)]  # every socket's
        if heartbeat is not None:  # HEARTBEAT_TTL: for the peer's side of a connection
            opts += [(zmq.HEARTBEAT_IVL, heartbeat[0]), (zmq.HEARTBEAT_TIMEOUT, heartbeat[1]),
                     (zmq.HEARTBEAT_TTL, heartbeat[1])]
        self._dealer_opts = [*opts, (zmq.SNDHWM, sndhwm),
                             (zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)]
        if keepalive is not None:
            self._dealer_opts += [(zmq.TCP_KEEPALIVE, 1), *zip(
                (zmq.TCP_KEEPALIVE_IDLE, zmq.TCP_KEEPALIVE_INTVL, zmq.TCP_KEEPALIVE_CNT),
                keepalive)]
        self._ctx = zmq.Context(io_threads=1)
        self._curve = derive_curve_keys(secret) if secret else None
        self._zap = ZapGuard(self._ctx, self._curve) if self._curve is not None else None
        self._router = self._ctx.socket(zmq.ROUTER)
        # ROUTER_HANDOVER: a restarted peer takes over its id (with CURVE: only a member can)
        for opt, value in [*opts, (zmq.ROUTER_HANDOVER, 1)]:
            self._router.setsockopt(opt, value)
        self._router_mon: zmq.Socket | None = None
        if self._curve is not None:
            make_server(self._router, self._curve)
            self._router_mon = self._router.get_monitor_socket(
                HANDSHAKE_FAILED, f"inproc://kvpush-sc-router-{id(self)}")
            self._router_mon.setsockopt(zmq.LINGER, 0)
        try:
            self._router.bind(f"tcp://{host}:{port if port else '*'}")
        except zmq.ZMQError:
            self._close_sockets()
            raise
        endpoint = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.host = host
        self.port = int(endpoint.rsplit(":", 1)[1])
        self.address = f"{host}:{self.port}"
        self._identity = self.address.encode()
        from kvpush.cli_types import is_loopback
        global _warned_unsigned_bind
        if self.auth is None and not _warned_unsigned_bind and not is_loopback(host):
            _warned_unsigned_bind = True
            log.warning("side channel bound to %s without a shared secret: anyone who "
                        "reaches it can register transfers and send KV messages; set "
                        "--kv-secret-file or KVPUSH_KV_SECRET on every instance",
                        self.address)
        self._dealers: dict[str, zmq.Socket] = {}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        if self._router_mon is not None:
            self._poller.register(self._router_mon, zmq.POLLIN)
        self._links = LinkWatch(self._poller)
        self._closed = False

    def __repr__(self) -> str:
        return f"SideChannel({self.address})"

    def send(self, address: str, payload: bytes) -> bool:
        """Queue ``payload`` for ``address`` without blocking; False if it was dropped."""
        if self._closed:
            self.stats.dropped("closed")
            return False
        try:
            sock = self._dealer(address)
        except (zmq.ZMQError, ValueError) as e:
            self.stats.dropped("connect_failed")
            self._log_limited("connect_failed", "side channel %s cannot open a connection to "
                              "%r (%s so far): %s", self.address, address[:80],
                              self.stats.send_dropped_by_reason["connect_failed"], e)
            return False
        frames = [payload]
        try:
            if self.auth is not None:  # signed as it goes out: counters follow wire order
                stream = self._streams.get(address)
                if stream is None:
                    stream = self._streams[address] = (os.urandom(8), itertools.count(1))
                frames.append(self.auth.seal(self._identity, stream[0], next(stream[1]), payload))
            sock.send_multipart(frames, flags=NOBLOCK)
        except zmq.Again:  # the destination's queue (sndhwm) is full
            self.stats.dropped("queue_full")
            return False
        except zmq.ZMQError as e:
            self.stats.dropped("send_failed")
            self._log_limited("send_failed", "side channel %s could not send to %r: %s",
                              self.address, address[:80], e)
            return False
        self.stats.sent += 1
        return True

    def connect(self, address: str) -> None:
        """Open the DEALER to ``address`` now (no-op if open), or raise
        :class:`SideChannelError` naming why not (where ``send`` would count a drop)."""
        if self._closed:
            raise SideChannelError("the side channel is closed")
        try:
            self._dealer(address)
        except (zmq.ZMQError, ValueError) as e:
            raise SideChannelError(f"{type(e).__name__}: {e}") from e

    @property
    def num_destinations(self) -> int:
        """Destinations with an open DEALER (three ZMQ sockets each)."""
        return len(self._dealers)

    def forget(self, address: str) -> None:
        """Close the DEALER to ``address``, discarding messages still queued for it."""
        self._streams.pop(address, None)
        self._close_dealer(address, forget=True)

    def _close_dealer(self, address: str, forget: bool = False, linger_ms: int = 0) -> None:
        sock = self._dealers.pop(address, None)
        self._links.detach(sock, address, forget)
        if sock is not None:
            sock.close(linger=linger_ms)

    def _dealer(self, address: str, slow: bool = False) -> zmq.Socket:
        sock = self._dealers.get(address)
        if sock is not None:
            return sock
        host, port = split_address(address)
        sock = self._ctx.socket(zmq.DEALER)
        for opt, value in [*self._dealer_opts, (zmq.ROUTING_ID, self._identity), *_SLOW * slow]:
            sock.setsockopt(opt, value)
        if self._curve is not None:
            make_client(sock, self._curve)
        try:
            self._links.attach(sock, address)
            sock.connect(f"tcp://{host}:{port}")
        except zmq.ZMQError:
            self._links.detach(sock, address, forget=True)
            sock.close(linger=0)
            raise
        self._dealers[address] = sock
        return sock

    def _log_limited(self, key: str, msg: str, *args: object) -> None:
        """log.error at most once per ``key`` per 10 s: a flood must not fill the log."""
        now = time.monotonic()
        if now - self._last_log.get(key, -1e9) >= 10.0:
            self._last_log[key] = now
            log.error(msg, *args)

    def take_dropped(self) -> list[str]:
        """Addresses whose connection (our DEALER's) dropped since the last call: the
        peer closed it (its process ended), or TCP gave up on the path."""
        out = self._links.take_dropped()
        self.stats.link_drops = self._links.drops
        return out

    def peer_gone(self, address: str) -> bool:
        """Whether our connection to ``address`` was up once and is down now (also
        after :meth:`forget`). A peer that is only frozen keeps its connection up."""
        return self._links.gone(address)

    def recv(self, timeout_ms: int) -> list[tuple[str, bytes]]:
        """What has arrived, as (sender address, payload) pairs, once there is some, on
        :meth:`wake` or a link drop (maybe empty), or empty after ``timeout_ms``."""
        if self._closed:
            return []
        deadline = time.monotonic() + max(0, timeout_ms) / 1000.0
        drops0 = self._links.drops
        self._links.pump()
        while True:
            self._take_refusals()
            out = self._drain()
            self.stats.link_drops = self._links.drops
            if out or self._links.drops != drops0:  # a drop: the owner acts on it
                return out
            wait = deadline - time.monotonic()
            if wait <= 0:
                return []
            events = dict(self._poller.poll(max(1, int(wait * 1000 + 0.999))))
            if any(self._links.owns(sock) for sock in events):
                self._links.pump()
            if self._wake_r in events:
                with contextlib.suppress(BlockingIOError, OSError):
                    while len(os.read(self._wake_r, 4096)) == 4096:  # (a short read: empty)
                        pass
                return self._drain()

    def pending(self) -> bool:
        """Whether a frame is ready to be received now (without waiting)."""
        return not self._closed and bool(self._router.getsockopt(zmq.EVENTS) & POLLIN)

    def wake(self) -> None:
        """Make a waiting (or the next) ``recv`` return early. Safe from any thread."""
        if self._closed:
            return
        with contextlib.suppress(BlockingIOError, OSError):  # full: a wake is pending
            os.write(self._wake_w, b"\0")

    def _take_refusals(self) -> None:
        """Count (with a secret) and log the failed handshakes of our DEALERs."""
        refusals, self._links.refusals = self._links.refusals, []
        for address, reason in refusals:
            n = self._count(reason) if self.auth is not None else None
            self._log_limited(f"to {reason}", "side channel %s: %s", self.address,
                              outgoing_refusal(address[:80], reason, n))
            if (reason == "closed_in_handshake" and address in self._dealers
                    and self._dealers[address].get(zmq.RECONNECT_IVL) < SLOW_RECONNECT_MS):
                self._close_dealer(address)  # reopened slow; its queue could reach no one
                with contextlib.suppress(zmq.ZMQError):
                    self._dealer(address, slow=True)

    def _drain(self) -> list[tuple[str, bytes]]:
        out: list[tuple[str, bytes]] = []
        if self._router_mon is not None:  # handshakes our ROUTER refused (no secret of ours)
            for event, value in monitor_events(self._router_mon):
                self._reject(b"(a connection)", handshake_reason(event, value, server=True))
        for _ in range(MAX_BATCH):  # refused frames count too: a flood cannot hold us here
            if not self.pending():  # (keeps the GIL, where a receive of nothing gives it up)
                break
            try:
                frames = self._router.recv_multipart(flags=NOBLOCK)
            except zmq.Again:
                break
            if len(frames) not in (2, 3):
                self.stats.malformed += 1
                continue
            sender, payload = frames[0], frames[1]
            if self.auth is not None:
                reason = self.auth.check(sender, payload, frames[2] if len(frames) == 3 else None)
                if reason is not None:
                    self._reject(sender, reason)
                    continue
            try:
                out.append((sender.decode(), payload))
            except UnicodeDecodeError:
                self.stats.malformed += 1
        self.stats.received += len(out)
        return out

    def _reject(self, sender: bytes, reason: str) -> None:
        self._log_limited(reason, "side channel %s rejected a message from %r (%s so far): %s",
                          self.address, sender[:80].decode("ascii", "replace"),
                          self._count(reason), REJECT_HINTS[reason])

    def _count(self, reason: str) -> int:
        self.stats.rejected += 1
        self.stats.rejected_by_reason[reason] += 1
        return self.stats.rejected_by_reason[reason]

    def close(self, linger_ms: int = 0) -> None:
        """Close every socket (idempotent); ZMQ has ``linger_ms`` to send what is queued."""
        if self._closed:
            return
        self._closed = True
        for address in list(self._dealers):
            self._close_dealer(address, linger_ms=linger_ms)
        self._close_sockets()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _close_sockets(self) -> None:
        if self._router_mon is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._router.disable_monitor()
            self._router_mon.close(linger=0)
        self._router.close(linger=0)
        if self._zap is not None:
            self._zap.stop()
        self._ctx.term()

    def __enter__(self) -> SideChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
