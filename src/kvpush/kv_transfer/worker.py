"""TransferWorker: the transfer thread of one instance.

It owns the side channel and drives the KV transport; the engine's step loop hands it
commands through a queue (and a wake-up pipe) and gets events back through the engine's
inbox. Nothing here touches the block pool: block ownership stays on the step loop.

The thread blocks in the side channel's poll (its socket and its wake-up pipe, which
``submit`` writes to). While something waits on a completion (a pull's READ, the last
WRITEs of a push whose PushDone is ready, an abort draining) it wakes every millisecond
to progress the transport and check completions; otherwise, WRITEs of a prefill still
under way included, it wakes for heartbeats, lease deadlines and (while peers exist)
every 20 ms to progress the transport. Waking every millisecond through a prefill's
forward pass, as it once did whenever WRITEs were in flight, made a 1-thread prefill
step slower where the thread shares the cores with the forward pass (each wake takes the
GIL and a core from it; docs/MEASURED.md). It never spins (on CUDA it sleeps on a
blocking CUDA event until a layer group's KV is written).

Its peers and their handshakes are a ``PeerTable`` (peers.py), bounded in size, swept
for unanswered handshakes, expired refusals and idle peers on the heartbeat period.

Per transfer it keeps a lease: a deadline renewed by the peer's heartbeats (or any
message about the transfer). An expired lease becomes a ``LeaseExpired`` event for the
engine and an ``Abort`` for the peer. Commands and events are the typed ones of
commands.py.

Decode side, it keeps the fences of pushes whose blocks wait for prefill (fences.py).
Prefill side, it answers an ``Abort`` with ``AbortAck`` for any transfer id once none of
its WRITEs is in flight, and posts no WRITE for that id again.

If the thread ends other than by ``stop()`` (an exception escaping its loop, or a Stop
the engine did not send), it closes the side channel and the transport and then posts
``WorkerDied`` to the step loop, its last event; ``death`` says why from then on (for
/health). What the step loop frees then, and what must wait, is thread_death.py's.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer import messages as m
from kvpush.kv_transfer.fences import DEFAULT_FENCE_TIMEOUT_S, FenceKeeper
from kvpush.kv_transfer.peers import (  # Peer re-exported: tests place peers
    DROP_REASONS,
    EVICT_REASONS,
    MAX_PEERS,
    STATES,
    Peer,
    PeerTable,
)
from kvpush.kv_transfer.side_channel import SEND_DROP_REASONS
from kvpush.kv_transfer.timeline import HandoffTimeline
from kvpush.kv_transfer.transport import KVTransport, TransferPostError, XferState

#: how many ended transfer ids (aborted by either side, or whose WRITEs are all done)
#: the worker remembers, to refuse a WRITE queued for one of them too late
MAX_ABORTED_REMEMBERED = 4096

log = logging.getLogger(__name__)

__all__ = ["Peer", "TransferWorker"]

#: ``side_channel_send_dropped_<reason>`` counters: the channel's reasons and the table's
SEND_DROPPED = tuple(dict.fromkeys((*SEND_DROP_REASONS, *DROP_REASONS)))

@dataclass
class Lease:
    deadline: float
    address: str | None  # peer that renews it; None: any peer
    renewable: bool = True  # False: a fixed deadline, heartbeats do not extend it


@dataclass
class PostedRead:
    """A pull's READ, posted by this thread."""

    tid: str
    address: str  # prefill's side channel: told PullDone when it ends
    num_descriptors: int
    num_bytes: int
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


