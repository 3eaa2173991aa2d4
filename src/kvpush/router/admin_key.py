"""The router's operator views behind their own key (issue 40, finding 4).

``/router/instances`` (instances, their cache sizes and load) and ``/metrics``
(per-request cached-token counts among them: +512 for a probe whose prompt another
user had cached, +0 for a fresh one) tell whoever reads them what others asked. With
``kvpush router --admin-key`` (or ``$KVPUSH_ADMIN_KEY``) they need
``Authorization: Bearer <admin key>``, and the API key no longer opens them; clients
keep the API key. Without an admin key they stay behind the API key, as before.
"""

from __future__ import annotations

import json
import os

from starlette.types import ASGIApp, Receive, Scope, Send

from kvpush.server.auth import check_bearer, unauthorized_body

#: the operator views
ADMIN_PATHS = frozenset({"/router/instances", "/metrics"})
ADMIN_KEY_ENV = "KVPUSH_ADMIN_KEY"


def resolve_admin_key(flag: str | None, env: dict[str, str] | None = None) -> str | None:
    """``--admin-key`` or else ``$KVPUSH_ADMIN_KEY``, stripped like the API key (a
    bearer token is compared stripped, so a trailing newline could never match; empty:
    none)."""
    env = os.environ if env is None else env
    value = flag if flag is not None else env.get(ADMIN_KEY_ENV, "")
    return value.strip() or None


class AdminKeyMiddleware:
    """Refuse the operator views without the admin key (401, OpenAI's error shape)."""

    def __init__(self, app: ASGIApp, key: str, paths: frozenset[str] = ADMIN_PATHS,
                 on_reject=None) -> None:
        self.app = app
        self.key = key.encode()
        self.paths = paths
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") not in self.paths:
            await self.app(scope, receive, send)
            return
        header = next((v for n, v in scope.get("headers", ()) if n == b"authorization"), None)
        reason = check_bearer(header, self.key)
        if reason is None:
            await self.app(scope, receive, send)
            return
        if self.on_reject is not None:
            self.on_reject(f"admin_{reason}")
        body = unauthorized_body(f"{scope.get('path')} is an operator view: send the admin "
                                 "key ('Authorization: Bearer <admin key>')")
        body["error"]["code"] = "invalid_admin_key"
        data = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(data)).encode()),
            (b"www-authenticate", b'Bearer realm="kvpush-admin"'),
        ]})
        await send({"type": "http.response.body", "body": data})
