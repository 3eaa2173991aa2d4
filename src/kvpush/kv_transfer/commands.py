"""The typed contract between the step loop and the transfer thread.

Three kinds of plain, frozen data cross between the two threads of an instance's KV
transfer, each dispatched with ``match``:

* **commands** (``Command``), step loop → transfer thread. On a push prefill instance
  they are facts, each stated once: a leg was added (``PushAdded``), blocks hold their
  KV for some layers (``BlocksComputed``), prefill is over (``PushPrefilled``) or the
  leg ended otherwise (``PushEnded``); the transfer thread decides what they mean for
  the transfer (push_sends.py). Pull and decode still use verbs: send, track, read,
  fence. The connector collects the commands of one engine turn (a step, or a pass
  over the inbox) and hands them over as **one** ``StepMessage`` (one queue item, one
  wake-up of the transfer thread); the layer hook hands over each layer group's
  ``BlocksComputed`` as one ``StepMessage`` too, mid-step;
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
class PushAdded:
    """Push, prefill: the leg of ``tid`` is in the engine. A registration must match its
    prompt: ``num_prompt_tokens`` tokens whose block hash chain is ``prompt_hashes``."""

    tid: str
    num_prompt_tokens: int
    prompt_hashes: list[bytes]


@dataclass(frozen=True, slots=True)
class BlocksComputed:
    """Push, prefill: prompt blocks ``first_block`` on (our ``local_blocks``) hold their
    KV for ``layers`` now. The transfer thread WRITEs them into decode's blocks once it
    has decode's registration (push_sends.py). ``ready``: on CUDA, the event recorded
    after those layers' kernels were queued; the transfer thread waits on it before it
    posts (None on CPU)."""

    tid: str
    first_block: int
    local_blocks: list[int]
    layers: range
    ready: Any = None


@dataclass(frozen=True, slots=True)
class PushPrefilled:
    """Push, prefill: the leg is over and every block was stated computed; ``done``
    (token #1) goes to decode once every WRITE has landed."""

    tid: str
    done: m.PushDone


@dataclass(frozen=True, slots=True)
class PushEnded:
    """Push, prefill: the step loop ended the leg (aborted, failed) or the router gave up
    on the transfer; the transfer thread ends it unless decode already waits for WRITEs
    of a finished prefill (then decode decides)."""

    tid: str
    why: str


@dataclass(frozen=True, slots=True)
class Register:
    """Push, decode: the blocks of receive ``tid`` are registered: send ``register`` to
    prefill at ``address``, and again if prefill says it never got it
    (registrations.py)."""

    tid: str
    address: str
    register: m.PushRegister


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


Command = (Send | EnsurePeer | Track | Untrack | PushAdded | BlocksComputed | PushPrefilled
           | PushEnded | Register | PostRead | FenceTransfer | Call | Stop)


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
class RegistrationLost:
    """Push, decode: prefill never got the registration of ``tid`` though it was sent
    again (registrations.py); prefill has been told (Abort)."""

    tid: str
    why: str


@dataclass(frozen=True, slots=True)
class WritesDone:
    """Push, prefill: transfer ``tid`` is over and nothing of ours reads its blocks any
    more (its WRITEs drained, or none was posted): the step loop frees them. ``failed``:
    why not all landed; ``prefill_not_needed``: decode has the whole prompt cached. One
    per transfer the step loop added (push_sends.py)."""

    tid: str
    failed: str | None
    num_descriptors: int = 0
    num_bytes: int = 0
    post_s: float = 0.0
    elapsed_s: float = 0.0
    prefill_not_needed: bool = False


@dataclass(frozen=True, slots=True)
class PushFailing:
    """Push, prefill: the transfer thread ended ``tid`` (``why``) while WRITEs of it are
    still draining: stop its prefill now; ``WritesDone`` follows once they drained."""

    tid: str
    why: str


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


TransferEvent = (PeerReady | PeerRefused | PeerEvicted | PushDoneReceived | PullDoneReceived
                 | AbortReceived | AbortAckReceived | RegistrationLost | PushFailing
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
    """The request's own kv_transfer_params were wrong, or it has nothing to do: a 400
    with ``code`` (e.g. ``prefill_not_needed``), not a 5xx."""

    request_id: str
    why: str
    code: str | None = None


@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: str
    why: str


EngineAction = EmitFirstToken | FailRequest | RejectRequest | AbortRequest
