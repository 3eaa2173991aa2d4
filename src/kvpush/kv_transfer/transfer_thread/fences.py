"""Fences: the decode side's wait for a push whose WRITEs may still land (transfer thread).

A push's request on decode can end (its lease ran out: prefill went silent; the client
went away; the registration was lost) while prefill's WRITEs into its blocks are still
in flight or queued: a prefill that is frozen (SIGSTOP, a stalled host) rather than dead
resumes and finishes them. So the step loop keeps those blocks out of the pool and asks
the transfer thread to *fence* the transfer. A fence ends, and the blocks go back, when:

* prefill answers for the transfer: ``AbortAck`` (sent once its WRITEs have drained, for
  any id), ``PushDone`` (sent after its WRITEs), or its own ``Abort`` (it had none in
  flight). These reach the step loop as ordinary events, which ends the fence there;
* prefill's side-channel connection is seen to drop (``fence_released``, "peer_gone"):
  a process that ends closes its sockets, a frozen one keeps them open. The connection
  is our DEALER's to prefill, watched by a ZMQ socket monitor (``SideChannel``), with TCP
  keepalive so that a path that breaks is seen to drop too;
* ``fence_timeout_s`` passes (``fence_released``, "timeout"): the blocks are freed
  anyway, so that a prefill frozen for good (connection up, never answering) cannot hold
  them for ever; counted, and logged as the risk it is.

While it waits, the fence repeats the ``Abort`` every lease period (one may be lost).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.wire import messages as m

log = logging.getLogger("kvpush.kv_transfer.transfer_thread.worker")

#: default of how long decode keeps a push's blocks fenced when prefill neither answers
#: nor drops its connection (``--fence-timeout``)
DEFAULT_FENCE_TIMEOUT_S = 300.0


@dataclass
class Fence:
    """Decode side: a push whose blocks stay out of the pool until prefill is done."""

    address: str  # prefill's side channel
    deadline: float  # the fence timeout: the blocks are freed then whatever happened
    next_abort: float  # when the Abort is sent again (the last one may have been lost)


class FenceKeeper:
    """The decode side's fences, owned by the transfer thread's ``TransferWorker``.
    ``peer_ready(address)`` says whether an Abort can be sent to that peer now."""

    def __init__(self, channel, post_event: Callable[[c.TransferEvent], None],
                 peer_ready: Callable[[str], bool], lease_timeout_s: float,
                 fence_timeout_s: float) -> None:
        self.channel = channel
        self.post_event = post_event
        self.peer_ready = peer_ready
        self.lease_timeout_s = lease_timeout_s
        self.fence_timeout_s = fence_timeout_s
        self.fences: dict[str, Fence] = {}  # tid -> fence

    def fence(self, tid: str, address: str) -> None:
        """Fence push ``tid`` (its lease has ended: the caller dropped it); its blocks
        (held by the step loop) are released by a ``FenceReleased`` event or by
        prefill's own answer."""
        if self.channel.peer_gone(address):  # prefill's process has ended already
            self._release(address, [tid])
            return
        now = time.monotonic()
        self.fences[tid] = Fence(address, now + self.fence_timeout_s,
                                 now + self.lease_timeout_s)

    def drop(self, tid: str) -> None:
        """The step loop ended the transfer (prefill answered)."""
        self.fences.pop(tid, None)

    def next_deadline(self) -> float | None:
        """When the next fence times out or repeats its Abort (monotonic), if any."""
        return min((min(f.deadline, f.next_abort) for f in self.fences.values()),
                   default=None)

    def peer_dropped(self, address: str) -> None:
        """Our connection to ``address`` dropped: a process that ends closes it."""
        tids = [tid for tid, fence in self.fences.items() if fence.address == address]
        if tids:
            self._release(address, tids)

    def _release(self, address: str, tids: list[str]) -> None:
        for tid in tids:
            self.fences.pop(tid, None)
            log.info("transfer %s: the connection to prefill %s dropped (its process "
                     "ended): the blocks fenced for it are freed", tid, address)
            self.post_event(c.FenceReleased(tid, "peer_gone"))
        # what is still queued for that peer (a registration, if the link went down
        # before it left) must not reach it should it come back: it could WRITE then
        self.channel.forget(address)

    def expire(self, now: float) -> None:
        for tid, fence in list(self.fences.items()):
            if fence.deadline <= now:
                del self.fences[tid]
                self.post_event(c.FenceReleased(tid, "timeout"))
            elif fence.next_abort <= now:  # the last Abort may have been lost: again
                fence.next_abort = now + self.lease_timeout_s
                if self.peer_ready(fence.address):
                    self.channel.send(fence.address, m.encode(m.Abort(tid, "lease expired")))
