"""What an instance answers at ``GET /kv/info`` (:class:`KVInfo`) and ``GET
/kv/cache_blocks`` (:class:`CacheBlocks`): built by its engine core, sent to its front
end as a utility reply, served as JSON, and decoded once by a router's health check.

A field that some instances leave out is ``UNSET`` there and absent from the JSON: the
block counts for a caller the member views do not open to (kvpush.server.member_view),
the transfer fields of a role-both instance, ``chat_template`` without
``--chat-template``. Every other field is always there (``null`` where it has no value):
a ``/kv/info`` without one is not a kvpush instance's (:func:`decode_kv_info`).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import UNSET, Meta, UnsetType

#: a block's tokens (checked where an answer is decoded)
BlockSize = Annotated[int, Meta(ge=1)]


class KVEvents(msgspec.Struct, frozen=True):
    """Where the instance publishes its KV cache events (kvpush.kv_cache.events)."""

    endpoint: Annotated[str, Meta(min_length=1)]
    block_size: BlockSize
    #: members only (CURVE), hashes published as keyed tags
    keyed: bool = False


class KVInfo(msgspec.Struct, frozen=True, kw_only=True):
    """An instance's identity, role, transfer mode, layout and blocks."""

    engine_id: str
    role: str  # prefill, decode or both
    kv_transfer: str | None  # push or pull; None for role both
    side_channel: str | None  # the transfer thread's "host:port"
    model: str  # the served model's name
    dtype: str  # weights' and activations' (the KV cache's is the layout's)
    dtype_reason: str
    block_size: BlockSize
    max_model_len: int
    vocab_size: int
    #: one rank's KV region: its KV heads of every block (tensor_parallel)
    layout: dict[str, Any]
    tensor_parallel_size: int
    #: above 1: the backend and each rank's heads (ModelRunner.tp_info)
    tensor_parallel: dict[str, Any] | None
    #: how --kv-cache-memory was split (kv_budget.py)
    kv_memory: dict[str, Any]
    #: where KV cache events are published (None: prefix caching is off)
    kv_events: KVEvents | None
    #: the engine core's request plane, "host:port" (None: it has none)
    request_plane: str | None
    #: whether the plane takes only the cluster's members (CURVE keys from the secret;
    #: False: a plain plane, --insecure-kv-params)
    request_plane_members: bool

    # member views (kvpush.server.member_view.COUNT_FIELDS)
    num_free_blocks: int | UnsetType = UNSET
    num_total_blocks: int | UnsetType = UNSET

    # P/D roles: the KV connector's (kvpush.kv_transfer.step_loop.connector)
    side_channel_host: str | UnsetType = UNSET
    side_channel_port: Annotated[int, Meta(gt=0, lt=65536)] | UnsetType = UNSET
    transport: str | UnsetType = UNSET
    model_fingerprint: str | UnsetType = UNSET
    kv_load_failure_policy: str | UnsetType = UNSET
    lease_timeout_s: float | UnsetType = UNSET
    fence_timeout_s: float | UnsetType = UNSET
    num_fenced_blocks: int | UnsetType = UNSET
    #: acts only on kv_transfer_params signed with the cluster secret
    kv_params_signed: bool | UnsetType = UNSET
    #: layers a push WRITE group (0: closed by compute time, at least the seconds)
    push_layers_per_write: int | None | UnsetType = UNSET
    push_write_group_min_s: float | None | UnsetType = UNSET

    #: the instance's --chat-template (the router renders chats with it)
    chat_template: str | UnsetType = UNSET


class CacheBlocks(msgspec.Struct, frozen=True):
    """Every block hash in the prefix cache (hex), as of KV event batch ``seq`` (0:
    before the first batch)."""

    engine_id: str
    seq: int
    block_size: BlockSize
    hashes: list[str]


class MalformedAnswer(ValueError):
    """An instance's answer that is not what a kvpush instance answers."""


def decode_kv_info(data: bytes) -> KVInfo:
    """The ``/kv/info`` answer in ``data`` (MalformedAnswer saying why it is not one)."""
    try:
        return msgspec.json.decode(data, type=KVInfo)
    except msgspec.DecodeError as e:  # (ValidationError too)
        raise MalformedAnswer(f"malformed /kv/info answer: {e}") from None


def decode_cache_blocks(data: bytes) -> CacheBlocks:
    """The ``/kv/cache_blocks`` answer in ``data`` (MalformedAnswer saying why not)."""
    try:
        return msgspec.json.decode(data, type=CacheBlocks)
    except msgspec.DecodeError as e:
        raise MalformedAnswer(f"malformed /kv/cache_blocks answer: {e}") from None
