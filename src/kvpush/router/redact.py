"""Client-facing error texts name no internal host, port or engine id.

The router's own errors are written that way (they say "the decode instance", and the
router's log names it, with the request id that the client gets as ``X-Request-Id``).
Errors that come from the instances — a 4xx/5xx body, an error frame inside a stream —
are relayed with their meaning kept ("KV transfer failed: the lease ran out") but with
what would map the cluster replaced by :data:`ADDRESS` or :data:`ENGINE`: the pool's
engine ids (vLLM's are whatever the operator chose), and anything shaped like a URL, an
IP address, ``host:port``, ``port N`` or a kvpush engine id (``decode-1a2b3c4d``), which
covers peers the router does not know (a pull decode naming prefill's side channel, an
instance's old engine id). Host names alone are left: a compose service may be called
``decode``, and replacing that word would garble every message.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from kvpush.errors import RequestError

ADDRESS = "<internal address>"
ENGINE = "<engine id>"

_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s\"'<>)\],;]+"), ADDRESS),  # URLs
    (re.compile(r"\[[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*\](?::\d{1,5})?"), ADDRESS),  # [v6]:port
    (re.compile(r"\b(?:\d{1,3}\.){3}\d{1,3}(?::\d{1,5})?\b"), ADDRESS),  # v4[:port]
    (re.compile(r"(?<![\w:])(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{1,4}(?![\w:])"),
     ADDRESS),  # bare v6
    (re.compile(r"\b[a-zA-Z][\w.-]*:\d{2,5}\b"), ADDRESS),  # host:port
    (re.compile(r"\b(?:prefill|decode|both)-[0-9a-f]{8}\b"), ENGINE),  # kvpush engine ids
    (re.compile(r"(?i)\b(ports?)\b(\W{0,3})\d{1,5}\b"), r"\1\2<hidden>"),
)


def scrub(text: str, engine_ids: Iterable[str] = ()) -> str:
    """``text`` without internal addresses and engine ids; ``engine_ids``: the pool's own
    (any string an operator chose, vLLM's included; replaced as whole words, so ids
    shorter than 4 characters are left alone: they would hit ordinary words)."""
    for eid in sorted({e for e in engine_ids if len(e) >= 4}, key=len, reverse=True):
        text = re.sub(rf"(?<![\w-]){re.escape(eid)}(?![\w-])", ENGINE, text)
    for pattern, repl in _PATTERNS:
        text = pattern.sub(repl, text)
    return text


def scrub_error(obj: Any, status: int, engine_ids: Iterable[str] = ()) -> RequestError | None:
    """An instance's error answer (parsed JSON), scrubbed, with ``status``: kvpush's
    ``{"error": {...}}``, or vLLM's older flat ``{"object": "error", "message": ...}``.
    None when ``obj`` is neither (the caller words its own error)."""
    if not isinstance(obj, dict):
        return None
    err = obj["error"] if isinstance(obj.get("error"), dict) else obj
    message = err.get("message")
    if not isinstance(message, str) or not message:
        return None
    ids = list(engine_ids)

    def text(key: str) -> str | None:
        v = err.get(key)
        return scrub(v, ids) if isinstance(v, str) and v else None

    return RequestError(scrub(message, ids), text("param"), text("code"), status)
