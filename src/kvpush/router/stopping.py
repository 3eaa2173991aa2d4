"""Stopping the router's background tasks within a bound.

The router's shutdown (its lifespan's end, on SIGTERM or Ctrl-C) cancels the health
loop, the KV-event followers, the discovery link and the tokenizer's load. A task that
does not end when cancelled (a cancellation lost in a library's timeout handling, a
blocking call) would otherwise hold the whole process open; here each wait is bounded
and what did not stop is named in the log, and the shutdown goes on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

logger = logging.getLogger(__name__)

#: how long a shutdown waits for cancelled tasks before it goes on without them
STOP_TIMEOUT_S = 5.0


async def cancel_and_wait(tasks: Iterable[asyncio.Task | None], what: str,
                          timeout: float = STOP_TIMEOUT_S) -> bool:
    """Cancel ``tasks`` and wait up to ``timeout`` seconds for them to end. Returns
    whether all did; those still running are logged (as ``what``) and left behind."""
    pending = {t for t in tasks if t is not None}
    for t in pending:
        t.cancel()
    if not pending:
        return True
    _, left = await asyncio.wait(pending, timeout=timeout)
    if left:
        logger.warning("%s: %d task(s) did not stop within %g s of being cancelled "
                       "(shutting down without them): %s", what, len(left), timeout,
                       ", ".join(sorted(t.get_name() for t in left)))
    return not left
