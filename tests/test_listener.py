"""The listening socket of `kvpush serve` and `kvpush router` (server/cli.py)."""

from __future__ import annotations


def test_listener_connections_have_nagle_off():
    """A chunk streamed after the headers must not wait for the client's delayed ACK:
    accepted connections need TCP_NODELAY (asyncio sets it only where ``proto`` says
    TCP, so both matter)."""
    import asyncio
    import socket

    from kvpush.server.cli import bind_listener

    listener = bind_listener("127.0.0.1", 0)
    assert listener.proto == socket.IPPROTO_TCP
    seen: list[int] = []

    async def main() -> None:
        def on_conn(reader, writer) -> None:
            sock = writer.get_extra_info("socket")
            seen.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_conn, sock=listener)
        async with server:
            _, w = await asyncio.open_connection(*listener.getsockname())
            for _ in range(100):
                if seen:
                    break
                await asyncio.sleep(0.01)
            w.close()

    asyncio.run(asyncio.wait_for(main(), 10))
    assert seen and seen[0] != 0
