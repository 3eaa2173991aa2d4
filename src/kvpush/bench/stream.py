"""One streaming request to an OpenAI-compatible server, measured on the client:
TTFT (send to the first chunk carrying a token), the gaps between token chunks, the
end-to-end latency, the usage the server reports, and the text it streamed (which the
multi-turn data set sends back as the next turn's history)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

from kvpush.aio import within
from kvpush.bench.metrics import RequestResult

#: How much of an error body is kept.
MAX_ERROR_CHARS = 2000


def auth_headers() -> dict[str, str]:
    """The bearer key for a keyed endpoint: $OPENAI_API_KEY (as `vllm bench serve`), else
    $KVPUSH_API_KEY (what kvpush serve/router/up read)."""
    key = os.environ.get("OPENAI_API_KEY") or os.environ.get("KVPUSH_API_KEY")
    return {"Authorization": f"Bearer {key.strip()}"} if key and key.strip() else {}


def _chunk_text(choice: dict[str, Any], chat: bool) -> str | None:
    """The text a streamed choice carries; None when it carries none (a chat stream's
    role announcement or a finish-only delta). "" is a token whose text the server holds
    back (part of a UTF-8 character, a possible stop string): as in vLLM's benchmark, it
    counts as the first token / an inter-token gap, so TTFT is the first token's time,
    not the first visible character's."""
    if chat:
        delta = choice.get("delta")
        if not isinstance(delta, dict) or "role" in delta:
            return None
        text = delta.get("content")
    else:
        text = choice.get("text")
    return text if isinstance(text, str) else None


async def _stream(client: Any, url: str, body: dict[str, Any], res: RequestResult,
                  chat: bool) -> None:
    """Send one request and read its SSE stream into ``res`` (success or error)."""
    st = time.perf_counter()
    last: float | None = None
    parts: list[str] = []
    done, finish = False, None
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode("utf-8", errors="replace")
            res.error = f"HTTP {resp.status_code}: {text.strip()[:MAX_ERROR_CHARS]}"
            return
        async for line in resp.aiter_lines():
            now = time.perf_counter()
            if not line.startswith("data:"):
                continue  # blank separators, comments, event:/id: fields
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            try:
                obj = json.loads(data)
            except ValueError:
                res.error = f"malformed SSE data: {data[:200]!r}"
                return
            if not isinstance(obj, dict):
                continue
            if obj.get("error"):
                res.error = f"error in stream: {json.dumps(obj['error'])[:MAX_ERROR_CHARS]}"
                return
            for choice in obj.get("choices") or []:
                text = _chunk_text(choice, chat)
                # an empty choice that ends the stream is no token gap (vLLM sends the
                # finish apart); still the first token if nothing came before it
                bare_finish = not text and choice.get("finish_reason") and last is not None
                if text is not None and not bare_finish:
                    if last is None:
                        res.ttft = now - st
                    else:
                        res.itl.append(now - last)
                    last = now
                    parts.append(text)
                finish = choice.get("finish_reason") or finish
            usage = obj.get("usage")
            if isinstance(usage, dict):
                res.output_tokens = int(usage.get("completion_tokens") or 0)
                if isinstance(usage.get("prompt_tokens"), int):
                    res.server_prompt_tokens = usage["prompt_tokens"]
    res.latency = time.perf_counter() - st
    res.generated_text = "".join(parts)
    if last is None:
        res.error = "the stream carried no content"
    elif not done and finish is None:
        res.error = "the stream ended before [DONE] or a finish_reason"
    elif finish in ("abort", "error"):
        res.error = f"the request finished with finish_reason={finish!r}"
    else:
        res.success = True


async def send_one(client: Any, url: str, body: dict[str, Any], res: RequestResult,
                chat: bool, t0: float, timeout: float) -> None:
    import httpx

    res.start_time = time.perf_counter() - t0
    try:
        await within(_stream(client, url, body, res, chat), timeout)
    except asyncio.TimeoutError:
        res.error = f"timed out after {timeout:g} s (request timeout)"
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    except Exception as e:  # noqa: BLE001 - a client bug must not lose the whole run
        res.error = f"client error: {type(e).__name__}: {e}"
    if res.error:
        res.success = False
