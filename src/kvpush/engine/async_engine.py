"""AsyncEngine: the asyncio front of an LLMEngine driven by its own step-loop thread.

Threads and hand-offs::

    event loop (HTTP)                      step-loop thread (owns the model)
    generate() ── command queue ──────────▶ add / abort, then engine.step()
    per-request asyncio.Queue ◀── call_soon_threadsafe(one batch per step) ──┘

The step loop blocks on the command queue when it has no work (it never spins) and
never waits on the event loop: outputs are posted and it goes on. The event loop never
runs model code. A consumer that stops iterating a generate() stream (client gone,
cancellation) aborts the request, which frees its blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator

from kvpush.config import EngineConfig
from kvpush.engine.llm_engine import LLMEngine
from kvpush.engine.outputs import EngineStats, FinishReason, RequestError, RequestOutput
from kvpush.sampling_params import SamplingParams

log = logging.getLogger(__name__)

_STOP = ("stop", "")


class AsyncEngine:
    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None):
        self.engine = engine if engine is not None else LLMEngine(config)
        self.config = config
        self.tokenizer = self.engine.tokenizer
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
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
        self._commands.put(_STOP)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30)
        self._thread = None

    def is_healthy(self) -> bool:
        return self._fatal is None and self._thread is not None and self._thread.is_alive()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    # ---- requests ----------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        if not self.is_healthy():
            raise RuntimeError("the engine's step loop is not running")
        self.engine.validate(prompt_token_ids, params)
        if request_id in self._streams:
            raise RequestError(f"request id {request_id!r} is already in use", "request_id")
        stream: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[request_id] = stream
        self._commands.put(("add", request_id, prompt_token_ids, params))
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
                self._commands.put(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    # ---- the step loop (its own thread) --------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                block = not self.engine.has_work()
                if not self._drain_commands(block):
                    break
                outputs = self.engine.step()
                if outputs:
                    self._post(outputs)
        except BaseException as e:  # pragma: no cover - reported through is_healthy
            log.exception("step loop died")
            self._fatal = e
        finally:
            self._abort_all()

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued commands; wait for one when idle. False means stop."""
        try:
            cmd = self._commands.get(block=block)
        except queue.Empty:
            return True
        while True:
            if cmd[0] == "stop":
                return False
            outputs = self._apply(cmd)
            if outputs:
                self._post(outputs)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, cmd: tuple) -> list[RequestOutput]:
        kind, request_id = cmd[0], cmd[1]
        if kind == "add":
            try:
                self.engine.add_request(request_id, cmd[2], cmd[3])
            except RequestError as e:
                return [self._error_output(request_id, str(e))]
            return []
        if kind == "abort":
            out = self.engine.abort_request(request_id)
            return [out] if out is not None else []
        raise ValueError(f"unknown command {kind!r}")

    @staticmethod
    def _error_output(request_id: str, message: str) -> RequestOutput:
        return RequestOutput(
            request_id=request_id,
            new_token_ids=[],
            new_text="",
            finished=True,
            finish_reason=FinishReason.ERROR,
            error=message,
        )

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
