"""A TransferWorker without its thread, for tests: a fake side channel and a fake
transport, an injected clock, and a recording ``post_update``. A test hands it the step
loop's facts and peers' frames (``m.encode(...)``) through the worker's own entry points
(``handle``, ``on_frame``, ``poll``, ``tick``, ``flush``, ``run_once``) and asserts on
the events it posts and the frames it sends. Nothing here sleeps or reaches into the
worker's private parts."""

from __future__ import annotations

import dataclasses

from kvpush.kv_cache.kv_region import KVLayout
from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.record import TransferCounters
from kvpush.kv_transfer.transfer_thread.context import Settings
from kvpush.kv_transfer.transfer_thread.worker import TransferWorker
from kvpush.kv_transfer.transports.transport import XferState
from kvpush.kv_transfer.wire import messages as m

#: decode's and prefill's side channels, and a third instance's
D, P, OTHER = "10.0.0.2:5700", "10.0.0.1:5600", "10.0.0.9:5900"
LEASE, HEARTBEAT, FENCE = 2.0, 0.5, 30.0
BASE = 4096  # both regions' base address
#: one layer of 8 blocks of 16 tokens, 8 bytes per block and layer
LAYOUT = KVLayout("x", num_layers=1, num_blocks=8, block_size=16, num_kv_heads=1,
                  head_dim=1, dtype="float32", block_bytes=8, layer_bytes=64)
#: a prompt of 8 full blocks and its (stand-in) hash chain
PROMPT_TOKENS, CHAIN = 8 * 16, tuple(bytes([i]) * 16 for i in range(8))


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeChannel:
    """Records each frame sent (decoded), hands ``inbox`` to ``recv`` (recording how
    long the worker would have waited), ``dropped`` to ``take_dropped``; ``gone``:
    peers whose connection is down."""

    def __init__(self, address: str = "") -> None:
        self.address = address
        self.log: list[str] = []  # "channel closed" (a test may share it with the transport)
        self.sent: list[tuple[str, m.Message]] = []
        self.inbox: list[tuple[str, bytes]] = []
        self.waits_ms: list[int] = []
        self.dropped: list[str] = []
        self.gone: set[str] = set()
        self.forgotten: list[str] = []
        self.closed = False
        self.stats = None

    def send(self, address: str, payload: bytes) -> bool:
        self.sent.append((address, m.decode(payload)))
        return True

    def of(self, kind: type) -> list:
        """The messages of ``kind`` sent, in order."""
        return [msg for _, msg in self.sent if isinstance(msg, kind)]

    def recv(self, timeout_ms: int) -> list[tuple[str, bytes]]:
        self.waits_ms.append(timeout_ms)
        out, self.inbox = self.inbox, []
        return out

    def wake(self) -> None:
        pass

    def connect(self, address: str) -> None:
        pass

    def take_dropped(self) -> list[str]:
        out, self.dropped = self.dropped, []
        return out

    def forget(self, address: str) -> None:
        self.forgotten.append(address)

    def peer_gone(self, address: str) -> bool:
        return address in self.gone

    def close(self) -> None:
        self.closed = True
        self.log.append("channel closed")


class FakeTransport:
    """Each post stays PENDING until the test ends it (``Harness.land``); a peer's
    agent is named after its role."""

    kind = "inproc"

    def __init__(self) -> None:
        self.states: dict[int, XferState] = {}
        self.posted: list[tuple] = []  # (op, agent, local descriptors, remote ones)
        self.removed: list[str] = []
        self.log: list[str] = []  # "transport closed"

    @property
    def posts(self) -> int:
        return len(self.posted)

    def post(self, op, peer, local, remote) -> int:
        self.posted.append((op, peer, list(local), list(remote)))
        handle = len(self.posted)
        self.states[handle] = XferState.PENDING
        return handle

    def state(self, handle: int) -> XferState:
        return self.states[handle]

    def release(self, handle: int) -> None:
        pass  # (kept: a test may look at a handle's last state)

    def progress(self) -> None:
        pass

    def add_peer(self, metadata: bytes) -> str:
        return metadata.decode() or "agent"

    def remove_peer(self, agent: str) -> None:
        self.removed.append(agent)

    def close(self) -> None:
        self.log.append("transport closed")


