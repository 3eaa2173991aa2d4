"""SideChannel: the ZMQ messaging endpoint between kvpush instances (bytes in, bytes out).

Each instance binds one ROUTER at ``tcp://host:port`` (its side-channel *address* is
``"host:port"``) and sends through one DEALER per destination address, created on
first use and cached. A DEALER's routing id is our own address, so every received
message comes with the sender's address: ``recv`` returns ``(sender, payload)``
pairs, and a reply is ``send(sender, ...)``.

Sending never blocks: DEALERs use ``linger=0``, a send high-water mark
(``sndhwm`` messages queued per destination, including while it is still connecting)
and ``zmq.NOBLOCK``. To a peer that is gone (or never existed) at most ``sndhwm``
messages queue up; the rest are dropped and counted in ``stats.send_dropped``.
:meth:`SideChannel.forget` closes a destination and discards what was queued for it.

Receiving waits in ``zmq.Poller`` (in the kernel, no CPU) for at most ``timeout_ms``;
:meth:`SideChannel.wake` (thread-safe, a byte on a pipe) makes a waiting ``recv``
return early, so other threads can hand the owning thread work. An owner with its
own ``select`` loop can use :meth:`SideChannel.fileno` / :meth:`SideChannel.pending`
instead.

**Threading:** apart from :meth:`wake`, an instance is used from ONE thread (the
instance's transfer thread): ZMQ sockets are not thread-safe.

Faults (a shared :class:`~kvpush.kv_transfer.faults.FaultPlan`) act on send: a
dropped message is silently lost (``send`` still returns True, as on a lossy
network); a delayed one is held in an outbox that ``send``/``recv`` flush when due.
Message types for ``drop_messages`` come from ``type_of(payload)``.

Signing (optional): ``signer(data) -> signature`` adds a frame; on receipt
``verifier(data, signature) -> bool`` must accept it, else the message is dropped and
counted in ``stats.rejected``. ``data`` is ``sender_address + b"\\n" + payload``, so a
signature also vouches for the sender. :func:`hmac_signer`/:func:`hmac_verifier` do
HMAC-SHA256 over a shared secret.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import hmac
import itertools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from kvpush.kv_transfer.faults import FaultPlan

Signer = Callable[[bytes], bytes]
Verifier = Callable[[bytes, bytes], bool]

MAX_BATCH = 4096  # messages returned by one recv at most


def hmac_signer(secret: bytes) -> Signer:
    """A signer computing HMAC-SHA256 over ``data`` with ``secret``."""

    def sign(data: bytes) -> bytes:
        return hmac.new(secret, data, hashlib.sha256).digest()

    return sign


def hmac_verifier(secret: bytes) -> Verifier:
    """A verifier accepting exactly the signatures of :func:`hmac_signer` (same secret)."""

    def verify(data: bytes, signature: bytes) -> bool:
        return hmac.compare_digest(hmac.new(secret, data, hashlib.sha256).digest(), signature)

    return verify


@dataclass
class SideChannelStats:
    """Counters of one channel."""

    sent: int = 0  # accepted by send() (returned True)
    send_dropped: int = 0  # refused by ZMQ: destination queue full (peer gone or slow)
    received: int = 0  # returned by recv
    rejected: int = 0  # unsigned or wrongly signed
    malformed: int = 0  # wrong number of frames


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
        signer: Signer | None = None,
        verifier: Verifier | None = None,
        sndhwm: int = 1000,
        max_message_bytes: int = 64 << 20,
    ):
        self.faults = faults
        self.type_of = type_of
        self.signer = signer
        self.verifier = verifier
        self.stats = SideChannelStats()
        self._sndhwm = sndhwm
        self._ctx = zmq.Context(io_threads=1)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted peer takes over its id
        self._router.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        try:
            self._router.bind(f"tcp://{host}:{port if port else '*'}")
        except zmq.ZMQError:
            self._router.close()
            self._ctx.term()
            raise
        endpoint = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.host = host
        self.port = int(endpoint.rsplit(":", 1)[1])
        self.address = f"{host}:{self.port}"
        self._identity = self.address.encode()
        self._dealers: dict[str, zmq.Socket] = {}
        self._outbox: list[tuple[float, int, str, list[bytes]]] = []  # heap by due time
        self._seq = itertools.count()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._closed = False

    def __repr__(self) -> str:
        return f"SideChannel({self.address})"

    # -- sending ----------------------------------------------------------------------

    def send(self, address: str, payload: bytes) -> bool:
        """Queue ``payload`` for ``address`` ("host:port"); False if it was dropped.

        Never blocks. A fault-dropped message returns True (it is lost "on the wire").
        """
        if self._closed:
            return False
        frames = [payload]
        if self.signer is not None:
            frames.append(self.signer(self._identity + b"\n" + payload))
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

    def forget(self, address: str) -> None:
        """Close the DEALER to ``address``, discarding messages still queued for it."""
        sock = self._dealers.pop(address, None)
        if sock is not None:
            sock.close(linger=0)

    def _dealer(self, address: str) -> zmq.Socket:
        sock = self._dealers.get(address)
        if sock is None:
            host, port = split_address(address)
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, self._sndhwm)
            sock.setsockopt(zmq.ROUTING_ID, self._identity)
            sock.connect(f"tcp://{host}:{port}")
            self._dealers[address] = sock
        return sock

    def _send_now(self, address: str, frames: list[bytes]) -> bool:
        try:
            self._dealer(address).send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            self.stats.send_dropped += 1
            return False
        except (zmq.ZMQError, ValueError):
            self.stats.send_dropped += 1
            return False
        return True

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
        while True:
            self._flush_outbox()
            out = self._drain()
            if out:
                return out
            now = time.monotonic()
            wait = deadline - now
            if wait <= 0:
                return []
            if self._outbox:
                wait = min(wait, max(0.0, self._outbox[0][0] - now))
            events = dict(self._poller.poll(max(1, int(wait * 1000 + 0.999))))
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

    def _drain(self) -> list[tuple[str, bytes]]:
        out: list[tuple[str, bytes]] = []
        while len(out) < MAX_BATCH:
            try:
                frames = self._router.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) not in (2, 3):
                self.stats.malformed += 1
                continue
            sender, payload = frames[0], frames[1]
            if self.verifier is not None and (
                len(frames) != 3 or not self.verifier(sender + b"\n" + payload, frames[2])
            ):
                self.stats.rejected += 1
                continue
            try:
                out.append((sender.decode(), payload))
            except UnicodeDecodeError:
                self.stats.malformed += 1
                continue
        self.stats.received += len(out)
        return out

    # -- lifetime ---------------------------------------------------------------------

    def close(self) -> None:
        """Close every socket (pending and delayed messages are discarded). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._outbox.clear()
        for sock in self._dealers.values():
            sock.close(linger=0)
        self._dealers.clear()
        self._router.close(linger=0)
        self._ctx.term()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def __enter__(self) -> SideChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
