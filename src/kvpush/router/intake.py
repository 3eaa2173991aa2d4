"""What the router accepts from a client, at the door: the body size, its deadline, and a
bound on the requests it holds at once (the body's JSON, and all that follows, is the
front's: kvpush.server.app).

* **Body size.** Bodies over ``MAX_BODY_BYTES`` (the instances' own limit) are a 413 in
  OpenAI's error shape. Starlette's ``max_body_size`` is not used: it swaps any answer
  to a request whose ``Content-Length`` is over the limit for a ``text/plain`` 413.
* **Body deadline.** :func:`read_body_within`: the whole body within
  ``--body-timeout`` of the headers, else a 408 (the header deadline and the bound on
  connections are kvpush.server.door's).
* **Outstanding requests.** :class:`Admission` counts requests from the moment their body
  has been read until everything they started is over (a push prefill leg may drain
  after the client's answer); above ``--max-outstanding-requests`` a request is a 429
  with ``Retry-After`` at once. The body is read first, so a slow client holds its
  connection but no place.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from fastapi import Request

from kvpush.aio import within
from kvpush.server.app import MAX_BODY_BYTES
from kvpush.server.body_limit import too_large
from kvpush.server.errors import APIError

logger = logging.getLogger("kvpush.router")

#: seconds a client is told to wait (``Retry-After``) when the router is full
RETRY_AFTER_S = 1
#: at most one "router full" warning per this many seconds (a flood must not fill the log)
FULL_LOG_INTERVAL_S = 10.0


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request body, or a 413 as soon as it is known to exceed ``limit`` bytes (by its
    ``Content-Length``, before reading; else while reading a chunked body). Raises
    ``ClientDisconnect`` when the client goes away meanwhile."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def read_body_within(request: Request, timeout: float,
                           limit: int = MAX_BODY_BYTES) -> bytes:
    """:func:`read_body`, or a 408 when the body is not all there within ``timeout``
    seconds (a client that sends its body slowly, or not at all)."""
    try:
        return await within(read_body(request, limit), timeout)
    except asyncio.TimeoutError:  # (3.10: not the builtin)
        raise APIError(f"the request body did not arrive within {timeout:g} s",
                       status_code=408, code="request_timeout") from None


class Admission:
    """A bound on the requests the router holds at once (``--max-outstanding-requests``).

    ``enter`` takes a place or returns False (the caller answers :func:`full_error`);
    ``leave`` gives it back once everything the request started is over. Event loop
    only: no lock."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.outstanding = 0
        self._warned_at = -math.inf

    def enter(self) -> bool:
        if self.outstanding >= self.limit:
            now = time.monotonic()
            if now - self._warned_at >= FULL_LOG_INTERVAL_S:
                self._warned_at = now
                logger.warning("router full: %d requests outstanding "
                               "(--max-outstanding-requests %d); answering 429",
                               self.outstanding, self.limit)
            return False
        self.outstanding += 1
        return True

    def leave(self) -> None:
        self.outstanding = max(0, self.outstanding - 1)


def full_error(limit: int) -> APIError:
    return APIError(f"the router is serving its limit of {limit} requests; try again shortly",
                    status_code=429, code="too_many_requests")
