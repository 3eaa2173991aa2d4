"""Plain state of KV transfers: the per-transfer records both sides keep, their state
enums, and the checking of the wire fields a request brings (vLLM's names)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvpush.engine.outputs import RequestError
from kvpush.kv_transfer import messages as m

#: Re-sends of a registration that prefill says it never got, before decode gives up.
MAX_REGISTER_RESENDS = 3


class SendState(enum.Enum):
    AWAITING_REGISTRATION = "awaiting_registration"
    SENDING = "sending"
    DRAINING = "draining"
    LENT = "lent"  # pull: blocks lent to decode until PullDone


class RecvState(enum.Enum):
    PENDING_BLOCKS = "pending_blocks"
    AWAITING_KV = "awaiting_kv"
    QUARANTINED = "quarantined"


@dataclass
class PushSend:
    tid: str
    request_id: str
    state: SendState = SendState.AWAITING_REGISTRATION
    reg: m.PushRegister | None = None
    written_blocks: int = 0  # leading prompt blocks whose every layer is posted
    finished: bool = False  # prefill done, token #1 known, blocks held here
    block_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    first: tuple[int, float | None] = (-1, None)
    retired: list[list[int]] = field(default_factory=list)  # blocks of a preempted run


@dataclass
class DecodeRecv:
    tid: str
    request_id: str
    mode: str
    address: str  # prefill's side channel
    remote_engine_id: str
    remote_block_ids: list[int] = field(default_factory=list)
    state: RecvState = RecvState.PENDING_BLOCKS
    held: list[int] = field(default_factory=list)  # quarantined blocks
    register: m.PushRegister | None = None  # kept to re-send if it was lost
    resends: int = 0
    registered_at: float = 0.0  # monotonic time of the last (re)send of ``register``
    t_start: float = field(default_factory=time.perf_counter)
    posted: TransferRecord | None = None  # pull: what the READ moves, filled at its post


@dataclass
class TransferRecord:
    """One finished transfer, for /metrics and logs."""

    transfer_id: str
    role: str
    mode: str
    ok: bool
    num_bytes: int = 0
    num_descriptors: int = 0
    post_s: float = 0.0
    transfer_s: float = 0.0
    error: str | None = None


def parse_kv_params(params: dict, role: str) -> dict:
    """Check the wire fields (vLLM's names) a request brings; RequestError if malformed."""
    if not isinstance(params, dict):
        raise RequestError("kv_transfer_params must be an object", "kv_transfer_params")

    def get(name, typ, required=True, default=None):
        v = params.get(name, default)
        if v is None:
            if required:
                raise RequestError(f"kv_transfer_params.{name} is required",
                                   "kv_transfer_params")
            return default
        if typ is int and isinstance(v, bool) or not isinstance(v, typ):
            raise RequestError(
                f"kv_transfer_params.{name} must be {typ.__name__}", "kv_transfer_params"
            )
        return v

    out = {
        "do_remote_decode": get("do_remote_decode", bool, False, False),
        "do_remote_prefill": get("do_remote_prefill", bool, False, False),
        "transfer_id": get("transfer_id", str, False),
    }
    if role == "decode" and out["do_remote_prefill"]:
        out["remote_host"] = get("remote_host", str)
        out["remote_port"] = get("remote_port", int)
        if not 0 < out["remote_port"] < 65536:
            raise RequestError("kv_transfer_params.remote_port out of range",
                               "kv_transfer_params")
        out["remote_engine_id"] = get("remote_engine_id", str, False, "")
        out["remote_request_id"] = get("remote_request_id", str, False)
        blocks = get("remote_block_ids", list, False, None)
        if blocks is not None and not all(
            isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in blocks
        ):
            raise RequestError("kv_transfer_params.remote_block_ids must be block ids",
                               "kv_transfer_params")
        out["remote_block_ids"] = blocks
    return out
