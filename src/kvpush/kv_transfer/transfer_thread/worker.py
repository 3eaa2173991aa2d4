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
for unanswered handshakes, expired refusals and idle peers on the heartbeat period. The
WRITEs and READs it has posted, with their transport handles, are a ``TransfersInFlight``
(inflight.py): posts, completions, cancels, and the PushDone / AbortAck / PullDone that
end them.

Per transfer it keeps a lease (leases.py) and sends the heartbeats that renew the
peers' own. An expired lease ends the transfer where it is owned: a push prefill's in
push_sends.py, a receive's in receives.py, a pull lend here (``LendOver``). Commands
and events are the typed ones of commands.py.

Decode side, its receives (receives.py) own each transfer into this instance's blocks,
with their registrations (registrations.py) and fences (fences.py). Prefill side, it
answers an ``Abort`` with ``AbortAck`` for any transfer id once none of its WRITEs is
in flight, and posts no WRITE for that id again (inflight.py).

If the thread ends other than by ``stop()`` (an exception escaping its loop, or a Stop
the engine did not send), it closes the side channel and the transport and then posts
``WorkerDied`` to the step loop, its last event (teardown.py); ``death`` says why from
then on (for /health). What the step loop frees then, and what must wait, is
step_loop/thread_death.py's.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.timeline import HandoffTimeline
from kvpush.kv_transfer.transfer_thread.fences import DEFAULT_FENCE_TIMEOUT_S, FenceKeeper
from kvpush.kv_transfer.transfer_thread.inflight import PostedRead, TransfersInFlight, WriteGroup
from kvpush.kv_transfer.transfer_thread.leases import Leases
from kvpush.kv_transfer.transfer_thread.lend_claims import LendClaims
from kvpush.kv_transfer.transfer_thread.peers import (  # Peer re-exported: tests place peers
    DROP_REASONS,
    EVICT_REASONS,
    MAX_PEERS,
    STATES,
    Peer,
    PeerTable,
)
from kvpush.kv_transfer.transfer_thread.push_sends import PushSends
from kvpush.kv_transfer.transfer_thread.receives import Receives
from kvpush.kv_transfer.transfer_thread.registrations import SentRegistrations
from kvpush.kv_transfer.transfer_thread.teardown import teardown
from kvpush.kv_transfer.transports.transport import KVTransport
from kvpush.kv_transfer.wire import messages as m
from kvpush.kv_transfer.wire.side_channel import SEND_DROP_REASONS

log = logging.getLogger(__name__)

__all__ = ["Peer", "TransferWorker"]

#: the step loop's statements about a push transfer (PushSends handles them)
PUSH_FACTS = (c.PushAdded, c.BlocksComputed, c.PushPrefilled, c.PushEnded)
#: every fact that belongs to one role (another role's instance logs and ignores it)
ROLE_FACTS = (*PUSH_FACTS, c.ReceiveAdded, c.BlocksAllocated, c.ReceiveEnded, c.Lent,
              c.LendEnded)
#: what the thread's parts tell one another (routed to Receives, never posted)
NOTICES = (c.PeerReady, c.PeerRefused, c.ReadDone, c.RegistrationLost, c.FenceReleased)

#: ``side_channel_send_dropped_<reason>`` counters: the channel's reasons and the table's
SEND_DROPPED = tuple(dict.fromkeys((*SEND_DROP_REASONS, *DROP_REASONS)))

