"""TransferWorker: the transfer thread of one instance.

It owns the side channel, the transport, the peers and every transfer. The step loop
hands it ``StepMessage``s through a queue (and a wake-up byte on the channel's pipe); it
hands back one ``TransferUpdate`` per pass through ``post_update``. The role object
chosen at start (``ROLES``) owns what a transfer means; the loop only routes:

1. the facts queued by the step loop, in order, to the role;
2. a wait on the side channel (in the kernel), until a message, a wake-up, or the next
   timer (one heap: leases, fences, re-sends, the heartbeat) is due; while a
   completion is awaited (a READ, or the last WRITEs of a finished push) it wakes every
   ``busy_poll_s`` to check it;
3. the facts that came during the wait, before the peers' messages that came with them
   (decode may claim a lend stated at the step's end in the same wake-up);
4. the peers' messages, dropped connections, completions, due timers;
5. the pass's events (and the counters, when they changed) as one update.

A peer's message that cannot be handled is dropped and counted. Anything else escaping
the loop is a bug: the thread closes its transport and channel and calls ``on_death``
once, which ends the engine core (peers' leases and fences cover it, as for a killed
instance). Without its thread (tests) ``handle``, ``on_frame``, ``poll``, ``tick`` and
``flush`` are driven by hand, with an injected clock.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence

from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.digest import BlockDigests
from kvpush.kv_transfer.transfer_thread.context import Context, Settings
from kvpush.kv_transfer.transfer_thread.decode import Decode
from kvpush.kv_transfer.transfer_thread.peers import MAX_PEERS, PeerTable
from kvpush.kv_transfer.transfer_thread.posts import Posts
from kvpush.kv_transfer.transfer_thread.pull_prefill import PullPrefill
from kvpush.kv_transfer.transfer_thread.push_prefill import PushPrefill
from kvpush.kv_transfer.transfer_thread.table import Phase, Table, Timer
from kvpush.kv_transfer.transports.transport import KVTransport
from kvpush.kv_transfer.wire import messages as m

log = logging.getLogger(__name__)

Role = PushPrefill | PullPrefill | Decode
ROLES: dict[tuple[str, str], type[Role]] = {
    ("prefill", "push"): PushPrefill, ("prefill", "pull"): PullPrefill,
    ("decode", "push"): Decode, ("decode", "pull"): Decode}

#: phases in which a post's completion is waited for (poll it every busy_poll_s)
AWAITED = (Phase.DRAINING, Phase.READING)


class TransferWorker:
    def __init__(self, hello: m.Hello, settings: Settings, channel, transport: KVTransport,
                 post_update: Callable[[c.TransferUpdate], None],
                 on_death: Callable[[str], None] = lambda why: None, *,
                 clock: Callable[[], float] = time.monotonic, busy_poll_s: float = 0.001,
                 max_peers: int = MAX_PEERS, peer_idle_s: float | None = None,
                 rank_transports: Sequence[KVTransport] = (),
                 digests: BlockDigests | None = None) -> None:
        """Peers: a handshake is given up and a refusal expires after a lease; a ready
        peer no transfer uses is dropped after ``peer_idle_s`` (default four leases).
        ``rank_transports``: at TP > 1, ranks 1.. (posts.py). ``digests``: our region's
        block digests under --kv-digest (digest.py)."""
        self.channel, self.transport = channel, transport
        self.post_update, self.on_death = post_update, on_death
        self.busy_poll_s = busy_poll_s
        table = Table(clock, settings.lease_s)
        peers = PeerTable(
            hello, channel, transport, max_peers=max_peers, clock=clock,
            on_ready=lambda a, h: self.role.on_peer_ready(a, h),
            on_refused=lambda a, why: self.role.on_peer_refused(a, why),
            deliver=self._dispatch, busy=table.addresses,
            handshake_timeout_s=settings.lease_s, refusal_ttl_s=settings.lease_s,
            idle_timeout_s=peer_idle_s if peer_idle_s is not None else 4 * settings.lease_s)
        self.table, self.peers = table, peers
        self.ctx = Context(hello, settings, table, peers,
                           Posts(transport, hello, rank_transports), channel, clock,
                           digests=digests)
        self.role: Role = ROLES[(hello.role, hello.kv_transfer)](self.ctx)
        self.ctx.on_landed = self.role.landed
        self.queue: queue.SimpleQueue[c.StepMessage | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvpush-transfer", daemon=True)
        self._stopping = False
        self._quiet_begins = hello.role == "prefill"

    # ---- other threads ----------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, msg: c.StepMessage) -> None:
        """Queue ``msg`` and wake the thread; on prefill, Begins alone wake nobody: they
        go with decode's registration (the pass it wakes takes the facts first), the
        step's hand-off, or the wait's end (0.2 s at most), so that no pass of their own
        takes the GIL from the step that follows them."""
        self.queue.put(msg)
        if not (self._quiet_begins and all(type(f) is c.Begin for f in msg.facts)):
            self.channel.wake()

    def stop(self, timeout: float = 5.0) -> None:
        if self._stopping:
            return
        self._stopping = True
        self.queue.put(None)
        self.channel.wake()
        if self._thread.is_alive():
            self._thread.join(timeout)
        elif self._thread.ident is None:  # never started: close here
            self._close()

    # ---- the thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.table.beat(0.0)
            while self.run_once():
                pass
        except BaseException as e:  # noqa: BLE001 - anything escaping the loop is a bug
            why = f"{type(e).__name__}: {e}"
            log.critical("the KV transfer thread died (%s): the engine core ends", why,
                         exc_info=True)
            self._close()
            self.on_death(why)
            return
        self._close()

    def run_once(self) -> bool:
        """One pass of the loop (above); False once stopped."""
        if not self._take_facts():
            return False
        self.flush()
        # rounded up: a timer due in under 1 ms must not make a zero wait (a spin)
        arrived = self.channel.recv(math.ceil(self._timeout() * 1000))
        if not self._take_facts():
            return False
        for sender, payload in arrived:
            self.on_frame(payload, sender)
        for address in self.channel.take_dropped():
            self.role.on_peer_dropped(address)
        self.poll()
        self.tick()
        self.flush()
        return True

    def _timeout(self) -> float:
        if not self.queue.empty():
            return 0.0
        if any(rec.handles and rec.phase in AWAITED for rec in self.table):
            return self.busy_poll_s
        # keep the transport progressing while peers may be setting up connections
        cap = 0.02 if self.peers.has_ready() else 0.2
        return max(0.0, min(self.table.timers.next_due() - self.ctx.clock(), cap))

    def _take_facts(self) -> bool:
        while True:
            try:
                msg = self.queue.get_nowait()
            except queue.Empty:
                return True
            if msg is None:
                return False
            self.handle(msg)

    def handle(self, msg: c.StepMessage) -> None:
        """Carry out one step message's facts, in order."""
        role = self.role
        for f in msg.facts:
            match f:
                case c.Begin():
                    role.begin(f)
                case c.BlocksReady():
                    role.blocks(f)
                case c.Prefilled():
                    role.prefilled(f)
                case c.End():
                    role.end(f)

    def on_frame(self, payload: bytes, sender: str = "") -> None:
        """One side-channel frame from ``sender`` (a peer's message)."""
        try:
            msg = m.decode(payload)
        except Exception:  # noqa: BLE001 - a peer's frame
            self._undecodable(payload, sender)
            return
        try:
            if sender:
                self.peers.touch(sender)
            if isinstance(msg, m.PushRegister) and sender and self.peers.hold(sender, msg):
                return  # delivered once the sender's Hello is in
            self._dispatch(msg, sender)
        except Exception:  # a peer's message must never end the transfer thread
            self.ctx.count("messages_bad")
            log.exception("dropped a side-channel %s that could not be handled",
                          type(msg).__name__)

    def _undecodable(self, payload: bytes, sender: str) -> None:
        other = m.other_version(payload)
        if other is not None and sender and other.address == sender:
            reason = (f"protocol version {other.version} != {m.PROTOCOL_VERSION}: "
                      "upgrade both instances to the same kvpush")
            log.error("refused peer %s at %s: %s", other.engine_id, sender, reason)
            self.channel.send(sender, m.encode(m.HelloRefused(self.ctx.hello.engine_id,
                                                               reason)))
            return
        self.ctx.count("messages_bad")
        log.warning("dropped a malformed side-channel frame (%d bytes)", len(payload))

    def _dispatch(self, msg: m.Message, sender: str) -> None:
        if isinstance(msg, m.Hello):
            if not self.peers.on_hello(msg, sender):
                self.ctx.count("messages_bad")
        elif isinstance(msg, m.HelloRefused):
            self.peers.on_refused_hello(msg, sender)
        elif isinstance(msg, m.Heartbeat):
            for tid in msg.transfer_ids:
                self.table.renew(tid, sender)
            self.role.on_heartbeat(msg, sender)
        else:
            self.role.on_message(msg, sender)

    def poll(self) -> None:
        """End the posts that completed (with peers and none posted: progress)."""
        if self.ctx.posts.awaited() or self.peers:
            for handle, state in self.ctx.posts.states():
                self.ctx.check(handle, state)

    def tick(self) -> None:
        """Fire what is due on the timer heap."""
        now = self.ctx.clock()
        for tid, kind in self.table.timers.take_due(now):
            if kind is Timer.HEARTBEAT:
                self._heartbeat(now)
                continue
            rec = self.table.get(tid)
            if rec is None:
                continue
            if kind is Timer.DEADLINE:
                self.role.deadline(rec)
            else:
                self.role.resend(rec)

    def _heartbeat(self, now: float) -> None:
        """Each ready peer gets the transfers it shares with us, and those waiting on
        any peer (listed as awaiting registration too); then the peers are swept."""
        self.table.beat(self.ctx.settings.heartbeat_s)
        by_peer: dict[str, list[str]] = {}
        unbound: list[str] = []
        for rec in self.table:
            if rec.peer is None:
                unbound.append(rec.tid)
            elif rec.phase is not Phase.FENCED:  # (a fence has no lease)
                by_peer.setdefault(rec.peer, []).append(rec.tid)
        engine_id = self.ctx.hello.engine_id
        for address, peer in list(self.peers.items()):
            tids = by_peer.get(address, []) + unbound
            if peer.ready and tids:
                self.channel.send(address, m.encode(m.Heartbeat(engine_id, sorted(tids),
                                                                sorted(unbound))))
        self.peers.sweep(now)
        self._sync_counters()

    def _sync_counters(self) -> None:
        """The channel's and the peer table's figures into the counters."""
        k, stats, peers = self.ctx.counters, getattr(self.channel, "stats", None), self.peers
        rejected = dict(getattr(stats, "rejected_by_reason", {}))
        dropped = dict(getattr(stats, "send_dropped_by_reason", {}))
        for reason, n in peers.dropped.items():
            dropped[reason] = dropped.get(reason, 0) + n
        new = (rejected, dropped, dict(peers.evicted), peers.counts())
        if new != (k.side_channel_rejected, k.side_channel_send_dropped,
                   k.side_channel_peers_evicted, k.side_channel_peers):
            (k.side_channel_rejected, k.side_channel_send_dropped,
             k.side_channel_peers_evicted, k.side_channel_peers) = new
            self.ctx.dirty = True

    def flush(self) -> None:
        """Post the pass's events, and the counters if they changed, as one update."""
        ctx = self.ctx
        if ctx.events or ctx.dirty:
            events, ctx.events = tuple(ctx.events), []
            counters = ctx.counters.copy() if ctx.dirty else None
            ctx.dirty = False
            self.post_update(c.TransferUpdate(events, counters))

    def _close(self) -> None:
        # the transport first (its posts released): a peer that sees our connection
        # drop frees the blocks it fenced for us, so nothing of ours may land after it
        for name, close in [*(("KV transport", t.close) for t in self.ctx.posts.transports),
                            ("side channel", self.channel.close)]:
            try:
                close()
            except Exception:  # noqa: BLE001 - going down anyway
                log.exception("closing the %s failed", name)
