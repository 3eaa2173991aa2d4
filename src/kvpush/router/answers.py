"""An instance's answer to a health check (``/health``, ``/kv/prove``, ``/kv/info``),
read whole within a deadline and a size cap.

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
    """The answer went past ANSWER_CAP bytes (a failed check)."""


@dataclass(frozen=True)
class Answer:
    status_code: int
    content: bytes

    def json(self) -> Any:
        return json.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")


async def fetch(client: httpx.AsyncClient, method: str, url: str, timeout: float,
                **kw: Any) -> Answer:
    """``method url`` answered whole within ``timeout`` seconds and ANSWER_CAP bytes."""
    async def read() -> Answer:
        async with client.stream(method, url, timeout=timeout, **kw) as r:
            body = bytearray()
            async for chunk in r.aiter_bytes():
                body += chunk
                if len(body) > ANSWER_CAP:
                    raise AnswerTooLarge(f"{httpx.URL(url).path} answered more than "
                                         f"{ANSWER_CAP} bytes")
            return Answer(r.status_code, bytes(body))

    try:
        return await within(read(), timeout)
    except asyncio.TimeoutError:
        raise httpx.ReadTimeout(f"{httpx.URL(url).path} not answered whole within "
                                f"{timeout:g} s") from None
