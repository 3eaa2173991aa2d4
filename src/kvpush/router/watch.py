"""Waits on an instance that end early: when the health loop marks the instance dead, or
when their own timer runs out.

A frozen instance (SIGSTOP, a hung host) keeps its TCP connections open: reads on them
neither fail nor return, so without this a leg in flight on it would wait for its whole
read timeout although the health loop took the instance out of rotation seconds ago.
Each wait on an instance runs inside a :class:`LegWatch`::

    with LegWatch(inst.watches, "decode's answer", timeout=60):
        chunk = await anext(chunks)

``Pool`` ends every watch of an instance when a health check fails
(:func:`end_all`); the waiting task is cancelled there and the ``with`` block raises
:class:`LegLost` instead of the cancellation. Only the wait inside the block is
affected: a task cancelled for another reason as well (the client went away) still
sees its ``CancelledError``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from types import TracebackType
from typing import Literal


class LegLost(Exception):
    """A wait on an instance ended by its :class:`LegWatch`."""

    def __init__(self, reason: str, timed_out: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        #: the watch's own timer ran out (else: the instance was marked dead)
        self.timed_out = timed_out


class LegWatch:
    """One bounded wait on an instance (a context manager; see the module docstring).

    ``timeout`` (seconds, or None) bounds the block by a timer of its own: cheaper per
    stream chunk than a task, and it leaves the request's own httpx timeouts as the
    backstop."""

    __slots__ = ("_handle", "_reason", "_task", "_timed_out", "timeout", "watches", "what")

    def __init__(self, watches: set[LegWatch], what: str, timeout: float | None = None) -> None:
        self.watches = watches
        self.what = what
        self.timeout = timeout
        self._task: asyncio.Task | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._reason: str | None = None
        self._timed_out = False

    def __enter__(self) -> LegWatch:
        self._task = asyncio.current_task()
        assert self._task is not None, "a LegWatch needs a task"
        self._reason = None
        self.watches.add(self)
        if self.timeout is not None:
            self._handle = asyncio.get_running_loop().call_later(
                self.timeout, self.end,
                f"no answer from the instance for {self.timeout:g} s ({self.what})", True)
        return self

    def end(self, reason: str, timed_out: bool = False) -> None:
        """End the wait now (from the event loop, outside the waiting task)."""
        if self._reason is not None or self._task is None or self._task.done():
            return
        self._reason, self._timed_out = reason, timed_out
        self._task.cancel()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> Literal[False]:
        self.watches.discard(self)
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._reason is None:
            return False
        # This watch cancelled the task: take that cancellation back and raise LegLost
        # instead, unless someone else cancelled the task too (it must stay cancelled).
        uncancel = getattr(self._task, "uncancel", None)  # Python >= 3.11
        if uncancel is not None and uncancel() > 0:
            return False
        raise LegLost(self._reason, self._timed_out) from None


def end_all(watches: Iterable[LegWatch], reason: str) -> int:
    """End every wait in ``watches`` (an instance was marked dead); how many there were."""
    ended = list(watches)
    for w in ended:
        w.end(reason)
    return len(ended)
