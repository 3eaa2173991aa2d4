"""Links for tests: how a test's engines reach each other, injected into ``LLMEngine``
(or a ``kvpush serve`` started by ``kvpush_testing.serve``) in place of
``kvpush.kv_transfer.links.NixlLinks``.

* ``InProcLinks``: the in-process transport (engines of one process) and a real ZMQ
  side channel, both misbehaving as a shared ``FaultPlan`` says;
* ``FaultyNixlLinks``: NIXL and the side channel as in production, with faults armed
  from plain knobs (picklable: it travels to the engine core process).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpush.kv_transfer.transports.transport import KVTransport, TransferPostError
from kvpush.kv_transfer.wire import messages as m
from kvpush.kv_transfer.wire.side_channel import SideChannel
from kvpush_testing.faults import FaultPlan


class FaultyChannel:
    """A side channel whose sends a ``FaultPlan`` may drop (lost on the wire: ``send``
    still says True) or delay (held here, sent by a later ``send`` or ``recv`` once
    due; ``recv`` waits no longer than the next one is due). Everything else is the
    wrapped channel's."""

    def __init__(self, channel: SideChannel, faults: FaultPlan,
                 type_of: Callable[[bytes], str] = m.type_name) -> None:
        self._channel, self._faults, self._type_of = channel, faults, type_of
        self._outbox: list[tuple[float, int, str, bytes]] = []
        self._seq = itertools.count()

    def send(self, address: str, payload: bytes) -> bool:
        if self._faults.take_message_drop(self._type_of(payload)):
            return True
        delay = self._faults.message_delay()
        if delay > 0:
            heapq.heappush(self._outbox, (time.monotonic() + delay, next(self._seq),
                                          address, payload))
            return True
        self._flush()
        return self._channel.send(address, payload)

    def recv(self, timeout_ms: int) -> list[tuple[str, bytes]]:
        self._flush()
        if self._outbox:
            due_ms = (self._outbox[0][0] - time.monotonic()) * 1000
            timeout_ms = max(0, min(timeout_ms, int(due_ms) + 1))
        out = self._channel.recv(timeout_ms)
        self._flush()
        return out

    def close(self) -> None:
        self._outbox.clear()
        self._channel.close()

    def _flush(self) -> None:
        now = time.monotonic()
        while self._outbox and self._outbox[0][0] <= now:
            _, _, address, payload = heapq.heappop(self._outbox)
            self._channel.send(address, payload)

    def __getattr__(self, name: str):
        return getattr(self._channel, name)


class FaultyPosts:
    """A transport that knows no FaultPlan (NIXL): ``fail_posts`` makes ``post`` raise
    TransferPostError; everything else is the real transport's."""

    def __init__(self, transport: KVTransport, faults: FaultPlan) -> None:
        self._transport, self._faults = transport, faults

    def post(self, op, peer, local, remote):
        if self._faults.take_post_failure():
            raise TransferPostError(f"injected {op} post failure (a test's FaultPlan)")
        return self._transport.post(op, peer, local, remote)

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


def _channel(host: str, port: int, secret: bytes | None, faults: FaultPlan | None):
    channel = SideChannel(host, port, secret=secret)
    return FaultyChannel(channel, faults) if faults is not None else channel


@dataclass(frozen=True, eq=False)
class InProcLinks:
    """Engines of one process: KV moves by memmove (``InProcTransport``)."""

    faults: FaultPlan | None = None

    def transport(self, engine_id: str) -> KVTransport:
        from kvpush_testing.inproc_transport import InProcTransport

        return InProcTransport(engine_id, faults=self.faults)

    def channel(self, host: str, port: int, secret: bytes | None):
        return _channel(host, port, secret, self.faults)


@dataclass(frozen=True, eq=False)
class FaultyNixlLinks:
    """NIXL and the ZMQ side channel with the faults ``knobs`` arm (FaultPlan's names,
    e.g. ``{"fail_posts": 1}``); the plan is made in the process that uses it."""

    knobs: dict = field(default_factory=dict)

    def plan(self) -> FaultPlan:
        plan = self.__dict__.get("_plan")
        if plan is None:
            plan = FaultPlan()
            plan.arm(**self.knobs)
            object.__setattr__(self, "_plan", plan)
        return plan

    def __getstate__(self) -> dict:
        return {"knobs": self.knobs}

    def __setstate__(self, state: dict) -> None:
        object.__setattr__(self, "knobs", state["knobs"])

    def transport(self, engine_id: str) -> KVTransport:
        from kvpush.kv_transfer.transports.nixl_transport import NixlTransport

        return FaultyPosts(NixlTransport(engine_id), self.plan())

    def channel(self, host: str, port: int, secret: bytes | None):
        return _channel(host, port, secret, self.plan())
