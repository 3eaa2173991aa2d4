"""Bounded waits on a condition: every test that waits for something uses these."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def wait_until(cond: Callable[[], object], timeout: float = 20.0, what: str = "",
               interval: float = 0.05) -> None:
    """Poll ``cond`` until it is true; an AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what or cond}")
        time.sleep(interval)


def settled(read: Callable[[], float], quiet: float = 0.3, timeout: float = 10.0) -> float:
    """``read()`` once it has kept one value for ``quiet`` seconds (a counter that an
    instance publishes a little after the answers it counts); AssertionError after
    ``timeout``."""
    deadline = time.monotonic() + timeout
    value, since = read(), time.monotonic()
    while time.monotonic() - since < quiet:
        if time.monotonic() > deadline:
            raise AssertionError(f"still changing after {timeout} s: {value}")
        time.sleep(0.05)
        if (now := read()) != value:
            value, since = now, time.monotonic()
    return value


async def wait_until_async(cond: Callable[[], object], timeout: float = 5.0,
                           what: str = "") -> None:
    """``wait_until`` for a test running on an event loop (yields to it while polling)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what or cond}")
        await asyncio.sleep(0.005)
