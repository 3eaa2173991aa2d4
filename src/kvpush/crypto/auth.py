"""Authentication of the cluster's members: who may move whose KV.

Three keys are derived from the one cluster secret, each for one use:

- **Grants** (``ParamsSigner``): the router's signature on ``kv_transfer_params``.
- **Channel messages** (``ChannelAuth``): an HMAC frame on every side-channel message.
- **The router's share** (``RouterKeys``): the grant key and the KV-event keys, and
  nothing that lets the router join the side channel.

docs/SECURITY.md has the threat model.

Grants
------
Signed ``kv_transfer_params``: the cluster's capability to move one request's KV.

``kv_transfer_params`` name blocks, peers and transfer ids: whoever can hand an instance
a set of them can make decode READ another request's blocks or store foreign KV under a
prompt's hashes. So they are the router's to issue, not a client's. The router signs
every set it sends to an instance (``ParamsSigner.sign``) with a key derived from the
cluster secret (the side-channel secret every instance already holds); an instance with
that secret acts on a set only when its signature verifies, it names this instance (its
role and engine id) and it has not expired (``ParamsSigner.verify``). Anything else is a
403 with an OpenAI-style body.

What a signed set carries, besides vLLM's fields::

    "kvpush_grant": {"role": "decode", "engine_id": "decode-1a2b",
                     "peer_engine_id": "prefill-3c4d", "expires_ms": 1764...},
    "kvpush_signature": "<hex HMAC-SHA256 over the canonical JSON of the rest>"

The MAC covers every other field, so block ids, addresses, the transfer id and (pull)
the prompt's hash chain from prefill's answer cannot be changed or added to. Clocks of
the router and the instances must agree within the grant's lifetime (60 s by default),
as they must for the side channel's signed messages.

Channel messages
----------------
Every message of an authenticating ``SideChannel`` carries a second ZMQ frame made here:
an HMAC-SHA256 over the sender's address, a per-connection stream id, a counter, a
timestamp and the payload. The receiving channel asks :meth:`ChannelAuth.check` before
anything decodes the payload; the reason of a refusal (``REJECT_REASONS``) is counted
and logged with what it most likely means (``REJECT_HINTS``).

The router's share
------------------
The router signs grants (``kv_transfer_params``, ``/kv/abort``) and follows members-only
KV events; it needs nothing else of the secret. So it keeps only the keys derived for
those two uses (``router.config.RouterKeys``): the grant key and the event keys.
Neither lets anyone join the side channel (CURVE keys and message MACs come from the
secret by other derivations), so a compromised router is not a side-channel member.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvpush.errors import RequestError

GRANT_KEY = "kvpush_grant"
SIGNATURE_KEY = "kvpush_signature"
#: How long a signed set is valid after the router issued it. An instance checks it
#: when the request arrives (before any queueing), so this only has to cover the HTTP
#: hop and clock differences between hosts.
DEFAULT_TTL_S = 60.0
#: A grant whose expiry lies further ahead than this was not issued by a router of
#: this cluster's configuration (or clocks differ by more than a minute).
MAX_AHEAD_MS = int((DEFAULT_TTL_S + 60.0) * 1000)
_KEY_LABEL = b"kvpush kv_transfer_params v1"


class ParamsForbidden(RequestError):
    """``kv_transfer_params`` the instance must not act on: HTTP 403."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message, param, code, status_code=403)


@dataclass(frozen=True)
class Grant:
    """What the router vouched for: the instance a set is for and the peer it names."""

    role: str
    engine_id: str
    peer_engine_id: str | None
    expires_ms: int


def canonical(params: Mapping[str, Any]) -> bytes:
    """The bytes the signature covers: every field but the signature, as JSON with
    sorted keys and no whitespace (so any JSON round trip keeps them equal)."""
    body = {k: v for k, v in params.items() if k != SIGNATURE_KEY}
    try:
        return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                          allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise RequestError(f"kv_transfer_params cannot be encoded: {e}",
                           "kv_transfer_params") from None


def grant_key(secret: bytes) -> bytes:
    """The key grants are signed with, derived from the cluster secret."""
    return hmac.new(secret, _KEY_LABEL, hashlib.sha256).digest()


