"""What the router puts on the wire: the prefill leg's body, push decode's
``kv_transfer_params``, and an instance's error answer relayed to the client."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse, Response

from kvpush.router.pool import Instance
from kvpush.server.errors import APIError


def relay_error(status: int, content: bytes, role: str, inst: Instance) -> Response:
    """An instance's non-200 answer for the client: its own JSON body and status (OpenAI
    error shape from kvpush, vLLM's own shape from vLLM), or a 502 naming the instance."""
    try:
        obj = json.loads(content)
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        return JSONResponse(obj, status_code=status)
    snippet = content[:200].decode("utf-8", "replace").strip() or "(empty body)"
    return APIError(f"{role} instance {inst.url} answered HTTP {status}: {snippet}",
                    status_code=502 if status >= 500 else status).response()


class LegSigner:
    """Signs each leg's ``kv_transfer_params`` for the kvpush instance it goes to
    (kvpush.kv_transfer.grants); vLLM instances (no /kv/info) get them unsigned, as
    their own proxies send them. Without the cluster secret nothing is signed."""

    def __init__(self, secret: bytes | None) -> None:
        from kvpush.kv_transfer.grants import ParamsSigner

        self._signer = ParamsSigner(secret) if secret else None

    def sign(self, params: dict[str, Any], to: Instance, role: str,
             peer: Instance | None = None) -> dict[str, Any]:
        if self._signer is None or to.info is None:
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
    b["kv_transfer_params"] = {
        "do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid,
        "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
        "remote_port": None,
    }
    return b


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