class TransferWorker:
    def __init__(
        self,
        hello: m.Hello,
        channel,  # kvpush.kv_transfer.side_channel.SideChannel
        transport: KVTransport,
        post_event: Callable[[c.TransferEvent], None],
        lease_timeout_s: float,
        heartbeat_interval_s: float,
        busy_poll_s: float = 0.001,
        fence_timeout_s: float = DEFAULT_FENCE_TIMEOUT_S,
        *,
        max_peers: int = MAX_PEERS,
        peer_idle_timeout_s: float | None = None,
    ):
        """Peers (peers.py): a handshake is given up and a refusal expires after a lease
        period; a ready peer no transfer uses is dropped after ``peer_idle_timeout_s``
        (default: four lease periods); at most ``max_peers``."""
        self.hello = hello
        self.channel = channel
        #: used by this thread only once it runs (posts, states, progress, peers)
        self.transport = transport
        self.post_event = post_event
        self.lease_timeout_s = lease_timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.busy_poll_s = busy_poll_s
        # prefill of a push: decode's blocks are written by us, Aborts are answered
        self._writer = hello.role == "prefill" and hello.kv_transfer == "push"
        self.commands: queue.SimpleQueue[c.Command] = queue.SimpleQueue()
        self.peers = PeerTable(
            hello, channel, transport, post_event, self._dispatch,
            handshake_timeout_s=lease_timeout_s, refusal_ttl_s=lease_timeout_s,
            idle_timeout_s=(peer_idle_timeout_s if peer_idle_timeout_s is not None
                            else 4 * lease_timeout_s),
            busy=self._busy_addresses, max_peers=max_peers)
        self.leases: dict[str, Lease] = {}
        self.writes: dict[str, WriteGroup] = {}
        #: decode: pushes whose blocks wait for prefill's word (fences.py)
        self.fences = FenceKeeper(channel, post_event, self.peers.is_ready,
                                  lease_timeout_s, fence_timeout_s)
        #: transfers whose WRITEs are over: aborted (a lease-expiry Abort sent to the
        #: peer, or decode's Abort received) or finished (PushDone/AbortAck sent). A
        #: WRITE the step loop queues for one of them later is refused (the peer frees
        #: its blocks on that message); bounded, oldest forgotten first
        self.aborted: OrderedDict[str, None] = OrderedDict()
        self.handles: dict[int, str] = {}  # transport handle -> transfer id (writes)
        self.reads: dict[int, PostedRead] = {}  # pull: transport handle -> its READ
        #: push prefill: transfer id -> decode's registration, set here as it arrives and
        #: taken (popped) by the step-loop thread, mid-step or with its inbox event
        self.register_hints: dict[str, m.PushRegister] = {}
        # every key exists from the start: other threads read this dict (metrics)
        self.counters = {"leases_expired": 0, "transfers_failed": 0, "messages_bad": 0,
                         "writes_refused": 0}
        stats = getattr(channel, "stats", None)
        self._rejected = getattr(stats, "rejected_by_reason", {})
        self._send_dropped = getattr(stats, "send_dropped_by_reason", {})
        for reason in self._rejected:
            self.counters[f"side_channel_rejected_{reason}"] = 0
        self._sync_peer_counters()
        self._next_heartbeat = 0.0
        #: per-transfer stage stamps (the connector's, timeline.py); None: not kept
        self.timeline: HandoffTimeline | None = None
        self._thread = threading.Thread(target=self._run, name="kvpush-transfer", daemon=True)
        self._stopped = False
        self._stop_requested = False
        #: why the thread ended without ``stop()`` (set by the thread as it ends)
        self._death: str | None = None

    # ---- called from other threads --------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, cmd: c.Command) -> None:
        self.commands.put(cmd)
        self.channel.wake()

    def stop(self, timeout: float = 5.0) -> None:
        if self._stopped:
            return
        self._stop_requested = True  # the thread's end is no death
        self.submit(c.Stop())
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._stopped = True

    # ---- the thread ---------------------------------------------------------------------
    @property
    def death(self) -> str | None:
        """Why the thread is gone although ``stop()`` was never called, or None (it runs,
        was not started yet, or was stopped). Safe from any thread (/health reads it)."""
        if self._death is not None:
            return self._death
        if (self._thread.ident is not None and not self._thread.is_alive()
                and not self._stop_requested):
            return "the transfer thread is not running"
        return None

    def _run(self) -> None:
        why = None
        try:
            while True:
                if not self._drain_commands():
                    break
                timeout_ms = int(self._timeout(time.monotonic()) * 1000)
                for sender, payload in self.channel.recv(timeout_ms):
                    self.receive(payload, sender)
                for address in self.channel.take_dropped():
                    self.fences.peer_dropped(address)
                for reason, n in self._rejected.items():
                    self.counters[f"side_channel_rejected_{reason}"] = n
                self._poll_transfers()
                now = time.monotonic()
                beat = now >= self._next_heartbeat
                if beat:
                    self._heartbeat(now)
                self._expire(now)
                if beat:  # after the leases: a request ends on its lease first
                    self.peers.sweep(now)
                    self._sync_peer_counters()  # (metrics: a heartbeat period late at most)
            if not self._stop_requested:  # a Stop the engine did not send
                why = "the transfer thread ended without being asked to stop"
        except BaseException as e:  # noqa: BLE001 - any end of the loop is a death
            log.exception("transfer thread died")
            why = f"{type(e).__name__}: {e}"
        finally:
            self._teardown(why)

    def _teardown(self, why: str | None) -> None:
        """Close the side channel and the transport; on a death (``why``), tell the step
        loop only once the transport is closed: from then on no transfer this instance
        posted touches its memory, which is what lets the step loop free blocks
        (thread_death.py says which, and which must wait)."""
        if why is not None:
            self._death = why  # /health fails from now on
        try:
            self.channel.close()
        except Exception:  # noqa: BLE001 - going down anyway
            log.exception("closing the side channel failed")
        transport_closed = True
        try:
            self.transport.close()
        except Exception:  # noqa: BLE001 - the event says so: its transfers may live on
            log.exception("closing the KV transport failed")
            transport_closed = False
        if why is not None:
            self.post_event(c.WorkerDied(why, transport_closed))

    def _timeout(self, now: float) -> float:
        """How long the next wait for messages may last (commands wake it early)."""
        if not self.commands.empty():
            return 0.0
        if self.reads or any(g.finish is not None and g.pending for g in self.writes.values()):
            return self.busy_poll_s  # a completion is waited for
        t = self._next_heartbeat - now
        if self.leases:
            t = min(t, min(lease.deadline for lease in self.leases.values()) - now)
        fence_due = self.fences.next_deadline()
        if fence_due is not None:
            t = min(t, fence_due - now)
        # keep the transport progressing while peers may be setting up connections
        return max(0.0, min(t, 0.02 if self.peers.has_ready() else 0.2))

    def _drain_commands(self) -> bool:
        while True:
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                return True
            if isinstance(cmd, c.Stop):
                return False
            try:
                self.handle(cmd)
            except Exception:
                log.exception("transfer command %s failed", type(cmd).__name__)

    def handle(self, cmd: c.Command) -> None:
        """Carry out one command (on the transfer thread; tests call it directly)."""
        match cmd:
            case c.Send(address, msg):
                self._send(address, msg)
            case c.PostWrite(tid, address, local, remote, ready):
                self._post_write(tid, address, local, remote, ready)
            case c.Finalize(tid, address, done):
                self._finalize(tid, address, done)
            case c.Track(tid, address, renewable):
                self.leases[tid] = Lease(time.monotonic() + self.lease_timeout_s, address,
                                         renewable)
            case c.Untrack(tid):
                self.leases.pop(tid, None)
                self.fences.drop(tid)
            case c.EnsurePeer(address):
                self._ensure_peer(address)
            case c.CancelWrites(tid, address):
                self._cancel_writes(tid, address)
            case c.PostRead(tid, address, local, remote):
                self._post_read(tid, address, local, remote)
            case c.FenceTransfer(tid, address):
                self.leases.pop(tid, None)  # the fence, not the lease, holds it now
                self.fences.fence(tid, address)
            case c.Call(fn):
                fn()
            case _:
                raise TypeError(f"not a transfer command: {cmd!r}")

    # ---- peers and messages ----------------------------------------------------------
    def _busy_addresses(self) -> set[str]:
        """Peers that transfers still use (leases, WRITEs, READs, fences): never idle."""
        busy = {lease.address for lease in self.leases.values() if lease.address}
        busy.update(group.address for group in self.writes.values())
        busy.update(read.address for read in self.reads.values())
        busy.update(fence.address for fence in self.fences.fences.values())
        return busy

    def _sync_peer_counters(self) -> None:
        """The peer table's and the channel's figures into ``counters`` (metrics)."""
        table = self.peers
        for reason in SEND_DROPPED:
            self.counters[f"side_channel_send_dropped_{reason}"] = (
                self._send_dropped.get(reason, 0) + table.dropped.get(reason, 0))
        for reason in EVICT_REASONS:
            self.counters[f"side_channel_peers_evicted_{reason}"] = table.evicted[reason]
        for state, n in (table.counts() if table else dict.fromkeys(STATES, 0)).items():
            self.counters[f"side_channel_peers_{state}"] = n

    def _send(self, address: str, msg: m.Message) -> None:
        self.peers.send(address, msg)

    def _ensure_peer(self, address: str) -> None:
        self.peers.ensure(address)

    def receive(self, payload: bytes, sender: str = "") -> None:
        """Handle one side-channel frame from ``sender`` (a peer's message)."""
        try:
            msg = m.decode(payload)
        except Exception:
            self.counters["messages_bad"] += 1
            log.warning("dropped a malformed side-channel frame (%d bytes)", len(payload))
            return
        try:
            if sender:
                self.peers.touch(sender)
            if isinstance(msg, m.PushRegister) and sender and self.peers.hold(sender, msg):
                return  # delivered once the sender's Hello is in (it was evicted here)
            self._dispatch(msg, sender)
        except Exception:  # a peer's message must never kill the transfer thread
            self.counters["messages_bad"] += 1
            log.exception("dropped a side-channel %s that could not be handled",
                          type(msg).__name__)

    def _dispatch(self, msg: m.Message, sender: str) -> None:
        if isinstance(msg, m.Abort):
            self._on_abort(msg, sender)
        elif isinstance(msg, m.Hello):
            if not self.peers.on_hello(msg, sender):
                self.counters["messages_bad"] += 1
        elif isinstance(msg, m.HelloRefused):
            self.peers.on_refused(msg, sender)
        else:
            getattr(self, "_on_" + type(msg).__name__)(msg)

    def _renew(self, tid: str) -> None:
        lease = self.leases.get(tid)
        if lease is not None and lease.renewable:
            lease.deadline = time.monotonic() + self.lease_timeout_s

    def _on_Heartbeat(self, msg: m.Heartbeat) -> None:
        for tid in msg.transfer_ids:
            self._renew(tid)
        if msg.awaiting_registration:
            self.post_event(c.AwaitingRegistration(list(msg.awaiting_registration)))

    def _on_PushRegister(self, msg: m.PushRegister) -> None:
        self._stamp(msg.transfer_id, "p_reg")
        self._renew(msg.transfer_id)
        if self._writer:  # for the layer hook of a step already under way (prefill_side)
            self.register_hints[msg.transfer_id] = msg
        self.post_event(c.Registered(msg))

    def _stamp(self, tid: str, stage: str) -> None:
        if self.timeline is not None:
            self.timeline.stamp(tid, stage)

    def _on_PushDone(self, msg: m.PushDone) -> None:
        self._stamp(msg.transfer_id, "d_done")
        self.post_event(c.PushDoneReceived(msg))

    def _on_PullDone(self, msg: m.PullDone) -> None:
        self.post_event(c.PullDoneReceived(msg))

    def _on_abort(self, msg: m.Abort, sender: str) -> None:
        if self._writer:  # decode gave up on a push: answer once nothing of ours can land
            self._writes_aborted(msg.transfer_id, sender)
        self.post_event(c.AbortReceived(msg))

    def _writes_aborted(self, tid: str, address: str) -> None:
        """Decode aborted push ``tid``: post no more WRITEs for it, and answer AbortAck
        once those in flight have drained (at once when none are). Any id gets its
        answer, one this instance never had or has finished with too: decode keeps the
        transfer's blocks fenced until it hears."""
        self._remember_aborted(tid)
        group = self.writes.get(tid)
        if group is not None:
            group.cancelled = group.abort_ack = True
            group.failed = group.failed or "aborted by decode"
            group.finish = group.finish or m.PushDone(tid, ok=False, error="aborted")
            self._maybe_finish(tid)
            return
        if address:  # (a peer not met yet, e.g. restarted on decode's old address,
            self._send(address, m.AbortAck(tid))  # gets it after a handshake)

    def _on_AbortAck(self, msg: m.AbortAck) -> None:
        self.post_event(c.AbortAckReceived(msg))

    # ---- commands from the engine --------------------------------------------------------
    def _post_write(self, tid: str, address: str, local: list, remote: list,
                    ready=None) -> None:
        group = self.writes.get(tid)
        if group is None:
            if tid in self.aborted:  # ended: the peer may have freed the blocks
                self.counters["writes_refused"] += 1
                return
            group = self.writes[tid] = WriteGroup(address)
        if group.cancelled or group.failed or not local:
            if local and group.cancelled:
                self.counters["writes_refused"] += 1
            return
        peer = self.peers.get(address)
        if peer is None or not peer.ready:
            group.failed = f"no connection to decode instance at {address}"
            return
        if ready is not None:  # CUDA: the layers' KV is in memory once this fires
            ready.synchronize()
        t0 = time.perf_counter()
        try:
            handle = self.transport.post("WRITE", peer.agent, local, remote)
        except TransferPostError as e:
            group.failed = f"WRITE failed to post: {e}"
            return
        group.post_s += time.perf_counter() - t0
        self._stamp(tid, "p_last_post")
        group.first_post = group.first_post or t0
        group.pending.add(handle)
        group.num_descriptors += len(local)
        group.num_bytes += sum(length for _, length in local)
        self.handles[handle] = tid
        self._check_now(handle)  # ends the group at once if that was its last WRITE

    def _finalize(self, tid: str, address: str, done: m.PushDone) -> None:
        """Send ``done`` to decode once every WRITE of the transfer has completed."""
        if self._ended(tid):
            return
        group = self.writes.setdefault(tid, WriteGroup(address))
        group.address = address
        group.finish = done
        self._maybe_finish(tid)

    def _cancel_writes(self, tid: str, address: str) -> None:
        """Decode aborted: post nothing more; AbortAck once in-flight WRITEs drain."""
        if tid in self.writes:
            self._writes_aborted(tid, address)  # writes_done once they have drained
        elif not self._ended(tid):  # its Abort forgotten already (bounded memory)
            self._writes_aborted(tid, address)
            self._ended(tid)

    def _ended(self, tid: str) -> bool:
        """Whether ``tid``'s WRITEs are over with none in flight (the peer has had its
        answer: AbortAck, PushDone, or our Abort). Then the step loop is told at once,
        so that it frees what the transfer held."""
        if tid in self.writes or tid not in self.aborted:
            return False
        self.post_event(c.WritesDone(tid, "aborted"))
        return True

    def _remember_aborted(self, tid: str) -> None:
        self.aborted[tid] = None
        self.aborted.move_to_end(tid)
        while len(self.aborted) > MAX_ABORTED_REMEMBERED:
            self.aborted.popitem(last=False)

    def _maybe_finish(self, tid: str) -> None:
        group = self.writes.get(tid)
        if group is None or group.finish is None or group.pending:
            return
        del self.writes[tid]
        self._remember_aborted(tid)  # a WRITE queued later is refused
        if group.abort_ack:
            self._send(group.address, m.AbortAck(tid))
        else:
            done = group.finish
            if group.failed:
                done = m.PushDone(tid, ok=False, error=group.failed)
                self.counters["transfers_failed"] += 1
            done.num_descriptors = group.num_descriptors
            done.num_bytes = group.num_bytes
            self._stamp(tid, "p_done_sent")  # before: the peer may read it at once
            self._send(group.address, done)
        elapsed = time.perf_counter() - group.first_post if group.first_post else 0.0
        self.post_event(c.WritesDone(tid, group.failed, group.num_descriptors,
                                     group.num_bytes, group.post_s, elapsed))

    # ---- transfers in flight ----------------------------------------------------------
    def _poll_transfers(self) -> None:
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
            self._stamp(read.tid, "d_read_done")
            self._read_ended(read, ok, None if ok else "READ failed")

    def _post_read(self, tid: str, address: str, local: c.Ranges, remote: c.Ranges) -> None:
        peer = self.peers.get(address)
        read = PostedRead(tid, address, len(local), sum(n for _, n in local))

        def when_ready(why: str | None) -> None:  # its handshake (again, after eviction)
            if why is None:
                self._post_read(tid, address, local, remote)
            else:
                self._read_ended(read, False, why, notify=False)

        if peer is not None and not peer.ready and self.peers.defer(address, when_ready):
            return
        if peer is None or not peer.ready:
            self._read_ended(read, False, f"no connection to prefill instance at {address}")
            return
        t0 = time.perf_counter()
        try:
            handle = self.transport.post("READ", peer.agent, local, remote)
        except TransferPostError as e:
            self._read_ended(read, False, f"READ failed to post: {e}")
            return
        read.post_s = time.perf_counter() - t0
        self._stamp(tid, "d_read_post")
        self.reads[handle] = read
        self._check_now(handle)

    def _read_ended(self, read: PostedRead, ok: bool, error: str | None,
                    notify: bool = True) -> None:
        """``notify``: tell prefill (PullDone); not when no handshake with it came off."""
        if not ok:
            self.counters["transfers_failed"] += 1
        if notify:
            self._send(read.address, m.PullDone(read.tid, ok=ok))
        self.post_event(c.ReadDone(read.tid, ok, error, read.num_descriptors,
                                   read.num_bytes, read.post_s))

    # ---- heartbeats and leases ----------------------------------------------------------
    def _heartbeat(self, now: float) -> None:
        self._next_heartbeat = now + self.heartbeat_interval_s
        by_peer: dict[str, list[str]] = {}
        unbound: list[str] = []
        for tid, lease in self.leases.items():
            if lease.address is None:
                unbound.append(tid)
            else:
                by_peer.setdefault(lease.address, []).append(tid)
        for tid, group in self.writes.items():
            by_peer.setdefault(group.address, []).append(tid)
        for address, peer in self.peers.items():
            tids = by_peer.get(address, []) + unbound
            if tids and peer.ready:
                hb = m.Heartbeat(self.hello.engine_id, sorted(set(tids)), sorted(unbound))
                self.channel.send(address, m.encode(hb))

    def _expire(self, now: float) -> None:
        expired = [tid for tid, lease in self.leases.items() if lease.deadline <= now]
        for tid in expired:
            lease = self.leases.pop(tid)
            self.counters["leases_expired"] += 1
            group = self.writes.get(tid)
            if group is not None and lease.address is not None:
                # our WRITEs may still be landing in the peer's blocks: post no more and
                # let the drain's PushDone (sent once they complete) tell the peer; an
                # Abort now would let it free blocks those WRITEs still reach. Failed, so
                # that PushDone says ok=False even if some WRITEs were never posted
                group.cancelled = True
                group.failed = group.failed or "lease expired: decode stopped answering"
            elif lease.address is not None:
                peer = self.peers.get(lease.address)
                if peer is not None and peer.ready:
                    self.channel.send(lease.address, m.encode(m.Abort(tid, "lease expired")))
                    self._remember_aborted(tid)
                elif peer is not None and peer.sent_hello and not peer.refused:
                    log.error("transfer %s: no answer to the side-channel handshake from %s "
                              "(unreachable, not a kvpush instance, or it refuses our "
                              "messages: a different side-channel secret?)", tid,
                              lease.address)
            self.post_event(c.LeaseExpired(tid))
        self.fences.expire(now)

