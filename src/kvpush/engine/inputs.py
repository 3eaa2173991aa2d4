"""What goes into the engine core: typed commands (msgspec structs, tagged so a decoder
tells them apart), applied by ``LLMEngine.process_inbox`` between two steps.

* :class:`AddRequest`: a request checked once by the front end (its typed
  ``kv_transfer_params`` and the sampling parameters it runs with);
* :class:`AbortRequests`: end these requests (client gone, stop string seen);
* :class:`AbortTransfer`: release what this prefill instance holds for a transfer;
* :class:`UtilityCall`: a request/reply call the front end awaits (``/kv/info``,
  ``/kv/cache_blocks``), answered in the batch of the turn that ran it;
* :class:`Shutdown`: stop the loop.

Other fronts (routers) reach the core over its request plane (``engine/request_plane.py``)
with :data:`PlaneCommand`: :class:`Hello` (on each connection: the core's snapshots
from then on), :class:`SubmitRequest` (not yet checked: its ``kv_transfer_params`` as
the router signed them, a WireKVParams), :class:`AbortRemote`, :class:`AbortTransfer` and
:class:`UtilityCall`. The plane checks them and puts the
commands above in the inbox with their front's number (``AddRequest.front``, which
every output of the request carries back), under ids that start with
:data:`REMOTE_MARK` and the front's number, so that no two fronts' ids meet in the core.

The transfer thread's updates (``kv_transfer.commands.TransferUpdate``) reach the same
inbox as they are, and so does :class:`TransferThreadDied`, which ends the step loop
(and with it the engine core process): local objects, never sent to another process.
"""

from __future__ import annotations

import contextlib
import enum

import msgspec

from kvpush.kv_transfer.params import KVTransferParams, WireKVParams
from kvpush.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, tag=True, frozen=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kv_transfer_params: KVTransferParams | None = None
    #: monotonic time the request arrived at the front end
    arrival_time: float = 0.0
    #: the front it came from: 0 the instance's own, n > 0 a request-plane front (its
    #: outputs carry it back, so no front is found by parsing ids)
    front: int = 0


class AbortRequests(msgspec.Struct, tag=True, frozen=True):
    """End these requests, every choice of each; a :func:`choice_id` ends one choice."""

    request_ids: list[str]


#: joins a request's id and a choice's index past the first (no front's id holds it)
CHOICE_MARK = "\x00"


def choice_id(request_id: str, index: int) -> str:
    """The engine's id of choice ``index`` of a request (choice 0: the request's)."""
    return request_id if index == 0 else f"{request_id}{CHOICE_MARK}{index}"


def request_of(choice: str) -> str:
    """The request id of a :func:`choice_id`."""
    return choice.partition(CHOICE_MARK)[0]


class AbortTransfer(msgspec.Struct, tag=True, frozen=True):
    transfer_id: str
    why: str = "aborted by the router"


class Utility(str, enum.Enum):
    KV_INFO = "kv_info"
    KV_CACHE_BLOCKS = "kv_cache_blocks"


class UtilityCall(msgspec.Struct, tag=True, frozen=True):
    call_id: int
    method: Utility


class Shutdown(msgspec.Struct, tag=True, frozen=True):
    pass


EngineCommand = AddRequest | AbortRequests | AbortTransfer | UtilityCall | Shutdown

#: the first character of the core's id of a request that came over the request plane
#: (``~<front>/<its id>``); no other front's ids start with it (FrontEnd makes sure)
REMOTE_MARK = "~"


class SubmitRequest(msgspec.Struct, tag=True, frozen=True):
    """A remote front's request: checked by the core's request plane (RequestChecker),
    ``kv_transfer_params`` as the router signed them."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kv_transfer_params: WireKVParams | None = None


class AbortRemote(msgspec.Struct, tag=True, frozen=True):
    """End these requests of the front that sends it (its own ids)."""

    request_ids: list[str]


class Hello(msgspec.Struct, tag=True, frozen=True):
    """A remote front's first word on a connection: the plane answers with the core's
    latest snapshot and sends it every later one (its gauges: the router's free blocks)."""


#: what a remote front sends the core's request plane
PlaneCommand = Hello | SubmitRequest | AbortRemote | AbortTransfer | UtilityCall
#: what a front (FrontEnd) sends its core: its own API process's, or a remote front's
FrontCommand = EngineCommand | PlaneCommand
#: the commands only a remote front sends
PLANE_ONLY = (Hello, SubmitRequest, AbortRemote)


def submitted_id(payload: bytes) -> str | None:
    """The request id of a SubmitRequest that does not decode (bad parameters, another
    version's fields), if it has one: its front gets a refusal, not silence."""
    with contextlib.suppress(msgspec.DecodeError):
        raw = msgspec.msgpack.decode(payload)
        if isinstance(raw, dict) and raw.get("type") == "SubmitRequest":
            rid = raw.get("request_id")
            return rid if isinstance(rid, str) else None
    return None


class GrammarReady(msgspec.Struct, frozen=True):
    """The engine's grammar thread compiled (or could not compile: ``error``) the
    structured output of a request waiting for it (local: never sent)."""

    request_id: str
    error: str | None = None


class TransferThreadDied(Exception):
    """The transfer thread died (``why``): put in the inbox, raised by the step loop,
    which ends (the core process exits 1; its peers' leases and fences cover it)."""

    def __init__(self, why: str) -> None:
        super().__init__(f"the KV transfer thread died: {why}")
        self.why = why
