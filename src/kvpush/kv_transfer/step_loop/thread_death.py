"""What an instance does when its transfer thread dies (the step loop's side).

The transfer thread (worker.py) owns the side channel and the transport. When it ends
without being stopped (an exception escaping its loop, or a Stop the engine did not
send) it closes both and posts ``WorkerDied``, its last event, to the engine's inbox: the
step loop learns of it the way it learns of every transfer event, between two steps,
and an idle step loop wakes for it. From then on no message goes out or comes in, no
lease runs and no fence can end by a peer's word: the instance takes no part in KV
transfers any more. ``/health`` answers 503 with the reason (the router drops the
instance), every new request gets a 503 (a P/D request that was queued before the
death is refused with one too), and the connector ends every transfer at once:

=====================================  ==============================================
what the transfer held                 when its blocks go back to the pool
=====================================  ==============================================
prefill: push send (waiting for its    at once. Our own WRITEs only read them, and
registration, writing, draining)       the transport is closed (its transfers released
                                       or aborted, the agent gone) before the event is
                                       posted; were one still reading, only decode's
                                       copy would be wrong, and decode, which never
                                       gets the PushDone, throws it away
prefill: early registration            nothing of ours: dropped
prefill: pull lend                     after ``--lease-timeout``. Decode READs them
                                       one-sidedly, and closing our transport does not
                                       stop that on every UCX transport (cma reads
                                       another process's memory by pid and address,
                                       without our process taking part). The lease is
                                       what bounds a lend today (it frees lent blocks
                                       when it expires); no lease can be renewed once
                                       the thread is gone, so each would have expired by
                                       then
decode: pull receive                   at once when the transport closed cleanly (our
                                       READ ended with it); else as a push receive
decode: push receive (awaiting KV,     after ``--fence-timeout``. Prefill's WRITEs are
or already fenced)                     one-sided too, and with our thread gone no
                                       AbortAck, PushDone or dropped connection can
                                       end the fence early: this is the bound the
                                       project already keeps for a frozen prefill
                                       (fences.py). Prefill itself stops within its own
                                       lease, since our heartbeats stopped
=====================================  ==============================================

Before it closes its side channel, a dying thread whose transport closed cleanly (so
nothing of its own can land or be read any more) tells each ready peer: an ``Abort``
for every transfer it shares with it (its leases, claimed lends, receives and fences;
transfer_thread/teardown.py), sent with a short linger. The peer then ends those
transfers at once instead of at its lease (decode's client used to wait its 15 s lease).

Every request a transfer was for and that is still in the engine fails with the
reason (a decode request under ``--kv-load-failure-policy recompute`` is recomputed
locally instead, as after any failed transfer). The blocks that must wait are released
by ``DeadHold``: a one-shot timer thread that posts ``DeadHoldExpired`` into the same
inbox (it never wakes the step loop before then, and is cancelled at shutdown).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvpush.config import KVTransferConfig
from kvpush.engine.outputs import RequestError
from kvpush.kv_transfer import commands as c

log = logging.getLogger("kvpush.kv_transfer.step_loop.connector")

#: the error code of a P/D request an instance with a dead transfer thread refuses
UNAVAILABLE_CODE = "kv_transfer_unavailable"



def died_message(why: str) -> str:
    """The reason every affected request and /health give."""
    return (f"the KV transfer thread died ({why}): this instance takes no part in KV "
            "transfers any more")


def unavailable(why: str) -> RequestError:
    """The refusal of a P/D request reaching an instance whose transfer thread died: a
    503 (the instance's fault, not the client's)."""
    return RequestError(why, "kv_transfer_params", UNAVAILABLE_CODE, status_code=503)


def hold_seconds(cfg: KVTransferConfig) -> float:
    """How long blocks a peer may still reach stay out of the pool after the death (see
    the module docstring): prefill's lent blocks a lease, decode's pushed-into blocks
    the fence timeout."""
    return cfg.lease_timeout_s if cfg.role == "prefill" else cfg.fence_timeout_s


class DeadHold:
    """The one-shot timer that ends the hold on those blocks: ``DeadHoldExpired`` goes
    into the engine's inbox (through ``post_event``) once ``start``'s delay has passed."""

    def __init__(self, post_event: Callable[[c.TransferEvent], None]) -> None:
        self._post_event = post_event
        self._timer: threading.Timer | None = None

    def start(self, delay_s: float) -> None:
        if self._timer is not None:
            return
        log.warning("blocks a peer may still reach stay out of the pool for %.1f s "
                    "after the transfer thread's death", delay_s)
        self._timer = threading.Timer(delay_s, self._post_event, (c.DeadHoldExpired(),))
        self._timer.name = "kvpush-dead-hold"
        self._timer.daemon = True
        self._timer.start()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer.join(5)
