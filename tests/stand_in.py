"""Stand-in instances for tests of the router's logic: an ASGI app that answers
``/health`` and, when given one, ``/kv/info``, to which each test adds the routes it
scripts; and a vLLM-like one (:func:`vllm_like`) the router reaches over HTTP. Serve
them with ``server_helpers.uvicorn_server``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvpush.kv_info import KVInfo


def stand_in(kv_info: dict[str, Any] | Callable[[], dict[str, Any]] | None = None) -> FastAPI:
    """An app whose ``/health`` is ok and whose ``/kv/info`` is ``kv_info`` (called per
    request when it is a function: an instance that restarts with a new identity; absent
    when None: a colocated instance taken on the operator's word)."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    if kv_info is not None:
        @app.get("/kv/info")
        async def info() -> JSONResponse:
            return JSONResponse(kv_info() if callable(kv_info) else kv_info)

    return app


#: a stand-in's /kv/info where its test says nothing else: a role-both tiny model
BASE_INFO: dict[str, Any] = {
    "engine_id": "stand-in", "role": "both", "kv_transfer": None, "side_channel": None,
    "model": "tiny", "dtype": "float32", "dtype_reason": "asked for", "block_size": 16,
    "max_model_len": 128, "vocab_size": 256, "layout": {}, "tensor_parallel_size": 1,
    "tensor_parallel": None, "kv_memory": {}, "kv_events": None, "request_plane": None,
    "request_plane_members": False}


def make_kv_info(**fields: Any) -> KVInfo:
    """A whole /kv/info: ``fields`` over BASE_INFO (checked as a router decodes it)."""
    return msgspec.convert({**BASE_INFO, **fields}, KVInfo)


def kv_info_body(**fields: Any) -> dict[str, Any]:
    """make_kv_info's, as the JSON object an instance answers."""
    return msgspec.to_builtins(make_kv_info(**fields))


def push_kv_info(role: str, engine_id: str, side_port: int, kv_transfer: str = "push",
                 **extra: Any) -> dict[str, Any]:
    """The /kv/info of a P/D instance with a side channel on 127.0.0.1:``side_port`` and
    a plain request plane (by default at an address nothing answers: a router's legs
    to it find no engine core)."""
    return kv_info_body(**{
        "engine_id": engine_id, "role": role, "kv_transfer": kv_transfer,
        "side_channel_host": "127.0.0.1", "side_channel_port": side_port,
        "request_plane": "127.0.0.1:9", "request_plane_members": False, **extra})


def add_models(app: FastAPI, model_root: str, model_id: str = "tiny") -> None:
    """vLLM's ``/v1/models``: the served model's name, its folder (the router loads its
    tokenizer from there) and its context."""

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": model_id, "root": model_root, "max_model_len": 128}]})


def vllm_like(model_root: str, bodies: list[dict[str, Any]] | None = None,
              tokens: tuple[int, ...] = (5, 6, 7), frame_delay_s: float = 0.0) -> FastAPI:
    """A stand-in vLLM instance (no /kv/info): ``/v1/completions`` answers with
    ``tokens`` (up to max_tokens) as vLLM does when asked for ``return_token_ids``,
    streaming one frame a token (every ``frame_delay_s``; each of ``n`` choices the same
    tokens, with made-up logprobs when asked) or whole; a prefill leg
    (``do_remote_decode``) gets its one token and ``kv_transfer_params`` as vLLM's NIXL
    connector answers them. Every body is appended to ``bodies``."""
    app = stand_in()
    add_models(app, model_root)
    seen = bodies if bodies is not None else []

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        seen.append(body)
        out = list(tokens[:body.get("max_tokens") or 16])
        if not body.get("stream"):
            answer: dict[str, Any] = {"id": "c", "object": "text_completion", "choices": [
                {"index": 0, "text": "", "token_ids": out, "finish_reason": "length"}]}
            if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
                answer["kv_transfer_params"] = {
                    "do_remote_prefill": True, "do_remote_decode": False,
                    "remote_engine_id": "vllm-prefill", "remote_block_ids": [1],
                    "remote_host": "127.0.0.1", "remote_port": 1, "tp_size": 1}
            return JSONResponse(answer)

        async def frames() -> AsyncIterator[bytes]:
            for i, t in enumerate(out):
                if frame_delay_s:
                    await asyncio.sleep(frame_delay_s)
                last = i == len(out) - 1
                for index in range(body.get("n") or 1):  # n > 1: the same tokens each
                    choice: dict[str, Any] = {"index": index, "text": "", "token_ids": [t],
                                              "finish_reason": "length" if last else None}
                    if body.get("logprobs") is not None:  # (return_tokens_as_token_ids)
                        top = {f"token_id:{t + k}": -0.5 * (k + 1)
                               for k in range(body["logprobs"] or 1)}
                        choice["logprobs"] = {"token_logprobs": [-0.5], "tokens": [
                            f"token_id:{t}"], "top_logprobs": [top], "text_offset": [0]}
                    yield b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(frames(), media_type="text/event-stream")

    return app
