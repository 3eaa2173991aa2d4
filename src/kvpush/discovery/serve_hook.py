"""`kvpush serve --register`: the HTTP server's lifecycle with a registration in it.

Order, on start: uvicorn starts (the app's lifespan starts the engine), then the card is
written (the instance is ready to serve). On SIGTERM or Ctrl-C: the key is deleted first
(routers watching the prefix drop the instance within a second), the instance keeps
serving for ``drain_grace_s`` (requests a router picked it for just before it saw the
deletion still arrive and are served), then uvicorn's graceful shutdown lets the requests
in flight finish (``timeout_graceful_shutdown``) and the process exits. A second signal
skips the wait. Nothing here knows about the engine: whichever process runs the HTTP
server runs this.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from kvpush.discovery.card import Card
from kvpush.discovery.register import Registrar
from kvpush.discovery.target import EtcdTarget

logger = logging.getLogger("kvpush.discovery")


class RegisteredServer(uvicorn.Server):
    """A uvicorn server that registers once started and withdraws before draining.

    ``make_card()`` is called once the server has started (the engine's identity, its
    side-channel port, is known by then)."""

    def __init__(self, config: uvicorn.Config, target: EtcdTarget,
                 make_card: Callable[[], Card], ttl_s: int, drain_grace_s: float) -> None:
        super().__init__(config)
        self.target, self.make_card = target, make_card
        self.ttl_s, self.drain_grace_s = ttl_s, drain_grace_s
        self.registrar: Registrar | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining: asyncio.Task | None = None
        self._signalled = False

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets=sockets)
        if not self.started or self.should_exit:
            return
        self._loop = asyncio.get_running_loop()
        self.registrar = Registrar(self.target, self.make_card(), self.ttl_s)
        self.registrar.start()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None or self._signalled or self.should_exit:
            super().handle_exit(sig, frame)  # not registered, or a second signal
            return
        self._signalled = True
        self._captured_signals.append(sig)
        # a signal handler runs between two bytecodes of the loop's own thread: hand the
        # drain to the loop the one way that is safe from there
        self._loop.call_soon_threadsafe(self._begin_drain, signal.Signals(sig).name)

    def _begin_drain(self, name: str) -> None:
        if self._draining is not None:
            return
        logger.info("%s: withdrawing from %s, then draining", name, self.target)
        self._draining = asyncio.create_task(self._drain())

    async def _drain(self) -> None:
        try:
            if self.registrar is not None:
                await self.registrar.withdraw()
            await asyncio.sleep(self.drain_grace_s)
        finally:
            self.should_exit = True

    async def shutdown(self, sockets: Any = None) -> None:
        await super().shutdown(sockets=sockets)
        if self.registrar is not None:
            await self.registrar.close()
