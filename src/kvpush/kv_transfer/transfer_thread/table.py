"""The transfer thread's records: one ``Transfer`` per transfer id, in one ``Table``,
with one timer heap for every deadline and one bounded memory of ended ids.

A record's phase, by role (its role object moves it; over: it leaves the table)::

    push prefill  EARLY (registration first) ─Begin─┐
                  WAITING (Begin) ─registration─────┴─▶ SENDING ─Prefilled─▶ DRAINING
                  DRAINING ─its WRITEs landed: PushDone (or AbortAck)─▶ over
                  WAITING / SENDING ─failed with WRITEs in flight─▶ DRAINING
    pull prefill  LENT (Prefilled) ─PullDone, Abort, its lease, End─▶ over
    decode        WAITING ─blocks, prefill checked─▶ REGISTERED (push) ─PushDone─▶ over
                                               └──▶ CLAIMING (pull) ─yes─▶ READING ─▶ over
                  REGISTERED ─failed or ended─▶ FENCED ─prefill's word, its connection
                                                drops, --fence-timeout─▶ over
                  READING ─failed or ended─▶ DRAINING ─our READ ended─▶ over

``deadline`` is the lease (renewed by the peer's heartbeats; a fixed one for EARLY) or,
FENCED, the fence timeout; ``resend_at`` the next re-send (a claim, a fence's Abort).
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.wire import messages as m

INF = math.inf


class Phase(enum.Enum):
    EARLY = "early"
    WAITING = "waiting"
    SENDING = "sending"
    LENT = "lent"
    REGISTERED = "registered"
    CLAIMING = "claiming"
    READING = "reading"
    DRAINING = "draining"
    FENCED = "fenced"


#: phases whose deadline heartbeats do not move
FIXED = (Phase.EARLY, Phase.FENCED)


class Timer(enum.Enum):
    DEADLINE, RESEND, HEARTBEAT = "deadline", "resend", "heartbeat"  # heartbeat: key ""


@dataclass(eq=False)
class Transfer:
    tid: str
    phase: Phase
    #: the peer's side channel; None while not known (a prefill's transfer before
    #: decode registered, a lend before it is claimed: any peer's heartbeat renews it)
    peer: str | None = None
    peer_engine: str = ""
    deadline: float = INF
    resend_at: float = INF
    sends: int = 0  # registrations or claims sent
    sent_at: float = 0.0
    num_prompt_tokens: int = 0
    prompt_hashes: tuple[bytes, ...] = ()
    #: push: decode's registration (prefill) or ours (decode)
    reg: m.PushRegister | None = None
    #: push prefill: blocks stated computed before the registration came
    computed: list[c.BlocksReady] = field(default_factory=list)
    #: decode: our blocks, once allocated
    blocks: c.BlocksReady | None = None
    lent_blocks: tuple[int, ...] = ()
    lend_expires_ms: int | None = None
    claim: int = 0  # pull decode: our claim's id
    claimer: tuple[str, int] | None = None  # pull prefill: (address, claim id)
    #: --kv-digest, push prefill: our block behind each registered position written;
    #: pull decode: prefill's digests of the lent blocks
    sources: dict[int, int] = field(default_factory=dict)
    peer_digest: list[bytes] | None = None
    peer_digest_alg: str = ""
    checked: bool = False  # decode: the request's params fit prefill's Hello
    done: m.PushDone | None = None  # push prefill: token #1, sent once all landed
    handles: set[int] = field(default_factory=set)  # our posts in flight
    failed: str | None = None  # why it failed
    told: bool = False  # the step loop knows the request ends (its End, or our Failing)
    abort_ack: bool = False  # push prefill: decode aborted: answer AbortAck
    cancelled: bool = False  # post nothing more for it
    num_descriptors: int = 0
    num_bytes: int = 0
    post_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)
    stamps: dict[str, float] = field(default_factory=dict)

    def stamp(self, stage: str) -> None:
        self.stamps[stage] = time.perf_counter()


class Timers:
    """One heap of (when, key, kind). A key's current time is where its owner keeps it
    (``value``): renewing a lease moves no entry; an entry that comes due early is
    pushed again at the current time, and one superseded by an earlier one is skipped."""

    def __init__(self, value: Callable[[str, Timer], float]) -> None:
        self._value = value
        self._heap: list[tuple[float, int, str, Timer]] = []
        self._queued: dict[tuple[str, Timer], float] = {}
        self._seq = itertools.count()

    def schedule(self, key: str, kind: Timer, when: float) -> None:
        if when < self._queued.get((key, kind), INF):
            self._queued[(key, kind)] = when
            heapq.heappush(self._heap, (when, next(self._seq), key, kind))

    def next_due(self) -> float:
        return self._heap[0][0] if self._heap else INF

    def take_due(self, now: float) -> list[tuple[str, Timer]]:
        due = []
        while self._heap and self._heap[0][0] <= now:
            when, _, key, kind = heapq.heappop(self._heap)
            if self._queued.get((key, kind)) != when:
                continue  # superseded by an earlier entry
            del self._queued[(key, kind)]
            current = self._value(key, kind)
            if current <= now:
                due.append((key, kind))
            elif current < INF:
                self.schedule(key, kind, current)
        return due


class Table:
    """The transfers of one instance (``by_tid``), their timers, and why the ones that
    ended did (bounded by count and by age: as long as a grant naming one may be valid)."""

    def __init__(self, clock: Callable[[], float], lease_s: float, max_ended: int = 1 << 16,
                 ended_s: float = 120.0) -> None:
        self.clock, self.lease_s = clock, lease_s
        self.by_tid: dict[str, Transfer] = {}
        self.heartbeat_at = 0.0
        self.timers = Timers(self._value)
        self._ended: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._max_ended, self._ended_s = max_ended, ended_s

    def _value(self, key: str, kind: Timer) -> float:
        if kind is Timer.HEARTBEAT:
            return self.heartbeat_at
        rec = self.by_tid.get(key)
        if rec is None:
            return INF
        return rec.deadline if kind is Timer.DEADLINE else rec.resend_at

    def __iter__(self) -> Iterator[Transfer]:
        return iter(list(self.by_tid.values()))

    def __len__(self) -> int:
        return len(self.by_tid)

    def get(self, tid: str) -> Transfer | None:
        return self.by_tid.get(tid)

    def add(self, rec: Transfer, **lease: Any) -> Transfer:
        self.by_tid[rec.tid] = rec
        self.lease(rec, **lease)
        return rec

    def pop(self, tid: str) -> Transfer | None:
        return self.by_tid.pop(tid, None)

    def lease(self, rec: Transfer, seconds: float | None = None) -> None:
        """(Re)start ``rec``'s deadline: a lease, or ``seconds`` from now."""
        rec.deadline = self.clock() + (self.lease_s if seconds is None else seconds)
        self.timers.schedule(rec.tid, Timer.DEADLINE, rec.deadline)

    def resend(self, rec: Transfer, after_s: float) -> None:
        rec.resend_at = self.clock() + after_s
        self.timers.schedule(rec.tid, Timer.RESEND, rec.resend_at)

    def renew(self, tid: str, sender: str) -> None:
        """A heartbeat of ``sender`` lists ``tid``: renew its lease if the record waits
        on that peer (or on any)."""
        rec = self.by_tid.get(tid)
        if (rec is not None and rec.phase not in FIXED and rec.deadline < INF
                and rec.peer in (None, sender)):
            rec.deadline = self.clock() + self.lease_s

    def beat(self, interval_s: float) -> None:
        self.heartbeat_at = self.clock() + interval_s
        self.timers.schedule("", Timer.HEARTBEAT, self.heartbeat_at)

    def addresses(self) -> set[str]:
        """Peers that transfers use (never dropped as idle)."""
        return {rec.peer for rec in self.by_tid.values() if rec.peer}

    def remember(self, tid: str, why: str) -> None:
        now = self.clock()
        self._ended[tid] = (why, now)
        self._ended.move_to_end(tid)
        while self._ended:
            oldest, (_, at) = next(iter(self._ended.items()))
            if len(self._ended) <= self._max_ended and now - at <= self._ended_s:
                break
            del self._ended[oldest]

    def ended(self, tid: str) -> str | None:
        """Why ``tid`` ended here, if it did (and is still remembered)."""
        entry = self._ended.get(tid)
        return entry[0] if entry is not None else None
