"""Side-channel messages between prefill and decode instances (msgspec, versioned).

Every frame is one msgpack-encoded tagged struct. ``Hello`` opens a peer relation and
carries what the compatibility check compares; everything else refers to a transfer
by its ``transfer_id`` (the router's id in push mode, prefill's request id in pull).

Push, in the order things usually happen (registration and P's finish may swap)::

    D → P  PushRegister(transfer_id, D's block ids, blocks D already has)
    P → D  Heartbeat(transfer ids)       while either side waits
    P ═══▶ D  NIXL WRITE, per layer while P's forward pass runs, the rest at the end
    P → D  PushDone(token #1, its logprob)   after every WRITE completed
           (ok=False with an error when a WRITE failed to post or complete)

Pull::

    (P's HTTP answer carries remote_block_ids & co and lend_expires_ms; the router
    signs them for D)
    D → P  PullClaim(transfer_id)        before the READ (lend_claims.py)
    P → D  PullClaimed(ok)               ok once per lend, while it is live
    D ═══▶ P  NIXL READ posted by D, only after PullClaimed(ok=True)
    D → P  PullDone(transfer_id)         P frees its blocks

Either side may send ``Abort`` at any moment; a lease expiring sends one too. Decode
keeps the blocks of a push it gave up on (aborted, or its lease ran out) fenced until
prefill answers — ``AbortAck``, which prefill sends for any transfer id once none of
its WRITEs is in flight, or ``PushDone`` — or prefill's connection drops, or the fence
times out. Prefill never WRITEs for a transfer again once it has answered or aborted.
"""

from __future__ import annotations

import msgspec

#: Raised when a message's meaning changes so that mixed versions would not work: the
#: Hello then refuses the peer plainly. 2: pull claims carry a claim id that decode
#: requires in the answer (an old prefill's answers would all be ignored).
PROTOCOL_VERSION = 2


class Hello(msgspec.Struct, tag=True):
    version: int
    engine_id: str
    role: str
    address: str  # side-channel "host:port" to answer to
    transport: str  # "nixl" | "inproc"
    agent_metadata: bytes
    model: str  # fingerprint of the weights' shape and name
    dtype: str
    block_size: int
    layout: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_transfer: str  # "push" | "pull"
    base_address: int  # of the KV region, for the peer's descriptors
    num_blocks: int
    block_bytes: int
    layer_bytes: int
    reply: bool = False  # True when answering a Hello


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
    #: the hash chain of decode's prompt (hash_prompt_chain): prefill writes only when
    #: its own prompt hashes the same
    prompt_hashes: list[bytes] = []


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


class PullDone(msgspec.Struct, tag=True):
    transfer_id: str
    ok: bool = True


class PullClaim(msgspec.Struct, tag=True):
    """Decode asks to READ a lend: prefill says yes once, while the lend is live.
    ``claim``: a random id of this receive's claim (sent again with it when the answer
    is lost), echoed in the answer: an answer to an earlier claim of the same transfer
    id (a replayed leg) is never taken for this one's."""

    transfer_id: str
    claim: int = 0


class PullClaimed(msgspec.Struct, tag=True):
    transfer_id: str
    ok: bool
    error: str | None = None
    claim: int = 0  # the claim answered


class AbortAck(msgspec.Struct, tag=True):
    """Prefill will not touch decode's blocks for this transfer any more (the answer to
    an ``Abort`` for any id, known or not, once no WRITE of it is in flight)."""

    transfer_id: str


class Abort(msgspec.Struct, tag=True):
    transfer_id: str
    reason: str


class Heartbeat(msgspec.Struct, tag=True):
    """Renews the receiver's leases on these transfers. ``awaiting_registration`` lists
    push transfers prefill has no registration for: decode re-sends a lost one."""

    engine_id: str
    transfer_ids: list[str]
    awaiting_registration: list[str] = []


Message = (
    Hello | HelloRefused | PushRegister | PushDone | PullDone | Abort | AbortAck | Heartbeat
    | PullClaim | PullClaimed
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(payload: bytes) -> Message:
    """Raises msgspec.DecodeError/ValidationError on a malformed frame."""
    return _decoder.decode(payload)


def type_name(payload: bytes) -> str:
    """Message type of a frame without a full decode failure path (for fault plans)."""
    try:
        return type(decode(payload)).__name__
    except (msgspec.DecodeError, msgspec.ValidationError):
        return "?"


def compatibility_problems(mine: Hello, theirs: Hello) -> list[str]:
    """Differences that make KV from one instance meaningless to the other."""
    problems = []
    if theirs.version != mine.version:
        problems.append(f"protocol version {theirs.version} != {mine.version}")
    for field in ("model", "dtype", "block_size", "layout", "num_layers", "num_kv_heads",
                  "head_dim", "kv_transfer", "transport"):
        a, b = getattr(mine, field), getattr(theirs, field)
        if a != b:
            problems.append(f"{field}: peer has {b!r}, this instance {a!r}")
    if theirs.block_bytes != mine.block_bytes:
        problems.append(f"block_bytes: peer has {theirs.block_bytes}, this instance "
                        f"{mine.block_bytes}")
    if theirs.num_blocks < 1 or theirs.layer_bytes != theirs.num_blocks * theirs.block_bytes:
        problems.append(f"the peer announces an inconsistent KV region ({theirs.num_blocks} "
                        f"blocks of {theirs.block_bytes} bytes, {theirs.layer_bytes} per layer)")
    return problems
