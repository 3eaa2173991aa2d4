"""The legs' sockets: an httpcore network backend on plain asyncio protocols, whose
writes within one turn of the event loop go out as one ``send``.

httpx (through httpcore and anyio) writes a request's headers and its body in two
``send`` calls, each after a yield to the event loop. On loopback every ``send`` hands
the receiving process its data at once, and a profile of the router on the 2-vCPU hosts
(py-spy, benchmarks/router_overhead.py --profile) had two thirds of its busy time inside
``transport.write``. :class:`CoalescingBackend` keeps httpx's client and everything the
router does with it (timeouts, pool, errors), and changes only the bottom layer:

* ``write`` appends to the connection's buffer and returns without yielding; the buffer
  goes out at the end of the current loop turn (``call_soon``), so a request's headers
  and body leave in one segment;
* ``read`` waits on the protocol's ``data_received`` (no anyio task-group machinery,
  no checkpoint per call). Past ``HIGH_WATER`` bytes received and not yet read, the
  socket stops being read until ``read`` takes them below ``LOW_WATER``: an instance
  streaming faster than a client takes the answer waits in TCP, as with httpx's own
  backend, instead of filling the router's memory.

Errors are httpcore's (ConnectError, ConnectTimeout, ReadError, ReadTimeout,
WriteError), which httpx maps to its own as with its default backend.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterable
from typing import Any

import httpcore
from httpcore import AsyncNetworkBackend, AsyncNetworkStream

from kvpush.aio import within

#: bytes received and not yet read above which the socket is no longer read
HIGH_WATER = 256 << 10
#: ... and below which it is read again
LOW_WATER = 64 << 10


class _Protocol(asyncio.Protocol):
    """One TCP connection's receive side, and its write buffer."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.chunks: list[bytes] = []
        self.buffered = 0  # bytes in ``chunks``
        self.paused = False
        self.eof = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.out: list[bytes] = []

    # ---- receive
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (uvloop's is no subclass)

    def data_received(self, data: bytes) -> None:
        self.chunks.append(data)
        self.buffered += len(data)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def took(self, n: int) -> None:
        """``n`` bytes were read out of ``chunks``."""
        self.buffered -= n
        t = self.transport
        if self.paused and self.buffered < LOW_WATER and t is not None:
            self.paused = False
            if not t.is_closing():  # (uvloop's refuses a closed transport)
                t.resume_reading()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self.error = exc
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    # ---- send
    def write(self, data: bytes) -> None:
        if not self.out:
            self.loop.call_soon(self.flush)
        self.out.append(data)

    def flush(self) -> None:
        if not self.out:
            return
        data = b"".join(self.out) if len(self.out) > 1 else self.out[0]
        self.out.clear()
        t = self.transport
        if t is not None and not t.is_closing():
            t.write(data)


def _time_out(waiter: asyncio.Future[None], timeout: float) -> None:
    if not waiter.done():
        waiter.set_exception(httpcore.ReadTimeout(f"no data within {timeout:g} s"))


class CoalescingStream(AsyncNetworkStream):
    def __init__(self, protocol: _Protocol) -> None:
        self._p = protocol

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        p = self._p
        p.flush()  # what was written this turn goes out before we wait for the answer
        while not p.chunks:
            if p.eof:
                if p.error is not None:
                    raise httpcore.ReadError(str(p.error) or type(p.error).__name__)
                return b""
            # the future is awaited directly, its deadline a timer on the loop: Python
            # 3.11's asyncio.wait_for returns the result and drops the task's own
            # cancellation when both come in one loop turn (data arriving as the client
            # hangs up), and a relay cancelled so went on to the end of decode's stream
            waiter = p.waiter = p.loop.create_future()
            timer = (p.loop.call_later(timeout, _time_out, waiter, timeout)
                     if timeout is not None else None)
            try:
                await waiter
            finally:
                p.waiter = None
                if timer is not None:
                    timer.cancel()
        data = p.chunks.pop(0)
        if len(data) > max_bytes:
            p.chunks.insert(0, data[max_bytes:])
            data = data[:max_bytes]
        p.took(len(data))
        return data

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        p = self._p
        if p.transport is None or p.transport.is_closing() or p.eof:
            raise httpcore.WriteError("the connection is closed")
        if buffer:
            p.write(buffer)

    async def aclose(self) -> None:
        p = self._p
        p.out.clear()
        if p.transport is not None:
            p.transport.close()

    async def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                        timeout: float | None = None) -> AsyncNetworkStream:
        raise httpcore.ConnectError("TLS is not supported on the router's legs")

    def get_extra_info(self, info: str) -> Any:
        p = self._p
        if info == "is_readable":  # an idle kept-alive connection the peer closed
            return p.eof or bool(p.chunks)
        t = p.transport
        if t is None:
            return None
        if info == "socket":
            return t.get_extra_info("socket")
        if info == "client_addr":
            return t.get_extra_info("sockname")
        if info == "server_addr":
            return t.get_extra_info("peername")
        return None


class CoalescingBackend(AsyncNetworkBackend):
    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Iterable[Any] | None = None) -> AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        local = (local_address, 0) if local_address else None
        try:
            _, protocol = await within(
                loop.create_connection(lambda: _Protocol(loop), host, port,
                                       local_addr=local), timeout)
        except asyncio.TimeoutError:
            raise httpcore.ConnectTimeout(f"connecting took over {timeout:g} s") from None
        except OSError as e:
            raise httpcore.ConnectError(str(e) or type(e).__name__) from e
        sock = protocol.transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for option in socket_options or ():
                sock.setsockopt(*option)
        return CoalescingStream(protocol)

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[Any] | None = None,
                                  ) -> AsyncNetworkStream:
        raise httpcore.ConnectError("unix sockets are not used by the router")

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
