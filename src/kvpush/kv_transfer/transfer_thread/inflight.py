"""TransfersInFlight: the WRITEs and READs the transfer thread has posted (transfer thread).

The transfer thread's ``TransferWorker`` owns one. PushSends (push_sends.py) hands it
the WRITEs to post (``PostWrite``) and each push's ``PushDone`` once prefill is over
(``finalize``); Receives (receives.py) hands it pull READs (``PostRead``). This object
owns the transport handles of what it posts, from the post to the completion it polls
for and the release of the handle. Nothing here touches the block pool, and nothing here runs
on another thread.

Push, prefill side: the WRITEs of one transfer are a ``WriteGroup``. ``finalize`` gives
the ``PushDone`` to send; it goes to decode once every WRITE of the group has completed
(then the step loop gets ``WritesDone``). A failed post or completion, or no ready peer,
makes the group fail: its ``PushDone`` says ok=False; ``end_writes`` (prefill gave up)
does the same. Decode's ``Abort`` cancels the group as it arrives: no more WRITEs are
posted for it, and once those in flight have drained decode gets ``AbortAck`` instead;
an id with no group gets its ``AbortAck`` at once, whether this instance never had it or
has finished with it. Ended ids (finished, or aborted by either side) are remembered,
boundedly, so that a WRITE stated too late is refused and counted (``writes_refused``):
the peer may have freed those blocks.

Pull, decode side: one ``PostedRead`` per transfer. Prefill is told ``PullDone`` when it
ends, and the receive ``ReadDone``; a READ for a peer whose handshake is under way
waits for it (``PeerTable.defer``).

Over cma the copy happens inside the post, so a transfer is checked at once after it is
posted: its completion goes out then, not at the next poll.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvpush.kv_cache.kv_region import KVLayout
from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.transfer_thread.peers import PeerTable
from kvpush.kv_transfer.transports.transport import (
    KVTransport,
    TransferPostError,
    XferState,
    layer_block_descs,
)
from kvpush.kv_transfer.wire import messages as m

#: how many ended transfer ids (aborted by either side, or whose WRITEs are all done)
#: are remembered, to refuse a WRITE queued for one of them too late
MAX_ABORTED_REMEMBERED = 4096

__all__ = ["MAX_ABORTED_REMEMBERED", "PostRead", "PostWrite", "PostedRead", "TransfersInFlight",
           "WriteGroup"]


#: (address, length) pairs: one NIXL descriptor each
Ranges = list[tuple[int, int]]


def hello_layout(hello: m.Hello) -> KVLayout:
    """The KV region layout an instance announced in its Hello."""
    return KVLayout(layout=hello.layout, num_layers=hello.num_layers,
                    num_blocks=hello.num_blocks, block_size=hello.block_size,
                    num_kv_heads=hello.num_kv_heads, head_dim=hello.head_dim,
                    dtype=hello.dtype, block_bytes=hello.block_bytes,
                    layer_bytes=hello.layer_bytes)


@dataclass(frozen=True, slots=True)
class PostWrite:
    """One WRITE to post: our ``local_blocks`` into the peer's ``remote_blocks`` (paired
    in order), every layer in ``layers``, for push ``tid``. Built by PushSends from the
    step loop's BlocksComputed and decode's registration; ``ready`` is the former's CUDA
    event (None on CPU)."""

    tid: str
    address: str
    local_blocks: list[int]
    remote_blocks: list[int]
    layers: range
    ready: Any = None


@dataclass(frozen=True, slots=True)
class PostRead:
    """One READ to post: the peer's ``remote_blocks`` into our ``local_blocks`` (paired
    in order), every layer in ``layers``, for pull ``tid`` (receives.py builds it once
    prefill has answered the lend's claim)."""

    tid: str
    address: str
    local_blocks: list[int]
    remote_blocks: list[int]
    layers: range


@dataclass
class PostedRead:
    """A pull's READ, posted by this thread."""

    tid: str
    address: str  # prefill's side channel: told PullDone when it ends
    num_descriptors: int = 0
    num_bytes: int = 0
    post_s: float = 0.0


@dataclass
class WriteGroup:
    """The WRITEs of one push transfer and what to send once they are done."""

    address: str
    pending: set[int] = field(default_factory=set)
    failed: str | None = None
    num_descriptors: int = 0
    num_bytes: int = 0
    post_s: float = 0.0
    first_post: float | None = None
    finish: m.PushDone | None = None  # set by finalize
    abort_ack: bool = False  # answer AbortAck instead of PushDone
    cancelled: bool = False


class TransfersInFlight:
    """The posted WRITEs and READs of one transfer thread, and their transport handles.

    ``send(address, msg)`` sends a side-channel message to a peer (the peer table's);
    ``post_event`` hands an event to the step loop; ``stamp(tid, stage)`` records a
    hand-off stage (timeline.py); ``counters`` is the worker's metrics dict, of which
    this object adds to ``writes_refused`` and ``transfers_failed``."""

    def __init__(
        self,
        transport: KVTransport,
        peers: PeerTable,
        send: Callable[[str, m.Message], None],
        post_event: Callable[[c.TransferEvent], None],
        stamp: Callable[[str, str], None],
        counters: dict[str, int],
    ) -> None:
        self.transport = transport
        self.peers = peers
        self.send = send
        self.post_event = post_event
        self.stamp = stamp
        self.counters = counters
        self.writes: dict[str, WriteGroup] = {}
        #: transfers whose WRITEs are over: aborted (a lease-expiry Abort sent to the
        #: peer, or decode's Abort received) or finished (PushDone/AbortAck sent). A
        #: WRITE the step loop queues for one of them later is refused (the peer frees
        #: its blocks on that message); bounded, oldest forgotten first
        self.aborted: OrderedDict[str, None] = OrderedDict()
        self.handles: dict[int, str] = {}  # transport handle -> transfer id (writes)
        self.reads: dict[int, PostedRead] = {}  # pull: transport handle -> its READ

    # ---- what the worker asks about them ------------------------------------------------
    def awaited(self) -> bool:
        """Whether a completion is waited for: a READ, or the last WRITEs of a push whose
        PushDone (or AbortAck) is ready to go."""
        return bool(self.reads) or any(g.finish is not None and g.pending
                                       for g in self.writes.values())

    def addresses(self) -> set[str]:
        """The peers that posted or finishing transfers use."""
        busy = {group.address for group in self.writes.values()}
        busy.update(read.address for read in self.reads.values())
        return busy

    # ---- push: WRITEs --------------------------------------------------------------------
    def descs(self, peer: m.Hello, cmd: PostWrite | PostRead) -> tuple[Ranges, Ranges]:
        """(ours, the peer's) descriptors of a command's paired blocks and layers, from
        the two Hellos (ValueError / IndexError: ids outside a region, layouts differ)."""
        own = self.peers.own
        return layer_block_descs(own.base_address, hello_layout(own), cmd.local_blocks,
                                 peer.base_address, hello_layout(peer), cmd.remote_blocks,
                                 cmd.layers)

    def post_write(self, cmd: PostWrite) -> None:
        tid, address = cmd.tid, cmd.address
        group = self.writes.get(tid)
        if group is None:
            if tid in self.aborted:  # ended: the peer may have freed the blocks
                self.counters["writes_refused"] += 1
                return
            group = self.writes[tid] = WriteGroup(address)
        wanted = bool(cmd.local_blocks) and bool(cmd.layers)
        if group.cancelled or group.failed or not wanted:
            if wanted and group.cancelled:
                self.counters["writes_refused"] += 1
            return
        peer = self.peers.get(address)
        if peer is None or not peer.ready or peer.hello is None:
            group.failed = f"no connection to decode instance at {address}"
            return
        try:
            local, remote = self.descs(peer.hello, cmd)
        except (IndexError, ValueError) as e:
            group.failed = f"WRITE not posted: {e}"
            return
        if cmd.ready is not None:  # CUDA: the layers' KV is in memory once this fires
            cmd.ready.synchronize()
        t0 = time.perf_counter()
        try:
            handle = self.transport.post("WRITE", peer.agent, local, remote)
        except TransferPostError as e:
            group.failed = f"WRITE failed to post: {e}"
            return
        group.post_s += time.perf_counter() - t0
        self.stamp(tid, "p_last_post")
        group.first_post = group.first_post or t0
        group.pending.add(handle)
        group.num_descriptors += len(local)
        group.num_bytes += sum(length for _, length in local)
        self.handles[handle] = tid
        self._check_now(handle)  # ends the group at once if that was its last WRITE

    def finalize(self, tid: str, address: str, done: m.PushDone) -> None:
        """Send ``done`` to decode once every WRITE of the transfer has completed."""
        group = self.writes.setdefault(tid, WriteGroup(address))
        group.address = address
        group.finish = done
        self._maybe_finish(tid)

    def writes_aborted(self, tid: str, address: str) -> None:
        """Decode aborted push ``tid``: post no more WRITEs for it, and answer AbortAck
        once those in flight have drained (at once when none are). Any id gets its
        answer, one this instance never had or has finished with too: decode keeps the
        transfer's blocks fenced until it hears."""
        self.remember_aborted(tid)
        group = self.writes.get(tid)
        if group is not None:
            group.cancelled = group.abort_ack = True
            group.failed = group.failed or "aborted by decode"
            group.finish = group.finish or m.PushDone(tid, ok=False, error="aborted")
            self._maybe_finish(tid)
            return
        if address:  # (a peer not met yet, e.g. restarted on decode's old address,
            self.send(address, m.AbortAck(tid))  # gets it after a handshake)

    def end_writes(self, tid: str, why: str) -> None:
        """Prefill ended push ``tid`` before handing it over: post no more WRITEs; once
        those in flight drained, decode gets PushDone(ok=False, ``why``) and the step
        loop WritesDone."""
        group = self.writes.get(tid)
        if group is None:
            return
        group.cancelled = True
        group.failed = group.failed or why
        group.finish = group.finish or m.PushDone(tid, ok=False, error=why)
        self._maybe_finish(tid)

    def lease_expired(self, tid: str, why: str) -> bool:
        """``tid``'s lease ran out: if it has WRITEs, post no more and fail it with
        ``why`` (its PushDone, sent once those in flight complete, says ok=False).
        False: it has none."""
        group = self.writes.get(tid)
        if group is None:
            return False
        group.cancelled = True
        group.failed = group.failed or why
        return True

    def remember_aborted(self, tid: str) -> None:
        self.aborted[tid] = None
        self.aborted.move_to_end(tid)
        while len(self.aborted) > MAX_ABORTED_REMEMBERED:
            self.aborted.popitem(last=False)

    def _maybe_finish(self, tid: str) -> None:
        group = self.writes.get(tid)
        if group is None or group.finish is None or group.pending:
            return
        del self.writes[tid]
        self.remember_aborted(tid)  # a WRITE queued later is refused
        if group.abort_ack:
            self.send(group.address, m.AbortAck(tid))
        else:
            done = group.finish
            if group.failed:
                done = m.PushDone(tid, ok=False, error=group.failed)
                self.counters["transfers_failed"] += 1
            done.num_descriptors = group.num_descriptors
            done.num_bytes = group.num_bytes
            self.stamp(tid, "p_done_sent")  # before: the peer may read it at once
            self.send(group.address, done)
        elapsed = time.perf_counter() - group.first_post if group.first_post else 0.0
        self.post_event(c.WritesDone(tid, group.failed, group.num_descriptors,
                                     group.num_bytes, group.post_s, elapsed))

    # ---- completions ----------------------------------------------------------------------
    def poll(self) -> None:
        """Check every posted transfer's state and end those that are over; with none
        posted, progress the transport while peers exist (their connections)."""
        if not (self.handles or self.reads):
            if self.peers:
                self.transport.progress()
            return
        states = {h: self.transport.state(h) for h in (*self.handles, *self.reads)}
        for h, st in states.items():
            if st is not XferState.PENDING:
                self._transfer_ended(h, st)

    def _check_now(self, handle: int) -> None:
        """A transfer just posted or handed over: over cma the copy happens inside the
        post, so it is usually DONE already; its completion then goes out now, not at
        the next poll of the transport."""
        st = self.transport.state(handle)
        if st is not XferState.PENDING:
            self._transfer_ended(handle, st)

    def _transfer_ended(self, h: int, st: XferState) -> None:
        self.transport.release(h)
        if h in self.handles:
            tid = self.handles.pop(h)
            group = self.writes.get(tid)
            if group is not None:
                group.pending.discard(h)
                if st is XferState.FAILED and not group.failed:
                    group.failed = "WRITE failed to complete"
                self._maybe_finish(tid)
        else:
            read = self.reads.pop(h)
            ok = st is XferState.DONE
            self.stamp(read.tid, "d_read_done")
            self._read_ended(read, ok, None if ok else "READ failed")

    # ---- pull: READs ---------------------------------------------------------------------
    def post_read(self, cmd: PostRead) -> None:
        tid, address = cmd.tid, cmd.address
        peer = self.peers.get(address)
        read = PostedRead(tid, address)

        def when_ready(why: str | None) -> None:  # its handshake (again, after eviction)
            if why is None:
                self.post_read(cmd)
            else:
                self._read_ended(read, False, why, notify=False)

        if peer is not None and not peer.ready and self.peers.defer(address, when_ready):
            return
        if peer is None or not peer.ready or peer.hello is None:
            self._read_ended(read, False, f"no connection to prefill instance at {address}")
            return
        try:
            local, remote = self.descs(peer.hello, cmd)
        except (IndexError, ValueError) as e:
            self._read_ended(read, False, f"bad remote_block_ids: {e}")
            return
        read.num_descriptors, read.num_bytes = len(local), sum(n for _, n in local)
        t0 = time.perf_counter()
        try:
            handle = self.transport.post("READ", peer.agent, local, remote)
        except TransferPostError as e:
            self._read_ended(read, False, f"READ failed to post: {e}")
            return
        read.post_s = time.perf_counter() - t0
        self.stamp(tid, "d_read_post")
        self.reads[handle] = read
        self._check_now(handle)

    def _read_ended(self, read: PostedRead, ok: bool, error: str | None,
                    notify: bool = True) -> None:
        """``notify``: tell prefill (PullDone); not when no handshake with it came off."""
        if not ok:
            self.counters["transfers_failed"] += 1
        if notify:
            self.send(read.address, m.PullDone(read.tid, ok=ok))
        self.post_event(c.ReadDone(read.tid, ok, error, read.num_descriptors,
                                   read.num_bytes, read.post_s))
