"""TransferLinks: how an instance reaches its peers, the KV transport and the side
channel. The engine builds both through the links it is given: ``NixlLinks`` (NIXL over
UCX, a ZMQ side channel) unless a test or a fault harness injects its own
(``kvpush_testing``). Links are plain picklable values: they travel to the engine core
process with its config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvpush.kv_transfer.transports.transport import KVTransport


class TransferLinks(Protocol):
    def transport(self, engine_id: str) -> KVTransport: ...

    def channel(self, host: str, port: int, secret: bytes | None): ...


@dataclass(frozen=True)
class NixlLinks:
    def transport(self, engine_id: str) -> KVTransport:
        from kvpush.kv_transfer.transports.nixl_transport import NixlTransport

        return NixlTransport(engine_id)

    def channel(self, host: str, port: int, secret: bytes | None):
        from kvpush.kv_transfer.wire.side_channel import SideChannel

        return SideChannel(host, port, secret=secret)
