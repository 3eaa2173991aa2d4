"""The worker half of the connector, without vLLM: kvpush's transfer thread over vLLM's
KV cache.

It registers vLLM's KV allocation with the transport (``region.py``), announces it in
a ``Hello`` and runs kvpush's ``TransferWorker`` (side channel, handshakes, leases,
heartbeats, fences, WRITEs and READs) unchanged. Each step's :class:`ConnectorStep` is
stated to it before the forward pass; a push prefill's blocks are stated per layer group
as vLLM saves each layer (``save_kv_layer``), a group that closes before the last layer
handed over at once. The transfer thread's ``Over`` ends a transfer: a decode's receive
is reported in (``finished_recving``; ``failed_recving`` unless it went OK), a
finished request's held blocks are reported free (a prefill's ``finished_sending``, a
decode's ``finished_recving``) once its transfer is over and not before: KV never lands
in, or is read from, blocks vLLM has given to another request.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from kvpush.config import KVTransferConfig
from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.links import NixlLinks, TransferLinks
from kvpush.kv_transfer.step_loop.prefill_side import write_groups
from kvpush.kv_transfer.transfer_thread.context import Settings
from kvpush.kv_transfer.transfer_thread.worker import TransferWorker
from kvpush.kv_transfer.wire import messages as m
from kvpush.vllm.plan import ConnectorStep, StepWrite
from kvpush.vllm.region import VllmRegion, vllm_region

log = logging.getLogger("kvpush.vllm")


@dataclass
class Results:
    """What one step's ``get_finished`` reports to vLLM's scheduler."""

    sending: set[str] = field(default_factory=set)
    recving: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)


class WorkerSide:
    def __init__(self, cfg: KVTransferConfig, model: str, model_kv_heads: int,
                 links: TransferLinks | None = None) -> None:
        self.cfg, self.model, self.model_kv_heads = cfg, model, model_kv_heads
        self.links = links if links is not None else NixlLinks()
        self.worker: TransferWorker | None = None
        self.region: VllmRegion | None = None
        self.updates: queue.SimpleQueue[c.TransferUpdate] = queue.SimpleQueue()
        self.request_of: dict[str, str] = {}  # transfer id -> request id
        self.over: dict[str, c.Over] = {}  # request id -> its transfer's Over, not reported
        self.held: set[str] = set()  # finished requests whose blocks wait for Over
        self.results = Results()
        self.died: str | None = None
        self._writes: tuple[StepWrite, ...] = ()
        self._group_first, self._group_since = 0, 0.0

    # ---- start and stop -------------------------------------------------------------------
    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        region = self.region = vllm_region(kv_caches)
        cfg = self.cfg
        transport = self.links.transport(cfg.engine_id)
        try:
            transport.register_region(region.base, region.nbytes, "cpu")
            channel = self.links.channel(cfg.side_channel_host, cfg.side_channel_port,
                                         cfg.side_channel_secret)
        except BaseException:
            transport.close()
            raise
        hello = m.Hello(
            version=m.PROTOCOL_VERSION, engine_id=cfg.engine_id, role=cfg.role,
            address=channel.address, transport=transport.kind,
            agent_metadata=transport.metadata(), model=self.model, kv_transfer=cfg.mode,
            base_address=region.base, layout=region.layout,
            model_kv_heads=self.model_kv_heads)
        settings = Settings(cfg.lease_timeout_s, cfg.heartbeat_interval_s,
                            cfg.fence_timeout_s, region.layout.block_size)
        self.groups = write_groups(cfg.push_layers_per_write, region.layout.num_layers,
                                   cuda=False)
        self.worker = TransferWorker(hello, settings, channel, transport, self.updates.put,
                                     self._on_death)
        self.worker.start()
        log.info("kvpush connector: %s %s, engine %s, side channel %s, %d layers x %d "
                 "blocks of %d tokens", cfg.role, cfg.mode, cfg.engine_id, channel.address,
                 region.layout.num_layers, region.layout.num_blocks, region.layout.block_size)

    def _on_death(self, why: str) -> None:
        self.died = why

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.stop()

    # ---- a step ------------------------------------------------------------------------
    def bind(self, step: ConnectorStep) -> None:
        """The step's facts go to the transfer thread before its forward pass."""
        if self.died is not None:
            raise RuntimeError(f"the kvpush transfer thread died: {self.died}")
        for rid, tid in step.begun:
            self.request_of[tid] = rid
        for rid, why in step.refused:
            log.warning("request %s: %s", rid, why)
            self.results.recving.add(rid)
            self.results.failed.add(rid)
        self.held.update(step.held)
        self._writes = step.writes
        self._group_first, self._group_since = 0, time.perf_counter()
        if step.facts:
            self._submit(step.facts)

    def _submit(self, facts) -> None:
        assert self.worker is not None
        self.worker.submit(c.StepMessage(tuple(facts)))

    def layer_saved(self, layer_name: str) -> None:
        """``save_kv_layer``: vLLM wrote this layer's KV for the step; a layer group
        that closes here is stated (and WRITten by the transfer thread) at once."""
        if not self._writes or self.region is None:
            return
        layer = self.region.layer_of.get(layer_name)
        if layer is None or layer < self._group_first:
            return
        last = self.region.layout.num_layers - 1
        now = time.perf_counter()
        if layer != last and not self.groups.closes(layer + 1 - self._group_first,
                                                    now - self._group_since):
            return
        layers = range(self._group_first, layer + 1)
        self._group_first, self._group_since = layer + 1, now
        self._submit([c.BlocksReady(w.tid, w.first_block, w.blocks, layers)
                      for w in self._writes])

    def step_saved(self) -> None:
        """``wait_for_save``: the layers no ``save_kv_layer`` covered (none normally)."""
        if self._writes and self.region is not None:
            num_layers = self.region.layout.num_layers
            if self._group_first < num_layers:
                layers = range(self._group_first, num_layers)
                self._submit([c.BlocksReady(w.tid, w.first_block, w.blocks, layers)
                              for w in self._writes])
        self._writes = ()

    def finished(self) -> Results:
        """``get_finished``: the transfers the transfer thread ended since the last call,
        as vLLM's scheduler takes them."""
        while True:
            try:
                update = self.updates.get_nowait()
            except queue.Empty:
                break
            for ev in update.events:
                if isinstance(ev, c.Over):
                    rid = self.request_of.pop(ev.tid, None)
                    if rid is not None:
                        self.over[rid] = ev
                        if ev.outcome is not c.Outcome.OK:
                            log.warning("transfer %s (request %s): %s: %s", ev.tid, rid,
                                        ev.outcome.value, ev.why)
        decode = self.cfg.role == "decode"
        for rid, ev in list(self.over.items()):
            if decode:  # a waiting request goes on (or fails); a finished one is freed
                self.results.recving.add(rid)
                if ev.outcome is not c.Outcome.OK and rid not in self.held:
                    self.results.failed.add(rid)
                self.held.discard(rid)
                del self.over[rid]
            elif rid in self.held:  # prefill: its blocks go back once it finished
                self.results.sending.add(rid)
                self.held.discard(rid)
                del self.over[rid]
        out, self.results = self.results, Results()
        return out
