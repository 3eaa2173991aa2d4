"""KVConnector: the step-loop half of KV transfer (the transfer thread is worker.py).

It decides, per request, whether the instance sends KV (prefill role), receives it
(decode role) or serves the request locally; it owns every block a transfer holds and
turns transfer events into request progress. All its methods run on the step-loop
thread; only ``TransferWorker.submit`` crosses to the transfer thread.

Push, prefill side (``PushSend``)::

    AWAITING_REGISTRATION ──PushRegister──▶ SENDING ──prefill done──▶ DRAINING
      │ (prefill may finish first: blocks    (each layer's new full      │ last WRITEs,
      │  held under a lease until D          blocks WRITten while the    │ then PushDone
      │  registers)                          forward pass goes on)       ▼ (token #1)
      └── lease expires / abort ──────────────────────────────────▶ RELEASED (blocks freed)

Push, decode side (``DecodeRecv``)::

    PENDING_BLOCKS ──blocks──▶ AWAITING_KV ──PushDone(token #1)──▶ request RUNNING
       │  (PushRegister sent; or a full    │  (no recompute)
       │   prefix hit: computed here)      ├─ PushDone(ok=False) / prefill's Abort:
       │                                   │    fail or recompute (policy), blocks freed
       └── failure: fail the request, or   └─ client abort, lease expiry, registration
           recompute it locally (policy)        lost: the request ends (fails or
                                                recomputes in fresh blocks) at once ──┐
    QUARANTINED (blocks fenced out of the pool, Abort sent and repeated) ◀────────────┘
       └── freed on AbortAck, PushDone, prefill's Abort, prefill's side-channel
           connection dropping, or --fence-timeout (counted): never at lease end,
           since a frozen prefill that resumes still finishes its WRITEs

Pull: prefill finishes with max_tokens=1 and lends its blocks (``LENT``) under a lease
until PullDone; decode allocates, posts a READ *on its step loop*, waits, then computes
the last prompt token itself to get token #1.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Callable

from kvpush.config import EngineConfig
from kvpush.engine.outputs import RequestError
from kvpush.kv_cache.kv_region import KVLayout, KVRegion
from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer import messages as m
from kvpush.kv_transfer.decode_side import DecodeSide
from kvpush.kv_transfer.prefill_side import PrefillSide, layers_per_write
from kvpush.kv_transfer.state import (
    DecodeRecv,
    KVTransferParams,
    PushSend,
    RecvState,
    SendState,
    TransferRecord,
)
from kvpush.kv_transfer.timeline import HandoffTimeline
from kvpush.kv_transfer.transport import layer_block_descs
from kvpush.kv_transfer.worker import TransferWorker
from kvpush.sampling_params import SampledToken
from kvpush.scheduler.request import Request
from kvpush.scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)

__all__ = ["KVConnector", "KVTransferParams", "TransferRecord"]


class KVConnector(PrefillSide, DecodeSide):
    """Step-loop side of KV transfer for one instance (see module docstring)."""

    def __init__(
        self,
        config: EngineConfig,
        region: KVRegion,
        scheduler: Scheduler,
        post_event: Callable[[tuple], None],
        faults=None,
    ):
        cfg = config.kv_transfer
        self.cfg = cfg
        self.role = cfg.role
        self.mode = cfg.mode
        self.engine_id = cfg.engine_id
        self.region = region
        self.layout = region.layout
        self.layers_per_write = layers_per_write(cfg.push_layers_per_write,
                                                 region.layout.num_layers, region.kv.is_cuda)
        self.scheduler = scheduler
        self.block_size = config.cache.block_size
        if faults is None:
            faults = faults_from_env()
        self.transport = _make_transport(cfg.transport, cfg.engine_id, faults)
        self.transport.register_region(region.base_address, region.nbytes, config.device)
        from kvpush.kv_transfer.side_channel import SideChannel

        self.channel = SideChannel(
            cfg.side_channel_host, cfg.side_channel_port, faults=faults, type_of=m.type_name,
            secret=cfg.side_channel_secret,
        )
        self.vocab_size = config.model.vocab_size  # bounds token #1 from a peer
        self.address = self.channel.address
        lay = self.layout
        self.hello = m.Hello(
            version=m.PROTOCOL_VERSION,
            engine_id=cfg.engine_id,
            role=cfg.role,
            address=self.address,
            transport=cfg.transport,
            agent_metadata=self.transport.metadata(),
            model=config.model.fingerprint(),
            dtype=lay.dtype,
            block_size=lay.block_size,
            layout=lay.layout,
            num_layers=lay.num_layers,
            num_kv_heads=lay.num_kv_heads,
            head_dim=lay.head_dim,
            kv_transfer=cfg.mode,
            base_address=region.base_address,
            num_blocks=lay.num_blocks,
            block_bytes=lay.block_bytes,
            layer_bytes=lay.layer_bytes,
        )
        self.worker = TransferWorker(
            self.hello,
            self.channel,
            self.transport,
            post_event,
            cfg.lease_timeout_s,
            cfg.heartbeat_interval_s,
            fence_timeout_s=cfg.fence_timeout_s,
        )
        self.timeline = self.worker.timeline = HandoffTimeline(self.role)
        self.peers: dict[str, m.Hello] = {}  # address -> the peer's Hello (ready peers)
        self.peer_layouts: dict[str, tuple[int, KVLayout]] = {}  # address -> (base, layout)
        self.refused: dict[str, str] = {}
        self.sends: dict[str, PushSend] = {}  # tid -> prefill-side transfer
        self.lent: dict[str, list[int]] = {}  # pull: tid -> blocks lent to decode
        self.recvs: dict[str, DecodeRecv] = {}  # tid -> decode-side transfer
        self.pending: deque[str] = deque()  # decode: tids waiting for blocks
        self.early_regs: dict[str, m.PushRegister] = {}  # registrations before the request
        self.ended: OrderedDict[str, str] = OrderedDict()  # recently ended tids -> why
        self.by_request: dict[str, str] = {}  # request id -> tid
        self.records: deque[TransferRecord] = deque(maxlen=1024)
        # called (on the step loop) with each finished transfer, e.g. by /metrics
        self.record_sink: Callable[[TransferRecord], None] | None = None
        self.counters = {"transfers_ok": 0, "transfers_failed": 0, "leases_expired": 0,
                         "aborts_sent": 0, "aborts_received": 0, "fences": 0,
                         "fences_peer_gone": 0, "fence_timeouts": 0,
                         "registrations_mid_step": 0}
        self._step_writes: list[tuple[PushSend, list[int], list[int]]] = []
        # what the engine must do next (commands.py: EngineAction)
        self.actions: list[c.EngineAction] = []
        self._stalled = False

    def has_pending_work(self) -> bool:
        """Whether before_schedule() could make progress now (no spinning: after a pass
        that could not, this stays False until an event or a finish changes things)."""
        return bool(self.pending) and not self._stalled

    def take_actions(self) -> list[c.EngineAction]:
        actions, self.actions = self.actions, []
        return actions

    # ---- life cycle -------------------------------------------------------------------
    def start(self) -> None:
        self.worker.start()

    def shutdown(self) -> None:
        self.worker.stop()

    def info(self) -> dict:
        host, port = self.address.rsplit(":", 1)
        return {
            "engine_id": self.engine_id,
            "role": self.role,
            "kv_transfer": self.mode,
            "side_channel": self.address,
            "side_channel_host": host,
            "side_channel_port": int(port),
            "transport": self.cfg.transport,
            "model_fingerprint": self.hello.model,
            "kv_load_failure_policy": self.cfg.load_failure_policy,
            "lease_timeout_s": self.cfg.lease_timeout_s,
            "fence_timeout_s": self.cfg.fence_timeout_s,
            "num_fenced_blocks": self.fenced_blocks,
            "push_layers_per_write": self.layers_per_write,
        }

    # ---- requests -------------------------------------------------------------------
    def add_request(self, req: Request, p: KVTransferParams | None) -> bool:
        """Take charge of a request that sends or receives KV; False: a local request.
        A prefill leg's params arrive already set for it (``prefill_leg_params``)."""
        if p is None:
            return False
        tid = p.transfer_id or req.request_id
        if self.role == "prefill" and p.do_remote_decode:
            if tid in self.sends or tid in self.lent:
                raise RequestError(f"transfer id {tid!r} is already in use", "kv_transfer_params")
            reg = None
            if self.mode == "push":
                reason = self.ended.pop(tid, None)
                if reason is not None:
                    raise RequestError(f"transfer {tid} already ended: {reason}",
                                       "kv_transfer_params")
                reg = self.early_regs.pop(tid, None)
                if reg is not None and reg.full_hit:  # nothing for prefill to do
                    self.worker.submit(c.Untrack(tid))
                    self._remember_ended(tid, "decode has the whole prompt cached")
                    raise RequestError(
                        "decode holds the whole prompt in its prefix cache: nothing to "
                        "prefill", "kv_transfer_params", "prefill_not_needed")
                self.sends[tid] = PushSend(tid, req.request_id)
            self.by_request[req.request_id] = tid
            self.timeline.stamp(tid, "p_added")
            self.scheduler.add_request(req)  # before a registration may abort it
            if self.mode == "push":
                if reg is not None:
                    self._registered(self.sends[tid], reg)
                else:
                    self.worker.submit(c.Track(tid, None))
            return True
        if self.role == "decode" and p.do_remote_prefill:
            if self.mode == "pull" and p.remote_block_ids is None:
                raise RequestError("pull needs kv_transfer_params.remote_block_ids",
                                   "kv_transfer_params")
            if self.mode == "pull":
                tid = p.transfer_id or p.remote_request_id or tid
                n_needed = -(-(req.num_prompt_tokens - 1) // self.block_size)
                if len(p.remote_block_ids) < n_needed:
                    raise RequestError(
                        f"kv_transfer_params.remote_block_ids has {len(p.remote_block_ids)}"
                        f" blocks; the prompt needs {n_needed}", "kv_transfer_params")
            if tid in self.recvs:
                raise RequestError(f"transfer id {tid!r} is already in use", "kv_transfer_params")
            address = p.remote_address
            if address in self.peers:  # known peer: check the params against it now (400)
                problem = self._peer_problem(address, p.remote_engine_id,
                                             p.remote_block_ids or [])
                if problem:
                    raise RequestError(f"kv_transfer_params: {problem}", "kv_transfer_params")
            recv = DecodeRecv(tid, req.request_id, self.mode, address, p.remote_engine_id,
                              list(p.remote_block_ids or []))
            self.recvs[tid] = recv
            self.by_request[req.request_id] = tid
            self.timeline.stamp(tid, "d_added")
            self.timeline.await_first(req.request_id, tid)
            self.scheduler.add_remote_request(req)
            self.pending.append(tid)
            self.worker.submit(c.EnsurePeer(address))
            self.worker.submit(c.Track(tid, address))
            return True
        return False

    # ---- decode: blocks for pending transfers ----------------------------------------------


    def _descs(self, local_blocks: list[int], remote_blocks: list[int], address: str,
               layers) -> tuple[list, list]:
        """Descriptors for the given layers of paired block lists (ours, the peer's)."""
        base, layout = self.peer_layouts[address]
        return layer_block_descs(self.region.base_address, self.layout, local_blocks,
                                 base, layout, remote_blocks, layers)

    def on_finish(self, req: Request, ok: bool, error: str | None) -> tuple[bool, dict | None]:
        """A request ends. Returns (connector keeps its blocks, kv_transfer_params for the
        response)."""
        self._stalled = False  # blocks may come free
        tid = self.by_request.pop(req.request_id, None)
        self.timeline.forget_request(req.request_id)  # (decode: token #1 never went out)
        if tid is None:
            return False, None
        if self.role == "prefill":
            self.timeline.stamp(tid, "p_first")
        if tid in self.sends:
            send = self.sends[tid]
            if not ok:
                return self._send_aborted(send, req, error or "prefill request aborted"), None
            send.finished = True
            send.block_ids = list(req.block_ids)
            send.num_prompt_tokens = req.num_prompt_tokens
            send.first = SampledToken(
                req.output_token_ids[0], req.output_logprobs[0] if req.output_logprobs else None,
                req.output_top_logprobs[0] if req.output_top_logprobs else None)
            if send.state is SendState.SENDING:
                self._flush(send, final=True)
            return True, None
        if self.role == "prefill" and self.mode == "pull":
            if not ok:
                return False, None
            self.lent[tid] = list(req.block_ids)
            self.worker.submit(c.Track(tid, None))
            self.timeline.emit(tid)
            return True, {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "transfer_id": tid,
                "remote_block_ids": list(req.block_ids),
                "remote_engine_id": self.engine_id,
                "remote_host": self.address.rsplit(":", 1)[0],
                "remote_port": int(self.address.rsplit(":", 1)[1]),
                "remote_request_id": req.request_id,
                "tp_size": 1,
            }
        recv = self.recvs.get(tid)
        if recv is None or recv.state is RecvState.QUARANTINED:
            return False, None
        if ok or recv.state is RecvState.PENDING_BLOCKS:
            self._end_recv(recv, ok=ok, why=error)
            if not ok:
                self.worker.submit(c.Send(recv.address, m.Abort(tid, error or "aborted")))
                self.counters["aborts_sent"] += 1
            return False, None
        # aborted while KV may be landing in its blocks: hold them until the peer is done
        recv.state = RecvState.QUARANTINED
        self._hold(recv, list(req.block_ids))
        if recv.mode == "push":
            self.worker.submit(c.Send(recv.address, m.Abort(tid, error or "aborted")))
            self.counters["aborts_sent"] += 1
            self._fence(recv)
        return True, None


    def _remember_ended(self, tid: str, why: str) -> None:
        self.ended[tid] = why
        while len(self.ended) > 4096:
            self.ended.popitem(last=False)

    # ---- decode: endings -----------------------------------------------------------------


    def abort_transfer(self, tid: str, why: str) -> None:
        """The router gave up on a transfer (e.g. decode refused the request): release
        what prefill holds for it now instead of when its lease runs out."""
        self._stalled = False
        send = self.sends.get(tid)
        if send is not None:
            if send.request_id in self.scheduler.requests:
                self.actions.append(c.AbortRequest(send.request_id, why))
            elif send.state is SendState.AWAITING_REGISTRATION:
                self._drop_send(send, why)
            return  # registered: decode is waiting for this KV and decides
        if tid in self.lent:
            self.worker.submit(c.Untrack(tid))
            self.scheduler.release_blocks(self.lent.pop(tid))
        elif tid in self.early_regs:
            reg = self.early_regs.pop(tid)
            self.worker.submit(c.Untrack(tid))
            self.worker.submit(c.Send(reg.address, m.Abort(tid, why)))
        self._remember_ended(tid, why)  # a leg that arrives later is refused

    # ---- events from the transfer thread ----------------------------------------------
    def handle_event(self, ev: c.TransferEvent) -> None:
        """Apply one event of the transfer thread (on the step loop)."""
        self._stalled = False
        match ev:
            case c.PeerReady(address, hello):
                self._on_peer_ready(address, hello)
            case c.PeerRefused(address, reason):
                self._on_peer_refused(address, reason)
            case c.Registered(reg):
                self._on_register(reg)
            case c.PushDoneReceived(done):
                self._on_push_done(done)
            case c.PullDoneReceived(done):
                self._on_pull_done(done)
            case c.AbortReceived(ab):
                self._on_abort(ab)
            case c.AbortAckReceived(ack):
                self._on_abort_ack(ack)
            case c.AwaitingRegistration(tids):
                self._on_awaiting_registration(tids)
            case c.WritesDone():
                self._on_writes_done(ev)
            case c.ReadDone():
                self._on_read_done(ev)
            case c.LeaseExpired(tid):
                self._on_lease_expired(tid)
            case c.FenceReleased(tid, why):
                self._on_fence_released(tid, why)
            case c.WorkerDied():
                self._on_worker_died()
            case _:
                raise TypeError(f"not a transfer event: {ev!r}")

    def _on_peer_ready(self, address: str, hello: m.Hello) -> None:
        self.peers[address] = hello
        self.peer_layouts[address] = (hello.base_address, KVLayout(
            layout=hello.layout, num_layers=hello.num_layers, num_blocks=hello.num_blocks,
            block_size=hello.block_size, num_kv_heads=hello.num_kv_heads,
            head_dim=hello.head_dim, dtype=hello.dtype, block_bytes=hello.block_bytes,
            layer_bytes=hello.layer_bytes))

    def _on_peer_refused(self, address: str, reason: str) -> None:
        self.refused[address] = reason
        for recv in [r for r in self.recvs.values() if r.address == address]:
            self._recv_gone(recv, reason)

    def _recv_gone(self, recv: DecodeRecv, why: str, silent: bool = False) -> None:
        """Prefill will send nothing more for ``recv``: end it. A READ of ours that may
        still land keeps the blocks fenced until it ends. ``silent``: prefill only
        stopped answering (lease), it has not said it is done: its push WRITEs may still
        land, so the blocks stay fenced too; otherwise a quarantined push is done."""
        if self._reading(recv) or (silent and recv.mode == "push" and recv.state in (
                RecvState.AWAITING_KV, RecvState.QUARANTINED)):
            if recv.state is not RecvState.QUARANTINED:
                self._recv_failed_fenced(recv, why)
        elif recv.state is RecvState.QUARANTINED:
            self._end_recv(recv, ok=False)
        else:
            self._recv_failed(recv, why)


    def _on_abort(self, ab: m.Abort) -> None:
        tid = ab.transfer_id
        self.counters["aborts_received"] += 1
        if tid in self.sends:  # decode gave up: stop, drain, acknowledge
            send = self.sends[tid]
            address = send.reg.address if send.reg else None
            if send.state in (SendState.SENDING, SendState.DRAINING) and address:
                self.worker.submit(c.CancelWrites(tid, address))
                if send.request_id in self.scheduler.requests:
                    self.actions.append(c.AbortRequest(send.request_id, f"decode: {ab.reason}"))
                return
            self._drop_send(send, f"aborted by decode: {ab.reason}")
            return
        if tid in self.early_regs:  # (the transfer thread has sent the AbortAck)
            self.early_regs.pop(tid)
            self.worker.submit(c.Untrack(tid))
            self._remember_ended(tid, f"aborted by decode: {ab.reason}")
            return
        if tid in self.lent:
            self._on_pull_done(m.PullDone(tid, ok=False))
            return
        recv = self.recvs.get(tid)
        if recv is not None:  # prefill gave up; nothing of its own is in flight any more
            self._recv_gone(recv, f"aborted by prefill: {ab.reason}")


    def _on_lease_expired(self, tid: str) -> None:
        self.counters["leases_expired"] += 1
        if tid in self.sends:
            send = self.sends[tid]
            if send.state is SendState.DRAINING:
                return  # the WRITEs' own completion (or failure) ends it
            if send.state is SendState.SENDING and send.request_id in self.scheduler.requests:
                # per-layer WRITEs may be in flight: abort the prefill; on_finish drains
                # them (DRAINING) before its blocks are freed
                self.actions.append(c.AbortRequest(send.request_id,
                                     "lease expired: decode stopped answering"))
                return
            self._drop_send(send, "lease expired: decode never registered")
        elif tid in self.early_regs:
            del self.early_regs[tid]
            self._remember_ended(tid, "lease expired: the request never reached prefill")
        elif tid in self.lent:
            self.scheduler.release_blocks(self.lent.pop(tid))
        elif tid in self.recvs:
            self._recv_gone(self.recvs[tid], "lease expired: prefill stopped answering",
                            silent=True)

    def _on_worker_died(self) -> None:
        for recv in list(self.recvs.values()):
            self._recv_failed(recv, "the transfer thread died")

    # ---- visibility --------------------------------------------------------------------
    def first_token_out(self, request_id: str) -> None:
        """The engine emitted the request's token #1 (decode: the hand-off is over)."""
        self.timeline.first_token(request_id)

    def _record(self, rec: TransferRecord) -> None:
        self.records.append(rec)
        if self.record_sink is not None:
            try:
                self.record_sink(rec)
            except Exception:  # metrics must never break a transfer
                log.exception("transfer record sink failed")

    def stats(self) -> dict:
        return {
            **self.counters,
            **{f"worker_{k}": v for k, v in self.worker.counters.items()},
            "sends_in_flight": len(self.sends),
            "recvs_in_flight": len(self.recvs),
            "blocks_lent": sum(len(b) for b in self.lent.values()),
            "blocks_fenced": self.fenced_blocks,
        }


#: Test-only: a JSON object of FaultPlan knobs (e.g. ``{"fail_posts": 1}``) armed in
#: every connector of the process (``kvpush serve`` under the fault tests). Never set it in
#: production; a process that reads it logs a warning.
FAULTS_ENV = "KVPUSH_FAULTS"


def faults_from_env():
    """The FaultPlan described by $KVPUSH_FAULTS, or None when it is unset or empty."""
    import json
    import os

    raw = os.environ.get(FAULTS_ENV, "").strip()
    if not raw:
        return None
    from kvpush.kv_transfer.faults import FaultPlan

    plan = FaultPlan()
    plan.arm(**json.loads(raw))
    log.warning("%s is set: injecting faults %s (test only)", FAULTS_ENV, raw)
    return plan


class _FaultyPosts:
    """Wraps a transport that knows no FaultPlan (NIXL): ``fail_posts`` makes ``post``
    raise TransferPostError; everything else goes to the real transport."""

    def __init__(self, transport, faults) -> None:
        self._transport, self._faults = transport, faults

    def post(self, op, peer, local, remote):
        from kvpush.kv_transfer.transport import TransferPostError

        if self._faults.take_post_failure():
            raise TransferPostError(f"injected {op} post failure ({FAULTS_ENV})")
        return self._transport.post(op, peer, local, remote)

    def __getattr__(self, name):
        return getattr(self._transport, name)


def _make_transport(kind: str, name: str, faults):
    if kind == "inproc":
        from kvpush.kv_transfer.inproc_transport import InProcTransport

        return InProcTransport(name, faults=faults)
    from kvpush.kv_transfer.nixl_transport import NixlTransport

    transport = NixlTransport(name)
    return transport if faults is None else _FaultyPosts(transport, faults)
