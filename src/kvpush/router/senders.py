"""How a leg reaches an instance: the :class:`LegSender` contract the request life
(kvpush.router.life) drives; :class:`CoreSender`, its engine-core side: each kvpush
instance's engine core over its request plane (kvpush.engine.core_link.RemoteCore:
ZMQ with CURVE keys from the cluster secret, msgspec); and :class:`Senders`, which
says once which way each instance takes: a kvpush instance (its /kv/info names a
request plane) its engine core, a vLLM instance (no /kv/info) HTTP
(kvpush.router.http_sender).

A leg is the engine's own typed request: prompt token ids, sampling parameters, the
``kv_transfer_params`` signed for the instance it goes to (the core checks them), under
the leg's transfer id. Its outputs are the core's token ids (``EngineOutput``); the life
turns them into text once for the whole request, whatever legs carried it.

The link to an instance's core is made on first sight of its request plane (its
``/kv/info``), remade when the address changes, and closed when the instance leaves the
pool (once the legs in flight on it are over). A link whose connection drops takes its
instance out of the rotation at once (``Pool.mark_failed``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvpush.engine.core_link import RemoteCore
from kvpush.engine.outputs import EngineOutput, EngineStats
from kvpush.router.pool import Instance, Pool
from kvpush.router.wire import LegKV

if TYPE_CHECKING:
    from kvpush.crypto.curve import CurveKeys
    from kvpush.kv_transfer.params import WireKVParams
    from kvpush.sampling_params import SamplingParams


@dataclass(frozen=True)
class Lost:
    """Why the way to an instance is gone: ``cause`` (a metric label:
    ``connection_lost``, ``core_died``) and the reason, as the log says it."""

    cause: str
    why: str


@dataclass(frozen=True)
class Leg:
    """One leg of a request, as it leaves for ``inst``."""

    inst: Instance
    #: the leg's id on the instance (the transfer id: both legs of a pair share it)
    transfer_id: str
    prompt: list[int]
    params: SamplingParams
    #: the leg's kv_transfer_params, signed for ``inst`` (None: a plain request)
    kv: LegKV | None


class LegSender(Protocol):
    """What the request life needs of the way to an instance."""

    def usable(self, inst: Instance) -> bool:
        """Whether a leg can leave for ``inst`` now."""
        ...

    def lost(self, inst: Instance) -> Lost | None:
        """Why the way to ``inst`` is gone (its connection dropped, its core died), or
        None while it holds."""
        ...

    def stream(self, leg: Leg) -> AsyncIterator[EngineOutput]:
        """The leg's outputs (RequestError when the instance refuses it; closing the
        stream early aborts the leg there)."""
        ...

    def release(self, inst: Instance, transfer_id: str) -> None:
        """Prefill ``inst`` drops what it holds for ``transfer_id`` (its KV has no
        reader: decode refused or failed, or the client left)."""
        ...

    def handshaking(self, inst: Instance) -> bool:
        """Whether the way to ``inst`` is still being set up (not lost: passed over)."""
        ...


class CoreLink(Protocol):
    """What the sender uses of a link to one engine core (RemoteCore)."""

    address: str
    proven: bool
    connected: bool
    fatal: str | None
    on_lost: Callable[[str], None] | None

    def health_problem(self) -> str | None: ...

    def latest_stats(self) -> EngineStats | None: ...

    def stream(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               kv_transfer_params: WireKVParams | None = None
               ) -> AsyncIterator[EngineOutput]: ...

    def abort_transfer(self, transfer_id: str, why: str = ...) -> None: ...

    def has_streams(self) -> bool: ...

    async def wait_connected(self, timeout: float) -> bool: ...

    def close(self) -> None: ...


def remote_core(keys: CurveKeys | None, tokenizer: Any) -> Callable[[str], CoreLink]:
    """Links to real engine cores: a started RemoteCore per request-plane address
    (``keys`` None: plain planes, a cluster without a secret)."""
    def connect(address: str) -> CoreLink:
        core = RemoteCore(address, keys, tokenizer)
        core.start()
        return core
    return connect


class CoreSender:
    """Legs to kvpush instances' engine cores."""

    def __init__(self, pool: Pool, connect: Callable[[str], CoreLink]) -> None:
        self.pool = pool
        self._connect = connect
        #: one link per instance URL, to the request plane its /kv/info names
        self._links: dict[str, CoreLink] = {}
        #: links of instances that left the pool, closed once their streams are over
        self._leaving: set[CoreLink] = set()
        pool.on_remove.append(self._forget)
        # an instance's link is made (and its handshake done) when it enters the
        # rotation, not by the first request that would take it
        pool.on_info.append(self._linked)

    def link(self, inst: Instance) -> CoreLink | None:
        """The link to ``inst``'s engine core (made on first sight of its request plane,
        remade when the address changes); None when its /kv/info names none. A link
        whose connection drops takes its instance out of the rotation at once."""
        addr = inst.info.request_plane if inst.info is not None else None
        if not addr:
            return None
        core = self._links.get(inst.url)
        if core is not None and core.address == addr:
            return core
        if core is not None:
            core.close()
        core = self._links[inst.url] = self._connect(addr)

        def lost(why: str) -> None:
            if self._links.get(inst.url) is core:
                self.pool.mark_failed(inst, f"its engine core was lost: {why}")

        core.on_lost = lost
        return core

    def _linked(self, inst: Instance) -> None:
        self.link(inst)

    def handshaking(self, inst: Instance) -> bool:
        """Whether ``inst``'s link has not finished its first handshake yet."""
        core = self._links.get(inst.url)
        return core is not None and not core.proven

    def latest_stats(self, inst: Instance) -> EngineStats | None:
        """``inst``'s gauges as its core's latest snapshot says (None: no link up, or
        no snapshot on it yet)."""
        core = self._links.get(inst.url)
        return core.latest_stats() if core is not None else None

    # ---- LegSender -----------------------------------------------------------------
    def usable(self, inst: Instance) -> bool:
        core = self._links.get(inst.url)
        return core is not None and core.proven and self.lost(inst) is None

    def lost(self, inst: Instance) -> Lost | None:
        core = self._links.get(inst.url)
        if core is None:
            return Lost("connection_lost", "it has no engine core link")
        if core.fatal is not None:
            return Lost("core_died", core.fatal)
        problem = core.health_problem()
        return None if problem is None else Lost("connection_lost", problem)

    async def stream(self, leg: Leg) -> AsyncIterator[EngineOutput]:
        core = self._links[leg.inst.url]
        assert not isinstance(leg.kv, dict)  # (a kvpush instance's: LegSigner)
        outs = core.stream(leg.transfer_id, leg.prompt, leg.params, leg.kv)
        try:
            async for out in outs:
                yield out
        finally:
            await outs.aclose()  # type: ignore[attr-defined]
            if core in self._leaving:  # its instance left: the link goes with its last leg
                self.close_idle()

    def release(self, inst: Instance, transfer_id: str) -> None:
        core = self._links.get(inst.url)
        if core is not None:
            core.abort_transfer(transfer_id)

    # ---- life ------------------------------------------------------------------------
    def _forget(self, inst: Instance) -> None:
        """``inst`` left the pool: no new legs; its link closes once the legs in flight
        on it are over."""
        core = self._links.pop(inst.url, None)
        if core is not None:
            self._leaving.add(core)
        self.close_idle()

    def close_idle(self) -> None:
        for core in [c for c in self._leaving if not c.has_streams()]:
            self._leaving.discard(core)
            core.close()

    def close(self) -> None:
        cores = [*self._links.values(), *self._leaving]
        self._links, self._leaving = {}, set()
        for core in cores:
            core.close()