def hello(role: str, address: str, mode: str = "push", *, reply: bool = False,
          engine_id: str | None = None, **layout) -> m.Hello:
    """An instance's Hello (its engine id is its role unless given; ``layout``: fields
    of LAYOUT to change)."""
    return m.Hello(version=m.PROTOCOL_VERSION, engine_id=engine_id or role, role=role,
                   address=address, transport="inproc", agent_metadata=role.encode(),
                   model="x", kv_transfer=mode, base_address=BASE,
                   layout=dataclasses.replace(LAYOUT, **layout), reply=reply)


class Harness:
    """A worker of ``role`` (at P for prefill, D for decode) and what it did."""

    def __init__(self, role: str, mode: str, *, fence_s: float = FENCE,
                 busy_poll_s: float = 0.001) -> None:
        self.role, self.mode = role, mode
        self.address = P if role == "prefill" else D
        self.peer = D if role == "prefill" else P
        self.clock = Clock()
        self.channel = FakeChannel(self.address)
        self.transport = FakeTransport()
        self.updates: list[c.TransferUpdate] = []
        self.worker = TransferWorker(
            hello(role, self.address, mode), Settings(LEASE, HEARTBEAT, fence_s, 16),
            self.channel, self.transport, self.updates.append, clock=self.clock,
            busy_poll_s=busy_poll_s)
        self.worker.table.beat(0.0)  # as the thread does when it starts

    # ---- driving it --------------------------------------------------------------------
    def state(self, *facts: c.Fact) -> None:
        """The step loop's facts of one turn; the pass's update posted."""
        self.worker.handle(c.StepMessage(facts))
        self.worker.flush()

    def receive(self, msg: m.Message | bytes, sender: str | None = None) -> None:
        """A frame from ``sender`` (the peer by default); the pass's update posted."""
        payload = msg if isinstance(msg, bytes) else m.encode(msg)
        self.worker.on_frame(payload, self.peer if sender is None else sender)
        self.worker.flush()

    def meet(self, address: str | None = None, role: str | None = None,
             engine_id: str | None = None) -> None:
        """The instance at ``address`` says Hello (as an answer): a ready peer."""
        address = address or self.peer
        role = role or ("decode" if self.role == "prefill" else "prefill")
        self.receive(hello(role, address, self.mode, reply=True, engine_id=engine_id),
                     address)

    def advance(self, seconds: float) -> None:
        """Time passes: due timers fire; the update posted."""
        self.clock.now += seconds
        self.worker.tick()
        self.worker.flush()

    def land(self, handle: int | None = None, ok: bool = True) -> None:
        """Post ``handle`` (the last one by default) completes; the worker polls."""
        handle = handle or len(self.transport.posted)
        self.transport.states[handle] = XferState.DONE if ok else XferState.FAILED
        self.worker.poll()
        self.worker.flush()

    def run_once(self) -> bool:
        """One pass of the loop, as the thread runs it (the fake channel does not wait)."""
        return self.worker.run_once()

    # ---- what it did -------------------------------------------------------------------
    @property
    def events(self) -> list[c.Event]:
        return [ev for u in self.updates for ev in u.events]

    def kinds(self) -> list[str]:
        return [type(ev).__name__ for ev in self.events]

    def overs(self) -> list[tuple[str, c.Outcome, str | None]]:
        return [(ev.tid, ev.outcome, ev.why) for ev in self.events if isinstance(ev, c.Over)]

    def failings(self) -> list[tuple[str, str]]:
        return [(ev.tid, ev.why) for ev in self.events if isinstance(ev, c.Failing)]

    @property
    def counters(self) -> TransferCounters:
        """The counters as the step loop last got them."""
        last = [u.counters for u in self.updates if u.counters is not None]
        return last[-1] if last else TransferCounters()

    def sent(self, kind: type, to: str | None = None) -> list:
        """The messages of ``kind`` sent (to ``to``), in order."""
        return [msg for address, msg in self.channel.sent
                if isinstance(msg, kind) and to in (None, address)]

    def posted(self, op: str | None = None) -> list[tuple]:
        return [p for p in self.transport.posted if op in (None, p[0])]


