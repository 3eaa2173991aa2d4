"""A request's ``kv_transfer_params`` (vLLM's names), checked once where it enters the
instance (:class:`KVTransferParams`), their form on an engine core's request plane
(:class:`WireKVParams`), and the checks of block ids and hash chains a peer or a
request brings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import msgspec

from kvpush.crypto.auth import GRANT_KEY, SIGNATURE_KEY, Grant, ParamsSigner
from kvpush.errors import RequestError

_T = TypeVar("_T")

#: Longest transfer / request id accepted from a request (the router's are 32-40 chars).
MAX_ID_CHARS = 256
#: Most remote_block_ids a request may carry (far above any context: a sanity bound).
MAX_REMOTE_BLOCKS = 1 << 20
#: A host name or a bracketed IPv6 address (msgspec searches: anchored).
_HOST_PATTERN = r"^(?:[A-Za-z0-9_.-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\])\Z"


def block_ids_problem(ids: Sequence[int], num_blocks: int, what: str) -> str | None:
    """Why ``ids`` are not distinct block ids of a region of ``num_blocks``, or None.
    ``ids`` are ints as msgspec decoded them (never bools): good ones pass on builtins
    alone (the transfer thread checks every registration here, inside a prefill's step),
    and only bad ones are looked at one by one, for the message."""
    if (not ids or min(ids) >= 0 and max(ids) < num_blocks) and len(set(ids)) == len(ids):
        return None
    bad = [b for b in ids if isinstance(b, bool) or not isinstance(b, int)
           or not 0 <= b < num_blocks]
    if bad:
        return f"{what}: block ids outside [0, {num_blocks}): {bad[:4]}"
    if len(set(ids)) != len(ids):
        return f"{what}: a block id listed twice"
    return None


def chain_problem(theirs: Sequence[bytes], ours: Sequence[bytes], who: str,
                  we: str) -> str | None:
    """Why two prompts' hash chains say the prompts differ, or None."""
    if tuple(theirs) == tuple(ours):
        return None
    if not theirs:
        return f"{who} side sent no hash chain of its prompt"
    first = next((i for i, (a, b) in enumerate(zip(theirs, ours, strict=False)) if a != b),
                 min(len(theirs), len(ours)))
    return f"{who} prompt differs from {we} from block {first} on: the KV is not for this prompt"


@dataclass(frozen=True)
class KVTransferParams:
    """A request's ``kv_transfer_params``, checked once by :meth:`parse`, handed on typed."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    transfer_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_engine_id: str = ""
    remote_request_id: str | None = None
    remote_block_ids: list[int] | None = None
    #: pull: the hash chain of the prompt whose KV prefill lent (from its answer)
    prompt_hashes: list[bytes] | None = None
    #: pull: when prefill's lend ends (wall-clock ms, from its answer)
    lend_expires_ms: int | None = None
    #: what the router vouched for, when the instance checks signatures
    grant: Grant | None = None

    def to_wire(self) -> dict:
        """As a request or an answer carries it (vLLM's names; hashes in hex; a lend's
        answer has no grant: the router signs what it forwards)."""
        wire: dict = {"do_remote_prefill": self.do_remote_prefill,
                      "do_remote_decode": self.do_remote_decode,
                      "transfer_id": self.transfer_id}
        if self.remote_host is not None:
            wire.update(remote_host=self.remote_host, remote_port=self.remote_port,
                        remote_engine_id=self.remote_engine_id,
                        remote_request_id=self.remote_request_id, tp_size=1)
        if self.remote_block_ids is not None:
            wire["remote_block_ids"] = list(self.remote_block_ids)
        if self.prompt_hashes is not None:
            wire["prompt_hashes"] = [h.hex() for h in self.prompt_hashes]
        if self.lend_expires_ms is not None:
            wire["lend_expires_ms"] = self.lend_expires_ms
        return wire

    @property
    def remote_address(self) -> str:
        """Prefill's side channel (decode of a remote prefill)."""
        return f"{self.remote_host}:{self.remote_port}"

    @classmethod
    def parse(cls, params: object, role: str, signer: ParamsSigner | None = None,
              engine_id: str = "") -> KVTransferParams:
        """Check the wire fields an instance of ``role`` reads (RequestError, a 400, if
        malformed), as JSON or a request plane (WireKVParams) brings them. With a
        ``signer`` they must be the router's, signed for ``engine_id`` (ParamsForbidden,
        403, if not). Types and bounds are the msgspec schemas'; what a schema cannot say
        (printable ids, distinct blocks, the grant's peer) is here."""
        if isinstance(params, WireKVParams):
            params = params.wire()
        if not isinstance(params, dict):
            raise RequestError("kv_transfer_params must be an object", "kv_transfer_params")
        grant = signer.verify(params, role=role, engine_id=engine_id) if signer else None
        leg = _convert(params, _LegFields)
        _printable(leg.transfer_id, "transfer_id")
        common = dict(do_remote_decode=bool(leg.do_remote_decode),
                      do_remote_prefill=bool(leg.do_remote_prefill),
                      transfer_id=leg.transfer_id, grant=grant)
        if not (role == "decode" and common["do_remote_prefill"]):
            return cls(**common)
        rp = _convert(params, _RemotePrefillFields)
        _printable(rp.remote_engine_id, "remote_engine_id")
        _printable(rp.remote_request_id, "remote_request_id")
        blocks = rp.remote_block_ids
        if blocks is not None and len(set(blocks)) != len(blocks):
            raise RequestError("kv_transfer_params.remote_block_ids lists a block twice",
                               "kv_transfer_params")
        engine = rp.remote_engine_id or ""
        if grant is not None and grant.peer_engine_id != engine:
            raise RequestError("kv_transfer_params.remote_engine_id is not the prefill "
                               "instance the router named", "kv_transfer_params")
        hashes = None
        if rp.prompt_hashes is not None:
            try:
                hashes = [bytes.fromhex(h) for h in rp.prompt_hashes]
            except ValueError:
                raise RequestError("kv_transfer_params.prompt_hashes must be hex block "
                                   "hashes", "kv_transfer_params") from None
        elif grant is not None and blocks is not None:
            raise RequestError("kv_transfer_params.prompt_hashes is required with "
                               "remote_block_ids", "kv_transfer_params")
        return cls(**common, remote_host=rp.remote_host, remote_port=rp.remote_port,
                   remote_engine_id=engine, remote_request_id=rp.remote_request_id,
                   remote_block_ids=blocks, prompt_hashes=hashes,
                   lend_expires_ms=rp.lend_expires_ms)


class SignedGrant(msgspec.Struct, frozen=True):
    """A grant as the router signs it (crypto.auth; a null peer is signed as null)."""

    role: str
    engine_id: str
    peer_engine_id: str | None
    expires_ms: int


class WireKVParams(msgspec.Struct, frozen=True, omit_defaults=True,
                   rename={"grant": GRANT_KEY, "signature": SIGNATURE_KEY}):
    """A leg's ``kv_transfer_params`` on an engine core's request plane: the fields a
    kvpush instance reads (vLLM's names; false or null: absent, not sent) and, where the
    cluster has a secret, the router's grant and its signature, which covers ``wire()``
    (exactly these fields). The core checks them as it checks a JSON set (``parse``)."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    transfer_id: str | None = None
    remote_engine_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_request_id: str | None = None
    remote_block_ids: list[int] | None = None
    prompt_hashes: list[str] | None = None  # (hex)
    lend_expires_ms: int | None = None
    grant: SignedGrant | None = None
    signature: str | None = None

    @classmethod
    def of(cls, params: dict[str, Any]) -> WireKVParams:
        """The fields of a JSON set a kvpush instance reads (the others dropped)."""
        return msgspec.convert(params, cls)

    def wire(self) -> dict[str, Any]:
        """As JSON carries them: the set the signature covers."""
        return msgspec.to_builtins(self)


#: a request's kv_transfer_params as a front hands them on: checked already (typed), as a
#: request plane carries them, or as JSON (unchecked)
GivenKVParams = KVTransferParams | WireKVParams | dict


#: Hex digits of one hash of a prompt's chain (``hash_block_tokens``: 16 bytes).
HASH_HEX_CHARS = 32

_Id = Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]
_BlockId = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
_Hash = Annotated[str, msgspec.Meta(min_length=HASH_HEX_CHARS, max_length=HASH_HEX_CHARS)]


class _LegFields(msgspec.Struct):
    """What every role reads of ``kv_transfer_params`` (null: absent)."""

    do_remote_decode: bool | None = None
    do_remote_prefill: bool | None = None
    transfer_id: _Id | None = None


class _RemotePrefillFields(msgspec.Struct):
    """What a decode of a remote prefill reads besides (pull: hashes, lend end from P's answer)."""

    remote_host: Annotated[str, msgspec.Meta(pattern=_HOST_PATTERN)]
    remote_port: Annotated[int, msgspec.Meta(gt=0, lt=65536)]
    remote_engine_id: _Id | None = None
    remote_request_id: _Id | None = None
    remote_block_ids: Annotated[list[_BlockId],
                                msgspec.Meta(max_length=MAX_REMOTE_BLOCKS)] | None = None
    prompt_hashes: Annotated[list[_Hash], msgspec.Meta(max_length=MAX_REMOTE_BLOCKS)] | None = None
    lend_expires_ms: int | None = None


def _convert(params: dict, fields: type[_T]) -> _T:
    """``params`` as ``fields``, or a 400 that names the field (msgspec's words)."""
    try:
        return msgspec.convert(params, fields)
    except msgspec.ValidationError as e:
        where = str(e).replace("`$.", "`kv_transfer_params.")
        where = where.replace("`$`", "`kv_transfer_params`")
        raise RequestError(f"invalid kv_transfer_params: {where}", "kv_transfer_params") from None


def _printable(value: str | None, name: str) -> None:
    if value is not None and not value.isprintable():
        raise RequestError(f"kv_transfer_params.{name} must be printable characters",
                           "kv_transfer_params")