class Senders:
    """Each instance's way, said once (``Instance.kvpush``: its engine core, else
    HTTP): the LegSender the life drives."""

    def __init__(self, cores: CoreSender, http: LegSender) -> None:
        self.cores = cores
        self.http = http

    def of(self, inst: Instance) -> LegSender:
        return self.cores if inst.kvpush else self.http

    def serves(self) -> bool:
        """Whether a leg can leave now for a decode (and a prefill, where the router
        needs one). Every healthy kvpush instance gets its core link here; one still
        handshaking is skipped."""
        usable = {"prefill": False, "decode": False}
        for inst in self.cores.pool.instances:
            if not inst.healthy:
                continue
            if inst.kvpush and self.cores.link(inst) is None:
                continue
            if self.of(inst).usable(inst):
                usable[inst.role] = True
        return usable["decode"] and (usable["prefill"]
                                     or not self.cores.pool.cfg.needs_prefill)

    def usable(self, inst: Instance) -> bool:
        return self.of(inst).usable(inst)

    def lost(self, inst: Instance) -> Lost | None:
        return self.of(inst).lost(inst)

    def stream(self, leg: Leg) -> AsyncIterator[EngineOutput]:
        return self.of(leg.inst).stream(leg)

    def release(self, inst: Instance, transfer_id: str) -> None:
        self.of(inst).release(inst, transfer_id)

    def handshaking(self, inst: Instance) -> bool:
        return self.of(inst).handshaking(inst)
