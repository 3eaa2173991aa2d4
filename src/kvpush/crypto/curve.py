"""ZMQ CURVE for the cluster's sockets, with keys derived from the cluster secret.

A side channel (and the KV-event publisher) with a cluster secret runs ZMQ's CURVE
mechanism: its ROUTER (or PUB) is a CURVE server, every DEALER (or SUB) a CURVE client,
and a ZAP handler (pyzmq's :class:`zmq.auth.thread.ThreadAuthenticator`) admits only
the client key of the cluster. Both key pairs come from the secret alone
(:func:`derive_curve_keys`: HMAC-SHA256 of a label, used as a Curve25519 secret key, its
public key from ``zmq.curve_public``), so every member derives the same ones and no key
file is distributed. Who does not hold the secret cannot finish a handshake: nothing it
sends reaches the socket, let alone Python, and it can take no routing id over (ZMQ's
``ROUTER_HANDOVER`` acts only between authenticated connections). Every message is also
encrypted on the wire.

Every CURVE server (:func:`make_server`: the request planes, the side channels, the
KV-event publishers) drops a connection that has not finished its handshake within
:data:`HANDSHAKE_IVL_MS` (ZMQ's default: 30 s). ZMQ has no cap on a socket's
connections, so the bound on those of non-members is the process's fd limit (``kvpush
serve`` raises its soft limit to the hard one, kvpush.procs.raise_fd_limit) over the
handshake interval: idle connections that fill it are gone within the interval, and
new ones (a front's) are accepted again.

Refused handshakes are visible: :func:`handshake_reason` maps a socket monitor's
``HANDSHAKE_FAILED_*`` event to the side channel's reject reasons (``unsigned``: the
peer speaks without CURVE, i.e. has no secret; ``bad_signature``: a different secret;
``malformed``: anything else). A client learns less: ZMQ (4.3.5) reports a server
that refused its key and a port where no ZMQ socket listens (accepts, then closes) alike,
as a handshake broken off without detail: ``closed_in_handshake``, "not a kvpush side
channel at that address, or one without our cluster secret", never a secret mismatch.
One refused connection may count twice (its refusal, then the broken connection).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

import zmq
from zmq.utils import z85

#: the label the request planes' keys are derived under (the side channel's: the default)
REQUEST_PLANE_PURPOSE = b"request plane"

#: the ZAP domain of kvpush's CURVE servers
ZAP_DOMAIN = b"kvpush"

#: how long a CURVE server keeps a connection that has not finished its handshake (a
#: member's takes milliseconds; ZAP's thread may wait for the GIL of a busy process)
HANDSHAKE_IVL_MS = 3000

#: monitor events of a refused handshake: the protocol's (a mechanism mismatch, a key
#: that does not decrypt), ZAP's, and a connection that broke off in the handshake (the
#: other side refused it, or is no ZMQ socket, and closed; ``closed_in_handshake``)
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


@dataclass(frozen=True, repr=False)
class CurveKeys:
    """The cluster's two CURVE key pairs (z85), derived from its secret."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    def __repr__(self) -> str:  # never show a key
        return "CurveKeys(...)"


def _keypair(secret: bytes, label: bytes) -> tuple[bytes, bytes]:
    raw = hmac.new(secret, b"kvpush curve v1 " + label, hashlib.sha256).digest()
    secret_z85 = z85.encode(raw)
    return zmq.curve_public(secret_z85), secret_z85


def derive_curve_keys(secret: bytes, purpose: bytes = b"side channel") -> CurveKeys:
    """Both key pairs of ``purpose`` (the side channel, the KV events) from the secret."""
    if not secret:
        raise ValueError("empty cluster secret")
    sp, ss = _keypair(secret, purpose + b" server")
    cp, cs = _keypair(secret, purpose + b" client")
    return CurveKeys(sp, ss, cp, cs)


def make_server(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make ``sock`` a CURVE server (before it binds)."""
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)


def make_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make ``sock`` a CURVE client of the cluster's servers (before it connects)."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)


class _MemberKey:
    """ZAP credentials provider: only the cluster's client key is a member."""

    def __init__(self, client_public: bytes) -> None:
        self._key = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self._key)


class ZapGuard:
    """The ZAP handler of one ZMQ context: admits the cluster's client key, nothing else.

    Start it before a CURVE server of that context binds; ``stop`` before the context
    terminates. One background thread (pyzmq's), idle but for handshakes.
    """

    def __init__(self, ctx: zmq.Context, keys: CurveKeys) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        self._auth = ThreadAuthenticator(ctx)
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN.decode(), _MemberKey(keys.client_public))

    def stop(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


def handshake_reason(event: int, value: int, server: bool = False) -> str:
    """The reject reason of a ``HANDSHAKE_FAILED_*`` monitor event (see module docs).
    ``server``: seen by our CURVE server. A client that broke the handshake off there
    saw the mechanism mismatch first (a wrong key is the server's to detect: it reports
    it as cryptographic), so it has no secret: ``unsigned``. A client's: the far end
    closed its connection, whatever it is (``closed_in_handshake``)."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return "unsigned" if server else "closed_in_handshake"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return "unsigned"
        if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            return "bad_signature"
        return "malformed"
    return "bad_signature"  # EVENT_HANDSHAKE_FAILED_AUTH: ZAP refused the key
