"""KVConnector: the step-loop half of KV transfer (the transfer thread is worker.py).

It decides per request whether the instance sends KV, receives it or serves it
locally; it holds the blocks transfers need until their ``Over`` (holds.py) and turns
the transfer thread's events into the engine's actions. Its side is chosen at start
(``PrefillSide`` or ``DecodeSide``). It runs on the step loop and reaches the transfer
thread only through ``TransferWorker.submit``; the answers come through the inbox.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from kvpush.config import EngineConfig, tp_kv_heads
from kvpush.kv_cache.kv_map import RankKV
from kvpush.kv_cache.kv_region import KVRegion
from kvpush.kv_transfer import actions as a
from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.digest import BlockDigests
from kvpush.kv_transfer.links import NixlLinks, TransferLinks
from kvpush.kv_transfer.params import KVTransferParams
from kvpush.kv_transfer.record import TransferCounters, TransferRecord
from kvpush.kv_transfer.step_loop.decode_side import DecodeSide
from kvpush.kv_transfer.step_loop.holds import Holds
from kvpush.kv_transfer.step_loop.prefill_side import PrefillSide
from kvpush.kv_transfer.timeline import HandoffTimeline
from kvpush.kv_transfer.transfer_thread.context import Settings
from kvpush.kv_transfer.transfer_thread.worker import TransferWorker
from kvpush.kv_transfer.transports.transport import KVTransport
from kvpush.kv_transfer.wire import messages as m
from kvpush.scheduler.request import Request
from kvpush.scheduler.scheduler import Scheduler, StepPlan

log = logging.getLogger(__name__)


class KVConnector:
    def __init__(self, config: EngineConfig, region: KVRegion, scheduler: Scheduler,
                 post_update: Callable[[c.TransferUpdate], None],
                 on_death: Callable[[str], None], links: TransferLinks | None = None,
                 ranks: Sequence[tuple[RankKV, KVTransport]] = ()):
        """``ranks``: at TP > 1, ranks 1.. (their region and agent, and the proxy that
        posts with their transport)."""
        cfg = self.cfg = config.kv_transfer
        self.role, self.mode, self.engine_id = cfg.role, cfg.mode, cfg.engine_id
        links = links if links is not None else NixlLinks()
        transport = links.transport(cfg.engine_id)
        try:
            transport.register_region(region.base_address, region.nbytes, config.device)
            channel = links.channel(cfg.side_channel_host, cfg.side_channel_port,
                                    cfg.side_channel_secret)
        except BaseException:
            transport.close()
            raise
        self.address = channel.address
        meta, tp = transport.metadata(), config.tensor_parallel_size
        own = tp_kv_heads(config.model, tp, 0)
        self.hello = m.Hello(
            version=m.PROTOCOL_VERSION, engine_id=cfg.engine_id, role=cfg.role,
            address=self.address, transport=transport.kind, agent_metadata=meta,
            model=config.model.fingerprint(), kv_transfer=cfg.mode,
            base_address=region.base_address, layout=region.layout, tensor_parallel_size=tp,
            model_kv_heads=config.model.num_kv_heads, ranks=[] if tp == 1 else [
                RankKV(0, own.start, own.stop, region.base_address, meta),
                *(r for r, _ in ranks)])
        settings = Settings(cfg.lease_timeout_s, cfg.heartbeat_interval_s,
                            cfg.fence_timeout_s, config.cache.block_size)
        self.worker = TransferWorker(  # (EngineConfig refuses --kv-digest at TP > 1)
            self.hello, settings, channel, transport, post_update, on_death,
            rank_transports=[t for _, t in ranks],
            digests=BlockDigests(region.storage) if cfg.kv_digest else None)
        self.timeline = HandoffTimeline(self.role)
        self.holds = Holds(cfg, scheduler, config.cache.block_size, self.timeline)
        self.side: PrefillSide | DecodeSide = (
            PrefillSide(self.holds, self.address, cfg.engine_id, region.layout.num_layers,
                        region.kv.is_cuda, self.flush)
            if cfg.role == "prefill" else DecodeSide(self.holds, config.model.vocab_size))
        #: the transfer thread's counters, as of its last update
        self.counters = TransferCounters()
        #: called (on the step loop) with each finished transfer, e.g. by /metrics
        self.record_sink: Callable[[TransferRecord], None] | None = None

    def start(self) -> None:
        self.worker.start()

    def shutdown(self) -> None:
        self.flush()  # what the last turn stated goes before the stop
        self.worker.stop()

    def info(self) -> dict:
        host, port = self.address.rsplit(":", 1)
        cfg, side = self.cfg, self.side
        groups = side.groups if isinstance(side, PrefillSide) else None
        return {"engine_id": self.engine_id, "role": self.role, "kv_transfer": self.mode,
                "side_channel": self.address, "side_channel_host": host,
                "side_channel_port": int(port), "transport": self.hello.transport,
                "model_fingerprint": self.hello.model,
                "kv_load_failure_policy": cfg.load_failure_policy,
                "lease_timeout_s": cfg.lease_timeout_s, "fence_timeout_s": cfg.fence_timeout_s,
                "num_fenced_blocks": self.fenced_blocks, "kv_params_signed": cfg.params_signed,
                # layers a WRITE group (0: closed by compute time, at least the seconds)
                "push_layers_per_write": groups.layers if groups else None,
                "push_write_group_min_s": groups.min_s if groups else None}

    def flush(self) -> None:
        """End of an engine turn (or a layer group): its facts go as one StepMessage."""
        facts = self.holds.take_facts()
        if facts:
            self.worker.submit(c.StepMessage(facts))

    def add_request(self, req: Request, p: KVTransferParams | None) -> bool:
        """Take charge of a request that sends or receives KV; False: a local one."""
        if p is None:
            return False
        tid = p.transfer_id or req.request_id
        if isinstance(self.side, PrefillSide) and p.do_remote_decode:
            self.side.add(req, tid)
            return True
        if isinstance(self.side, DecodeSide) and p.do_remote_prefill:
            self.side.add(req, p, tid)
            return True
        return False

    def has_pending_work(self) -> bool:
        return self.holds.scheduler.has_remote_pending()

    def before_schedule(self) -> None:
        if isinstance(self.side, DecodeSide):
            self.side.before_schedule()

    def layer_hook(self, plan: StepPlan) -> Callable[[int], None] | None:
        return self.side.layer_hook(plan) if isinstance(self.side, PrefillSide) else None

    def on_preempt(self, req: Request, blocks: list[int]) -> bool:
        return isinstance(self.side, PrefillSide) and self.side.on_preempt(req, blocks)

    def on_finish(self, req: Request, ok: bool,
                  error: str | None) -> tuple[bool, KVTransferParams | None]:
        """A request ends: (the connector keeps its blocks, kv_transfer_params for the
        answer)."""
        found = self.holds.of_request(req.request_id)
        self.timeline.forget_request(req.request_id)  # (decode: token #1 never went out)
        if found is None:
            return False, None
        tid, hold = found
        if isinstance(self.side, PrefillSide):
            return self.side.finish(req, tid, hold, ok, error)
        return self.side.finish(req, tid, hold, error), None

    def abort_transfer(self, tid: str, why: str) -> None:
        """The router gave up on a transfer (decode refused it, say): release what
        prefill holds for it now instead of when its lease runs out."""
        if isinstance(self.side, PrefillSide):
            self.side.abort_transfer(tid, why)

    def first_token_out(self, request_id: str) -> None:
        """The engine emitted the request's token #1 (decode: the hand-off is over)."""
        self.timeline.first_token(request_id)

    def take_actions(self) -> list[a.EngineAction]:
        actions, self.holds.actions = self.holds.actions, []
        return actions

    def handle_update(self, update: c.TransferUpdate) -> None:
        if update.counters is not None:
            self.counters = update.counters
        for ev in update.events:
            hold = self.holds.by_tid.get(ev.tid)
            if hold is None:
                continue
            if isinstance(ev, c.Failing):
                self.side.on_failing(hold, ev)
                continue
            for stage, t in ev.stamps:
                self.timeline.stamp(ev.tid, stage, t)
            self.holds.over(ev.tid)  # its blocks go back
            self.side.on_over(hold, ev)
            if ev.record is not None and self.record_sink is not None:
                try:
                    self.record_sink(ev.record)
                except Exception:  # metrics must never break a transfer
                    log.exception("transfer record sink failed")

    @property
    def fenced_blocks(self) -> int:
        return self.holds.held_blocks() if self.role == "decode" else 0

    def stats(self) -> TransferCounters:
        k = self.counters.copy()
        n, held = len(self.holds.by_tid), self.holds.held_blocks()
        if self.role == "prefill":
            k.sends_in_flight, k.blocks_lent = n, held if self.mode == "pull" else 0
        else:
            k.recvs_in_flight, k.blocks_fenced = n, held
        return k
