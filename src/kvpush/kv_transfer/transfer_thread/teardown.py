"""How the transfer thread ends (worker.py's ``_run`` calls ``teardown`` on its way out).

Stopped (``TransferWorker.stop``): it closes the side channel and the transport, and
tells no one. Dead (an exception escaped its loop, or a Stop the engine did not send):
it closes the transport first; once that closed cleanly nothing of this instance's can
land in or read a peer's memory any more, so it tells each ready peer an ``Abort`` for
every transfer it shares with it (``tell_peers``: its leases, claimed lends, receives
and fences), closes the side channel with a short linger for those to leave, and posts
``WorkerDied`` to the step loop as its last event. What the step loop frees then, and
what must wait, is step_loop/thread_death.py's.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.wire import messages as m

if TYPE_CHECKING:
    from kvpush.kv_transfer.transfer_thread.worker import TransferWorker

log = logging.getLogger("kvpush.kv_transfer.transfer_thread.worker")

#: how long the dying thread's side channel may take to send its Aborts (ms)
NOTICE_LINGER_MS = 500


def tell_peers(worker: TransferWorker, why: str) -> int:
    """On the dying transfer thread: an Abort to each ready peer for every transfer it
    shares with us; the linger (ms) the channel's close should give them (0: none)."""
    shared: dict[str, set[str]] = {}
    for tid, lease in worker.leases.items():
        if lease.address:
            shared.setdefault(lease.address, set()).add(tid)
    for tid, (address, _) in worker.claims.claimed.items():
        shared.setdefault(address, set()).add(tid)
    if worker.receives is not None:
        for address, tids in worker.receives.shared().items():
            shared.setdefault(address, set()).update(tids)
    for tid, fence in worker.fences.fences.items():
        shared.setdefault(fence.address, set()).add(tid)
    sent = 0
    reason = f"the peer's KV transfer thread died: {why}"[:512]
    for address, tids in shared.items():
        if not worker.peers.is_ready(address):
            continue
        for tid in sorted(tids):
            try:
                sent += worker.channel.send(address, m.encode(m.Abort(tid, reason)))
            except Exception:  # noqa: BLE001 - going down anyway: best effort
                log.exception("telling %s of the death failed", address)
                break
    if sent:
        log.warning("the dying transfer thread told its peers: %d transfers aborted", sent)
    return NOTICE_LINGER_MS if sent else 0


def teardown(worker: TransferWorker, why: str | None) -> None:
    """Close the side channel and the transport; on a death (``why``), tell the step
    loop only once the transport is closed: from then on no transfer this instance
    posted touches its memory, which is what lets the step loop free blocks."""
    try:
        worker._flush_events()  # what the last pass saw goes before any death
    except Exception:  # noqa: BLE001 - going down anyway
        log.exception("posting the transfer thread's last events failed")
    worker._batch = None
    if why is not None:
        worker._death = why  # /health fails from now on
    else:  # stopped: nothing to tell anyone
        _close_channel(worker, 0)
    transport_closed = True
    try:
        worker.transport.close()
    except Exception:  # noqa: BLE001 - the event says so: its transfers may live on
        log.exception("closing the KV transport failed")
        transport_closed = False
    if why is not None:  # a death: tell the peers once nothing of ours moves any more
        linger_ms = 0
        try:
            linger_ms = tell_peers(worker, why) if transport_closed else 0
        except Exception:  # noqa: BLE001 - going down anyway
            log.exception("telling the peers of the death failed")
        _close_channel(worker, linger_ms)
        worker.post_event(c.WorkerDied(why, transport_closed))


def _close_channel(worker: TransferWorker, linger_ms: int) -> None:
    try:
        if linger_ms:  # (test channels take no linger)
            worker.channel.close(linger_ms)
        else:
            worker.channel.close()
    except Exception:  # noqa: BLE001 - going down anyway
        log.exception("closing the side channel failed")