def make(role: str, mode: str = "push", *, ready: bool = True, **kw) -> Harness:
    """A worker of ``role`` whose peer (decode for prefill, prefill for decode) is
    ready (unless not ``ready``); the handshake's frames are cleared."""
    h = Harness(role, mode, **kw)
    if ready:
        h.meet()
        h.channel.sent.clear()
    return h


# ---- push: what each side says ----------------------------------------------------------
def register(tid: str, blocks: list[int] | None = None, skip: int = 0,
             address: str = D, **kw) -> m.PushRegister:
    """Decode's registration of ``tid``: its 8 blocks (0-7 unless given), a prompt of
    PROMPT_TOKENS hashing to CHAIN."""
    return m.PushRegister(tid, "decode", address, list(range(8)) if blocks is None
                          else blocks, skip, PROMPT_TOKENS,
                          prompt_hashes=list(kw.pop("prompt_hashes", CHAIN)), **kw)


def begin_push(tid: str) -> c.Begin:
    """Prefill's leg of ``tid`` (PROMPT_TOKENS, CHAIN)."""
    return c.Begin(tid, PROMPT_TOKENS, CHAIN)


def computed(tid: str, first: int = 0, blocks: list[int] | None = None) -> c.BlocksReady:
    """Prefill: ``blocks`` (all 8 by default) from prompt block ``first`` hold layer 0."""
    return c.BlocksReady(tid, first, list(range(8)) if blocks is None else blocks, range(1))


def prefilled(tid: str, first_token: int = 3) -> c.Prefilled:
    return c.Prefilled(tid, m.PushDone(tid, ok=True, first_token=first_token))


def sending(h: Harness, tid: str, *, blocks: bool = True) -> None:
    """Prefill: ``tid``'s leg, decode's registration and (``blocks``) its 8 blocks
    computed: one WRITE posted."""
    h.state(begin_push(tid))
    h.receive(register(tid))
    if blocks:
        h.state(computed(tid))


def begin_receive(tid: str, address: str = P, engine_id: str = "prefill",
                  lent: tuple[int, ...] = (), prompt_tokens: int = PROMPT_TOKENS,
                  lend_expires_ms: int | None = None) -> c.Begin:
    """Decode's leg of ``tid`` from the prefill at ``address`` (pull: ``lent``)."""
    return c.Begin(tid, prompt_tokens, CHAIN if not lent else (),
                   c.PeerRef(address, engine_id, lent, lend_expires_ms))


def allocated(tid: str, blocks: list[int] | None = None, cached: int = 0,
              full_hit: bool = False) -> c.BlocksReady:
    """Decode: ``tid``'s block table (0-7 by default), ``cached`` leading ones here."""
    return c.BlocksReady(tid, cached, list(range(8)) if blocks is None else blocks,
                         full_hit=full_hit)


def registered(h: Harness, tid: str, address: str = P) -> m.PushRegister:
    """Decode, push: ``tid`` begun with the (ready) prefill at ``address`` and its blocks
    allocated: the registration it sent."""
    h.state(begin_receive(tid, address), allocated(tid))
    return [r for r in h.sent(m.PushRegister, address) if r.transfer_id == tid][-1]


def claiming(h: Harness, tid: str, lent: tuple[int, ...] = (6,),
             blocks: list[int] | None = None) -> int:
    """Decode, pull: ``tid``'s one-block lend begun and its block allocated: the id of
    the claim it sent."""
    h.state(begin_receive(tid, lent=lent, prompt_tokens=16),
            allocated(tid, [3] if blocks is None else blocks))
    return [x for x in h.sent(m.PullClaim) if x.transfer_id == tid][-1].claim
