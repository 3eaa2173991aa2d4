"""The legs' socket layer (kvpush.router.net) keeps TCP's back-pressure: what an instance
sends faster than the router reads it waits in the kernel, not in the router's memory.
A plain asyncio server on 127.0.0.1 writes 32 MiB at once; the test reads slowly."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from kvpush.router.net import CoalescingBackend

pytestmark = pytest.mark.timeout(60)

TOTAL = 32 << 20


def test_a_fast_sender_is_held_back_while_the_router_does_not_read():
    async def main() -> None:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"x" * TOTAL)
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        stream = await CoalescingBackend().connect_tcp("127.0.0.1", port, timeout=5)
        try:
            first = await stream.read(65536, timeout=5)
            await asyncio.sleep(0.5)  # the sender goes on; nobody reads
            held = sum(len(c) for c in stream._p.chunks)
            # on old main the protocol took everything the kernel handed it (32 MiB)
            assert held < 4 << 20, f"{held >> 20} MiB buffered in the router"
            got = len(first)
            for _ in range(TOTAL):  # bounded: at least one byte a read
                data = await stream.read(1 << 20, timeout=5)
                if not data:
                    break
                got += len(data)
            assert got == TOTAL
        finally:
            await stream.aclose()
            server.close()
            await server.wait_closed()

    asyncio.run(main())


def test_the_same_on_uvloop_with_the_peer_gone_before_the_router_reads():
    """The router runs on uvloop when installed (router/cli.py): pausing and resuming
    work on its transports, also when the peer closed while reading was paused."""
    uvloop = pytest.importorskip("uvloop")

    async def main() -> None:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"y" * (1 << 20))
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        stream = await CoalescingBackend().connect_tcp("127.0.0.1", port, timeout=5)
        try:
            await asyncio.sleep(0.3)  # paused above the high-water mark; the peer closes
            got = 0
            for _ in range(1 << 20):
                data = await stream.read(1 << 16, timeout=5)
                if not data:
                    break
                got += len(data)
            assert got == 1 << 20
        finally:
            await stream.aclose()
            server.close()
            await server.wait_closed()

    loop = uvloop.new_event_loop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


@pytest.mark.parametrize("timeout", [None, 5.0])
def test_a_read_cancelled_as_its_data_arrives_stays_cancelled(timeout):
    """The relay's task is cancelled (its client hung up) in the very loop turn in which
    decode's next bytes arrive: the read must raise CancelledError, not return the bytes
    (Python 3.11's asyncio.wait_for dropped that cancellation, and the relay went on to
    the end of decode's stream)."""
    from kvpush.router.net import CoalescingStream, _Protocol

    async def main() -> tuple[bool, bool]:
        loop = asyncio.get_running_loop()
        protocol = _Protocol(loop)
        stream = CoalescingStream(protocol)
        task = asyncio.ensure_future(stream.read(1024, timeout=timeout))
        await asyncio.sleep(0)  # the read waits
        assert protocol.waiter is not None
        protocol.data_received(b"data: token\n\n")  # resolves the waiter ...
        task.cancel()  # ... and the task is cancelled in the same turn
        with contextlib.suppress(asyncio.CancelledError):
            await task
        # and a read's deadline still ends it, as httpcore's ReadTimeout
        late = asyncio.ensure_future(CoalescingStream(_Protocol(loop)).read(1, timeout=0.05))
        try:
            await late
        except Exception as e:  # noqa: BLE001 - checked below
            timed_out = type(e).__name__ == "ReadTimeout"
        else:
            timed_out = False
        return task.cancelled(), timed_out

    cancelled, timed_out = asyncio.run(main())
    assert cancelled, "the cancellation was dropped: the read returned the data"
    assert timed_out
