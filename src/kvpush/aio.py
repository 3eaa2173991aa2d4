"""``within``: await with a deadline without losing a cancellation.

``asyncio.wait_for`` on Python 3.10-3.11 returns the awaited result and drops the
caller's cancellation when both arrive in the same loop turn (fixed in 3.12, where it
is built on ``asyncio.timeout``). A router task cancelled because its client hung up
then ran on to the end (router/net.py met it in the relay's reads). ``within`` uses
``asyncio.timeout`` where it exists (3.11+), which keeps the cancellation; on 3.10 it
runs the awaitable as a task under ``asyncio.wait``, which does not swallow one either.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import TypeVar

_T = TypeVar("_T")


async def within(aw: Awaitable[_T], timeout: float | None) -> _T:
    """``await aw``; ``asyncio.TimeoutError`` after ``timeout`` seconds (None: none)."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(timeout):
            return await aw
    task = asyncio.ensure_future(aw)  # 3.10
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        raise asyncio.TimeoutError
    return task.result()
