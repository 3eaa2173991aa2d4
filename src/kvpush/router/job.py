"""One client request's record in the router: what happened to it (the fields of its
request log line) around the request itself, the front's one ``Job`` once parsed; and
the outcome a status counts as."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpush.router.decide import Route
from kvpush.router.pool import Instance

if TYPE_CHECKING:
    from kvpush.server.protocol import Job


@dataclass(eq=False)
class RequestRecord:
    """One client request and what happened to it (the request log line). It exists
    from the request's arrival, before any parsing (a 408 or 429 is logged with one),
    and outlives the answer while a prefill leg drains."""

    rid: str
    kind: str  # "completion" | "chat"
    arrival: float
    #: the request as the front parsed it (None: refused before or while parsing)
    parsed: Job | None = None
    client_rid: str | None = None
    mode: str = ""  # the path taken: push, pull, colocated, fallback, local
    #: the cache-aware policy's facts (None: another policy, or not placed yet)
    route: Route | None = None
    prefill: Instance | None = None
    decode: Instance | None = None
    #: the decode that refused the local leg (429/503): the remote legs go to another
    #: decode when one is healthy
    d_refused: Instance | None = None
    transfer_id: str = ""
    attempts: int = 0
    #: times the request moved to another decode after losing its own
    migrations: int = 0
    p_leg_s: float | None = None
    p_outcome: str = "-"
    p_task: asyncio.Task | None = None
    legs_sent: float | None = None  # push: both legs; pull: the prefill leg
    d_sent: float | None = None
    d_first_byte_s: float | None = None
    first_byte: float | None = None
    status: int = 0
    outcome: str = ""
    error: str | None = None
    #: the decode instance whose in-flight count the request holds (Placement), and
    #: the KV tokens its leg is charged there (cache-aware: its ``tokens_in_flight``)
    d_held: Instance | None = None
    d_tokens: int = 0
    #: parts still running: the client's answer, plus a prefill leg draining after it
    parts: int = 1
    closed: bool = False
    ended: float | None = None
    #: called once everything the request started is over (frees its admission place)
    on_done: Callable[[], None] | None = None

    @property
    def stream(self) -> bool:
        """Whether its client streams (the router's TTFT counts streams only)."""
        return self.parsed is not None and self.parsed.stream

    def new_transfer_id(self) -> str:
        self.attempts += 1
        self.transfer_id = self.rid if self.attempts == 1 else f"{self.rid}-{self.attempts}"
        return self.transfer_id


def outcome_for(status: int) -> str:
    if status == 200:
        return "ok"
    if status == 499:
        return "abort"
    if status == 503:
        return "unavailable"
    if status == 429:
        return "overloaded"
    return "client_error" if status < 500 else "error"

