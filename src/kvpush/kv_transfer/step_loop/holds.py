"""Holds: what the step loop keeps per transfer, the blocks it must give back.

A ``Hold`` lives from the request's arrival to the transfer's ``Over``: its request id
while the request waits on the transfer (None once it ended, or runs on its own), and
the blocks the step loop kept out of the pool for it (a finished prefill's, a preempted
run's, an ended decode's that KV may still land in). Its presence keeps the transfer id
taken. Everything else about a transfer is the transfer thread's. Step loop only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpush.config import KVTransferConfig
from kvpush.errors import RequestError
from kvpush.kv_transfer import actions as a
from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.timeline import HandoffTimeline
from kvpush.scheduler.scheduler import Scheduler


@dataclass(eq=False)
class Hold:
    request_id: str | None
    blocks: list[int] = field(default_factory=list)
    #: push prefill: leading prompt blocks stated computed for every layer (this run)
    stated: int = 0


class Holds:
    def __init__(self, cfg: KVTransferConfig, scheduler: Scheduler, block_size: int,
                 timeline: HandoffTimeline) -> None:
        self.cfg, self.scheduler, self.block_size = cfg, scheduler, block_size
        self.timeline = timeline
        self.by_tid: dict[str, Hold] = {}
        self.by_request: dict[str, str] = {}  # request id -> transfer id
        self.facts: list[c.Fact] = []  # this turn's, for the transfer thread
        self.actions: list[a.EngineAction] = []  # for the engine

    def take(self, tid: str, request_id: str) -> Hold:
        if tid in self.by_tid:
            raise RequestError(f"transfer id {tid!r} is already in use", "kv_transfer_params")
        hold = self.by_tid[tid] = Hold(request_id)
        self.by_request[request_id] = tid
        return hold

    def of_request(self, request_id: str) -> tuple[str, Hold] | None:
        tid = self.by_request.get(request_id)
        return (tid, self.by_tid[tid]) if tid is not None else None

    def detach(self, hold: Hold) -> None:
        """``hold``'s request no longer waits on the transfer."""
        if hold.request_id is not None:
            self.by_request.pop(hold.request_id, None)
            hold.request_id = None

    def over(self, tid: str) -> Hold | None:
        """The transfer is over: drop its hold and give its blocks back."""
        hold = self.by_tid.pop(tid, None)
        if hold is not None:
            if hold.request_id is not None:
                self.by_request.pop(hold.request_id, None)
            if hold.blocks:
                self.scheduler.release_blocks(hold.blocks)
                hold.blocks = []
        return hold

    def state(self, fact: c.Fact) -> None:
        self.facts.append(fact)

    def take_facts(self) -> tuple[c.Fact, ...]:
        facts, self.facts = tuple(self.facts), []
        return facts

    def held_blocks(self) -> int:
        return sum(len(h.blocks) for h in self.by_tid.values())
