"""KVConnector: the step-loop half of KV transfer (the transfer thread is worker.py).

It decides, per request, whether the instance sends KV (prefill role), receives it
(decode role) or serves the request locally; it owns every block a transfer holds and
turns transfer events into request progress. All its methods run on the step-loop
thread; only ``TransferWorker.submit`` crosses to the transfer thread.

Push, prefill side (``PushSend``: the blocks; the transfer is the transfer thread's,
push_sends.py)::

    PREFILLING ──request ends──▶ HELD ──WritesDone──▶ (blocks freed)
      │ (blocks computed are         (PushPrefilled / PushEnded stated; the
      │  stated per layer group)      transfer thread drains its WRITEs, sends PushDone)
      └──WritesDone first (decode aborted, lease, bad registration, full hit)──▶ OVER
           (the request is aborted, or rejected with prefill_not_needed; the scheduler
            frees its blocks as it ends)

Decode side, push and pull (``DecodeRecv``: the blocks; the transfer is the transfer
thread's, receives.py)::

    PENDING_BLOCKS ──blocks (BlocksAllocated)──▶ AWAITING_KV ──ReceiveOver(ok)──▶ RUNNING
       │  (a full prefix hit, or nothing to read:   │  (push: token #1 from prefill;
       │   computed here, no wait)                  │   pull: the last token recomputed)
       │                                            ├─ ReceiveOver(failed): fail or
       └── ReceiveOver(failed): fail the request,   │    recompute (policy), blocks freed
           or recompute it locally (policy)         └─ the request ends (ReceiveEnded), or
                                                       ReceiveFailing (lease, registration
                                                       lost): it fails at once ──┐
    QUARANTINED (blocks fenced out of the pool) ◀───────────────────────────────────┘
       └── freed on ReceiveOver: prefill answered, its connection dropped, our READ
           ended, or --fence-timeout passed; never at lease end, since a frozen
           prefill that resumes still finishes its WRITEs
    ENDED: done here with no blocks held (ended before its blocks, a full prefix hit,
       nothing to read); kept until its ReceiveOver so that its transfer id stays taken

Pull, prefill side: prefill finishes with max_tokens=1 and lends its blocks
(``PrefillSender.lent``, stated ``Lent``) under a lease until ``LendOver`` (decode's
PullDone, its Abort, or the lease's end). Decode's transfer thread claims the lend,
then posts the READ (vLLM's connector posts it on the step loop).

If the transfer thread dies (``WorkerDied``), every transfer ends at once and the
requests they were for fail; blocks a peer may still reach wait for a hold
(thread_death.py), and new P/D requests are refused with a 503.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvpush.config import EngineConfig
from kvpush.kv_cache.kv_region import KVRegion
from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.step_loop.context import TransferContext
from kvpush.kv_transfer.step_loop.decode_side import DecodeReceiver
from kvpush.kv_transfer.step_loop.prefill_side import PrefillSender, layers_per_write
from kvpush.kv_transfer.step_loop.state import (
    KVTransferParams,
    TransferRecord,
)
from kvpush.kv_transfer.step_loop.thread_death import (
    DeadHold,
    died_message,
    hold_seconds,
    unavailable,
)
from kvpush.kv_transfer.timeline import HandoffTimeline
from kvpush.kv_transfer.transfer_thread.worker import TransferWorker
from kvpush.kv_transfer.wire import messages as m
from kvpush.kv_transfer.wire.auth import ParamsSigner
from kvpush.scheduler.request import Request
from kvpush.scheduler.scheduler import Scheduler, StepPlan

log = logging.getLogger(__name__)

__all__ = ["KVConnector", "KVTransferParams", "TransferRecord"]


class KVConnector:
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
        if faults is None:
            faults = faults_from_env()
        self.transport = _make_transport(cfg.transport, cfg.engine_id, faults)
        self.transport.register_region(region.base_address, region.nbytes, config.device)
        from kvpush.kv_transfer.wire.side_channel import SideChannel

        self.channel = SideChannel(
            cfg.side_channel_host, cfg.side_channel_port, faults=faults, type_of=m.type_name,
            secret=cfg.side_channel_secret,
        )
        self.address = self.channel.address
        #: checks that requests' kv_transfer_params are the router's (None: trusted)
        self.params_signer = (ParamsSigner(cfg.side_channel_secret)
                              if cfg.params_signed else None)
        lay = region.layout
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
        self.ctx = TransferContext(
            cfg=cfg, engine_id=cfg.engine_id, address=self.address, scheduler=scheduler,
            worker=self.worker, region=region, block_size=config.cache.block_size,
            vocab_size=config.model.vocab_size, timeline=self.timeline)
        #: the prefill half (push sends, pull lends) and the decode half (receives):
        #: each owns its transfers; ``ctx`` holds what they share
        self.sender = PrefillSender(ctx=self.ctx, layers_per_write=layers_per_write(
            cfg.push_layers_per_write, region.layout.num_layers, region.kv.is_cuda))
        self.receiver = DecodeReceiver(self.ctx)
        #: after a death: frees the blocks a peer may still reach, later (thread_death.py)
        self.dead_hold = DeadHold(post_event)
        # the shared tables, by their names (tests and /metrics read them)
        self.counters, self.records = self.ctx.counters, self.ctx.records
        self.by_request, self.ended = self.ctx.by_request, self.ctx.ended

    @property
    def record_sink(self) -> Callable[[TransferRecord], None] | None:
        """Called (on the step loop) with each finished transfer, e.g. by /metrics."""
        return self.ctx.record_sink

    @record_sink.setter
    def record_sink(self, sink: Callable[[TransferRecord], None] | None) -> None:
        self.ctx.record_sink = sink

    @property
    def fenced_blocks(self) -> int:
        return self.receiver.fenced_blocks

    def has_pending_work(self) -> bool:
        return self.receiver.has_pending_work()

    def take_actions(self) -> list[c.EngineAction]:
        actions, self.ctx.actions = self.ctx.actions, []
        return actions

    # ---- life cycle -------------------------------------------------------------------
    def start(self) -> None:
        self.worker.start()

    def shutdown(self) -> None:
        self.ctx.flush()  # what the last turn queued goes before the Stop
        self.worker.stop()
        self.dead_hold.cancel()

    @property
    def failure(self) -> str | None:
        """Why the transfer thread is gone without being stopped, or None. Read from any
        thread (/health), before the step loop has handled the death too."""
        return self.worker.death

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
            "push_layers_per_write": self.sender.layers_per_write,
            # the router signs kv_transfer_params for this instance (it needs the secret)
            "kv_params_signed": self.params_signer is not None,
        }

    # ---- the step loop's hooks ------------------------------------------------------------
    def flush(self) -> None:
        """End of an engine turn (a step, a pass over the inbox): what it asked of the
        transfer thread goes as one ``StepMessage``."""
        self.ctx.flush()

    def add_request(self, req: Request, p: KVTransferParams | None) -> bool:
        """Take charge of a request that sends or receives KV; False: a local request.
        A prefill leg's params arrive already set for it (``LLMEngine.leg_params``)."""
        if p is None:
            return False
        if self.ctx.dead is not None and (p.do_remote_decode or p.do_remote_prefill):
            raise unavailable(self.ctx.dead)  # queued before the death was known: a 503
        tid = p.transfer_id or req.request_id
        if self.role == "prefill" and p.do_remote_decode:
            self.sender.add(req, tid)
            return True
        if self.role == "decode" and p.do_remote_prefill:
            self.receiver.add(req, p, tid)
            return True
        return False

    def before_schedule(self) -> None:
        self.receiver.before_schedule()

    def layer_hook(self, plan: StepPlan) -> Callable[[int], None] | None:
        return self.sender.layer_hook(plan)

    def on_preempt(self, req: Request, blocks: list[int]) -> bool:
        return self.sender.on_preempt(req, blocks)

    def on_finish(self, req: Request, ok: bool, error: str | None) -> tuple[bool, dict | None]:
        """A request ends. Returns (connector keeps its blocks, kv_transfer_params for the
        response)."""
        self.receiver.unstall()  # blocks may come free
        tid = self.ctx.by_request.pop(req.request_id, None)
        self.timeline.forget_request(req.request_id)  # (decode: token #1 never went out)
        if tid is None:
            return False, None
        if self.role == "prefill":
            return self.sender.finish(req, tid, ok, error)
        return self.receiver.finish(req, tid, ok, error), None

    def abort_transfer(self, tid: str, why: str) -> None:
        """The router gave up on a transfer (e.g. decode refused the request): release
        what prefill holds for it now instead of when its lease runs out."""
        self.receiver.unstall()
        self.sender.abort_transfer(tid, why)

    def first_token_out(self, request_id: str) -> None:
        """The engine emitted the request's token #1 (decode: the hand-off is over)."""
        self.timeline.first_token(request_id)

    # ---- events from the transfer thread ----------------------------------------------
    def handle_event(self, ev: c.TransferUpdate | c.TransferEvent) -> None:
        """Apply one update (or one event) of the transfer thread (on the step loop)."""
        self.receiver.unstall()
        sender, receiver = self.sender, self.receiver
        match ev:
            case c.TransferUpdate(events):
                for one in events:
                    self.handle_event(one)
            case c.WritesDone():
                sender.on_writes_done(ev)
            case c.PushFailing(tid, why):
                sender.on_push_failing(tid, why)
            case c.ReceiveOver():
                receiver.on_over(ev)
            case c.ReceiveFailing(tid, why):
                receiver.on_failing(tid, why)
            case c.LendOver(tid, ok):
                sender.on_lend_over(tid, ok)
            case c.WorkerDied(why, transport_closed):
                self._worker_died(why, transport_closed)
            case c.DeadHoldExpired():
                sender.release_dead_hold()
                receiver.release_dead_hold()
            case _:
                raise TypeError(f"not a transfer event: {ev!r}")

    def _worker_died(self, why: str, transport_closed: bool) -> None:
        """The transfer thread is gone: end every transfer now, fail the requests they
        were for, free their blocks, or hold those a peer may still reach
        (thread_death.py)."""
        if self.ctx.dead is not None:
            return
        msg = self.ctx.dead = died_message(why)
        log.error("%s: failing %d sends, %d receives; %d lent blocks", msg,
                  len(self.sender.sends), len(self.receiver.recvs),
                  sum(len(b) for b in self.sender.lent.values()))
        held = self.sender.on_worker_died(msg)
        held = self.receiver.on_worker_died(msg, transport_closed) or held
        if held:
            self.dead_hold.start(hold_seconds(self.cfg))

    # ---- visibility --------------------------------------------------------------------
    def stats(self) -> dict:
        return {
            **self.counters,
            **{f"worker_{k}": v for k, v in self.worker.counters.items()},
            "sends_in_flight": len(self.sender.sends),
            "recvs_in_flight": len(self.receiver.recvs),
            "blocks_lent": sum(len(b) for b in self.sender.lent.values()),
            "blocks_fenced": self.fenced_blocks,
        }


#: Test-only: $KVPUSH_FAULTS arms a FaultPlan in every connector of the process
#: (kvpush_testing.faults); a production process never sets it
FAULTS_ENV = "KVPUSH_FAULTS"


def faults_from_env():
    """The FaultPlan $KVPUSH_FAULTS describes (kvpush_testing), or None when unset."""
    import os

    if not os.environ.get(FAULTS_ENV, "").strip():
        return None
    from kvpush_testing.faults import faults_from_env as from_env

    return from_env(FAULTS_ENV)


def _make_transport(kind: str, name: str, faults):
    if kind == "inproc":
        from kvpush_testing.inproc_transport import InProcTransport

        return InProcTransport(name, faults=faults)
    from kvpush.kv_transfer.transports.nixl_transport import NixlTransport

    transport = NixlTransport(name)
    if faults is None:
        return transport
    from kvpush_testing.faults import FaultyPosts

    return FaultyPosts(transport, faults)
