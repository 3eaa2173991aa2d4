"""An instance's registration: its card under a lease, kept alive, withdrawn on drain.

Lifecycle (:class:`RegState`)::

    IDLE -> REGISTERING -> REGISTERED -> WITHDRAWN          (drain: key deleted, lease revoked)
               ^   |           |
               |   v           v
               +-- WAITING <---+   (etcd unreachable, or the lease is gone: after an etcd
                                    restart without its data, or a partition longer than
                                    the TTL; granted and written again when etcd answers)

The key is ``PREFIX/instances/ROLE/ENGINE_ID`` and is bound to a lease of ``ttl_s``
seconds, renewed every third of it: a crashed instance's key goes when its lease expires
(within ``ttl_s``); a drained one's goes at once (:meth:`Registrar.withdraw`).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging

from kvpush.discovery.card import Card, encode
from kvpush.discovery.etcd import EtcdClient, EtcdError
from kvpush.discovery.target import EtcdTarget

logger = logging.getLogger("kvpush.discovery")

#: seconds between tries while etcd does not answer
RETRY_S = 1.0


class RegState(enum.Enum):
    IDLE = "idle"
    REGISTERING = "registering"
    REGISTERED = "registered"
    WAITING = "waiting"
    WITHDRAWN = "withdrawn"


def card_key(target: EtcdTarget, card: Card) -> str:
    return f"{target.prefix}instances/{card.role}/{card.engine_id}"


class Registrar:
    def __init__(self, target: EtcdTarget, card: Card, ttl_s: int = 10) -> None:
        if ttl_s < 2:
            raise ValueError("the registration TTL must be at least 2 s")
        self.target, self.card, self.ttl_s = target, card, ttl_s
        self.key = card_key(target, card)
        self.client = EtcdClient(target, timeout=min(2.0, ttl_s / 3))
        self.state = RegState.IDLE
        self.lease = 0
        self._task: asyncio.Task | None = None
        #: set each time the card is written (tests, `kvpush up`)
        self.registered = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvpush-register")

    async def _run(self) -> None:
        warned = False
        while True:
            try:
                self.state = RegState.REGISTERING
                self.lease = await self.client.grant(self.ttl_s)
                await self.client.put(self.key, encode(self.card), self.lease)
                self.state = RegState.REGISTERED
                self.registered.set()
                logger.info("registered in %s as %s (lease %x, TTL %d s)", self.target,
                            self.key, self.lease, self.ttl_s)
                warned = False
                while True:
                    await asyncio.sleep(self.ttl_s / 3)
                    if await self.client.keepalive(self.lease) <= 0:
                        logger.warning("registration lease %x is gone (etcd lost it or "
                                       "it expired): registering again", self.lease)
                        break
            except EtcdError as e:
                if not warned:
                    logger.warning("registration in %s: %s; trying again every %g s",
                                   self.target, e, RETRY_S)
                    warned = True
            self.state = RegState.WAITING
            self.registered.clear()
            await asyncio.sleep(RETRY_S)

    async def withdraw(self) -> None:
        """Drain: stop renewing, delete the key, revoke the lease (each bounded; if etcd
        does not answer the lease expires on its own within the TTL)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.state is RegState.WITHDRAWN:
            return
        try:
            await self.client.delete(self.key)
            if self.lease:
                await self.client.revoke(self.lease)
            logger.info("withdrew %s from %s", self.key, self.target)
        except EtcdError as e:
            logger.warning("could not withdraw %s (%s): its lease expires within %d s",
                           self.key, e, self.ttl_s)
        self.state = RegState.WITHDRAWN

    async def close(self) -> None:
        await self.withdraw()
        await self.client.aclose()
