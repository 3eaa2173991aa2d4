"""Request-body schemas in the OpenAPI document of the instance and of the router.

The generation handlers read their body by hand (so every parse error becomes an
OpenAI-style 400, never FastAPI's 422), which hides the request models from FastAPI's
schema generation. Each route names its model with ``openapi_extra=request_body(NAME)``
and :func:`install_openapi` adds the models (and what they refer to) to
``components/schemas``: clients, docs and schemathesis see the real request shapes.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from kvpush.sampling_params import MAX_LOGIT_BIAS_ENTRIES, MAX_PENALTY, MAX_TOP_LOGPROBS
from kvpush.server.chat import ALLOWED_ROLES
from kvpush.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)

REF = "#/components/schemas/{model}"


class KVTransferParams(BaseModel):
    """vLLM's field names; what a prefill or decode instance expects (the router sets
    them; a client of the router cannot)."""

    model_config = ConfigDict(extra="allow")

    do_remote_decode: bool | None = None
    do_remote_prefill: bool | None = None
    transfer_id: str | None = Field(default=None, max_length=256)
    remote_engine_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = Field(default=None, ge=1, le=65535)
    remote_block_ids: list[int] | None = None
    remote_request_id: str | None = None


class KVAbortRequest(BaseModel):
    transfer_id: str = Field(min_length=1, max_length=256)


class KVProveRequest(BaseModel):
    """A router's challenge (kvpush.server.prove)."""

    nonce: str = Field(pattern=r"^[0-9a-f]{64}$")
    url: str = Field(max_length=512)


MODELS: dict[str, type[BaseModel]] = {
    "CompletionRequest": CompletionRequest,
    "ChatCompletionRequest": ChatCompletionRequest,
    "KVAbortRequest": KVAbortRequest,
    "KVProveRequest": KVProveRequest,
    "KVTransferParams": KVTransferParams,
    "TokenizeCompletionRequest": TokenizeCompletionRequest,
    "TokenizeChatRequest": TokenizeChatRequest,
    "DetokenizeRequest": DetokenizeRequest,
}


def request_body(name: str) -> dict[str, Any]:
    """``openapi_extra`` of a route whose JSON body is the model ``name``."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": REF.format(model=name)}}}}}


def component_schemas() -> dict[str, Any]:
    """The request models and every model they use, as OpenAPI component schemas."""
    out: dict[str, Any] = {}
    for name, model in MODELS.items():
        schema = model.model_json_schema(ref_template=REF, mode="validation")
        out.update(schema.pop("$defs", {}))
        out[name] = schema
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = out[name]["properties"]
        props["kv_transfer_params"] = {"anyOf": [{"$ref": REF.format(
            model="KVTransferParams")}, {"type": "null"}]}
        for field, bounds in LIMITS.items():
            if field in props:
                _constrain(props[field], bounds)
    out["ChatCompletionRequest"]["properties"]["logprobs"]["description"] = (
        "return the sampled token's logprob (and top_logprobs alternatives)")
    _constrain(out["CompletionRequest"]["properties"]["logprobs"], {"minimum": 0, "maximum": 5})
    out["ChatMessage"]["properties"]["role"] = {"type": "string", "enum": list(ALLOWED_ROLES)}
    # /tokenize takes either (a body with "messages" is a chat)
    out["TokenizeRequest"] = {"anyOf": [{"$ref": REF.format(model=m)} for m in
                                        ("TokenizeCompletionRequest", "TokenizeChatRequest")]}
    return out


#: What the server checks by hand (kvpush.server.chat), written into the schema so that
#: documentation and generated clients know it (the models themselves keep the server's
#: own error messages).
LIMITS: dict[str, dict[str, Any]] = {
    "max_tokens": {"minimum": 1},
    "max_completion_tokens": {"minimum": 1},
    "temperature": {"minimum": 0},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"minimum": -1},
    "n": {"minimum": 1, "maximum": 1},
    "best_of": {"minimum": 1, "maximum": 1},
    "top_logprobs": {"minimum": 0, "maximum": MAX_TOP_LOGPROBS},
    "seed": {"minimum": -(2**63), "maximum": 2**64 - 1},
    "stop": {"maxItems": 16},
    "presence_penalty": {"minimum": -MAX_PENALTY, "maximum": MAX_PENALTY},
    "frequency_penalty": {"minimum": -MAX_PENALTY, "maximum": MAX_PENALTY},
    "repetition_penalty": {"exclusiveMinimum": 0},
    "logit_bias": {"maxProperties": MAX_LOGIT_BIAS_ENTRIES},
}


def _constrain(prop: dict[str, Any], bounds: dict[str, Any]) -> None:
    """Add ``bounds`` to the non-null branch of ``prop`` (``anyOf: [X, null]``) or to it."""
    for branch in prop.get("anyOf", [prop]):
        if branch.get("type") not in (None, "null"):
            if branch.get("type") == "array" and "minimum" in bounds:
                continue
            branch.update({k: v for k, v in bounds.items()
                           if (k == "maxItems") == (branch.get("type") == "array")})


def install_openapi(app: FastAPI) -> None:
    """Make ``app.openapi()`` include the request models (see module docs)."""
    default = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = default()
            schema.setdefault("components", {}).setdefault("schemas", {}).update(
                component_schemas())
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
