"""A TransferWorker without its thread, on a fake side channel and a fake transport, on
an injected clock: what the transfer-contract, thread-death and peer-table tests drive
by hand (``handle``, ``on_frame``, ``poll``, ``tick``, ``flush``)."""

from __future__ import annotations

from kvpush.cluster.launcher import free_port
from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.transfer_thread.context import Settings
from kvpush.kv_transfer.transfer_thread.worker import TransferWorker
from kvpush.kv_transfer.wire import messages as m
from worker_helpers import (  # noqa: F401 - the fakes and constants these tests share
    CHAIN,
    FENCE,
    LAYOUT,
    LEASE,
    PROMPT_TOKENS,
    Clock,
    D,
    FakeChannel,
    FakeTransport,
    P,
    hello,
)


def closed_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports on ``host`` that nothing listens on (bounded tries)."""
    ports: set[int] = set()
    for _ in range(20 * n):
        ports.add(free_port(host))
        if len(ports) == n:
            return sorted(ports)
    raise AssertionError(f"found only {len(ports)} free ports")


class Updates(list):
    """The worker's posted TransferUpdates, in order."""

    def events(self) -> list[c.Event]:
        return [ev for u in self for ev in u.events]

    def kinds(self) -> list[str]:
        return [type(ev).__name__ for ev in self.events()]

    def counters(self):
        """The last counters an update carried (None: none did)."""
        last = [u.counters for u in self if u.counters is not None]
        return last[-1] if last else None


def worker(role: str, mode: str = "push", *, ready: bool = True, channel=None,
           transport=None, lease: float = LEASE, **kw
           ) -> tuple[TransferWorker, FakeChannel, FakeTransport, Updates, Clock]:
    """A worker of ``role`` at P (prefill) or D (decode; a real ``channel``'s address),
    with the other side ready (its Hello delivered as a frame) unless not ``ready``.
    Not started: its heartbeat is due at once, as when its thread starts."""
    mine, theirs = (P, D) if role == "prefill" else (D, P)
    mine = getattr(channel, "address", None) or mine
    ch = channel if channel is not None else FakeChannel(mine)
    tr = transport if transport is not None else FakeTransport()
    updates, clock = Updates(), Clock()
    w = TransferWorker(hello(role, mine, mode), Settings(lease, 0.5, FENCE, 16), ch, tr,
                       updates.append, clock=clock, **kw)
    w.table.beat(0.0)
    if ready:
        other = "decode" if role == "prefill" else "prefill"
        w.on_frame(m.encode(hello(other, theirs, mode, reply=True)), theirs)
    return w, ch, tr, updates, clock


def step(w: TransferWorker, *facts: c.Fact) -> None:
    """The step loop's facts of one turn, carried out, and the pass's update posted."""
    w.handle(c.StepMessage(facts))
    w.flush()


def frame(w: TransferWorker, msg: m.Message, sender: str) -> None:
    """A peer's message on the side channel, and the pass's update posted."""
    w.on_frame(m.encode(msg), sender)
    w.flush()
