"""SentRegistrations: decode's push registrations, sent and sent again (transfer thread
of a push decode instance).

Receives (receives.py) hands it a receive's ``PushRegister`` once its blocks are
allocated and prefill checked. This object sends it, and keeps it while the transfer is
live: when prefill's heartbeat lists the transfer as awaiting its registration (the
message was lost, or prefill's peer table had evicted us), it is sent again, at most
every quarter lease and ``MAX_REGISTER_RESENDS`` times; after that decode gives up: it
tells prefill (``Abort``) and the receive (``RegistrationLost``), which fails the
request and fences its blocks (prefill may yet have got one). A registration is
forgotten as soon as its receive ends or is fenced.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.wire import messages as m

#: Re-sends of a registration that prefill says it never got, before decode gives up.
MAX_REGISTER_RESENDS = 3


@dataclass
class Sent:
    address: str
    reg: m.PushRegister
    at: float  # monotonic time of the last (re)send
    resends: int = 0


class SentRegistrations:
    def __init__(self, send: Callable[[str, m.Message], None],
                 post_event: Callable[[c.TransferEvent], None],
                 lease_timeout_s: float) -> None:
        self.send, self.post_event = send, post_event
        self.resend_after_s = lease_timeout_s / 4
        self.sent: dict[str, Sent] = {}

    def register(self, tid: str, address: str, reg: m.PushRegister, now: float) -> None:
        self.sent[tid] = Sent(address, reg, now)
        self.send(address, reg)

    def awaited(self, tids: Iterable[str], now: float, sender: str = "") -> None:
        """Prefill at ``sender`` says it has no registration for ``tids``: send ours
        again (only those sent to it)."""
        for tid in tids:
            s = self.sent.get(tid)
            if s is None or now - s.at < self.resend_after_s or (sender
                                                                 and s.address != sender):
                continue  # not ours, not its, or just sent: it may only be slow
            s.at = now
            s.resends += 1
            if s.resends <= MAX_REGISTER_RESENDS:
                self.send(s.address, s.reg)
                continue
            why = f"registration lost {MAX_REGISTER_RESENDS + 1} times"
            del self.sent[tid]
            self.send(s.address, m.Abort(tid, why))
            self.post_event(c.RegistrationLost(tid, why))

    def forget(self, tid: str) -> None:
        self.sent.pop(tid, None)
