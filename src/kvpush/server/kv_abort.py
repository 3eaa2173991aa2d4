"""``POST /kv/abort``: the router releases what a prefill instance holds for a transfer.

Only the router may call it: with the cluster secret, the body must be signed by the
router for this instance like ``kv_transfer_params`` (kvpush.crypto.auth: the
grant names this instance and expires), and carry ``"kvpush_action": "abort"``, so that
a signed leg's params cannot be replayed as an abort. The body is small and flat:
at most ``MAX_ABORT_BODY_BYTES`` (a 413 beyond: :func:`read_abort_body` stops reading
once more than that has arrived, so no one makes the instance buffer 32 MiB here),
JSON that parses (a 400 for anything else, deep nesting included), a ``transfer_id``
of at most ``MAX_ID_CHARS`` printable characters. Every refusal is in OpenAI's error shape.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from kvpush.crypto.auth import ParamsForbidden, ParamsSigner
from kvpush.kv_transfer.params import MAX_ID_CHARS
from kvpush.server.errors import APIError

#: the largest /kv/abort body accepted: a transfer id, a grant and a signature
MAX_ABORT_BODY_BYTES = 4096
ACTION_KEY = "kvpush_action"
ABORT = "abort"


def abort_body(transfer_id: str) -> dict[str, Any]:
    """The body the router sends (then signs for the prefill instance)."""
    return {"transfer_id": transfer_id, ACTION_KEY: ABORT}


def _too_large() -> APIError:
    return APIError(f"a /kv/abort body is at most {MAX_ABORT_BODY_BYTES} bytes",
                    status_code=413, code="request_too_large")


async def read_abort_body(request: Request) -> bytes:
    """The body, read only up to the cap: a declared or arriving body over
    ``MAX_ABORT_BODY_BYTES`` is a 413 as soon as that is known."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_ABORT_BODY_BYTES:
        raise _too_large()
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_ABORT_BODY_BYTES:
            raise _too_large()
    return bytes(body)


def parse_abort(raw: bytes, signer: ParamsSigner | None, role: str,
                engine_id: str) -> str:
    """The transfer id of a /kv/abort body this instance may act on; APIError if not."""
    if len(raw) > MAX_ABORT_BODY_BYTES:
        raise _too_large()
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise APIError("the body must be a JSON object with transfer_id",
                       param="transfer_id") from None
    tid = body.get("transfer_id") if isinstance(body, dict) else None
    if not isinstance(tid, str) or not tid or len(tid) > MAX_ID_CHARS \
            or not tid.isprintable():
        raise APIError(f"transfer_id (a string of at most {MAX_ID_CHARS} printable "
                       "characters) is required", param="transfer_id")
    if signer is not None:
        try:
            signer.verify(body, role=role, engine_id=engine_id)
        except ParamsForbidden as e:
            raise APIError(f"/kv/abort: {e}", status_code=403, param=e.param,
                           code=e.code) from None
        if body.get(ACTION_KEY) != ABORT:
            raise APIError("/kv/abort takes only the router's signed abort",
                           status_code=403, code="kv_abort_not_signed_for_abort")
    return tid
