"""Membership: what an instance shows a router to be let in (docs/SECURITY.md).

Two keys are derived from the cluster secret for it, each for one use:

- **The card key** signs an instance's card in etcd (``card_mac``): a router drops a
  card whose signature does not verify before it connects to anything the card names.
- **The proof key** answers a router's challenge (``proof_mac``): the router sends a
  fresh random nonce and the URL it reaches the instance at (``POST /kv/prove``); the
  instance answers its engine id, role and side-channel address with a MAC over all of
  them. The router checks it against the identity it is about to use, and only then
  sends the instance an API key, a prompt or a grant.

The MAC binds the URL, so a server that relays the challenge to a real instance gains
nothing: the instance answers only for a URL of its own (kvpush.server.prove), and a
proof for one URL does not admit another.

Routers hold both keys (``RouterKeys``) so as to check; neither lets anyone join the side
channel or sign grants.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets

_PROOF_LABEL = b"kvpush membership proof v1"
_CARD_LABEL = b"kvpush membership card v1"
_MEMBER_VIEW_LABEL = b"kvpush member view v1"
#: bytes of randomness in a challenge
NONCE_BYTES = 32


def proof_key(secret: bytes) -> bytes:
    """The key instances answer challenges with, derived from the cluster secret."""
    return hmac.new(secret, _PROOF_LABEL, hashlib.sha256).digest()


def card_key(secret: bytes) -> bytes:
    """The key instances sign their cards with, derived from the cluster secret."""
    return hmac.new(secret, _CARD_LABEL, hashlib.sha256).digest()


def member_view_token(secret: bytes) -> str:
    """The token that opens an instance's member views (kvpush.server.member_view) to a
    member: the router sends it with its calls to proven instances."""
    return hmac.new(secret, _MEMBER_VIEW_LABEL, hashlib.sha256).hexdigest()


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def is_nonce(value: object) -> bool:
    return (isinstance(value, str) and len(value) == 2 * NONCE_BYTES
            and all(c in "0123456789abcdef" for c in value))


def proof_mac(key: bytes, *, nonce: str, url: str, engine_id: str, role: str,
              side_channel: str | None) -> str:
    """The answer to the challenge ``nonce`` of an instance reached at ``url``."""
    msg = json.dumps(["kvpush-proof", nonce, url, engine_id, role, side_channel],
                     separators=(",", ":"), ensure_ascii=True).encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def proof_holds(key: bytes, mac: object, *, nonce: str, url: str, engine_id: str,
                role: str, side_channel: str | None) -> bool:
    """Whether ``mac`` answers the challenge for exactly this identity."""
    want = proof_mac(key, nonce=nonce, url=url, engine_id=engine_id, role=role,
                     side_channel=side_channel)
    return isinstance(mac, str) and hmac.compare_digest(mac, want)


def card_mac(key: bytes, payload: bytes) -> str:
    """The signature of a card's canonical bytes (kvpush.discovery.card)."""
    return hmac.new(key, b"kvpush-card\0" + payload, hashlib.sha256).hexdigest()


def card_mac_holds(key: bytes, payload: bytes, mac: object) -> bool:
    return isinstance(mac, str) and hmac.compare_digest(mac, card_mac(key, payload))
