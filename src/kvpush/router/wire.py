"""What the router puts on the wire: the prefill leg's body, push decode's
``kv_transfer_params``, and what of an instance's errors reaches the client (its error
answer, the error frames of its stream), scrubbed of internal names."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import httpx
from fastapi.responses import JSONResponse, Response

from kvpush.router.pool import Instance
from kvpush.router.redact import scrub, scrub_error
from kvpush.server.errors import APIError

if TYPE_CHECKING:
    from kvpush.router.config import RouterKeys

logger = logging.getLogger("kvpush.router")


def relay_error(status: int, content: bytes, role: str, inst: Instance, rid: str,
                engine_ids: Sequence[str] = (), retry_after: str | None = None) -> Response:
    """An instance's non-200 answer for the client: its status and its error in OpenAI's
    shape (kvpush's own, or vLLM's converted) with internal addresses and engine ids
    scrubbed (kvpush.router.redact), or a 502 when the body is no JSON error; the
    router's log keeps the answer as it came, with the request id. ``retry_after``: the
    instance's ``Retry-After`` (its 429 or 503), passed on."""
    headers = {"Retry-After": retry_after} if retry_after and status in (429, 503) else None
    snippet = content[:300].decode("utf-8", "replace").strip() or "(empty body)"
    if status >= 500:
        logger.warning("request %s: %s instance %s (%s) answered HTTP %d: %s", rid, role,
                       inst.url, inst.engine_id, status, snippet)
    try:
        obj = json.loads(content)
    except ValueError:
        obj = None
    body = scrub_error(obj, status, engine_ids)
    if body is not None:
        return JSONResponse(body, status_code=status, headers=headers)
    text = scrub(snippet[:200], engine_ids)
    return APIError(f"the {role} instance answered HTTP {status}: {text}",
                    status_code=502 if status >= 500 else status).response(headers)


class LegSigner:
    """Signs each leg's ``kv_transfer_params`` for the kvpush instance it goes to
    (kvpush.crypto.auth), and for an instance named ``URL@ENGINE_ID@HOST:PORT`` (vLLM
    with kvpush's connector checks them; vLLM's own connectors ignore the two keys);
    other vLLM instances get them unsigned, as their own proxies send them. Without
    the cluster secret nothing is signed."""

    def __init__(self, keys: RouterKeys | None) -> None:
        from kvpush.crypto.auth import ParamsSigner

        self._signer = ParamsSigner.from_key(keys.grant_key) if keys else None

    def sign(self, params: dict[str, Any], to: Instance, role: str,
             peer: Instance | None = None) -> dict[str, Any]:
        if self._signer is None or (to.info is None and to.spec.explicit is None):
            return params
        return self._signer.sign(params, role=role, engine_id=to.engine_id,
                                 peer_engine_id=peer.engine_id if peer else None)


def client_kv_params_problem(body: dict[str, Any]) -> str | None:
    """Why the router refuses a client's body: ``kv_transfer_params`` are cluster-
    internal (the router makes its own for every leg), so a client may not send any."""
    if body.get("kv_transfer_params") is None:
        return None
    return ("kv_transfer_params are cluster-internal: the router sets them for each leg, "
            "and a client may not send its own")


class FrameTooLong(Exception):
    """Decode's stream held more than the frame cap without a frame end."""


class AnswerTooLarge(Exception):
    """An instance's answer is larger than the router reads whole."""


async def read_answer(resp: httpx.Response, limit: int) -> bytes:
    """The body of an open (``stream=True``) answer, read until ``limit`` bytes at most:
    AnswerTooLarge past it (by its Content-Length, before reading any)."""
    size = resp.headers.get("content-length", "")
    if size.isdigit() and int(size) > limit:
        raise AnswerTooLarge(f"its answer is {int(size)} bytes, over the router's cap "
                             f"of {limit >> 20} MiB")
    parts: list[bytes] = []
    total = 0
    async for chunk in resp.aiter_bytes():
        total += len(chunk)
        if total > limit:
            raise AnswerTooLarge(f"its answer is over the router's cap of {limit >> 20} MiB")
        parts.append(chunk)
    return b"".join(parts)


