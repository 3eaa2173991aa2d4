"""Side-channel messages between prefill and decode instances (msgspec, versioned).

Every frame is one msgpack-encoded tagged struct. ``Hello`` opens a peer relation and
carries what the compatibility check compares; everything else names a transfer by its
``transfer_id`` (the router's id in push mode, prefill's request id in pull)::

    push   D → P  PushRegister (D's blocks, those it has cached, its prompt's hashes)
           P ═▶ D NIXL WRITEs while P's forward pass runs, the rest at its end
           P → D  PushDone (token #1) once every WRITE completed (ok=False: failed)
    pull   (P's answer carries its lent block ids; the router signs them for D)
           D → P  PullClaim; P → D PullClaimed(ok) once per lend, while it is live
           D ═▶ P NIXL READ, then D → P PullDone: P frees its blocks
    either Heartbeat (renews the peer's leases), Abort (at any moment)

Decode keeps the blocks of a push it gave up on fenced until prefill answers (``AbortAck``
once none of its WRITEs is in flight, or ``PushDone``), prefill's connection drops, or the
fence times out; prefill never WRITEs for a transfer it has answered or aborted.
"""

from __future__ import annotations

import msgspec

from kvpush.kv_cache.kv_map import RankKV, pair_problems
from kvpush.kv_cache.kv_region import KVLayout

#: Raised when mixed versions would not work, so that the Hello refuses the peer plainly.
PROTOCOL_VERSION = 4


class Hello(msgspec.Struct, tag=True):
    version: int
    engine_id: str
    role: str
    address: str  # side-channel "host:port" to answer to
    transport: str  # the transport's kind ("nixl")
    agent_metadata: bytes
    model: str  # fingerprint of the weights' shape and name
    kv_transfer: str  # "push" | "pull"
    base_address: int  # of the KV region, for the peer's descriptors
    layout: KVLayout  # rank 0's region (every rank's but for its base address)
    reply: bool = False  # True when answering a Hello
    tensor_parallel_size: int = 1
    model_kv_heads: int = 0  # the model's, over every rank
    ranks: list[RankKV] = []  # TP > 1: each rank's KV heads, region, agent (kv_map.py)


class HelloVersion(msgspec.Struct, tag="Hello"):
    """Any version's Hello, read for its version only (to refuse a mixed pair)."""

    version: int
    engine_id: str = ""
    address: str = ""


class HelloRefused(msgspec.Struct, tag=True):
    engine_id: str
    reason: str


class PushRegister(msgspec.Struct, tag=True):
    transfer_id: str
    engine_id: str  # decode's
    address: str  # decode's side channel
    block_ids: list[int]  # decode's whole block table for the prompt
    skip_blocks: int  # leading blocks decode already holds (its prefix cache)
    num_prompt_tokens: int
    full_hit: bool = False  # decode computes the rest itself: prefill may stop
    prompt_hashes: list[bytes] = []  # prefill writes only when its prompt hashes the same


class PushDone(msgspec.Struct, tag=True):
    transfer_id: str
    ok: bool
    first_token: int = -1
    first_logprob: float | None = None
    #: token #1's top alternatives [[id, logprob], ...] when the request asked for them
    first_top_logprobs: list[tuple[int, float]] | None = None
    num_descriptors: int = 0
    num_bytes: int = 0
    error: str | None = None
    #: --kv-digest: the digest of each block written, decode's registered blocks from
    #: ``kv_digest_first`` on (kv_transfer/digest.py)
    kv_digest: list[bytes] | None = None
    kv_digest_first: int = 0
    kv_digest_alg: str = ""  # the hash (kv_transfer/digest.py HASHERS)


class PullDone(msgspec.Struct, tag=True):
    transfer_id: str
    ok: bool = True


class PullClaim(msgspec.Struct, tag=True):
    """Decode asks to READ a lend. ``claim`` (random per receive, kept when sent again) is
    echoed in the answer, so that an earlier claim's answer is never taken for this one."""

    transfer_id: str
    claim: int = 0


class PullClaimed(msgspec.Struct, tag=True):
    transfer_id: str
    ok: bool
    error: str | None = None
    claim: int = 0  # the claim answered
    #: --kv-digest: the digest of every lent block, in the lend's order, by ``kv_digest_alg``
    kv_digest: list[bytes] | None = None
    kv_digest_alg: str = ""


class AbortAck(msgspec.Struct, tag=True):
    """Prefill will not touch decode's blocks for this transfer any more."""

    transfer_id: str


class Abort(msgspec.Struct, tag=True):
    transfer_id: str
    reason: str


class Heartbeat(msgspec.Struct, tag=True):
    """Renews the receiver's leases on these transfers."""

    engine_id: str
    transfer_ids: list[str]
    awaiting_registration: list[str] = []  # push ids prefill lacks a registration of: re-send


Message = (Hello | HelloRefused | PushRegister | PushDone | PullDone | Abort | AbortAck
           | Heartbeat | PullClaim | PullClaimed)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_version_decoder = msgspec.msgpack.Decoder(HelloVersion)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(payload: bytes) -> Message:
    """Raises msgspec.DecodeError/ValidationError on a malformed frame."""
    return _decoder.decode(payload)


def other_version(payload: bytes) -> HelloVersion | None:
    """A frame that did not decode: the Hello of another protocol version, or None."""
    try:
        hello = _version_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return hello if hello.version != PROTOCOL_VERSION else None


def type_name(payload: bytes) -> str:
    """A frame's message type, "?" if it does not decode (for fault plans)."""
    try:
        return type(decode(payload)).__name__
    except (msgspec.DecodeError, msgspec.ValidationError):
        return "?"


def compatibility_problems(mine: Hello, theirs: Hello) -> list[str]:
    """Differences that make KV from one instance meaningless to the other (the
    tensor-parallel pair and the layouts: ``kv_map.pair_problems``)."""
    problems = []
    if theirs.version != mine.version:
        problems.append(f"protocol version {theirs.version} != {mine.version}")
    pairs = [(f, getattr(mine, f), getattr(theirs, f))
             for f in ("model", "kv_transfer", "transport")]
    problems += [f"{f}: peer has {b!r}, this instance {a!r}" for f, a, b in pairs if a != b]
    lay = theirs.layout
    if lay.num_blocks < 1 or lay.layer_bytes != lay.num_blocks * lay.block_bytes:
        problems.append(f"the peer announces an inconsistent KV region ({lay.num_blocks} "
                        f"blocks of {lay.block_bytes} bytes, {lay.layer_bytes} per layer)")
    return problems + pair_problems(mine, theirs)
