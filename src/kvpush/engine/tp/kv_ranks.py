"""KV transfer at tensor parallelism: each rank of a P/D instance moves its own head slice.

Every rank r > 0 registers its own KV region with a transport of its own (a NIXL agent
named ``<engine id>.rank<r>``) and leaves its region's base and the transport's metadata
in rank 0's store at start-up; rank 0's Hello lists every rank (``kv_map.RankKV``). Rank
0's transfer thread works out the pieces (``kv_map.head_map``) and posts rank r's through
a :class:`RankProxy`: typed msgspec messages on a ZMQ PAIR socket per rank (in rank 0's
private folder; the rank's first message is the instance's token, group.py), never
pickled calls and never the KV itself:

    rank 0 → rank r   KVAddPeer(the peer rank's metadata), KVPost(handle, op, the peer's
                      agent, our ranges, theirs), KVRelease(handle)
    rank r → rank 0   KVState(handle, DONE | FAILED, why) once its post has ended

Rank r's :class:`RankKVServer` (a thread of the rank process) posts with its own
transport and region, polls the post (every ms while one runs) and answers; with nothing
posted it progresses its transport every 5 ms (the target of a NIXL WRITE must, while an
initiator connects: a decode rank > 0 that only receives pushes). If that thread dies the
rank process exits 1, which ends the instance as any rank's death does; a dead rank's
proxy (``RankProxy.dead``, set by rank 0's watcher) fails its pending and later posts at
once instead of leaving them to leases and fences. A push WRITE of the
layers rank 0's layer hook states is safe from every rank: at TP > 1 the hook runs after
the layer's first all-reduce, which every rank enters after writing that layer's KV (gloo
on the CPU is synchronous; P/D at TP > 1 runs on the CPU only so far).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import msgspec
import zmq

from kvpush.kv_transfer.transports.transport import (
    KVTransport,
    Op,
    PeerMetadata,
    Range,
    TransferPostError,
    XferState,
)

log = logging.getLogger("kvpush.engine.tp")


class KVAddPeer(msgspec.Struct, tag="add", array_like=True, frozen=True):
    metadata: bytes


class KVPost(msgspec.Struct, tag="post", array_like=True, frozen=True):
    handle: int
    op: str
    peer: str
    local: list[tuple[int, int]]
    remote: list[tuple[int, int]]


class KVRelease(msgspec.Struct, tag="release", array_like=True, frozen=True):
    handle: int


class KVState(msgspec.Struct, tag="state", array_like=True, frozen=True):
    handle: int
    state: str
    error: str | None = None


KVRequest = KVAddPeer | KVPost | KVRelease


def kv_key(rank: int) -> str:
    """Rank ``rank``'s region base and transport metadata in rank 0's store."""
    return f"kvpush/kv/{rank}"


def encode_rank_kv(base: int, metadata: bytes) -> bytes:
    return msgspec.msgpack.encode((base, metadata))


def decode_rank_kv(blob: bytes) -> tuple[int, bytes]:
    base, metadata = msgspec.msgpack.decode(blob, type=tuple[int, bytes])
    return base, metadata


class RankProxy(KVTransport):
    """Rank 0's handle on rank r's transport (used by rank 0's transfer thread only)."""

    kind = "rank"

    def __init__(self, sock: zmq.Socket, rank: int) -> None:
        self.sock, self.rank, self.name = sock, rank, f"rank {rank}"
        self.stats = None  # type: ignore[assignment]  # the rank's transport keeps them
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(KVState)
        self._states: dict[int, XferState] = {}
        self._next = 1
        #: why the rank is gone (set by the rank watcher): its posts fail at once
        self.dead: str | None = None

    def _send(self, msg: KVRequest) -> None:
        try:
            self.sock.send(self._enc.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            raise TransferPostError(f"tensor-parallel rank {self.rank} is not reachable: "
                                    f"{e}") from None

    def register_region(self, base: int, nbytes: int, device: str = "cpu") -> None:
        raise NotImplementedError("rank r registers its region in its own process")

    def metadata(self) -> bytes:
        raise NotImplementedError("rank r's metadata is in rank 0's store")

    def add_peer(self, metadata: bytes) -> str:
        name = msgspec.msgpack.decode(metadata, type=PeerMetadata).name
        self._send(KVAddPeer(metadata))
        return name

    def remove_peer(self, peer: str) -> None:
        pass  # the rank keeps its peers until it stops

    def post(self, op: Op, peer: str, local: Sequence[Range], remote: Sequence[Range]) -> int:
        if self.dead is not None:
            raise TransferPostError(self.dead)
        handle, self._next = self._next, self._next + 1
        self._send(KVPost(handle, op, peer, [(r[0], r[1]) for r in local],
                          [(r[0], r[1]) for r in remote]))
        self._states[handle] = XferState.PENDING
        return handle

    def state(self, handle: int) -> XferState:
        self.progress()
        return self._states[handle]

    def release(self, handle: int) -> None:
        if self._states.pop(handle, None) is XferState.PENDING:
            self._send(KVRelease(handle))

    def progress(self) -> None:
        if self.dead is not None:  # its pending posts will never be answered
            for handle, state in self._states.items():
                if state is XferState.PENDING:
                    log.warning("tensor-parallel rank %d: post %d failed: %s", self.rank,
                                handle, self.dead)
                    self._states[handle] = XferState.FAILED
            return
        while True:
            try:
                reply = self._dec.decode(self.sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            if reply.handle in self._states:
                if reply.error:
                    log.warning("tensor-parallel rank %d: post %d failed: %s", self.rank,
                                reply.handle, reply.error)
                self._states[reply.handle] = XferState(reply.state)

    def close(self) -> None:
        self.sock.close(linger=0)


class RankKVServer:
    """Rank r's side (a thread of the rank process): posts what rank 0 asks with this
    rank's own transport and region, and says when each post has ended."""

    def __init__(self, transport: KVTransport, ctx: zmq.Context, address: str,
                 rank: int, token: bytes, on_death: Callable[[], None] = lambda: None
                 ) -> None:
        """``token``: sent first, for rank 0 to admit this socket. ``on_death()``: on the
        thread, once, if it dies (the rank process then exits: rank 0 would wait on its
        posts until leases and fences cleared them)."""
        self.transport, self.rank, self.on_death = transport, rank, on_death
        self.sock = ctx.socket(zmq.PAIR)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.sock.send(token)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvpush-tp-kv", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(KVRequest)
        pending: dict[int, int] = {}  # rank 0's handle -> our transport's
        transport = self.transport
        try:
            while not self._stop.is_set():
                if self.sock.poll(1 if pending else 5):
                    while True:
                        try:
                            msg = dec.decode(self.sock.recv(zmq.NOBLOCK))
                        except zmq.Again:
                            break
                        if isinstance(msg, KVAddPeer):
                            try:
                                transport.add_peer(msg.metadata)
                            except Exception:  # noqa: BLE001 - its posts will fail
                                log.exception("rank %d: a peer could not be added", self.rank)
                        elif isinstance(msg, KVPost):
                            try:
                                pending[msg.handle] = transport.post(
                                    msg.op, msg.peer, msg.local, msg.remote)  # type: ignore[arg-type]
                            except TransferPostError as e:
                                self.sock.send(enc.encode(KVState(msg.handle, "FAILED",
                                                                  str(e))))
                        elif msg.handle in pending:  # KVRelease: rank 0 gave up on it
                            transport.release(pending.pop(msg.handle))
                for handle, inner in list(pending.items()):
                    state = transport.state(inner)
                    if state is not XferState.PENDING:
                        del pending[handle]
                        transport.release(inner)
                        self.sock.send(enc.encode(KVState(handle, state.value)))
                if not pending:  # (a WRITE's target too, while its initiator connects)
                    transport.progress()
        except Exception:  # noqa: BLE001 - rank 0's posts would never end: the rank ends
            log.exception("tensor-parallel rank %d: its KV transfer thread died; the rank "
                          "exits", self.rank)
            self.on_death()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self.sock.close(linger=0)
        self.transport.close()
