"""The bound on waiting requests: past it, an instance answers 429 instead of queueing.

A request *waits* from the moment it is parsed until its first output (token #1, or its
end): while it is tokenized, queued in the engine, prefilled, or (decode of a P/D pair)
waiting for its KV. ``--max-waiting-requests`` caps how many do at once; a request over
the cap is refused at once with a 429 in OpenAI's error shape (``rate_limit_error``,
code ``queue_full``, ``Retry-After: 1``) before anything is tokenized or allocated, so
refusing costs nothing and holds nothing. Requests already generating are not counted:
the running batch is bounded by ``--max-num-seqs`` and the KV cache.

The second leg of a P/D pair is never refused: its peer already holds blocks for it (a
push prefill leg: decode has allocated and registered the blocks this leg will WRITE;
a pull decode leg: prefill has lent the blocks it will READ). Refusing it would waste
the first leg's work and leave the peer's blocks to its lease. Such a leg is counted
while it waits (it is load) but admitted over the cap; the pair's first leg (push
decode, pull prefill) is the one that takes the 429, and the router then releases what
the other side holds (it aborts the transfer on prefill).

Everything here runs on the event loop only, so the counter needs no lock.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpush.kv_transfer.params import KVTransferParams
from kvpush.server.errors import APIError

#: Default of ``kvpush serve --max-waiting-requests``: generous for a server whose
#: batch runs 64 requests (--max-num-seqs), small enough that a flood is refused in
#: milliseconds instead of queueing for minutes behind the prompts already waiting.
DEFAULT_MAX_WAITING_REQUESTS = 1024


def is_second_leg(role: str, mode: str, kv: KVTransferParams | None) -> bool:
    """Whether a request with these (checked) ``kv_transfer_params`` is the second leg
    of a P/D pair on an instance of ``role`` in ``mode`` (see the module)."""
    if kv is None:
        return False
    if role == "prefill" and mode == "push":
        return kv.do_remote_decode
    if role == "decode" and mode == "pull":
        return kv.do_remote_prefill
    return False


class WaitingSlot:
    """One admitted request's place among the waiting; :meth:`release` it (idempotent)
    at its first output or however it ends."""

    __slots__ = ("_bound", "_held")

    def __init__(self, bound: WaitingBound) -> None:
        self._bound = bound
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._bound.waiting -= 1


@dataclass
class WaitingBound:
    """Counts waiting requests and refuses those over ``limit`` (0: no bound)."""

    limit: int = DEFAULT_MAX_WAITING_REQUESTS
    waiting: int = 0
    #: requests refused because the bound was reached (``/metrics``)
    refused: int = 0

    def __post_init__(self) -> None:
        if self.limit < 0:
            raise ValueError(f"max waiting requests must be >= 0, got {self.limit}")

    def admit(self, exempt: bool = False) -> WaitingSlot:
        """A slot for one more waiting request, or APIError 429 when ``limit`` requests
        wait already (an ``exempt`` request is admitted anyway)."""
        if self.limit and self.waiting >= self.limit and not exempt:
            self.refused += 1
            raise APIError(
                f"the server is overloaded: {self.waiting} requests are waiting for their "
                "first token (--max-waiting-requests); retry later",
                status_code=429, code="queue_full")
        self.waiting += 1
        return WaitingSlot(self)
