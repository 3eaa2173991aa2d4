"""BodyLimit: request bodies over the instance's limit are a 413 in OpenAI's error shape.

Starlette's own ``max_body_size`` answers ``text/plain`` (and swaps any answer to a
request whose ``Content-Length`` is over the limit for one), so instances do not use it.
This ASGI middleware refuses a declared ``Content-Length`` over the limit before the
app sees the request, and stops a chunked body once it has passed the limit: reading
it raises an :class:`APIError` (413), which the app's error handlers answer like any
other. The router's app uses it too (``on_reject``: its request count).
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvpush.server.errors import APIError


def too_large(limit: int) -> APIError:
    return APIError(f"the request body is larger than {limit >> 20} MiB"
                    if limit >= 1 << 20 else f"the request body is larger than {limit} bytes",
                    status_code=413, code="request_too_large")


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, limit: int,
                 on_reject: Callable[[Scope], None] | None = None) -> None:
        self.app = app
        self.limit = limit
        #: called with each request refused by its Content-Length (the app never sees it)
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                if value.isdigit() and int(value) > self.limit:
                    if self.on_reject is not None:
                        self.on_reject(scope)
                    await too_large(self.limit).response()(scope, receive, send)
                    return
                break
        size = 0

        async def counted() -> Message:
            nonlocal size
            message = await receive()
            if message["type"] == "http.request":
                size += len(message.get("body", b""))
                if size > self.limit:
                    raise too_large(self.limit)
            return message

        await self.app(scope, counted, send)
