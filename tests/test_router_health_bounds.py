"""The router's health checks are bounded per answer and per instance (issue 67, point 3).

A stand-in instance (a raw asyncio HTTP server) answers ``/health`` normally, a byte at
a time (trickling), or with 200 MiB. A trickled answer fails its check at the
deadline, not never; a huge one stops being read at the cap; a trickling instance
delays no other instance's checks; and once it answers again it is back at its next
check.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvpush.aio import within
from kvpush.discovery.instance_spec import parse_instance
from kvpush.router.answers import ANSWER_CAP, AnswerTooLarge, fetch
from kvpush.router.config import RouterConfig
from kvpush.router.pool import Pool
from stand_in import push_kv_info

pytestmark = pytest.mark.timeout(30)


class StandIn:
    """One instance: ``mode`` is ok, trickle or huge (for /health; /kv/info always ok)."""

    def __init__(self, engine_id: str, role: str = "decode") -> None:
        self.mode = "ok"
        self.info = push_kv_info(role, engine_id, 5600)
        self.checks = 0  # /health requests answered in full
        self.sent = 0  # body bytes written
        self.checked = asyncio.Event()  # set at each answered /health
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1].decode()
                if path == "/health" and self.mode == "trickle":
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000000\r\n\r\n")
                    for _ in range(1000):  # a byte every 0.2 s: every read is prompt
                        writer.write(b" ")
                        await writer.drain()
                        self.sent += 1
                        await asyncio.sleep(0.2)
                    return
                if path == "/health" and self.mode == "huge":
                    size, chunk = 200 << 20, b"x" * (1 << 16)
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
                    for _ in range(size // len(chunk)):
                        writer.write(chunk)
                        await writer.drain()
                        self.sent += len(chunk)
                    return
                body = json.dumps(self.info if path == "/kv/info" else {"status": "ok"})
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(body), body.encode()))
                await writer.drain()
                if path == "/health":
                    self.checks += 1
                    self.checked.set()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()


def _pool(prefill: str, decode: str, timeout: float, interval: float = 0.05) -> Pool:
    cfg = RouterConfig(mode="push", prefill=(parse_instance(prefill),),
                       decode=(parse_instance(decode),),
                       health_interval_s=interval, health_timeout_s=timeout)
    return Pool(cfg)


def test_a_trickled_answer_fails_at_the_deadline_and_a_huge_one_at_the_cap():
    async def main():
        slow, big = StandIn("slow"), StandIn("big")
        slow.mode, big.mode = "trickle", "huge"
        slow_url, big_url = await slow.start(), await big.start()
        try:
            async with httpx.AsyncClient() as client:
                t0 = asyncio.get_running_loop().time()
                with pytest.raises(httpx.ReadTimeout, match="not answered whole within"):
                    await fetch(client, "GET", f"http://{slow_url}/health", 1.0)
                took = asyncio.get_running_loop().time() - t0
                assert 0.9 < took < 2.0, took  # each read came in 0.2 s: only the
                # deadline ends it
                with pytest.raises(AnswerTooLarge, match="more than"):
                    await fetch(client, "GET", f"http://{big_url}/health", 10.0)
                # reading stopped at the cap: what was written is the cap plus what the
                # sockets' buffers held, not 200 MiB
                await asyncio.sleep(0)
                assert big.sent < ANSWER_CAP + (16 << 20), big.sent
        finally:
            await slow.stop()
            await big.stop()

    asyncio.run(main())


def test_a_trickling_instance_delays_only_itself():
    async def main():
        slow, fast = StandIn("slow", "prefill"), StandIn("fast")
        slow.mode = "trickle"
        timeout = 3.0
        pool = _pool(await slow.start(), await fast.start(), timeout)
        (s,), (f,) = pool.by_role["prefill"], pool.by_role["decode"]
        async with httpx.AsyncClient() as client:
            loop = asyncio.create_task(pool.health_loop(client))
            try:
                # lock-step rounds would check the fast one once per slow check (3 s):
                # here it is checked every interval while the slow check hangs
                for _ in range(5):
                    fast.checked.clear()
                    await within(fast.checked.wait(), timeout / 5)
                assert fast.checks >= 5 and f.healthy
                # the slow one's checks fail at the deadline (it never got in) ...
                await within(_until(lambda: s.last_error is not None
                                    and "not answered whole" in s.last_error
                                    and not s.healthy), 3 * timeout)
                # ... and is back at its next check once it answers
                slow.mode = "ok"
                await within(_until(lambda: s.healthy), timeout + 1.0)
            finally:
                loop.cancel()
                await asyncio.gather(loop, return_exceptions=True)
                await slow.stop()
                await fast.stop()
        assert not pool._checks  # no check left running

    asyncio.run(main())


async def _until(cond) -> None:
    while not cond():
        await asyncio.sleep(0.02)
