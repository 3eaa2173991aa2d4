"""The contract between the step loop and the transfer thread.

The step loop states four kinds of fact about a transfer, once each, and hands the
facts of one engine turn (or of one layer group, mid-step) over as one ``StepMessage``:

* ``Begin``: the request is in the engine (its prompt; decode: the prefill it names);
* ``BlocksReady``: prefill: blocks hold their KV for some layers; decode: allocated;
* ``Prefilled``: prefill is over (push: with token #1; pull: the blocks are lent);
* ``End``: the request ended otherwise, or the router gave up on the transfer.

It hears two kinds back, in one ``TransferUpdate`` per pass of the transfer thread:

* ``Failing``: it failed while KV may still move: end the request, keep its blocks;
* ``Over``: nothing of it touches its blocks any more: give them back; the
  ``Outcome`` says what becomes of the request.

Everything else is the transfer thread's. Block ids travel as lists the sender does
not touch again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from kvpush.kv_transfer.record import TransferCounters, TransferRecord
from kvpush.kv_transfer.wire import messages as m


@dataclass(frozen=True, slots=True)
class PeerRef:
    """Decode: the prefill instance a request's kv_transfer_params name (pull: the
    blocks it lent, and when the lend ends, wall-clock ms)."""

    address: str
    engine_id: str = ""
    lent_blocks: tuple[int, ...] = ()
    lend_expires_ms: int | None = None


@dataclass(frozen=True, slots=True)
class Begin:
    """A request that sends (push prefill) or receives (decode) KV is in the engine;
    its prompt has ``num_prompt_tokens`` tokens hashing to ``prompt_hashes``."""

    tid: str
    num_prompt_tokens: int
    prompt_hashes: tuple[bytes, ...]
    peer: PeerRef | None = None


@dataclass(frozen=True, slots=True)
class BlocksReady:
    """Prefill: our ``blocks`` (prompt blocks ``first_block`` on) hold their KV for
    ``layers``; ``ready``: on CUDA, the event to wait on before posting.
    Decode: ``blocks`` is the request's block table, of which ``first_block`` leading
    blocks are cached here; ``full_hit``: decode computes the rest itself, nothing is
    wanted from prefill."""

    tid: str
    first_block: int
    blocks: list[int]
    layers: range = range(0)
    ready: Any = None
    full_hit: bool = False


@dataclass(frozen=True, slots=True)
class Prefilled:
    """Prefill is over. Push: ``done`` (token #1) goes to decode once every WRITE has
    landed. Pull: the blocks are lent (``lent``) until decode has read them."""

    tid: str
    done: m.PushDone | None = None
    lent: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class End:
    """The step loop ended ``tid``'s request (``why``), or the router gave up on it."""

    tid: str
    why: str


Fact = Begin | BlocksReady | Prefilled | End


@dataclass(frozen=True, slots=True)
class StepMessage:
    """The facts of one engine turn (or one layer group), carried out in order."""

    facts: tuple[Fact, ...]


class Outcome(enum.Enum):
    OK = "ok"  # the KV moved (decode: ``Over.first`` is token #1 from push)
    FAILED = "failed"  # fail the request (decode: or recompute it, by policy)
    REJECTED = "rejected"  # its kv_transfer_params are wrong: a 400
    NOT_NEEDED = "not_needed"  # push prefill: decode holds the whole prompt: a 400


@dataclass(frozen=True, slots=True)
class Failing:
    """``tid`` failed (``why``) while KV may still land in or be read from its blocks:
    end the request now and keep the blocks until ``Over``."""

    tid: str
    why: str


@dataclass(frozen=True, slots=True)
class Over:
    """``tid`` is over: nothing of it touches its blocks any more."""

    tid: str
    outcome: Outcome
    why: str | None = None
    first: m.PushDone | None = None  # decode, push: token #1 with the KV
    record: TransferRecord | None = None
    stamps: tuple[tuple[str, float], ...] = ()  # the transfer thread's timeline stages


Event = Failing | Over


@dataclass(frozen=True, slots=True)
class TransferUpdate:
    """The events of one pass of the transfer thread, in order, and its counters when
    they changed (one inbox item)."""

    events: tuple[Event, ...]
    counters: TransferCounters | None = None
