"""TransferContext: what the connector's two halves share (all on the step loop).

``KVConnector`` composes a ``PrefillSender`` (prefill_side.py: push sends, pull lends)
and a ``DecodeReceiver`` (decode_side.py). Each owns its own transfers; this object holds
the rest, one instance per connector: the scheduler (every block goes through its
ownership API), the transfer thread's handle, the request ->
transfer map, the counters, the actions for the engine, the ended-transfer memory and
the finished-transfer records.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpush.config import KVTransferConfig
from kvpush.kv_cache.kv_region import KVLayout, KVRegion
from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.step_loop.state import TransferRecord
from kvpush.kv_transfer.timeline import HandoffTimeline
from kvpush.kv_transfer.transfer_thread.worker import TransferWorker
from kvpush.kv_transfer.wire.auth import MAX_AHEAD_MS
from kvpush.scheduler.scheduler import Scheduler

log = logging.getLogger("kvpush.kv_transfer.step_loop.connector")

#: ended transfer ids remembered (a leg arriving after its transfer ended is refused,
#: every time): each for as long as a signed grant naming it may be valid (its
#: lifetime and the clock slack ``grants.MAX_AHEAD_MS`` allows), at most this many
MAX_ENDED_REMEMBERED = 1 << 16
ENDED_REMEMBERED_S = MAX_AHEAD_MS / 1000


@dataclass
class TransferContext:
    cfg: KVTransferConfig
    engine_id: str
    address: str  # our side channel
    scheduler: Scheduler
    worker: TransferWorker
    region: KVRegion
    block_size: int
    vocab_size: int  # bounds token #1 from a peer
    timeline: HandoffTimeline
    by_request: dict[str, str] = field(default_factory=dict)  # request id -> tid
    counters: dict[str, int] = field(default_factory=lambda: {
        "transfers_ok": 0, "transfers_failed": 0})
    actions: list[c.EngineAction] = field(default_factory=list)
    ended: OrderedDict[str, str] = field(default_factory=OrderedDict)  # tid -> why
    _ended_at: dict[str, float] = field(default_factory=dict)  # tid -> when (monotonic)
    records: deque[TransferRecord] = field(default_factory=lambda: deque(maxlen=1024))
    #: called (on the step loop) with each finished transfer, e.g. by /metrics
    record_sink: Callable[[TransferRecord], None] | None = None
    #: set once the transfer thread died (thread_death.py): why, as requests are told
    dead: str | None = None
    #: commands of the current engine turn, handed over as one StepMessage by flush()
    outbox: list[c.Command] = field(default_factory=list)
    #: whether a command of the outbox needs the transfer thread now (see submit)
    _wake: bool = False

    @property
    def role(self) -> str:
        return self.cfg.role

    @property
    def mode(self) -> str:
        return self.cfg.mode

    @property
    def layout(self) -> KVLayout:
        return self.region.layout

    def submit(self, cmd: c.Command, wake: bool = True) -> None:
        """Queue ``cmd`` for the transfer thread; it leaves with the turn's ``flush``.
        ``wake=False``: a fact the transfer thread may take whenever it next wakes
        (blocks computed while no push transfer is registered): handing it over costs
        no wake-up of that thread in the middle of a step, and a registration that
        arrives meanwhile wakes it anyway and finds the fact queued before it."""
        if self.dead is None:  # a dead thread reads no commands
            self.outbox.append(cmd)
            self._wake = self._wake or wake

    def flush(self) -> None:
        """Hand the queued commands to the transfer thread as one StepMessage (one
        wake-up, unless none of them needs one); nothing to do when none were queued."""
        if not self.outbox:
            return
        cmds, self.outbox = tuple(self.outbox), []
        wake, self._wake = self._wake, False
        if self.dead is None:
            self.worker.submit(c.StepMessage(cmds), wake=wake)

    def remember_ended(self, tid: str, why: str) -> None:
        now = time.monotonic()
        self.ended[tid] = why
        self.ended.move_to_end(tid)
        self._ended_at[tid] = now
        while self.ended:
            oldest = next(iter(self.ended))
            if (len(self.ended) <= MAX_ENDED_REMEMBERED
                    and now - self._ended_at[oldest] <= ENDED_REMEMBERED_S):
                break
            self.ended.popitem(last=False)
            del self._ended_at[oldest]

    def record(self, rec: TransferRecord) -> None:
        self.records.append(rec)
        if self.record_sink is not None:
            try:
                self.record_sink(rec)
            except Exception:  # metrics must never break a transfer
                log.exception("transfer record sink failed")
