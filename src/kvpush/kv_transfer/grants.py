"""Signed ``kv_transfer_params``: the cluster's capability to move one request's KV.

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
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpush.engine.outputs import RequestError

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
        """A signer from the derived grant key alone (the router's: router_keys.py)."""
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
