"""``POST /kv/prove``: an instance shows a router that it holds the cluster secret.

The router sends ``{"nonce": <64 hex>, "url": <the URL it reaches us at>}``, without its
API key (it sends no key before the proof). We answer our engine id, role and side
channel with a MAC keyed from the secret over all of them, the nonce and the URL
(kvpush.crypto.membership), but only for a URL of our own: ``--advertise-url``, or one
whose port is the port the request came in on and whose host is the IP address it came
in on (or ``localhost`` for a loopback one). No host name is resolved: a caller would
choose what we look up. So a server that relays a router's challenge to us gets no
proof for its own URL. Refusals are logged at a bounded rate. Without a secret we cannot
prove: 404, as where there is no such endpoint (vLLM), and routers admit us only from
their own command line.
"""

from __future__ import annotations

import ipaddress
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

from kvpush.crypto.membership import is_nonce, proof_key, proof_mac
from kvpush.kv_info import KVInfo
from kvpush.ratelog import LogBudget

logger = logging.getLogger("kvpush.server")

PROVE_PATH = "/kv/prove"
#: the largest challenge body read
MAX_CHALLENGE_BYTES = 1024


class ProveError(Exception):
    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def _split(url: str) -> tuple[str, str, int] | None:
    try:
        u = urlsplit(url)
        port = u.port
    except ValueError:
        return None
    if u.scheme not in ("http", "https") or not u.hostname or port is None:
        return None
    return u.scheme, u.hostname, port


class Prover:
    """Answers challenges with the proof key of ``secret``."""

    def __init__(self, secret: bytes, advertise_url: str | None = None) -> None:
        self._key = proof_key(secret)
        self.advertise_url = advertise_url.rstrip("/") if advertise_url else None
        self._refusals = LogBudget(logger, per_s=1.0, burst=5)

    def __repr__(self) -> str:  # never show the key
        return f"Prover(advertise_url={self.advertise_url!r})"

    def owns(self, url: str, local: tuple[str, int] | None) -> bool:
        """Whether ``url`` reaches this server: the advertised URL, or the IP address
        (``localhost``: a loopback one) and port a request came in on (``local``, the
        ASGI scope's ``server``); never a name to resolve."""
        if self.advertise_url is not None and url == self.advertise_url:
            return True
        parts = _split(url)
        if parts is None or local is None:
            return False
        _, host, port = parts
        local_host, local_port = local
        if port != local_port:
            return False
        try:
            here = ipaddress.ip_address(local_host)
        except ValueError:
            return False
        if host == "localhost":
            return here.is_loopback
        try:
            return ipaddress.ip_address(host) == here
        except ValueError:  # a name: not looked up
            return False

    async def answer(self, body: bytes, local: tuple[str, int] | None,
                     kv_info: Callable[[], Awaitable[KVInfo]]) -> dict[str, Any]:
        """The proof for the challenge ``body``; ProveError when there is none to give."""
        if len(body) > MAX_CHALLENGE_BYTES:
            raise ProveError("challenge too large", 413)
        try:
            challenge = json.loads(body)
        except ValueError:
            raise ProveError("the challenge is not JSON", 400) from None
        if not isinstance(challenge, dict):
            raise ProveError("the challenge is not a JSON object", 400)
        nonce, url = challenge.get("nonce"), challenge.get("url")
        if not is_nonce(nonce) or not isinstance(url, str) or len(url) > 512:
            raise ProveError("a challenge is {\"nonce\": <64 lowercase hex>, \"url\": <str>}",
                             400)
        if not self.owns(url, local):
            self._refusals.log(logging.WARNING, "refused to prove membership for %r: not "
                               "an IP URL of this instance (a relayed challenge, or set "
                               "--advertise-url to the URL routers reach it at)", url)
            raise ProveError("not an IP URL of this instance (set --advertise-url to the "
                             "URL routers reach it at)", 403)
        info = await kv_info()
        engine_id, role, side_channel = info.engine_id, info.role, info.side_channel
        return {"url": url, "engine_id": engine_id, "role": role,
                "side_channel": side_channel,
                "mac": proof_mac(self._key, nonce=str(nonce), url=url, engine_id=engine_id,
                                 role=role, side_channel=side_channel)}