class ErrorFrames:
    """Decode's SSE stream on its way to the client, cut at frame ends (a frame split
    over two chunks goes out whole, with the second), with each in-band error frame
    (``data: {"error": ...}``) scrubbed. ``errors`` keeps their messages as they came,
    for the router's log; ``done`` says the ``data: [DONE]`` frame has gone out (a client
    that hangs up after it received the whole answer). Each byte is scanned for a frame
    end once; an unfinished frame longer than ``max_frame`` raises FrameTooLong."""

    def __init__(self, engine_ids: Sequence[str] = (), max_frame: int = 4 << 20) -> None:
        self.engine_ids = engine_ids
        self.errors: list[str] = []
        self.done = False
        self.max_frame = max_frame
        self._pending = bytearray()

    def feed(self, chunk: bytes) -> bytes:
        """What of the stream so far can go to the client now."""
        pending = self._pending
        if not pending:
            end = chunk.rfind(b"\n\n")
            if end < 0:
                pending += chunk
                self._check()
                return b""
            if end + 2 == len(chunk):
                return self._clean(chunk)  # whole frames: the usual case
            pending += memoryview(chunk)[end + 2:]
            self._check()
            return self._clean(chunk[:end + 2])
        start = len(pending) - 1  # a frame end may straddle the old and the new bytes
        pending += chunk
        end = pending.rfind(b"\n\n", start)
        if end < 0:
            self._check()
            return b""
        out = bytes(pending[:end + 2])
        del pending[:end + 2]
        self._check()
        return self._clean(out)

    def _check(self) -> None:
        if len(self._pending) > self.max_frame:
            held = len(self._pending)
            self._pending = bytearray()
            raise FrameTooLong(f"a frame of its stream passed {held} bytes without an end "
                               f"(the router's cap is {self.max_frame >> 20} MiB)")

    def flush(self) -> bytes:
        """The rest, once the stream has ended."""
        data, self._pending = bytes(self._pending), bytearray()
        return self._clean(data)

    def _clean(self, data: bytes) -> bytes:
        if data.endswith(b"data: [DONE]\n\n") or data.endswith(b"data: [DONE]"):
            self.done = True
        if b'data: {"error"' not in data:
            return data
        frames = data.split(b"\n\n")
        for i, frame in enumerate(frames):
            if not frame.startswith(b'data: {"error"'):
                continue
            try:
                obj = json.loads(frame[6:])
                self.errors.append(str(obj["error"].get("message")))
            except (ValueError, AttributeError, TypeError, KeyError):
                obj = None
            body = scrub_error(obj, 500, self.engine_ids) or APIError(
                "decode reported an error in its stream", status_code=500).body()
            frames[i] = b"data: " + json.dumps(body).encode()
        return b"\n\n".join(frames)


def prefill_body(body: dict[str, Any], tid: str) -> dict[str, Any]:
    """The prefill leg: the client's body, one token, no stream, and the KV instructions
    (vLLM's field names; the None fields are what vLLM's own proxies send)."""
    b = dict(body)
    b["max_tokens"] = 1
    if "max_completion_tokens" in b:
        b["max_completion_tokens"] = 1
    if "min_tokens" in b:
        b["min_tokens"] = 0
    b["stream"] = False
    b.pop("stream_options", None)
    b["kv_transfer_params"] = prefill_params(tid)
    return b


def prefill_params(tid: str) -> dict[str, Any]:
    """A prefill leg's KV instructions (vLLM's field names; the None fields are what
    vLLM's own proxies send)."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid,
            "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
            "remote_port": None}


def push_decode_params(p: Instance, tid: str) -> dict[str, Any]:
    ident = p.identity
    assert ident is not None  # verified before it entered the rotation
    kv: dict[str, Any] = {
        "do_remote_prefill": True, "do_remote_decode": False, "transfer_id": tid,
        "remote_engine_id": ident.engine_id, "remote_host": ident.side_channel_host,
        "remote_port": ident.side_channel_port, "remote_request_id": tid,
    }
    if p.info is None:  # vLLM: its push proxy also sends P's parallel sizes
        kv.update(tp_size=1, pp_size=1)
    return kv
