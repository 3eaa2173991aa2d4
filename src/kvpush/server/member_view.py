"""The member views: what an instance caches, for the cluster's members and the operator.

``/kv/cache_blocks`` lists every block hash cached; its tags are keyed, but a client
need not compute them: diffed before and after its own request, the set tells whether
another tenant had sent the same prefix (0-1 new tags when it had, 40 when not). The
block counts of ``/kv/info`` (``num_free_blocks``, ``num_total_blocks``) are a coarser
form of the same. So, where any key is set, they open only to

* a member: ``X-KVPush-Member: <token>``, the token derived from the cluster secret
  (kvpush.crypto.membership.member_view_token); the router's KV index and health checks
  send it;
* the operator: ``Authorization: Bearer <admin key>``.

An API key never opens them: ``/kv/cache_blocks`` answers 403 ``member_view`` and
``/kv/info`` leaves the counts out. Without the secret only the admin key opens them.
With neither key they are open, like everything else (a trusted network).
"""

from __future__ import annotations

import hmac
import json

import msgspec
from msgspec import UNSET
from starlette.types import ASGIApp, Receive, Scope, Send

from kvpush.crypto.membership import member_view_token
from kvpush.kv_info import KVInfo
from kvpush.server.auth import check_bearer

#: the paths that are member views as a whole
MEMBER_PATHS = frozenset({"/kv/cache_blocks"})
#: the header a member sends its token in
MEMBER_HEADER = "x-kvpush-member"
#: the fields of /kv/info that are member views
COUNT_FIELDS = ("num_free_blocks", "num_total_blocks")


def member_header(secret_token: str | None) -> dict[str, str]:
    """The header a member (the router) sends to an instance (none without a token)."""
    return {MEMBER_HEADER: secret_token} if secret_token else {}


class MemberViews:
    """Who may read the member views of one instance (see the module)."""

    def __init__(self, secret: bytes | None, api_key: str | None,
                 admin_key: str | None) -> None:
        self.open = not api_key and not admin_key
        self._token = member_view_token(secret).encode() if secret else None
        self._admin = admin_key.encode() if admin_key else None

    def opens(self, scope: Scope) -> bool:
        if self.open:
            return True
        headers = scope.get("headers", ())
        if self._token is not None:
            member = next((v for n, v in headers if n == MEMBER_HEADER.encode()), None)
            if member is not None and hmac.compare_digest(member, self._token):
                return True
        if self._admin is not None:
            auth = next((v for n, v in headers if n == b"authorization"), None)
            return check_bearer(auth, self._admin) is None
        return False

    def kv_info(self, info: KVInfo, scope: Scope) -> KVInfo:
        """``/kv/info`` as the caller may see it."""
        if self.opens(scope):
            return info
        return msgspec.structs.replace(info, **dict.fromkeys(COUNT_FIELDS, UNSET))


class MemberViewMiddleware:
    """Refuse MEMBER_PATHS to whoever the views do not open to (403, OpenAI's shape)."""

    def __init__(self, app: ASGIApp, views: MemberViews, on_reject=None) -> None:
        self.app, self.views, self.on_reject = app, views, on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope.get("path") not in MEMBER_PATHS
                or self.views.opens(scope)):
            await self.app(scope, receive, send)
            return
        if self.on_reject is not None:
            self.on_reject("member_view")
        data = json.dumps({"error": {
            "message": f"{scope.get('path')} tells what other requests cached: it opens "
                       "to the cluster's members (the router, with the cluster secret) "
                       "and the admin key, never to an API key",
            "type": "permission_error", "param": None, "code": "member_view"}}).encode()
        await send({"type": "http.response.start", "status": 403,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})
