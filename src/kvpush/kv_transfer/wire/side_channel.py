"""SideChannel: the ZMQ messaging endpoint between kvpush instances (bytes in, bytes out).

Each instance binds one ROUTER at ``tcp://host:port`` (its side-channel *address* is
``"host:port"``) and sends through one DEALER per destination address, created on
first use and cached. A DEALER's routing id is our own address, so every received
message comes with the sender's address: ``recv`` returns ``(sender, payload)``
pairs, and a reply is ``send(sender, ...)``.

Sending never blocks: DEALERs use ``linger=0``, a send high-water mark
(``sndhwm`` messages queued per destination, including while it is still connecting)
and ``zmq.NOBLOCK``. To a peer that is gone (or never existed) at most ``sndhwm``
messages queue up; the rest are dropped and counted in ``stats.send_dropped`` (and by
reason in ``stats.send_dropped_by_reason``: ``queue_full``, ``connect_failed``,
``send_failed``, ``closed``). :meth:`SideChannel.connect` opens a destination's DEALER up front and
raises :class:`SideChannelError` with ZMQ's reason when it cannot (a bad address, out
of sockets); :meth:`SideChannel.forget` closes a destination and discards what was
queued for it. Each destination costs three ZMQ sockets (the DEALER and its link
monitor's pair) and their file descriptors until it is forgotten: the owner bounds
them (the transfer thread's ``PeerTable``, peers.py).

Receiving waits in ``zmq.Poller`` (in the kernel, no CPU) for at most ``timeout_ms``;
:meth:`SideChannel.wake` (thread-safe, a byte on a pipe) makes a waiting ``recv``
return early, so other threads can hand the owning thread work. An owner with its
own ``select`` loop can use :meth:`SideChannel.fileno` / :meth:`SideChannel.pending`
instead.

Link watch (link_watch.py): every DEALER has a ZMQ socket monitor, read by ``recv``, so
the owner can tell a peer whose process is gone (it closed its sockets, or TCP keepalive
gave up on the path: :meth:`take_dropped`, :meth:`peer_gone`) from one that is merely
slow. A peer whose process stops answering (SIGSTOP, a stalled host: its kernel keeps
the TCP connection open) misses ZMTP heartbeats (``heartbeat=``), so ZMQ closes the
connection within ``HEARTBEAT_TIMEOUT_MS`` and the link watch reports it as a drop like
a death (fences released, transfers failed); the DEALER keeps reconnecting and its next
handshake, once the peer answers again, brings the link back up. A peer whose transfer
thread alone is blocked still answers heartbeats (ZMQ's I/O thread does) and stays up.
A drop ends a waiting ``recv``.

**Threading:** apart from :meth:`wake`, an instance is used from ONE thread (the
instance's transfer thread): ZMQ sockets are not thread-safe.

Faults (a shared :class:`~kvpush_testing.faults.FaultPlan`) act on send: a
dropped message is silently lost (``send`` still returns True, as on a lossy
network); a delayed one is held in an outbox that ``send``/``recv`` flush when due.
Message types for ``drop_messages`` come from ``type_of(payload)``.

Authentication (optional, ``secret=``): every message gets a second frame from
:class:`ChannelAuth` (HMAC-SHA256 over the sender's address, a per-connection stream
id, a counter, a timestamp and the payload, keyed by the shared secret). On receipt a
message without it (``unsigned``), with a wrong MAC (``bad_signature``), with a counter
not above the last one seen on its stream (``replayed``) or a timestamp outside the
window (``stale``) is dropped before anyone decodes it, counted in
``stats.rejected_by_reason`` and logged (rate-limited) with what it most likely means.
Without a secret, messages are neither signed nor checked (trusted networks only; a
warning is logged once when such a channel binds a non-loopback address).

Below the MAC, a channel with a secret runs ZMQ's CURVE (curve.py): the ROUTER is a
CURVE server whose ZAP handler admits only the key pair derived from the secret, every
DEALER a client with it. A process without the secret cannot finish a handshake, so it
can neither send a frame that reaches Python nor take a member's routing id over
(``ROUTER_HANDOVER`` acts between authenticated connections only); a refused handshake
is counted and logged under the same reasons (``unsigned``: the peer has no secret,
``bad_signature``: a different one). The routing id a peer declares is thus trusted
only because its connection proved the secret, and the MAC binds every message to it.
Frames refused by the MAC count toward ``MAX_BATCH`` like accepted ones, so a flood
cannot keep ``recv`` in its loop.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import zmq

from kvpush.kv_transfer.wire.auth import REJECT_HINTS, REJECT_REASONS, ChannelAuth
from kvpush.kv_transfer.wire.curve import (
    HANDSHAKE_FAILED,
    ZapGuard,
    derive_curve_keys,
    handshake_reason,
    make_client,
    make_server,
)
from kvpush.kv_transfer.wire.link_watch import LinkWatch

if TYPE_CHECKING:  # test-only (kvpush_testing): a type here, never imported
    from kvpush_testing.faults import FaultPlan

log = logging.getLogger(__name__)

MAX_BATCH = 4096  # frames read by one recv at most (accepted or refused)

#: Largest side-channel message ZMQ accepts (bigger ones close the connection before
#: they are buffered): a Hello's NIXL metadata is kilobytes, a registration of 2**20
#: block ids about 5 MiB.
MAX_MESSAGE_BYTES = 16 << 20

#: Why ``send`` dropped a message (``stats.send_dropped_by_reason`` keys): the
#: destination's queue was full (peer gone or slow), its DEALER could not be opened
#: (bad address, out of sockets), ZMQ refused the send otherwise, the channel was closed.
SEND_DROP_REASONS = ("queue_full", "connect_failed", "send_failed", "closed")

#: Longest wait (ms) between ZMQ's reconnection attempts to a destination that does not
#: answer (it starts at ZMQ's 100 ms and doubles): an address nobody listens on costs a
#: connection attempt per second at most, not ten.
RECONNECT_IVL_MAX_MS = 1000

#: ZMTP heartbeats on every side-channel connection (both ends): a PING each
#: ``HEARTBEAT_IVL_MS``; a connection that brings nothing back (no PONG, no message)
#: for ``HEARTBEAT_TIMEOUT_MS`` is closed by ZMQ, which the link watch reports as a
#: drop, and the DEALER reconnects by itself (a fresh CURVE handshake) once the peer
#: answers again. They are answered by ZMQ's I/O thread, not by Python: a peer process
#: that is stopped (SIGSTOP) or a host that stalls is dropped, a busy or blocked Python
#: thread is not (the transfer leases and fence timeouts cover that). Nothing waits on
#: them: they only end connections that are already silent.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000

_warned_unsigned_bind = False


class SideChannelError(Exception):
    """A destination's connection could not be opened (the message names ZMQ's reason)."""


@dataclass
class SideChannelStats:
    """Counters of one channel."""

    sent: int = 0  # accepted by send() (returned True)
    send_dropped: int = 0  # refused by ZMQ: destination queue full (peer gone or slow)
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

    def __init__(
        self,
        host: str,
        port: int,
        faults: FaultPlan | None = None,
        *,
        type_of: Callable[[bytes], str] | None = None,
        secret: bytes | None = None,
        sndhwm: int = 1000,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        auth_window_s: float = 60.0,
        keepalive: tuple[int, int, int] | None = (10, 5, 3),
        heartbeat: tuple[int, int] | None = (HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS),
    ):
        """``keepalive``: TCP keepalive of the DEALERs as (idle s, interval s, probes),
        so that a peer behind a broken path is seen to drop; None: the system's.
        ``heartbeat``: ZMTP heartbeats as (interval ms, timeout ms) on the ROUTER and
        every DEALER, so that a peer gone silent is dropped (see HEARTBEAT_IVL_MS);
        None: none."""
        self.faults = faults
        self.type_of = type_of
        self.auth = ChannelAuth(secret, auth_window_s) if secret else None
        self.stats = SideChannelStats()
        self._streams: dict[str, tuple[bytes, itertools.count]] = {}  # per destination
        self._last_log: dict[str, float] = {}  # reject reason -> when last logged
        self._sndhwm = sndhwm
        self._keepalive = keepalive
        self._heartbeat = heartbeat
        self._ctx = zmq.Context(io_threads=1)
        self._curve = derive_curve_keys(secret) if secret else None
        self._zap = ZapGuard(self._ctx, self._curve) if self._curve is not None else None
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        # a restarted peer takes over its id (with CURVE: only a member can)
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._router.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._set_heartbeat(self._router)
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
        if self.auth is None and not _is_loopback(host):
            global _warned_unsigned_bind
            if not _warned_unsigned_bind:
                _warned_unsigned_bind = True
                log.warning("side channel bound to %s without a shared secret: anyone who "
                            "reaches it can register transfers and send KV messages; set "
                            "--kv-secret-file or KVPUSH_KV_SECRET on every instance",
                            self.address)
        self._dealers: dict[str, zmq.Socket] = {}
        self._outbox: list[tuple[float, int, str, list[bytes]]] = []  # heap by due time
        self._seq = itertools.count()
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

    # -- sending ----------------------------------------------------------------------

    def send(self, address: str, payload: bytes) -> bool:
        """Queue ``payload`` for ``address`` ("host:port"); False if it was dropped.

        Never blocks. A fault-dropped message returns True (it is lost "on the wire").
        """
        if self._closed:
            self.stats.dropped("closed")
            return False
        frames = [payload]
        if self.faults is not None:
            type_name = self.type_of(payload) if self.type_of is not None else ""
            if self.faults.take_message_drop(type_name):
                self.stats.sent += 1
                return True
            delay = self.faults.message_delay()
            if delay > 0:
                due = time.monotonic() + delay
                heapq.heappush(self._outbox, (due, next(self._seq), address, frames))
                self.stats.sent += 1
                return True
        self._flush_outbox()
        if self._send_now(address, frames):
            self.stats.sent += 1
            return True
        return False

    def connect(self, address: str) -> None:
        """Open the DEALER to ``address`` now (a no-op if it is open): raises
        :class:`SideChannelError` naming the reason when it cannot be (a malformed
        address, ZMQ out of sockets, the channel closed), where ``send`` would only
        count the message dropped."""
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

    def _dealer(self, address: str) -> zmq.Socket:
        sock = self._dealers.get(address)
        if sock is None:
            host, port = split_address(address)
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, self._sndhwm)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
            sock.setsockopt(zmq.ROUTING_ID, self._identity)
            sock.setsockopt(zmq.MAXMSGSIZE, self._router.getsockopt(zmq.MAXMSGSIZE))
            if self._curve is not None:
                make_client(sock, self._curve)
            if self._keepalive is not None:
                idle, interval, count = self._keepalive
                sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
                sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, idle)
                sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, interval)
                sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, count)
            self._set_heartbeat(sock)
            try:
                self._links.attach(sock, address)
            except zmq.ZMQError:
                sock.close(linger=0)
                raise
            try:
                sock.connect(f"tcp://{host}:{port}")
            except zmq.ZMQError:
                self._links.detach(sock, address, forget=True)
                sock.close(linger=0)
                raise
            self._dealers[address] = sock
        return sock

    def _set_heartbeat(self, sock: zmq.Socket) -> None:
        if self._heartbeat is not None:
            interval_ms, timeout_ms = self._heartbeat
            sock.setsockopt(zmq.HEARTBEAT_IVL, interval_ms)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
            sock.setsockopt(zmq.HEARTBEAT_TTL, timeout_ms)  # the peer's side, too

    # -- link watch -------------------------------------------------------------------

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

    def _send_now(self, address: str, frames: list[bytes]) -> bool:
        try:
            sock = self._dealer(address)
        except (zmq.ZMQError, ValueError) as e:
            self.stats.dropped("connect_failed")
            self._log_limited("connect_failed", "side channel %s cannot open a connection to "
                              "%r (%s so far): %s", self.address, address[:80],
                              self.stats.send_dropped_by_reason["connect_failed"], e)
            return False
        try:
            if self.auth is not None:  # signed as it goes out: counters follow wire order
                stream = self._streams.get(address)
                if stream is None:
                    stream = self._streams[address] = (os.urandom(8), itertools.count(1))
                frames = [frames[0], self.auth.seal(self._identity, stream[0],
                                                    next(stream[1]), frames[0])]
            sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:  # the destination's queue (sndhwm) is full
            self.stats.dropped("queue_full")
            return False
        except zmq.ZMQError as e:
            self.stats.dropped("send_failed")
            self._log_limited("send_failed", "side channel %s could not send to %r: %s",
                              self.address, address[:80], e)
            return False
        return True

    def _log_limited(self, key: str, msg: str, *args: object) -> None:
        """log.error at most once per ``key`` per 10 s: a flood must not fill the log."""
        now = time.monotonic()
        if now - self._last_log.get(key, -1e9) < 10.0:
            return
        self._last_log[key] = now
        log.error(msg, *args)

    def _flush_outbox(self) -> None:
        now = time.monotonic()
        while self._outbox and self._outbox[0][0] <= now:
            _, _, address, frames = heapq.heappop(self._outbox)
            self._send_now(address, frames)  # counted as sent at send()

    # -- receiving --------------------------------------------------------------------

    def recv(self, timeout_ms: int) -> list[tuple[str, bytes]]:
        """Everything that has arrived, as (sender address, payload) pairs.

        Returns as soon as at least one message is there, when :meth:`wake` is called
        (possibly with nothing), or after ``timeout_ms`` with nothing. Waits in the
        kernel; also sends delayed messages that have come due.
        """
        if self._closed:
            return []
        deadline = time.monotonic() + max(0, timeout_ms) / 1000.0
        drops0 = self._links.drops
        if self._links.active:
            self._links.pump()
        while True:
            self._take_refusals()
            self._flush_outbox()
            out = self._drain()
            self.stats.link_drops = self._links.drops
            if out or self._links.drops != drops0:  # a drop: the owner acts on it
                return out
            now = time.monotonic()
            wait = deadline - now
            if wait <= 0:
                return []
            if self._outbox:
                wait = min(wait, max(0.0, self._outbox[0][0] - now))
            events = dict(self._poller.poll(max(1, int(wait * 1000 + 0.999))))
            if any(self._links.owns(sock) for sock in events):
                self._links.pump()
            if self._router_mon is not None and self._router_mon in events:
                self._pump_router_monitor()
            if self._wake_r in events:
                self._clear_wake()
                self._flush_outbox()
                return self._drain()

    def fileno(self) -> int | None:
        """The ROUTER's ZMQ notification fd, for an owner that runs its own ``select``.

        It is *edge-triggered*: it only says "look". Check :meth:`pending` before
        waiting on it, and drain with ``recv(0)`` after it fires. None once closed.
        """
        return None if self._closed else int(self._router.getsockopt(zmq.FD))

    def pending(self) -> bool:
        """Whether a message is ready to be received now (without waiting)."""
        return not self._closed and bool(self._router.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def timeout_hint(self) -> float | None:
        """Seconds until a delayed (fault-injected) message is due to go out, else None.

        An owner that waits with its own ``select`` should wait no longer than this,
        then call ``send`` or ``recv`` so the outbox is flushed.
        """
        if not self._outbox:
            return None
        return max(0.0, self._outbox[0][0] - time.monotonic())

    def wake(self) -> None:
        """Make a waiting (or the next) ``recv`` return early. Safe from any thread."""
        if self._closed:
            return
        with contextlib.suppress(BlockingIOError, OSError):  # full: a wake is pending
            os.write(self._wake_w, b"\0")

    def _clear_wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._wake_r, 4096):
                pass

    def _take_refusals(self) -> None:
        """Count and log the handshakes our DEALERs had refused (CURVE mismatches)."""
        if not self._links.refusals:
            return
        refusals, self._links.refusals = self._links.refusals, []
        for address, reason in refusals:
            if self.auth is not None:
                self._reject(address.encode(), reason)
            else:
                self._log_limited("handshake_refused", "side channel %s: %r refused our "
                                  "connection's handshake: it has a side-channel secret "
                                  "and this instance has none", self.address, address[:80])

    def _pump_router_monitor(self) -> None:
        """Count and log the handshakes our ROUTER refused (peers without our secret)."""
        assert self._router_mon is not None
        while True:
            try:
                frames = self._router_mon.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) == 2 and len(frames[0]) == 6:
                event, value = struct.unpack("=HI", frames[0])
                self._reject(b"(a connection)", handshake_reason(event, value, server=True))

    def _drain(self) -> list[tuple[str, bytes]]:
        out: list[tuple[str, bytes]] = []
        if self._router_mon is not None:
            self._pump_router_monitor()
        for _ in range(MAX_BATCH):  # refused frames count too: a flood cannot hold us here
            try:
                frames = self._router.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) not in (2, 3):
                self.stats.malformed += 1
                continue
            sender, payload = frames[0], frames[1]
            if self.auth is not None:
                reason = self.auth.check(sender, payload, frames[2] if len(frames) == 3
                                         else None)
                if reason is not None:
                    self._reject(sender, reason)
                    continue
            try:
                out.append((sender.decode(), payload))
            except UnicodeDecodeError:
                self.stats.malformed += 1
                continue
        self.stats.received += len(out)
        return out

    def _reject(self, sender: bytes, reason: str) -> None:
        self.stats.rejected += 1
        self.stats.rejected_by_reason[reason] += 1
        now = time.monotonic()
        if now - self._last_log.get(reason, -1e9) < 10.0:
            return  # at most one line per reason per 10 s: a flood must not fill the log
        self._last_log[reason] = now
        who = sender[:80].decode("ascii", "replace")
        log.error("side channel %s rejected a message from %r (%s so far): %s",
                  self.address, who, self.stats.rejected_by_reason[reason],
                  REJECT_HINTS[reason])

    # -- lifetime ---------------------------------------------------------------------

    def close(self, linger_ms: int = 0) -> None:
        """Close every socket (delayed messages are discarded; pending ones too, unless
        ``linger_ms``: then ZMQ has that long to send them). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._outbox.clear()
        for address in list(self._dealers):
            if linger_ms > 0:
                self._dealers[address].setsockopt(zmq.LINGER, linger_ms)
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


def _is_loopback(host: str) -> bool:
    from kvpush.cli_types import is_loopback

    return is_loopback(host)
