"""Operator views behind their own key, on the router and on every instance.

``/metrics`` (per-request cached-token counts among its figures: +512 for a probe whose
prompt another user had cached, +0 for a fresh one) and the router's
``/router/instances`` (instances, their cache sizes and load) tell whoever reads them
what others asked. So an API key never opens them:

* with ``--admin-key`` (or ``$KVPUSH_ADMIN_KEY``) they need ``Authorization: Bearer
  <admin key>`` (Prometheus: ``authorization: {credentials: <admin key>}``);
* with an API key and no admin key they are closed (403 ``operator_view_closed``,
  saying to set ``--admin-key``);
* with neither key (a trusted network) they are open, like everything else.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from starlette.types import ASGIApp, Receive, Scope, Send

from kvpush.server.auth import OPEN_PATHS, APIKeyMiddleware, check_bearer, unauthorized_body

#: an instance's operator views (the router adds /router/instances)
ADMIN_PATHS = frozenset({"/metrics"})
ADMIN_KEY_ENV = "KVPUSH_ADMIN_KEY"
ADMIN_KEY_HELP = ("the key of the operator views (/metrics; the router's /router/instances "
                  "too), which show what other users' requests found cached: an API key "
                  "never opens them; with an API key and no admin key they are closed "
                  "(default: $KVPUSH_ADMIN_KEY). Prefer the environment variable")


def resolve_admin_key(flag: str | None, env: Mapping[str, str] | None = None) -> str | None:
    """``--admin-key`` or else ``$KVPUSH_ADMIN_KEY``, stripped like the API key (a
    bearer token is compared stripped, so a trailing newline could never match; empty:
    none)."""
    environ: Mapping[str, str] = os.environ if env is None else env
    value = flag if flag is not None else environ.get(ADMIN_KEY_ENV, "")
    return value.strip() or None


class AdminKeyMiddleware:
    """Refuse the operator views without the admin key (401, OpenAI's error shape), or
    always when ``key`` is None (403: an API key is set but no admin key)."""

    def __init__(self, app: ASGIApp, key: str | None, paths: frozenset[str] = ADMIN_PATHS,
                 on_reject=None) -> None:
        self.app = app
        self.key = key.encode() if key is not None else None
        self.paths = paths
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") not in self.paths:
            await self.app(scope, receive, send)
            return
        path = scope.get("path")
        if self.key is None:
            status, code, reason = 403, "operator_view_closed", "admin_closed"
            message = (f"{path} is an operator view: API keys do not open it; start the "
                       "server with --admin-key (or $KVPUSH_ADMIN_KEY) and send that key")
        else:
            header = next((v for n, v in scope.get("headers", ()) if n == b"authorization"),
                          None)
            bad = check_bearer(header, self.key)
            if bad is None:
                await self.app(scope, receive, send)
                return
            status, code, reason = 401, "invalid_admin_key", f"admin_{bad}"
            message = (f"{path} is an operator view: send the admin key "
                       "('Authorization: Bearer <admin key>')")
        if self.on_reject is not None:
            self.on_reject(reason)
        body = unauthorized_body(message)
        body["error"]["code"] = code
        data = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(data)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b'Bearer realm="kvpush-admin"'))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})


def protect(app, api_key: str | None, admin_key: str | None,
            paths: frozenset[str] = ADMIN_PATHS, on_reject=None,
            member_paths: frozenset[str] = frozenset()) -> None:
    """Put ``app``'s API key (every path but /health, the operator views and the member
    views, which have their own checks: kvpush.server.member_view) and its operator
    views' key in place (see the module)."""
    if api_key:
        app.add_middleware(APIKeyMiddleware, key=api_key, on_reject=on_reject,
                           open_paths=OPEN_PATHS | paths | member_paths)
    if api_key or admin_key:
        app.add_middleware(AdminKeyMiddleware, key=admin_key, paths=paths,
                           on_reject=on_reject)