class TransferWorker:
    def __init__(
        self,
        hello: m.Hello,
        channel,  # kvpush.kv_transfer.wire.side_channel.SideChannel
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
        #: events of the running pass of the thread's loop, posted as one TransferUpdate
        #: at its end (None outside the loop: tests calling methods get them one by one)
        self._batch: list[c.TransferEvent] | None = None
        self.heartbeat_interval_s = heartbeat_interval_s
        self.busy_poll_s = busy_poll_s
        # pull: prefill lends its blocks (claims answered), decode READs them
        self._lender = hello.role == "prefill" and hello.kv_transfer == "pull"
        self._reader = hello.role == "decode" and hello.kv_transfer == "pull"
        self.commands: queue.SimpleQueue[c.Command] = queue.SimpleQueue()
        self.peers = PeerTable(
            hello, channel, transport, self._post, self._dispatch,
            handshake_timeout_s=lease_timeout_s, refusal_ttl_s=lease_timeout_s,
            idle_timeout_s=(peer_idle_timeout_s if peer_idle_timeout_s is not None
                            else 4 * lease_timeout_s),
            busy=self._busy_addresses, max_peers=max_peers)
        #: per transfer, how long without word from its peer (leases.py)
        self.lease_table = Leases(lease_timeout_s)
        #: decode: pushes whose blocks wait for prefill's word (fences.py)
        self.fences = FenceKeeper(channel, self._post, self.peers.is_ready,
                                  lease_timeout_s, fence_timeout_s)
        # every key exists from the start: other threads read this dict (metrics)
        self.counters = {"leases_expired": 0, "transfers_failed": 0, "messages_bad": 0,
                         "writes_refused": 0, "aborts_sent": 0, "aborts_received": 0}
        stats = getattr(channel, "stats", None)
        self._rejected = getattr(stats, "rejected_by_reason", {})
        self._send_dropped = getattr(stats, "send_dropped_by_reason", {})
        for reason in self._rejected:
            self.counters[f"side_channel_rejected_{reason}"] = 0
        self._sync_peer_counters()
        self._next_heartbeat = 0.0
        #: per-transfer stage stamps (the connector's, timeline.py); None: not kept
        self.timeline: HandoffTimeline | None = None
        #: the WRITEs and READs posted, with their transport handles (inflight.py)
        self.inflight = TransfersInFlight(transport, self.peers, self.peers.send,
                                          self._post, self._stamp, self.counters)
        #: pull prefill: which decode claimed each lend (lend_claims.py)
        self.claims = LendClaims(self.peers.send)
        #: push decode: the registrations it sent, sent again if lost (registrations.py)
        self.registered = SentRegistrations(self.peers.send, self._post, lease_timeout_s)
        #: decode: its receives, from the leg's arrival to the end of the KV (receives.py)
        self.receives = (Receives(self.peers, self.inflight, self.registered,
                                  self.fences, self._post, self.lease_table.track, self._untrack,
                                  self._stamp, hello.num_layers, self.counters)
                         if hello.role == "decode" else None)
        #: push prefill: its transfers, registrations matched to blocks (push_sends.py)
        self.push = (PushSends(self.peers, self.inflight, self.peers.send, self._post,
                               self.lease_table.track, self._untrack, hello.block_size,
                               self.counters)
                     if hello.role == "prefill" and hello.kv_transfer == "push" else None)
        self._thread = threading.Thread(target=self._run, name="kvpush-transfer", daemon=True)
        self._stopped = False
        self._stop_requested = False
        #: why the thread ended without ``stop()`` (set by the thread as it ends)
        self._death: str | None = None

    # ---- called from other threads --------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, cmd: c.Command, wake: bool = True) -> None:
        """Queue ``cmd``; ``wake``: now (else at the thread's next wake-up: a message, a
        timer, or another submit)."""
        self.commands.put(cmd)
        if wake:
            self.channel.wake()

    def writes_wanted(self) -> bool:
        """Whether a push transfer is registered and still taking blocks, so that blocks
        stated computed mid-step are worth waking this thread for. Read from the step
        loop as a hint (one int): a registration landing just after it was read finds
        the blocks queued when it wakes this thread, so nothing depends on it."""
        return self.push is not None and self.push.sending > 0

    def stop(self, timeout: float = 5.0) -> None:
        if self._stopped:
            return
        self._stop_requested = True  # the thread's end is no death
        self.submit(c.Stop())
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._stopped = True

    # ---- views of the transfers in flight (tests, the heartbeat) ----------------------
    @property
    def leases(self) -> dict:
        """Transfer id -> its ``Lease`` (``Leases.by_tid``)."""
        return self.lease_table.by_tid

    @property
    def writes(self) -> dict[str, WriteGroup]:
        """Push: transfer id -> its WRITEs (``TransfersInFlight.writes``)."""
        return self.inflight.writes

    @property
    def reads(self) -> dict[int, PostedRead]:
        """Pull: transport handle -> its READ (``TransfersInFlight.reads``)."""
        return self.inflight.reads

    @property
    def handles(self) -> dict[int, str]:
        """Transport handle -> transfer id of each WRITE in flight."""
        return self.inflight.handles

    @property
    def aborted(self) -> OrderedDict[str, None]:
        """Transfer ids whose WRITEs are over (a WRITE queued for one is refused)."""
        return self.inflight.aborted

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

    def _post(self, ev: c.TransferEvent | c.Notice) -> None:
        """Post ``ev`` for the step loop: with the pass's others when the loop runs. A
        notice of the thread's parts (peers, READs, fences, registrations) goes to the
        receives instead; a push's WritesDone ends its lease here."""
        if isinstance(ev, NOTICES):
            if self.receives is not None:
                self.receives.on_notice(ev)
            return
        if isinstance(ev, c.WritesDone):
            self._untrack(ev.tid)
        if self._batch is None:
            self.post_event(ev)
        else:
            self._batch.append(ev)

    def _flush_events(self) -> None:
        """Post the pass's events as one TransferUpdate (one inbox item)."""
        if self._batch:
            events, self._batch = tuple(self._batch), []
            self.post_event(c.TransferUpdate(events))

    def _run(self) -> None:
        why = None
        self._batch = []
        try:
            while True:
                if not self._drain_commands():
                    break
                self._flush_events()  # (a WRITE done in its post) before the wait
                timeout_ms = int(self._timeout(time.monotonic()) * 1000)
                arrived = self.channel.recv(timeout_ms)
                # what the step loop queued during the wait goes before the peers'
                # messages: one of them may answer it (a pull lend is Tracked at the
                # step's end; decode's claim of it can come in the same wake-up)
                if not self._drain_commands():
                    break
                for sender, payload in arrived:
                    self.receive(payload, sender)
                for address in self.channel.take_dropped():
                    self.fences.peer_dropped(address)
                for reason, n in self._rejected.items():
                    self.counters[f"side_channel_rejected_{reason}"] = n
                self.inflight.poll()
                now = time.monotonic()
                beat = now >= self._next_heartbeat
                if beat:
                    self._heartbeat(now)
                    if self.receives is not None:
                        self.receives.claims_unanswered(now)
                self._expire(now)
                if beat:  # after the leases: a request ends on its lease first
                    self.peers.sweep(now)
                    self._sync_peer_counters()  # (metrics: a heartbeat period late at most)
                self._flush_events()
            if not self._stop_requested:  # a Stop the engine did not send
                why = "the transfer thread ended without being asked to stop"
        except BaseException as e:  # noqa: BLE001 - any end of the loop is a death
            log.exception("transfer thread died")
            why = f"{type(e).__name__}: {e}"
        finally:
            teardown(self, why)

    def _timeout(self, now: float) -> float:
        """How long the next wait for messages may last (commands wake it early)."""
        if not self.commands.empty():
            return 0.0
        if self.inflight.awaited():
            return self.busy_poll_s  # a completion is waited for
        t = self._next_heartbeat - now
        lease_due = self.lease_table.next_deadline()
        if lease_due is not None:
            t = min(t, lease_due - now)
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
            case c.StepMessage(commands):
                for one in commands:  # one failing command does not drop the others
                    try:
                        self.handle(one)
                    except Exception as e:
                        log.exception("transfer command %s failed", type(one).__name__)
                        if self.push is not None and isinstance(one, PUSH_FACTS):
                            # (a bug) the step loop must still hear the end of it
                            self.push.abandon(one.tid, f"transfer thread error: {e}")
            case c.BlocksComputed() if self.push is not None:
                self.push.computed(cmd)
            case c.PushAdded() if self.push is not None:
                self.push.added(cmd)
            case c.PushPrefilled(tid, done) if self.push is not None:
                self.push.prefilled(tid, done)
            case c.PushEnded(tid, why) if self.push is not None:
                self.push.ended_by_step_loop(tid, why)
            case c.ReceiveAdded() if self.receives is not None:
                self.receives.added(cmd)
            case c.BlocksAllocated() if self.receives is not None:
                self.receives.allocated(cmd)
            case c.ReceiveEnded(tid, why) if self.receives is not None:
                self.receives.ended_by_step_loop(tid, why)
            case c.Lent(tid) if self._lender:
                self.lease_table.track(tid, None)  # renewed by any peer's heartbeat
            case c.LendEnded(tid) if self._lender:
                self._untrack(tid)
            case c.Call(fn):
                fn()
            case _ if isinstance(cmd, ROLE_FACTS):
                log.warning("ignored %s: not this instance's role", type(cmd).__name__)
            case _:
                raise TypeError(f"not a transfer command: {cmd!r}")

    def _untrack(self, tid: str) -> None:
        self.lease_table.untrack(tid)
        self.claims.forget(tid)

    # ---- peers and messages ----------------------------------------------------------
    def _busy_addresses(self) -> set[str]:
        """Peers that transfers still use (leases, WRITEs, READs, fences): never idle."""
        busy = self.lease_table.addresses()
        busy.update(self.inflight.addresses())
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
        elif isinstance(msg, m.PushDone | m.AbortAck):
            self._on_answer(msg, sender)
        elif isinstance(msg, m.Hello):
            if not self.peers.on_hello(msg, sender):
                self.counters["messages_bad"] += 1
        elif isinstance(msg, m.HelloRefused):
            self.peers.on_refused(msg, sender)
        elif isinstance(msg, m.PullClaim | m.PullClaimed | m.PullDone):
            self._on_lend_message(msg, sender)
        elif isinstance(msg, m.Heartbeat):
            self._on_heartbeat(msg, sender)
        else:
            getattr(self, "_on_" + type(msg).__name__)(msg)

    def _on_heartbeat(self, msg: m.Heartbeat, sender: str) -> None:
        for tid in msg.transfer_ids:
            self.lease_table.renew(tid, sender)
        if msg.awaiting_registration and self.receives is not None:
            self.registered.awaited(msg.awaiting_registration, time.monotonic(), sender)

    def _on_PushRegister(self, msg: m.PushRegister) -> None:
        self._stamp(msg.transfer_id, "p_reg")
        self.lease_table.renew(msg.transfer_id)
        if self.push is None:  # only a push prefill instance writes
            log.warning("ignored a push registration from %s: this instance does not "
                        "send KV", msg.address)
            return
        self.push.on_register(msg)  # its computed blocks go now, the rest as computed

    def _stamp(self, tid: str, stage: str) -> None:
        if self.timeline is not None:
            self.timeline.stamp(tid, stage)

    def _on_answer(self, msg: m.PushDone | m.AbortAck, sender: str) -> None:
        """Prefill's last word on a push receive: done (token #1), or our Abort acked."""
        if self.receives is None:
            log.warning("ignored a %s from %s: this instance receives no KV",
                        type(msg).__name__, sender)
        elif isinstance(msg, m.PushDone):
            self._stamp(msg.transfer_id, "d_done")
            self.receives.on_push_done(msg, sender)
        else:
            self.receives.on_abort_ack(msg, sender)

    def _on_lend_message(self, msg: m.PullClaim | m.PullClaimed | m.PullDone,
                         sender: str) -> None:
        """Pull lends (lend_claims.py): claims and their answers; a PullDone ends a
        claimed lend only from its claimer."""
        tid = msg.transfer_id
        if isinstance(msg, m.PullClaim):
            if self._lender:
                self.claims.claim(msg, sender, live=tid in self.lease_table.by_tid)
        elif isinstance(msg, m.PullClaimed):
            if self._reader:
                self.receives.on_claimed(msg, sender)
        elif not self.claims.from_claimer(tid, sender):
            self.counters["messages_bad"] += 1
        elif self._lender and tid in self.lease_table.by_tid:
            self._end_lend(tid, msg.ok)

    def _end_lend(self, tid: str, ok: bool) -> None:
        self._untrack(tid)
        self._post(c.LendOver(tid, ok))

    def _on_abort(self, msg: m.Abort, sender: str) -> None:
        tid = msg.transfer_id
        if self.receives is not None:  # (counted there, if it is prefill's word)
            self.receives.on_abort(msg, sender)
            return
        if not self.claims.from_claimer(tid, sender):
            self.counters["messages_bad"] += 1  # a lend claimed by another decode
            return
        self.counters["aborts_received"] += 1
        if self.push is not None:  # decode gave up on a push: answer once nothing of
            self.push.on_abort(msg, sender)  # ours can land
        elif self._lender and tid in self.lease_table.by_tid:
            self._end_lend(tid, False)

    # ---- heartbeats and leases ----------------------------------------------------------
    def _heartbeat(self, now: float) -> None:
        self._next_heartbeat = now + self.heartbeat_interval_s
        writes = [(tid, group.address) for tid, group in self.writes.items()]
        ready = [address for address, peer in self.peers.items() if peer.ready]
        for address, hb in self.lease_table.heartbeats(self.hello.engine_id, writes, ready):
            self.channel.send(address, m.encode(hb))

    def _expire(self, now: float) -> None:
        for tid in self.lease_table.take_expired(now):
            self.counters["leases_expired"] += 1
            if self.push is not None and self.push.lease_expired(tid):
                continue  # a push of ours: ended there (the step loop gets WritesDone)
            if self.receives is not None and self.receives.lease_expired(tid):
                continue  # fenced, draining or over there (receives.py)
            if self._lender:  # decode neither read the lend nor renewed it
                self._end_lend(tid, False)
        self.fences.expire(now)
