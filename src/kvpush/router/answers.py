"""An instance's answer read whole within a size cap (:func:`read_capped`: a health
check's, a vLLM prefill leg's), and a health check's (``/health``, ``/kv/prove``,
``/kv/info``) within a deadline too.

httpx's timeout bounds each read, not the answer: an instance that trickles a byte a
second never times out. :func:`fetch` bounds the whole exchange (connect, headers,
body) by one deadline, raising ``httpx.ReadTimeout`` past it (a slow check, as the pool
counts them), and stops reading past :data:`ANSWER_CAP` bytes (:class:`AnswerTooLarge`).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import httpx

from kvpush.aio import within

#: the most a health-check answer may hold (a TP 8 instance's /kv/info is a few KiB)
ANSWER_CAP = 1 << 20


class AnswerTooLarge(ValueError):
    """An instance's answer (or one frame of its stream) went past the router's cap."""


@dataclass(frozen=True)
class Answer:
    status_code: int
    content: bytes

    def json(self) -> Any:
        return json.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")


async def read_capped(resp: httpx.Response, limit: int, what: str = "its answer") -> bytes:
    """The body of an open (``stream=True``) answer, read until ``limit`` bytes at most:
    AnswerTooLarge past it (by its Content-Length, before reading any)."""
    cap = f"the router's cap of {limit >> 20} MiB"
    size = resp.headers.get("content-length", "")
    if size.isdigit() and int(size) > limit:
        raise AnswerTooLarge(f"{what} is {int(size)} bytes, more than {cap}")
    body = bytearray()
    async for chunk in resp.aiter_bytes():
        body += chunk
        if len(body) > limit:
            raise AnswerTooLarge(f"{what} is more than {cap}")
    return bytes(body)


async def fetch(client: httpx.AsyncClient, method: str, url: str, timeout: float,
                **kw: Any) -> Answer:
    """``method url`` answered whole within ``timeout`` seconds and ANSWER_CAP bytes."""
    async def read() -> Answer:
        async with client.stream(method, url, timeout=timeout, **kw) as r:
            what = f"{httpx.URL(url).path}'s answer"
            return Answer(r.status_code, await read_capped(r, ANSWER_CAP, what))

    try:
        return await within(read(), timeout)
    except asyncio.TimeoutError:
        raise httpx.ReadTimeout(f"{httpx.URL(url).path} not answered whole within "
                                f"{timeout:g} s") from None
