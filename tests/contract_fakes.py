"""A TransferWorker without its thread, on a fake side channel and a fake transport, on
an injected clock: what the transfer-contract, thread-death and peer-table tests drive
by hand (``handle``, ``on_frame``, ``poll``, ``tick``, ``flush``)."""

from __future__ import annotations

import dataclasses

from kvpush.cluster.launcher import free_port
from kvpush.kv_cache.kv_region import KVLayout
from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.transfer_thread.context import Settings
from kvpush.kv_transfer.transfer_thread.worker import TransferWorker
from kvpush.kv_transfer.transports.transport import XferState
from kvpush.kv_transfer.wire import messages as m

D, P = "10.0.0.2:5700", "10.0.0.1:5600"
LEASE, FENCE = 2.0, 30.0
#: one layer of 8 blocks of 16 tokens (8 bytes per block and layer)
LAYOUT = KVLayout("x", num_layers=1, num_blocks=8, block_size=16, num_kv_heads=1,
                  head_dim=1, dtype="float32", block_bytes=8, layer_bytes=64)
#: a prompt of 8 full blocks and its (stand-in) hash chain
PROMPT_TOKENS, CHAIN = 8 * 16, tuple(bytes([i]) * 16 for i in range(8))


def closed_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports on ``host`` that nothing listens on (bounded tries)."""
    ports: set[int] = set()
    for _ in range(20 * n):
        ports.add(free_port(host))
        if len(ports) == n:
            return sorted(ports)
    raise AssertionError(f"found only {len(ports)} free ports")


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeChannel:
    """Records what is sent (decoded); ``gone``: peers whose connection is down."""

    def __init__(self, address: str = "") -> None:
        self.address = address
        self.sent: list[tuple[str, m.Message]] = []
        self.gone: set[str] = set()
        self.dropped: list[str] = []
        self.forgotten: list[str] = []
        self.log: list[str] = []

    def send(self, address: str, payload: bytes) -> bool:
        self.sent.append((address, m.decode(payload)))
        return True

    def of(self, kind: type) -> list:
        return [msg for _, msg in self.sent if isinstance(msg, kind)]

    def recv(self, timeout_ms: int) -> list[tuple[str, bytes]]:
        return []

    def wake(self) -> None:
        pass

    def connect(self, address: str) -> None:
        pass

    def peer_gone(self, address: str) -> bool:
        return address in self.gone

    def take_dropped(self) -> list[str]:
        out, self.dropped = self.dropped, []
        return out

    def forget(self, address: str) -> None:
        self.forgotten.append(address)

    def close(self) -> None:
        self.log.append("channel closed")


class FakeTransport:
    """Posts stay PENDING until a test sets ``states[handle]``; a peer's agent is its
    metadata (or "agent")."""

    kind = "inproc"

    def __init__(self) -> None:
        self.states: dict[int, XferState] = {}
        self.posts = 0
        self.posted: list[tuple] = []  # (op, peer, local, remote)
        self.removed: list[str] = []
        self.log: list[str] = []

    def post(self, op, peer, local, remote) -> int:
        self.posted.append((op, peer, local, remote))
        self.posts += 1
        self.states[self.posts] = XferState.PENDING
        return self.posts

    def state(self, handle: int) -> XferState:
        return self.states[handle]

    def release(self, handle: int) -> None:
        self.states.pop(handle, None)

    def progress(self) -> None:
        pass

    def add_peer(self, metadata: bytes) -> str:
        return metadata.decode() or "agent"

    def remove_peer(self, peer: str) -> None:
        self.removed.append(peer)

    def close(self) -> None:
        self.log.append("transport closed")


def hello(role: str, address: str, mode: str = "push", reply: bool = False,
          **layout) -> m.Hello:
    lay = dataclasses.replace(LAYOUT, **layout)
    return m.Hello(version=m.PROTOCOL_VERSION, engine_id=role, role=role, address=address,
                   transport="inproc", agent_metadata=b"", model="x", kv_transfer=mode,
                   base_address=4096, layout=lay, reply=reply)


class Updates(list):
    """The worker's posted TransferUpdates, in order."""

    def events(self) -> list[c.Event]:
        return [ev for u in self for ev in u.events]

    def kinds(self) -> list[str]:
        return [type(ev).__name__ for ev in self.events()]

    def counters(self):
        """The last counters an update carried (None: none did)."""
        last = [u.counters for u in self if u.counters is not None]
        return last[-1] if last else None


def worker(role: str, mode: str = "push", *, ready: bool = True, channel=None,
           transport=None, lease: float = LEASE, **kw
           ) -> tuple[TransferWorker, FakeChannel, FakeTransport, Updates, Clock]:
    """A worker of ``role`` at P (prefill) or D (decode; a real ``channel``'s address),
    with the other side ready (its Hello delivered as a frame) unless not ``ready``.
    Not started: its heartbeat is due at once, as when its thread starts."""
    mine, theirs = (P, D) if role == "prefill" else (D, P)
    mine = getattr(channel, "address", None) or mine
    ch = channel if channel is not None else FakeChannel(mine)
    tr = transport if transport is not None else FakeTransport()
    updates, clock = Updates(), Clock()
    w = TransferWorker(hello(role, mine, mode), Settings(lease, 0.5, FENCE, 16), ch, tr,
                       updates.append, clock=clock, **kw)
    w.table.beat(0.0)
    if ready:
        other = "decode" if role == "prefill" else "prefill"
        w.on_frame(m.encode(hello(other, theirs, mode, reply=True)), theirs)
    return w, ch, tr, updates, clock


def step(w: TransferWorker, *facts: c.Fact) -> None:
    """The step loop's facts of one turn, carried out, and the pass's update posted."""
    w.handle(c.StepMessage(facts))
    w.flush()


def frame(w: TransferWorker, msg: m.Message, sender: str) -> None:
    """A peer's message on the side channel, and the pass's update posted."""
    w.on_frame(m.encode(msg), sender)
    w.flush()
