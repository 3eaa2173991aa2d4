"""The typed contract between the step loop and the transfer thread.

Three kinds of plain, frozen data cross between the two threads of an instance's KV
transfer, each dispatched with ``match``:

* **commands** (``Command``), step loop → transfer thread: facts, each stated once,
  about the transfers of one instance; the transfer thread decides what they mean.
  Push prefill (push_sends.py): a leg was added (``PushAdded``), blocks hold their KV
  for some layers (``BlocksComputed``), prefill is over (``PushPrefilled``) or the leg
  ended otherwise (``PushEnded``). Decode (receives.py): a leg was added
  (``ReceiveAdded``), it has its blocks (``BlocksAllocated``), its request ended
  (``ReceiveEnded``). Pull prefill: blocks are lent (``Lent``), the router gave up on
  them (``LendEnded``). The connector collects the commands of one engine turn (a
  step, or a pass over the inbox) and hands them over as **one** ``StepMessage`` (one
  queue item, one wake-up of the transfer thread); the layer hook hands over each
  layer group's ``BlocksComputed`` as one ``StepMessage`` too, mid-step;
* **events** (``TransferEvent``), transfer thread → step loop: the ends of transfers,
  one per transfer (``WritesDone``, ``ReceiveOver``, ``LendOver``), and a warning
  before it when the request must stop while KV still moves (``PushFailing``,
  ``ReceiveFailing``). The events of one pass of the transfer thread go to the
  engine's inbox as **one** ``TransferUpdate``, ``("kv", update)``;
* **actions** (``EngineAction``), connector → engine, taken by the engine after each
  event or schedule: which request to fail, reject, abort, or to emit token #1 for.

Peers, leases, fences, registrations and READs are the transfer thread's alone: what
its parts tell one another (``Notice``) never reaches the step loop.

Nothing here holds a reference to mutable state of either side; block ids travel as
the lists the sender built and does not touch again. Descriptors never cross: the
transfer thread builds them from block ids, layers and the peers' Hellos.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvpush.kv_transfer.wire import messages as m


# ---- commands: step loop -> transfer thread ---------------------------------------------
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
class ReceiveAdded:
    """Decode: the leg of ``tid`` is in the engine; its KV comes from the prefill
    instance at ``address``, which the request says is engine ``engine_id`` and (pull)
    lends ``remote_block_ids``. The transfer thread handshakes with it, checks those
    against its Hello, and leases the transfer (receives.py)."""

    tid: str
    address: str
    engine_id: str = ""
    remote_block_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class BlocksAllocated:
    """Decode: receive ``tid`` has its blocks. Push: ``register`` is the registration
    that tells prefill where to WRITE (a full prefix hit: nothing comes, the step loop
    has ended the receive). Pull: READ prefill's ``remote_blocks`` into our
    ``local_blocks``, paired in order (none: nothing to read, prefill is told so)."""

    tid: str
    register: m.PushRegister | None = None
    local_blocks: list[int] = field(default_factory=list)
    remote_blocks: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ReceiveEnded:
    """Decode: the step loop ended receive ``tid``'s request (``why``). Prefill is told;
    the blocks the step loop kept for it go back on the ``ReceiveOver`` that follows,
    once nothing of prefill's can land in them."""

    tid: str
    why: str


@dataclass(frozen=True, slots=True)
class Lent:
    """Pull, prefill: the blocks of ``tid`` are lent to decode (the answer went out): a
    lease covers them until decode's PullDone, its Abort, or the lease's end."""

    tid: str


@dataclass(frozen=True, slots=True)
class LendEnded:
    """Pull, prefill: the router gave up on ``tid``; the step loop freed its blocks."""

    tid: str


@dataclass(frozen=True, slots=True)
class Call:
    """Run ``fn`` on the transfer thread, in command order (diagnostics and tests)."""

    fn: Callable[[], None]


@dataclass(frozen=True, slots=True)
class Stop:
    """End the transfer thread."""


Command = (PushAdded | BlocksComputed | PushPrefilled | PushEnded | ReceiveAdded
           | BlocksAllocated | ReceiveEnded | Lent | LendEnded | Call | Stop)


@dataclass(frozen=True, slots=True)
class StepMessage:
    """What one engine turn (or one layer group of a step) asks of the transfer thread:
    its commands, carried out in order."""

    commands: tuple[Command, ...]


# ---- events: transfer thread -> step loop -----------------------------------------------
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
class ReceiveFailing:
    """Decode: receive ``tid`` failed (``why``: prefill went silent past its lease, its
    registration was lost, it aborted while our READ runs) but prefill's KV may still
    land in its blocks: end the request now (fail, or recompute in fresh blocks) and
    keep the blocks until ``ReceiveOver``."""

    tid: str
    why: str


@dataclass(frozen=True, slots=True)
class ReceiveOver:
    """Decode: receive ``tid`` is over and nothing of prefill's lands in its blocks any
    more. ``ok``: the KV is in (push: ``done`` carries token #1; pull: the READ's
    figures). Else ``why``; ``client_error``: the request's kv_transfer_params do not
    fit the prefill instance that answered (a 400). One per receive the step loop
    added (receives.py)."""

    tid: str
    ok: bool
    why: str | None = None
    done: m.PushDone | None = None
    num_descriptors: int = 0
    num_bytes: int = 0
    post_s: float = 0.0
    client_error: bool = False


@dataclass(frozen=True, slots=True)
class LendOver:
    """Pull, prefill: decode is done with the lend of ``tid`` (read it: ``ok``; gave
    up; or its lease ran out): the step loop frees the blocks."""

    tid: str
    ok: bool


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


TransferEvent = (WritesDone | PushFailing | ReceiveFailing | ReceiveOver | LendOver
                 | WorkerDied | DeadHoldExpired)


# ---- notices inside the transfer thread (its parts -> the worker; never the step loop)
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
class ReadDone:
    """Pull, decode: the READ of ``tid`` ended (``error``: why it failed, its claim's
    refusal and its post included)."""

    tid: str
    ok: bool
    error: str | None = None
    num_descriptors: int = 0
    num_bytes: int = 0
    post_s: float = 0.0


@dataclass(frozen=True, slots=True)
class RegistrationLost:
    """Push, decode: prefill never got the registration of ``tid`` though it was sent
    again (registrations.py); prefill has been told (Abort)."""

    tid: str
    why: str


@dataclass(frozen=True, slots=True)
class FenceReleased:
    """A fence ended without prefill's word: ``why`` is "peer_gone" or "timeout"."""

    tid: str
    why: str


Notice = PeerReady | PeerRefused | ReadDone | RegistrationLost | FenceReleased


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
