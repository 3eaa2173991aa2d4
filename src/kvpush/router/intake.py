"""A bound on the requests the router holds at once: :class:`Admission` counts requests
from the moment their body has been read (its size and deadline are the instances' own:
kvpush.server.body_limit, kvpush.server.app.read_body_within) until everything they
started is over (a push prefill leg may drain after the client's answer); above
``--max-outstanding-requests`` a request is a 429 with ``Retry-After`` at once. The body
is read first, so a slow client holds its connection but no place.
"""

from __future__ import annotations

import logging
import math
import time

from kvpush.server.errors import APIError

logger = logging.getLogger("kvpush.router")

#: seconds a client is told to wait (``Retry-After``) when the router is full
RETRY_AFTER_S = 1
#: at most one "router full" warning per this many seconds (a flood must not fill the log)
FULL_LOG_INTERVAL_S = 10.0


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
