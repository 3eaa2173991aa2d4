"""The door of the router and of every instance: how long a client may take to send its
request's headers, and how many client connections may be open at once.

uvicorn's own options do not cover either: ``timeout_keep_alive`` runs only between
requests on a kept-alive connection (a connection that sends half its headers, or
nothing, is held forever), and ``limit_concurrency`` still accepts every connection and
reads its headers before it answers 503. So the router and ``kvpush serve`` serve HTTP
with
:func:`guarded_protocol`, uvicorn's httptools protocol with two additions:

* **Header deadline.** From the moment a connection opens, and from the first byte of
  every later request on it, the request line and headers must be complete within
  ``header_timeout_s``; else the connection is closed. Between requests uvicorn's
  keep-alive timeout applies as before. An answer sent before its request's body was
  all in (a 401, a 404: the app did not read it) gives the rest of the body the same
  deadline: uvicorn discards such a body and each byte of it cancels the keep-alive
  timer, so a client trickling it held the connection forever.
* **Connection bound.** A connection beyond ``max_connections`` open ones is answered
  ``503`` (OpenAI's error shape, ``Connection: close``) at once and closed, before
  anything is read from it, so descriptors and memory stay bounded whatever clients do.

Its writes are coalesced (:class:`CoalescingTransport`): what is written to a client
within one turn of the event loop leaves in one ``send``.

The body's deadline is the handler's (the router: kvpush.server.app.read_body_within,
before a request takes a place; an instance: its request handler, before admission), so
a slow body holds a connection, never a place. :func:`add_door_args` gives both CLIs the
same three flags.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (uvicorn and asyncio are imported when a door is made, not by a CLI)
    import asyncio

    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger("kvpush.server.door")

#: at most one "connections refused" warning per this many seconds
REFUSED_LOG_INTERVAL_S = 10.0


def _busy_answer() -> bytes:
    body = json.dumps({"error": {
        "message": "the server has too many open connections; try again shortly",
        "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            b"retry-after: 1\r\nconnection: close\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


BUSY_ANSWER = _busy_answer()


class CoalescingTransport:
    """A transport whose writes within one turn of the event loop go out as one
    ``send`` (at the end of the turn, or before closing): an answer's headers and its
    first chunk, written back to back, leave in one segment. Everything else is the
    wrapped transport's."""

    __slots__ = ("_loop", "_out", "_t")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._t = transport
        self._loop = loop
        self._out: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not data:
            return
        if not self._out:
            self._loop.call_soon(self.flush)
        self._out.append(data)

    def flush(self) -> None:
        if self._out:
            data = b"".join(self._out) if len(self._out) > 1 else self._out[0]
            self._out.clear()
            if not self._t.is_closing():
                self._t.write(data)

    def close(self) -> None:
        self.flush()
        self._t.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._t, name)


def guarded_protocol(header_timeout_s: float, max_connections: int) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with a header deadline and a connection bound (pass
    it as ``uvicorn.Config(http=...)``)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GuardedProtocol(HttpToolsProtocol):
        _warned_at = -1e18

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._header_timer: asyncio.TimerHandle | None = None
            super().connection_made(
                CoalescingTransport(transport, self.loop))  # type: ignore[arg-type]
            if len(self.connections) > max_connections:
                now = time.monotonic()
                if now - GuardedProtocol._warned_at >= REFUSED_LOG_INTERVAL_S:
                    GuardedProtocol._warned_at = now
                    logger.warning("%d client connections open (the bound is %d): refusing "
                                   "more with 503", len(self.connections) - 1, max_connections)
                transport.write(BUSY_ANSWER)
                transport.close()
                return
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._disarm()  # (the body of a request answered before it was all in)
            super().on_message_complete()

        def on_response_complete(self) -> None:
            cycle = self.cycle
            if cycle is not None and cycle.more_body and not self.transport.is_closing():
                self._arm()  # the rest of the body, within the header deadline
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return GuardedProtocol


def uvicorn_options(header_timeout_s: float, max_connections: int) -> dict[str, Any]:
    """The ``uvicorn.Config`` keywords of the door."""
    return {"http": guarded_protocol(header_timeout_s, max_connections),
            "backlog": min(2048, max(128, max_connections))}


def default_max_connections(reserve: int = 256) -> int:
    """Client connections an instance allows by default: its descriptor limit less what
    the engine core's sockets, the KV transport and the logs may need (at least 64)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(64, min(4096, soft - reserve))


def add_door_args(group: Any, max_connections: int | None = None) -> None:
    """``--header-timeout``, ``--body-timeout`` and ``--max-client-connections`` on an
    argparse group (``max_connections``: the default; None: from the descriptor limit)."""
    from kvpush import cli_types

    group.add_argument("--header-timeout", type=cli_types.seconds, default=10.0,
                       metavar="SECONDS",
                       help="a client's request line and headers must arrive within this "
                            "many seconds of connecting (or of a later request's first "
                            "byte); else the connection is closed (default: 10)")
    group.add_argument("--body-timeout", type=cli_types.seconds, default=30.0,
                       metavar="SECONDS",
                       help="a client's request body must arrive within this many seconds "
                            "of its headers; else 408 (default: 30)")
    default = max_connections if max_connections is not None else default_max_connections()
    group.add_argument("--max-client-connections", type=cli_types.positive_int,
                       default=default, metavar="N",
                       help="client connections open at once; more are answered 503 and "
                            f"closed at once (default: {default}"
                            + ("" if max_connections is not None else
                               ", the descriptor limit less 256") + ")")

