"""OpenAI-style error bodies, and the exception handlers that produce them.

Every error the HTTP server returns has the body OpenAI clients expect::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens",
               "code": null}}

so that the official clients raise a typed exception with a readable message, and
nothing a client sends can make the server answer with FastAPI's 422 shape or a bare
traceback.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvpush.errors import RequestError
from kvpush.sampling_params import SamplingParamsError

logger = logging.getLogger("kvpush.server")

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


def error_type_for(status_code: int) -> str:
    if status_code >= 500:
        return "server_error"
    return _TYPE_BY_STATUS.get(status_code, "invalid_request_error")


class APIError(Exception):
    """An error meant for the client: raised anywhere in a handler, answered as-is."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int = 400,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type or error_type_for(status_code)
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=headers)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    """('body', 'messages', 0, 'role') -> 'messages[0].role'."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or None


def from_validation_errors(errors: list[dict[str, Any]]) -> APIError:
    """Turn pydantic / FastAPI validation errors into one 400.

    The offending input is never echoed back (it may be huge, or NaN, which is not JSON).
    """
    if not errors:
        return APIError("invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error") or first.get("msg", "")
        return APIError(f"could not parse the request body as JSON: {detail}")
    parts = []
    for err in errors[:3]:
        param = _loc_to_param(tuple(err.get("loc", ())))
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if param is None and err.get("type") in ("model_type", "model_attributes_type", "missing"):
            msg = "the request body must be a JSON object"
        parts.append(f"{param}: {msg}" if param else msg)
    if len(errors) > 3:
        parts.append(f"and {len(errors) - 3} more")
    return APIError("; ".join(parts), param=_loc_to_param(tuple(first.get("loc", ()))))


def to_api_error(exc: BaseException) -> APIError | None:
    """The client-facing form of a known exception, or None for an unexpected one."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, (SamplingParamsError, RequestError)):
        return APIError(
            str(exc), param=getattr(exc, "param", None), code=getattr(exc, "code", None),
            status_code=getattr(exc, "status_code", 400),
        )
    if isinstance(exc, (ValidationError, RequestValidationError)):
        return from_validation_errors([dict(e) for e in exc.errors()])
    if isinstance(exc, StarletteHTTPException):  # e.g. 413 from the body-size limit
        return APIError(str(exc.detail), status_code=exc.status_code)
    return None


def internal_error() -> APIError:
    return APIError(
        "the server hit an internal error while serving this request; it has been logged",
        status_code=500,
        code="internal_error",
    )


def install_error_handlers(app: FastAPI) -> None:
    """Route every error FastAPI/Starlette can produce into the OpenAI body shape."""

    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        err = to_api_error(exc)
        assert err is not None
        return err.response()

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        status = exc.status_code
        if status == 404:
            message = f"no route for {request.method} {request.url.path}"
        else:
            message = str(exc.detail)
        err = APIError(message, status_code=status)
        return err.response(headers=dict(exc.headers) if exc.headers else None)

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Backstop only: the generation handlers catch their own errors (and count them).
        logger.error("unhandled error serving %s %s", request.method, request.url.path,
                     exc_info=exc)
        return internal_error().response()

    for cls in (APIError, SamplingParamsError, RequestError, RequestValidationError,
                ValidationError):
        app.add_exception_handler(cls, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)
