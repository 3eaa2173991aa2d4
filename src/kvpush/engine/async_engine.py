"""AsyncEngine: the asyncio front of an LLMEngine driven by its own step-loop thread.

Threads and hand-offs::

    event loop (HTTP)                      step-loop thread (owns the model)
    generate() ── engine.inbox ───────────▶ add / abort, then engine.step()
    per-request asyncio.Queue ◀── call_soon_threadsafe(one batch per step) ──┘

The step loop blocks on the engine's inbox when it has no work (it never spins) and
never waits on the event loop: outputs are posted and it goes on. The event loop never
runs model code. A consumer that stops iterating a generate() stream (client gone,
cancellation) aborts the request, which frees its blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator

from kvpush.config import EngineConfig
from kvpush.engine.llm_engine import LLMEngine
from kvpush.engine.outputs import EngineStats, RequestError, RequestOutput
from kvpush.sampling_params import SamplingParams

log = logging.getLogger(__name__)

_STOP = ("stop", "")


class AsyncEngine:
    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None):
        self.engine = engine if engine is not None else LLMEngine(config)
        self.config = config
        self.tokenizer = self.engine.tokenizer
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._fatal: BaseException | None = None

    # ---- life cycle --------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvpush-step-loop", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        if self._thread is None:
            return
        self.engine.inbox.put(_STOP)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30)
        self._thread = None

    def is_healthy(self) -> bool:
        return self._fatal is None and self._thread is not None and self._thread.is_alive()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    # ---- requests ----------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_transfer_params: dict | None = None,
    ) -> AsyncIterator[RequestOutput]:
        if not self.is_healthy():
            raise RuntimeError("the engine's step loop is not running")
        self.engine.validate(prompt_token_ids, params)
        if request_id in self._streams:
            raise RequestError(f"request id {request_id!r} is already in use", "request_id")
        stream: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[request_id] = stream
        self.engine.inbox.put(("add", request_id, prompt_token_ids, params, kv_transfer_params))
        finished = False
        try:
            while True:
                out = await stream.get()
                if out.finished:
                    finished = True
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.engine.inbox.put(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        self.engine.inbox.put(("abort", request_id))

    # ---- the step loop (its own thread) --------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                outputs = engine.process_inbox(block=not engine.has_work())
                if outputs and outputs[-1] == "stop":
                    if outputs[:-1]:
                        self._post(outputs[:-1])
                    break
                outputs += engine.step()
                if outputs:
                    self._post(outputs)
        except BaseException as e:  # pragma: no cover - reported through is_healthy
            log.exception("step loop died")
            self._fatal = e
        finally:
            self._abort_all()
            engine.shutdown()

    def _post(self, outputs: list[RequestOutput]) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        # the loop may close between the check and the call
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    def _abort_all(self) -> None:
        outs = []
        for rid in list(self.engine.scheduler.requests):
            out = self.engine.abort_request(rid)
            if out is not None:
                outs.append(out)
        if outs:
            self._post(outs)
