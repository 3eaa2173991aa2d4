"""``KvpushConnector``: kvpush's KV transfer as a vLLM v1 KV connector.

Loaded by vLLM (``--kv-transfer-config '{"kv_connector": "KvpushConnector",
"kv_connector_module_path": "kvpush.vllm", ...}'``), once in the scheduler's process
(role SCHEDULER: ``plan.py``) and once in each worker's (role WORKER: ``worker.py``).
This module is the only one in kvpush that imports vLLM; it translates vLLM's calls
and objects into the two halves' plain ones.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.request import RequestStatus

from kvpush.vllm.plan import ConnectorStep, SchedulerPlan
from kvpush.vllm.settings import connector_config
from kvpush.vllm.worker import WorkerSide

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvpush.vllm")

_OK = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


@dataclass
class KvpushMetadata(KVConnectorMetadata):
    step: ConnectorStep


def model_fingerprint(path: str, num_layers: int) -> str:
    """kvpush's fingerprint of the model folder (equal weights, equal fingerprint on
    a kvpush instance), or one of vLLM's model name where kvpush cannot read it."""
    from kvpush.config import ModelConfig
    from kvpush.errors import ConfigError

    try:
        return ModelConfig.from_dir(path).fingerprint()
    except (ConfigError, OSError, KeyError, ValueError):
        return f"vllm:{path}:{num_layers}"


def _log_like_vllm() -> None:
    """kvpush's log lines go where vLLM's go, in its format (once per process)."""
    ours, theirs = logging.getLogger("kvpush"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False


class KvpushConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _log_like_vllm()
        kvt = vllm_config.kv_transfer_config
        cfg = connector_config(kvt.kv_role, kvt.engine_id, kvt.kv_connector_extra_config)
        if vllm_config.parallel_config.tensor_parallel_size != 1:
            from kvpush.errors import ConfigError

            raise ConfigError("kvpush connector: vLLM at tensor parallelism > 1 is not "
                              "supported yet")
        mc = vllm_config.model_config
        num_layers = mc.get_num_layers(vllm_config.parallel_config)
        self.plan: SchedulerPlan | None = None
        self.side: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.plan = SchedulerPlan(cfg, vllm_config.cache_config.block_size, num_layers)
        else:
            self.side = WorkerSide(cfg, model_fingerprint(mc.model, num_layers),
                                   mc.get_total_num_kv_heads())

    # ---- worker side ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.side is not None
        self.side.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.side is not None and isinstance(connector_metadata, KvpushMetadata):
            self.side.bind(connector_metadata.step)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        pass  # the facts went with the metadata; receives complete asynchronously

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        if self.side is not None:
            self.side.layer_saved(layer_name)

    def wait_for_save(self) -> None:
        if self.side is not None:
            self.side.step_saved()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self.side is None:
            return KVConnectorTransferResults()
        r = self.side.finished()
        return KVConnectorTransferResults(finished_sending=r.sending,
                                          finished_recving=r.recving, failed_recving=r.failed)

    def shutdown(self) -> None:
        if self.side is not None:
            self.side.shutdown()

    # ---- scheduler side ---------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        assert self.plan is not None
        return self.plan.matched(request.request_id, request.prompt_token_ids,
                                 request.kv_transfer_params, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        assert self.plan is not None and self._kv_cache_manager is not None
        table = list(self._kv_cache_manager.get_block_ids(request.request_id)[0])
        self.plan.allocated(request.request_id, request.prompt_token_ids,
                            request.kv_transfer_params, table, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        assert self.plan is not None
        n = scheduler_output.num_scheduled_tokens
        scheduled = [(r.req_id, r.num_computed_tokens, n.get(r.req_id, 0))
                     for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        scheduled += [(rid, cached.num_computed_tokens[i], n.get(rid, 0))
                      for i, rid in enumerate(cached.req_ids)]
        manager = self._kv_cache_manager
        return KvpushMetadata(self.plan.step(
            scheduled, lambda rid: list(manager.get_block_ids(rid)[0])))

    def update_connector_output(self, connector_output) -> None:
        if self.plan is not None:
            self.plan.reported(connector_output.finished_recving or ())

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        assert self.plan is not None
        return self.plan.finished(request.request_id, request.status in _OK,
                                  list(request.output_token_ids), list(block_ids))
