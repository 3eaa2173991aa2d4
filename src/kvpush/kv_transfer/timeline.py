"""Per-transfer stage timestamps: where the milliseconds of a hand-off go.

Each instance stamps the stages of each transfer it takes part in (request in, step,
WRITEs or READ, completion, token #1) and, when its part is over, logs one line (logger
``kvpush.kv_transfer.handoff``, DEBUG)::

    handoff transfer=T role=prefill t_p_added=812.004113 t_p_step=812.004398 ...

Stamps are ``time.perf_counter()`` seconds (CLOCK_MONOTONIC: one clock per host), so the
router's and both instances' lines of a transfer line up (`kvpush bench handoff`). The
step loop owns the table (bounded); the transfer thread's stamps arrive with its ``Over``.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

log = logging.getLogger("kvpush.kv_transfer.handoff")
#: transfers whose stamps are kept at once (ended ones are logged and dropped)
MAX_TRACKED = 4096


class HandoffTimeline:
    def __init__(self, role: str) -> None:
        self.role = role
        self._stamps: OrderedDict[str, dict[str, float]] = OrderedDict()
        self._first: OrderedDict[str, str] = OrderedDict()  # decode: request id -> tid

    def begin(self, tid: str, stage: str) -> None:
        """The transfer's first stage on this instance (its request is in the engine)."""
        self._stamps.setdefault(tid, {})[stage] = time.perf_counter()
        while len(self._stamps) > MAX_TRACKED:
            self._stamps.popitem(last=False)

    def stamp(self, tid: str, stage: str, t: float | None = None, first: bool = False) -> None:
        """Record a later ``stage`` of ``tid`` now (or at ``t``) if its line is open (begun,
        not yet emitted); ``first``: keep an earlier stamp of the stage."""
        stamps = self._stamps.get(tid)
        if stamps is None or first and stage in stamps:
            return
        stamps[stage] = time.perf_counter() if t is None else t

    def await_first(self, request_id: str, tid: str) -> None:
        """Decode: ``tid``'s line waits for the request's token #1 (see first_token)."""
        self._first[request_id] = tid
        while len(self._first) > MAX_TRACKED:
            self._first.popitem(last=False)

    def first_token(self, request_id: str) -> None:
        """The request's token #1 went out: stamp ``d_first`` and log its line."""
        tid = self._first.pop(request_id, None)
        if tid is not None:
            self.stamp(tid, "d_first")
            self.emit(tid)

    def forget_request(self, request_id: str) -> None:
        tid = self._first.pop(request_id, None)
        if tid is not None:
            self._stamps.pop(tid, None)

    def emit(self, tid: str) -> dict[str, float] | None:
        """Log ``tid``'s line and forget it; returns its stamps (None: none taken)."""
        stamps = self._stamps.pop(tid, None)
        if stamps and log.isEnabledFor(logging.DEBUG):
            fields = " ".join(f"t_{k}={v:.6f}" for k, v in sorted(stamps.items(),
                                                                  key=lambda kv: kv[1]))
            log.debug("handoff transfer=%s role=%s %s", tid, self.role, fields)
        return stamps
