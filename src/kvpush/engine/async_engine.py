"""AsyncEngine: the engine core's loop on a thread of this process, behind the
EngineClient interface (kvpush.engine.client).

Threads and hand-offs::

    event loop (HTTP)                        step-loop thread (owns the model)
    generate() ── engine.inbox (typed) ────▶ CoreLoop: process_inbox, step
    per-request asyncio.Queue ◀── call_soon_threadsafe(one EngineOutputs per turn) ──┘

The step loop blocks on the engine's inbox when it has no work (it never spins) and
never waits on the event loop: outputs are posted and it goes on. The event loop never
runs model code; it detokenizes each request's tokens (kvpush.engine.front). A consumer
that stops iterating a generate() stream (client gone, cancellation) aborts the
request, which frees its blocks. See kvpush.engine.core_loop for the loop itself and
its torch threads, and kvpush.engine.core_client for the same core in a child process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

from kvpush.config import EngineConfig
from kvpush.engine.core_loop import DEFAULT_THREADS, CoreLoop  # noqa: F401 (re-export)
from kvpush.engine.front import FrontEnd
from kvpush.engine.inputs import PLANE_ONLY, FrontCommand, Shutdown
from kvpush.engine.llm_engine import LLMEngine
from kvpush.engine.outputs import EngineOutputs

log = logging.getLogger(__name__)


class AsyncEngine(FrontEnd):
    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None):
        self.core = CoreLoop(config, engine)
        self.engine = self.core.engine
        #: the engine's structured-output compiler: the HTTP front in this process checks
        #: specs with it, so each compiles once
        self.grammars = self.engine.grammars
        self.engine_id = self.core.engine_id
        self.kv_events = self.core.kv_events
        self.side_channel = self.core.side_channel
        super().__init__(config, self.engine.tokenizer, self.engine.snapshot())
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ---- life cycle --------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        if self.kv_events is not None:
            self.kv_events.start()
        self._thread = threading.Thread(target=self._run, name="kvpush-step-loop",
                                        daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        loop = asyncio.get_running_loop()
        if self._thread is not None:
            self._send(Shutdown())
            await loop.run_in_executor(None, self._thread.join, 30)
            self._thread = None
        if self.kv_events is not None:  # after the step loop: its last events go out
            await loop.run_in_executor(None, self.kv_events.close)

    def _run(self) -> None:
        self.core.run(self._post)
        fatal, loop = self.core.fatal, self._loop
        if fatal is not None and loop is not None and not loop.is_closed():
            # as a dead core process is reported (CoreClient): the owner stops serving
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._died, str(fatal))

    def _died(self, why: str) -> None:
        if self.on_death is not None:
            self.on_death(why)

    def _core_problem(self) -> str | None:
        if self.core.fatal is not None or self._thread is None \
                or not self._thread.is_alive():
            return "the engine step loop is not running"
        return None

    def _send(self, cmd: FrontCommand) -> None:
        assert not isinstance(cmd, PLANE_ONLY)  # (a remote front's commands)
        self.engine.inbox.put(cmd)

    def _post(self, batch: EngineOutputs) -> None:
        """Hand a batch to the event loop (step-loop thread; never waits)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        # the loop may close between the check and the call
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self.dispatch, batch)
