"""``within``: await with a deadline without losing a cancellation.

``asyncio.wait_for`` on Python 3.10-3.11 returns the awaited result and drops the
caller's cancellation when both arrive in the same loop turn (fixed in 3.12, where it
is built on ``asyncio.timeout``). A router task cancelled because its client hung up
then ran on to the end (router/net.py met it in the relay's reads). ``within`` uses
``asyncio.timeout`` where it exists (3.11+), which keeps the cancellation, and falls
back to ``wait_for`` on 3.10.
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
    return await asyncio.wait_for(aw, timeout)  # pragma: no cover - 3.10 only
