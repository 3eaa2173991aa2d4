"""A stand-in instance for tests of the router's logic: an ASGI app that answers
``/health`` and, when given one, ``/kv/info``; each test adds the routes it scripts
(completions, models, aborts) to it. Serve it with ``server_helpers.uvicorn_server``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse


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


def push_kv_info(role: str, engine_id: str, side_port: int, kv_transfer: str = "push",
                 **extra: Any) -> dict[str, Any]:
    """The /kv/info of a P/D instance with a side channel on 127.0.0.1:``side_port``."""
    return {"engine_id": engine_id, "role": role, "kv_transfer": kv_transfer,
            "side_channel_host": "127.0.0.1", "side_channel_port": side_port, **extra}
