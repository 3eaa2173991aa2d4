"""ChannelAuth: signing and checking of side-channel messages with the cluster secret.

Every message of an authenticating ``SideChannel`` carries a second ZMQ frame made here:
an HMAC-SHA256 over the sender's address, a per-connection stream id, a counter, a
timestamp and the payload. The receiving channel asks :meth:`ChannelAuth.check` before
anything decodes the payload; the reason of a refusal (``REJECT_REASONS``) is counted
and logged with what it most likely means (``REJECT_HINTS``). docs/SECURITY.md has the
threat model.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import time
from collections.abc import Callable

#: Why an authenticating channel refused a message (``stats.rejected_by_reason`` keys).
REJECT_REASONS = ("unsigned", "bad_signature", "replayed", "stale", "malformed",
                  "handshake_refused")

REJECT_HINTS = {
    "unsigned": "the peer has no side-channel secret configured while this instance has "
                "one (--kv-secret-file / KVPUSH_KV_SECRET must be set on both)",
    "bad_signature": "its signature does not verify: the peer uses a DIFFERENT side-channel "
                     "secret (or the message was forged or altered)",
    "replayed": "its counter is not above the last one seen from that sender: a replayed "
                "or duplicated message",
    "stale": "its timestamp is outside the accepted window: the two hosts' clocks differ "
             "or the message was replayed",
    "malformed": "its authentication frame is malformed",
    "handshake_refused": "the connection broke off in the CURVE handshake: the peer has "
                         "no side-channel secret or a DIFFERENT one",
}


class ChannelAuth:
    """Signs and checks side-channel messages with a shared secret (see module docs).

    The auth frame is ``MAGIC | stream (8) | counter (8) | time_ms (8) | mac (32)``;
    the MAC is HMAC-SHA256(secret, frame header | len(sender) | sender | payload).
    Each sending socket (one per destination) is its own stream with a random id and a
    counter starting at 1; ZMQ delivers one connection's messages in order, so the
    receiver accepts a stream's counters only going up. A stream it has not seen (or
    forgot) must carry a timestamp within ``window_s`` of its clock; streams idle for
    two windows are forgotten (their old messages are stale by then).
    """

    MAGIC = b"KVA1"
    HEADER = struct.Struct(">4s8sQQ")
    SIZE = HEADER.size + 32

    def __init__(self, secret: bytes, window_s: float = 60.0,
                 clock: Callable[[], float] = time.time) -> None:
        if not secret:
            raise ValueError("empty side-channel secret")
        self._secret = secret
        self.window_s = window_s
        self.clock = clock
        self._streams: dict[tuple[bytes, bytes], tuple[int, float]] = {}  # -> (last, seen)
        self._next_prune = 0.0

    def __repr__(self) -> str:  # never show the secret
        return f"ChannelAuth(window_s={self.window_s})"

    def _mac(self, header: bytes, sender: bytes, payload: bytes) -> bytes:
        h = hmac.new(self._secret, header, hashlib.sha256)
        h.update(len(sender).to_bytes(2, "big"))
        h.update(sender)
        h.update(payload)
        return h.digest()

    def seal(self, sender: bytes, stream: bytes, counter: int, payload: bytes) -> bytes:
        """The auth frame of ``payload`` sent by ``sender`` as ``counter`` on ``stream``."""
        header = self.HEADER.pack(self.MAGIC, stream, counter, int(self.clock() * 1000))
        return header + self._mac(header, sender, payload)

    def check(self, sender: bytes, payload: bytes, frame: bytes | None) -> str | None:
        """None if the message is authentic and fresh (and records it), else the reason."""
        if frame is None:
            return "unsigned"
        if len(frame) != self.SIZE or not frame.startswith(self.MAGIC) or len(sender) > 65535:
            return "malformed"
        header = frame[: self.HEADER.size]
        if not hmac.compare_digest(self._mac(header, sender, payload), frame[-32:]):
            return "bad_signature"
        _, stream, counter, ms = self.HEADER.unpack(header)
        now = self.clock()
        key = (sender, stream)
        last = self._streams.get(key)
        if last is None:
            if abs(now - ms / 1000.0) > self.window_s:
                return "stale"
        elif counter <= last[0]:
            return "replayed"
        self._streams[key] = (counter, now)
        if now >= self._next_prune:
            self._prune(now)
        return None

    def _prune(self, now: float) -> None:
        self._next_prune = now + self.window_s / 2
        # idle for two windows: anything replayed from it now is stale even if the
        # sender's clock runs up to one window ahead of ours
        old = [k for k, (_, seen) in self._streams.items()
               if now - seen > 2 * self.window_s + 1]
        for k in old:
            del self._streams[k]
