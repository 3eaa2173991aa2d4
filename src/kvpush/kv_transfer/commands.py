"""The typed contract between the step loop and the transfer thread.

Three kinds of plain, frozen data cross between the two threads of an instance's KV
transfer, each dispatched with ``match``:

* **commands** (``Command``), step loop → transfer thread: what to send, post, track
  or fence. The connector collects the commands of one engine turn (a step, or a pass
  over the inbox) and hands them over as **one** ``StepMessage`` (one queue item, one
  wake-up of the transfer thread); the layer hook hands over each layer group's WRITEs
  as one ``StepMessage`` too, mid-step;
* **events** (``TransferEvent``), transfer thread → step loop: what a peer said, which
  transfer ended, which lease ran out. The events of one pass of the transfer thread go
  to the engine's inbox as **one** ``TransferUpdate``, ``("kv", update)``;
* **actions** (``EngineAction``), connector → engine, taken by the engine after each
  event or schedule: which request to fail, reject, abort, or to emit token #1 for.

Nothing here holds a reference to mutable state of either side; block ids travel as
the lists the sender built and does not touch again. Descriptors never cross: the
transfer thread builds them from block ids, layers and the peers' Hellos.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvpush.kv_transfer.wire import messages as m


# ---- commands: step loop -> transfer thread ---------------------------------------------
@dataclass(frozen=True, slots=True)
class Send:
    """Send ``msg`` to the peer at ``address`` (after the handshake if it is new)."""

    address: str
    msg: m.Message


@dataclass(frozen=True, slots=True)
class EnsurePeer:
    """Start the handshake with ``address`` unless it is done or under way."""

    address: str


@dataclass(frozen=True, slots=True)
class Track:
    """Cover ``tid`` with a lease renewed by ``address``'s heartbeats (None: any peer's);
    ``renewable=False``: a fixed deadline."""

    tid: str
    address: str | None
    renewable: bool = True


@dataclass(frozen=True, slots=True)
class Untrack:
    """Drop ``tid``'s lease and fence: the step loop has ended it."""

    tid: str


@dataclass(frozen=True, slots=True)
class PostWrite:
    """Push: these blocks' KV is ready for ``layers``: WRITE our ``local_blocks`` into
    the peer's ``remote_blocks`` (paired in order) for transfer ``tid``. The transfer
    thread builds the descriptors from the two instances' Hellos (it owns the peers).
    ``ready``: on CUDA, the event recorded after the layers' KV was computed; the
    transfer thread waits on it (``synchronize()``) before it posts."""

    tid: str
    address: str
    local_blocks: list[int]
    remote_blocks: list[int]
    layers: range
    ready: Any = None


@dataclass(frozen=True, slots=True)
class Finalize:
    """Push: send ``done`` once every WRITE of ``tid`` has completed."""

    tid: str
    address: str
    done: m.PushDone


@dataclass(frozen=True, slots=True)
class PostRead:
    """Pull: READ the peer's ``remote_blocks`` into our ``local_blocks`` (paired in
    order, every layer in ``layers``) for transfer ``tid``; tell prefill (PullDone) and
    the step loop (ReadDone) when it ends."""

    tid: str
    address: str
    local_blocks: list[int]
    remote_blocks: list[int]
    layers: range


@dataclass(frozen=True, slots=True)
class FenceTransfer:
    """Decode: keep waiting for prefill's word on push ``tid`` (fences.py)."""

    tid: str
    address: str


@dataclass(frozen=True, slots=True)
class Call:
    """Run ``fn`` on the transfer thread, in command order (diagnostics and tests)."""

    fn: Callable[[], None]


@dataclass(frozen=True, slots=True)
class Stop:
    """End the transfer thread."""


Command = (Send | EnsurePeer | Track | Untrack | PostWrite | Finalize | PostRead
           | FenceTransfer | Call | Stop)


@dataclass(frozen=True, slots=True)
class StepMessage:
    """What one engine turn (or one layer group of a step) asks of the transfer thread:
    its commands, carried out in order."""

    commands: tuple[Command, ...]


# ---- events: transfer thread -> step loop -----------------------------------------------
@dataclass(frozen=True, slots=True)
class PeerReady:
    address: str
    hello: m.Hello


