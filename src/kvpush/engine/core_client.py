"""CoreClient: an EngineClient whose engine core runs in a child process
(kvpush.engine.core_proc), over ZMQ ``ipc://`` sockets with msgspec messages.

This process keeps the HTTP server, the tokenizer, the requests' checks and their
detokenizers and stop strings (kvpush.engine.front); it holds no weights and no KV. The
event loop itself watches the output socket (its ZMQ FD) and the child's pidfd
(``add_reader``: no thread hop between a batch's arrival and its dispatch, no timer,
no spinning). When the child exits without being asked to, every open stream ends with
an error, /health answers 503 and ``on_death`` is called (``kvpush serve`` then stops
with a non-zero exit).
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
import time

import msgspec
import zmq

from kvpush.config import ConfigError, EngineConfig
from kvpush.engine.core_dir import make_core_dir
from kvpush.engine.core_proc import CoreFailed, CoreReady, CoreSetup, Hello
from kvpush.engine.front import FrontEnd
from kvpush.engine.inputs import PLANE_ONLY, FrontCommand, Shutdown
from kvpush.engine.outputs import EngineOutputs
from kvpush.kv_transfer.links import TransferLinks
from kvpush.models.tokenizer import load_tokenizer
from kvpush.procs import describe_exit, pdeathsig_preexec

log = logging.getLogger("kvpush.engine.core")

#: how long a stopping core may take before it is killed
STOP_TIMEOUT_S = 30.0


class CoreClient(FrontEnd):
    @classmethod
    def launch(cls, config: EngineConfig, tokenizer=None, log_level: str = "INFO",
               start_timeout: float = 600.0, links: TransferLinks | None = None
               ) -> CoreClient:
        """Start the engine core and wait until it is ready (model loaded, sockets
        bound); ConfigError with the core's own message if it could not start.
        ``links`` (picklable) go to the core with its config (default: NIXL)."""
        tmp = make_core_dir()  # removes the folders of dead processes first
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
                                stdin=subprocess.PIPE, preexec_fn=pdeathsig_preexec())
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
            pickle.dump(CoreSetup(config, in_addr, out_addr, log_level, links), proc.stdin)
            proc.stdin.close()
        except OSError as e:
            raise give_up(f"the engine core did not start: {e}") from e
        if tokenizer is None:  # while the core starts
            try:
                tokenizer = load_tokenizer(config.model.path)
            except BaseException:
                give_up("the tokenizer did not load")  # stops the core; its error goes on
                raise
        poller = zmq.Poller()
        poller.register(from_core, zmq.POLLIN)
        poller.register(pidfd, zmq.POLLIN)
        deadline = time.monotonic() + start_timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise give_up(f"the engine core was not ready in {start_timeout:.0f} s")
            ready = dict(poller.poll(int(left * 1000)))
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
        #: the core's request plane ("host:port"; None: role both, or no secret)
        self.request_plane = hello.request_plane
        self.proc = proc
        self._pidfd = pidfd
        self._ctx = ctx
        self._to_core = to_core
        self._from_core = from_core
        self._tmp = tmp
        self._enc = msgspec.msgpack.Encoder()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dec = msgspec.msgpack.Decoder(EngineOutputs)
        self._watching = False
        self._stopping = False
        self._death: str | None = None
        self._closed = False

    # ---- life cycle -----------------------------------------------------------------
    def start(self) -> None:
        if self._watching:
            return
        self._watching = True
        loop = self._loop = asyncio.get_running_loop()
        loop.add_reader(self._from_core.fileno(), self._drain)
        loop.add_reader(self._pidfd, self._on_exit)
        self._drain()  # what arrived before the loop watched (the FD is edge-like)

    def _unwatch(self) -> None:
        if self._watching and self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._from_core.fileno())
            self._loop.remove_reader(self._pidfd)
        self._watching = False

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
        self._drain()
        self._unwatch()
        self.close()

    def close(self) -> None:
        """Release the sockets and the ipc folder, killing the core if it still runs."""
        if self._closed:
            return
        self._closed = True
        self._unwatch()
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

    def _send(self, cmd: FrontCommand) -> None:
        assert not isinstance(cmd, PLANE_ONLY)  # (a remote front's commands)
        if self._death is not None:
            return  # its streams have ended with the error already
        try:
            # never block: a PUSH socket with no peer (the core exiting, e.g. it took
            # the SIGTERM that killpg sent the whole group) would wait forever; the
            # pidfd watch reports the core's exit and ends its streams
            self._to_core.send(self._enc.encode(cmd), zmq.NOBLOCK)
        except zmq.Again:
            (log.info if self._stopping else log.warning)(
                "the engine core is not connected; %s dropped", type(cmd).__name__)

    # ---- the core's reports (event loop callbacks) --------------------------------------
    def _drain(self) -> None:
        """Dispatch every batch queued on the output socket (its FD only says that
        something may have changed: read until there is nothing). Nothing once closed:
        the exit watch's late drains can outlive a shutdown that already drained."""
        if self._closed:
            return
        sock = self._from_core
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.dispatch(self._dec.decode(frame))

    def _on_exit(self) -> None:
        """The child exited: what it sent just before may still be crossing ZMQ's I/O
        thread, so take that first (its last outputs precede the death's errors)."""
        assert self._loop is not None
        self._loop.remove_reader(self._pidfd)
        self._loop.create_task(self._after_exit())

    async def _after_exit(self) -> None:
        for _ in range(5):  # ~100 ms, once, and only on the core's exit
            self._drain()
            await asyncio.sleep(0.02)
        self._drain()
        code = self.proc.wait()
        if (self._stopping and code == 0) or self._death is not None:
            return  # (a loop that died said so in its last batch: told then)
        self._died(f"the engine core process {describe_exit(code)}")

    def _loop_died(self, why: str) -> None:
        # the process exits next; its streams, new requests and `serve` learn it now
        self._died(why)

    def _died(self, why: str) -> None:
        if self._stopping:
            log.warning("%s while stopping", why)
            return
        self._death = why
        log.error("%s: this instance cannot serve any more", why)
        self.fail_all(why)
        if self.on_death is not None:
            self.on_death(why)