class ParamsSigner:
    """Signs (router) and verifies (instances) ``kv_transfer_params`` with a key derived
    from the cluster secret; the secret itself never leaves this object."""

    def __init__(self, secret: bytes, ttl_s: float = DEFAULT_TTL_S) -> None:
        self._key = grant_key(secret)
        self.ttl_ms = int(ttl_s * 1000)

    @classmethod
    def from_key(cls, key: bytes, ttl_s: float = DEFAULT_TTL_S) -> ParamsSigner:
        """A signer from the derived grant key alone (the router's: ``RouterKeys`` below)."""
        signer = cls.__new__(cls)
        signer._key = key
        signer.ttl_ms = int(ttl_s * 1000)
        return signer

    def __repr__(self) -> str:
        return f"ParamsSigner(ttl_ms={self.ttl_ms})"

    def _mac(self, params: Mapping[str, Any]) -> str:
        return hmac.new(self._key, canonical(params), hashlib.sha256).hexdigest()

    def sign(self, params: Mapping[str, Any], *, role: str, engine_id: str,
             peer_engine_id: str | None = None, now_ms: int | None = None) -> dict[str, Any]:
        """``params`` for the instance ``engine_id`` of ``role``, with a grant and its
        signature (any grant or signature ``params`` had is replaced)."""
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        out = {k: v for k, v in params.items() if k not in (GRANT_KEY, SIGNATURE_KEY)}
        out[GRANT_KEY] = {"role": role, "engine_id": engine_id,
                          "peer_engine_id": peer_engine_id,
                          "expires_ms": now_ms + self.ttl_ms}
        out[SIGNATURE_KEY] = self._mac(out)
        return out

    def verify(self, params: Mapping[str, Any], *, role: str, engine_id: str,
               now_ms: int | None = None) -> Grant:
        """The grant of a set this instance may act on; ParamsForbidden otherwise."""
        sig = params.get(SIGNATURE_KEY)
        if sig is None:
            raise ParamsForbidden(
                "kv_transfer_params are issued by the cluster's router and must carry its "
                "signature; this instance does not act on a client's own",
                "kv_transfer_params", "kv_transfer_params_unsigned")
        if not isinstance(sig, str) or not hmac.compare_digest(sig, self._mac(params)):
            raise ParamsForbidden(
                "the signature of kv_transfer_params does not verify (another cluster's "
                "secret, or altered params)", "kv_transfer_params",
                "kv_transfer_params_bad_signature")
        g = params.get(GRANT_KEY)
        grant = _grant(g)
        if grant.role != role or grant.engine_id != engine_id:
            raise ParamsForbidden(
                f"kv_transfer_params were issued for the {grant.role} instance "
                f"{grant.engine_id!r}, not for this one", "kv_transfer_params",
                "kv_transfer_params_wrong_instance")
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        if now_ms > grant.expires_ms:
            raise ParamsForbidden(
                f"kv_transfer_params expired {(now_ms - grant.expires_ms) / 1000:.1f} s ago "
                "(do the router's and this host's clocks agree?)", "kv_transfer_params",
                "kv_transfer_params_expired")
        if grant.expires_ms - now_ms > MAX_AHEAD_MS:
            raise ParamsForbidden(
                "kv_transfer_params expire too far ahead (do the router's and this host's "
                "clocks agree?)", "kv_transfer_params", "kv_transfer_params_expired")
        return grant


def _grant(g: object) -> Grant:
    """A signed grant's fields (the router wrote them, so a bad shape is a bug there)."""
    if not isinstance(g, dict):
        raise ParamsForbidden("signed kv_transfer_params carry no grant",
                              "kv_transfer_params", "kv_transfer_params_bad_signature")
    role, engine_id, peer, exp = (g.get("role"), g.get("engine_id"),
                                  g.get("peer_engine_id"), g.get("expires_ms"))
    if not (isinstance(role, str) and isinstance(engine_id, str)
            and (peer is None or isinstance(peer, str))
            and isinstance(exp, int) and not isinstance(exp, bool)):
        raise ParamsForbidden("the grant of kv_transfer_params is malformed",
                              "kv_transfer_params", "kv_transfer_params_bad_signature")
    return Grant(role, engine_id, peer, exp)


#: Why an authenticating channel refused a message (``stats.rejected_by_reason`` keys).
#: ``closed_in_handshake``: our own connection's, the far end closed it in the handshake.
REJECT_REASONS = ("unsigned", "bad_signature", "replayed", "stale", "malformed",
                  "closed_in_handshake")

_NOT_OURS = "not a kvpush side channel at that address, or one without our cluster secret"
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
    "closed_in_handshake": "the far end closed the connection during the CURVE "
                           f"handshake: {_NOT_OURS}",
}


def outgoing_refusal(address: str, reason: str, count: int | None) -> str:
    """What a side channel logs (after its own address) when the handshake of its
    connection to ``address`` failed; ``count``: so far (None: it has no secret)."""
    if count is None:  # our DEALER speaks without CURVE
        why = ("the peer has a side-channel secret and this instance has none"
               if reason == "unsigned" else "not a kvpush side channel at that address, "
               "or one with a side-channel secret (this instance has none)")
        return f"our connection to {address!r} failed in the handshake: {why}"
    if reason == "closed_in_handshake":
        return (f"our connection to {address!r} was closed during the handshake ({count} "
                f"so far): {_NOT_OURS}")
    return (f"our connection to {address!r} was refused in the handshake ({count} so "
            f"far): {REJECT_HINTS[reason]}")


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