@dataclass(frozen=True, slots=True)
class PeerRefused:
    """The handshake with ``address`` failed or cannot be had now (either side refused,
    no answer, no connection, the peer table full): ``reason`` says which."""

    address: str
    reason: str


@dataclass(frozen=True, slots=True)
class PeerEvicted:
    """The transfer thread dropped ``address`` from its peer table (idle, or its place
    was needed): a transfer with it handshakes again first (peers.py)."""

    address: str


@dataclass(frozen=True, slots=True)
class RegistrationsArrived:
    """Decode's registrations (``PushRegister``) wait on ``TransferWorker.registrations``
    (prefill side). Each is applied once, by whichever drains it first: the layer hook of
    a step under way, or the step loop on this event. The event carries nothing, so no
    registration reaches the step loop twice."""


@dataclass(frozen=True, slots=True)
class PushDoneReceived:
    done: m.PushDone


@dataclass(frozen=True, slots=True)
class PullDoneReceived:
    done: m.PullDone


@dataclass(frozen=True, slots=True)
class AbortReceived:
    abort: m.Abort


@dataclass(frozen=True, slots=True)
class AbortAckReceived:
    ack: m.AbortAck


@dataclass(frozen=True, slots=True)
class AwaitingRegistration:
    """Prefill has no registration for these transfers (decode re-sends)."""

    tids: list[str]


@dataclass(frozen=True, slots=True)
class WritesDone:
    """Push: every WRITE of ``tid`` is over; ``failed``: why not all landed."""

    tid: str
    failed: str | None
    num_descriptors: int = 0
    num_bytes: int = 0
    post_s: float = 0.0
    elapsed_s: float = 0.0


@dataclass(frozen=True, slots=True)
class ReadDone:
    """Pull: the READ of ``tid`` ended (``error``: why it failed, posting included)."""

    tid: str
    ok: bool
    error: str | None = None
    num_descriptors: int = 0
    num_bytes: int = 0
    post_s: float = 0.0


@dataclass(frozen=True, slots=True)
class LeaseExpired:
    tid: str


@dataclass(frozen=True, slots=True)
class FenceReleased:
    """A fence ended without prefill's word: ``why`` is "peer_gone" or "timeout"."""

    tid: str
    why: str


@dataclass(frozen=True, slots=True)
class WorkerDied:
    """The transfer thread ended without being stopped (its last event): nothing it held
    will complete. ``why``: the exception (or how it ended). ``transport_closed``: its
    transport closed cleanly, so no transfer this instance posted touches its memory
    any more (thread_death.py)."""

    why: str = "the transfer thread died"
    transport_closed: bool = True


@dataclass(frozen=True, slots=True)
class DeadHoldExpired:
    """After a ``WorkerDied``: the blocks kept from the pool because a peer may still
    reach them one-sidedly (pull: lent; push on decode: fenced) can go back now. Posted
    by thread_death.py's timer, not by the transfer thread."""


TransferEvent = (PeerReady | PeerRefused | PeerEvicted | RegistrationsArrived | PushDoneReceived
                 | PullDoneReceived | AbortReceived | AbortAckReceived | AwaitingRegistration
                 | WritesDone | ReadDone | LeaseExpired | FenceReleased | WorkerDied
                 | DeadHoldExpired)


@dataclass(frozen=True, slots=True)
class TransferUpdate:
    """The events of one pass of the transfer thread, in order (one inbox item)."""

    events: tuple[TransferEvent, ...]


# ---- actions: connector -> engine ---------------------------------------------------------
@dataclass(frozen=True, slots=True)
class EmitFirstToken:
    """Token #1 arrived with the KV: hand it to the client now."""

    request_id: str


@dataclass(frozen=True, slots=True)
class FailRequest:
    request_id: str
    why: str


@dataclass(frozen=True, slots=True)
class RejectRequest:
    """The request's own kv_transfer_params were wrong: a 400, not a 5xx."""

    request_id: str
    why: str


@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: str
    why: str


EngineAction = EmitFirstToken | FailRequest | RejectRequest | AbortRequest
