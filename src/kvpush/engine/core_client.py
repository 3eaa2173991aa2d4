"""CoreClient: an EngineClient whose engine core runs in a child process
(kvpush.engine.core_proc), over ZMQ ``ipc://`` sockets with msgspec messages.

This process keeps the HTTP server, the tokenizer, the requests' checks and their
detokenizers and stop strings (kvpush.engine.front); it holds no weights and no KV. A
reader thread (``kvpush-core-output``) waits on the output socket and on the child's
pidfd at once (no timer, no spinning), decodes each batch and hands it to the event
loop. When the child exits without being asked to, every open stream ends with an
error, /health answers 503 and ``on_death`` is called (``kvpush serve`` then stops with
a non-zero exit).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import msgspec
import zmq

from kvpush.cluster.launcher import _pdeathsig_preexec, describe_exit
from kvpush.config import ConfigError, EngineConfig
from kvpush.engine.core_proc import CoreFailed, CoreReady, CoreSetup, Hello
from kvpush.engine.front import FrontEnd
from kvpush.engine.inputs import EngineCommand, Shutdown
from kvpush.engine.outputs import EngineOutputs

log = logging.getLogger("kvpush.engine.core")

#: how long a stopping core may take before it is killed
STOP_TIMEOUT_S = 30.0


class CoreClient(FrontEnd):
    @classmethod
    def launch(cls, config: EngineConfig, tokenizer=None, log_level: str = "INFO",
               start_timeout: float = 600.0) -> CoreClient:
        """Start the engine core and wait until it is ready (model loaded, sockets
        bound); ConfigError with the core's own message if it could not start."""
        if tokenizer is None:
            from kvpush.engine.llm_engine import load_tokenizer

            tokenizer = load_tokenizer(config.model.path)
        tmp = tempfile.mkdtemp(prefix="kvpush-core-")
        ctx = zmq.Context()
        to_core = ctx.socket(zmq.PUSH)
        to_core.setsockopt(zmq.SNDHWM, 0)
        to_core.setsockopt(zmq.LINGER, 0)
        from_core = ctx.socket(zmq.PULL)
        from_core.setsockopt(zmq.RCVHWM, 0)
        from_core.setsockopt(zmq.LINGER, 0)
        in_addr, out_addr = f"ipc://{tmp}/in", f"ipc://{tmp}/out"
        to_core.bind(in_addr)
        from_core.bind(out_addr)
        # the kernel kills the core if this process dies (PR_SET_PDEATHSIG); it stays
        # in this process group, so Ctrl-C and killpg reach it too
        proc = subprocess.Popen([sys.executable, "-m", "kvpush.engine.core_proc"],
                                stdin=subprocess.PIPE, preexec_fn=_pdeathsig_preexec())
        pidfd = os.pidfd_open(proc.pid)

        def give_up(message: str) -> ConfigError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
            os.close(pidfd)
            to_core.close()
            from_core.close()
            ctx.term()
            shutil.rmtree(tmp, ignore_errors=True)
            return ConfigError(message)

        try:
            assert proc.stdin is not None
            pickle.dump(CoreSetup(config, in_addr, out_addr, log_level), proc.stdin)
            proc.stdin.close()
        except OSError as e:
            raise give_up(f"the engine core did not start: {e}") from e
        poller = zmq.Poller()
        poller.register(from_core, zmq.POLLIN)
        poller.register(pidfd, zmq.POLLIN)
        deadline = time.monotonic() + start_timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise give_up(f"the engine core was not ready in {start_timeout:.0f} s")
            ready = dict(poller.poll(left * 1000))
            if from_core in ready:
                break
            if pidfd in ready:
                raise give_up(f"the engine core {describe_exit(proc.wait())} while "
                              "starting (see its log above)")
        hello = msgspec.msgpack.decode(from_core.recv(), type=Hello)
        if isinstance(hello, CoreFailed):
            raise give_up(hello.message)
        return cls(config, tokenizer, hello, proc, pidfd, ctx, to_core, from_core, tmp)

    def __init__(self, config: EngineConfig, tokenizer, hello: CoreReady,
                 proc: subprocess.Popen, pidfd: int, ctx: zmq.Context,
                 to_core: zmq.Socket, from_core: zmq.Socket, tmp: str):
        super().__init__(config, tokenizer, hello.snapshot)
        self.engine_id = hello.engine_id
        self.side_channel = hello.side_channel
        self.proc = proc
        self._pidfd = pidfd
        self._ctx = ctx
        self._to_core = to_core
        self._from_core = from_core
        self._tmp = tmp
        self._enc = msgspec.msgpack.Encoder()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self._stopping = False
        self._death: str | None = None
        self._closed = False

    # ---- life cycle -----------------------------------------------------------------
    def start(self) -> None:
        if self._reader is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._reader = threading.Thread(target=self._read, name="kvpush-core-output",
                                        daemon=True)
        self._reader.start()

    async def shutdown(self) -> None:
        self._stopping = True
        loop = asyncio.get_running_loop()
        if self.proc.poll() is None:
            with contextlib.suppress(zmq.ZMQError):
                self._send(Shutdown())
            try:
                await loop.run_in_executor(None, self.proc.wait, STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.error("the engine core did not stop in %.0f s; killing it",
                          STOP_TIMEOUT_S)
                self.proc.kill()
                await loop.run_in_executor(None, self.proc.wait)
        if self._reader is not None:
            await loop.run_in_executor(None, self._reader.join, 10)
        self.close()

    def close(self) -> None:
        """Release the sockets and the ipc folder, killing the core if it still runs."""
        if self._closed:
            return
        self._closed = True
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        with contextlib.suppress(OSError):
            os.close(self._pidfd)
        self._to_core.close()
        self._from_core.close()
        self._ctx.term()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def _core_problem(self) -> str | None:
        return self._death

    def _send(self, cmd: EngineCommand) -> None:
        if self._death is not None:
            return  # its streams have ended with the error already
        self._to_core.send(self._enc.encode(cmd))

    # ---- the reader thread --------------------------------------------------------------
    def _read(self) -> None:
        dec = msgspec.msgpack.Decoder(EngineOutputs)
        poller = zmq.Poller()
        poller.register(self._from_core, zmq.POLLIN)
        poller.register(self._pidfd, zmq.POLLIN)
        loop = self._loop
        assert loop is not None

        def drain() -> None:
            while True:
                try:
                    frame = self._from_core.recv(zmq.NOBLOCK)
                except zmq.Again:
                    return
                loop.call_soon_threadsafe(self.dispatch, dec.decode(frame))

        while True:
            ready = dict(poller.poll())
            drain()
            if self._pidfd in ready:
                # what it sent before exiting may still be on its way through ZMQ's
                # I/O thread: take it (its last outputs precede the death's errors)
                while self._from_core.poll(100):
                    drain()
                break
        code = self.proc.wait()
        if self._stopping and code == 0:
            return
        why = f"the engine core process {describe_exit(code)}"
        with contextlib.suppress(RuntimeError):  # the loop may be closed
            loop.call_soon_threadsafe(self._died, why)

    def _died(self, why: str) -> None:
        if self._stopping:
            log.warning("%s while stopping", why)
            return
        self._death = why
        log.error("%s: this instance cannot serve any more", why)
        self.fail_all(why)
        if self.on_death is not None:
            self.on_death(why)
