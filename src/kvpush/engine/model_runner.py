"""ModelRunner: owns the model and the KV region; turns a StepPlan into sampled tokens."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from kvpush.config import EngineConfig
from kvpush.kv_cache.kv_region import KVRegion
from kvpush.model.attention import DecodeKVCache, build_metadata
from kvpush.model.loader import load_model
from kvpush.model.sampler import sample
from kvpush.sampling_params import SampledToken
from kvpush.scheduler.scheduler import StepPlan

log = logging.getLogger("kvpush.engine")


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = config.device
        self.block_size = config.cache.block_size
        self.model = load_model(
            config.model, config.dtype, config.device, config.scheduler.max_model_len
        )
        self.kv_region = KVRegion(config.model, config.cache, config.device)
        self.default_generator = torch.Generator().manual_seed(config.seed)
        # Dense copies of decoding requests' KV (see DecodeKVCache), capped at the share
        # of --kv-cache-memory that config.build gave it (kv_budget.py; 0: gather
        # from the region, or read it through the block tables with the paged decode
        # attention).
        cap = config.cache.decode_cache_bytes
        self.paged_decode = config.cache.decode_attention == "paged"
        self.decode_cache = DecodeKVCache(
            self.kv_region.kv,
            self.block_size,
            config.dtype,
            self.kv_region.nbytes if cap is None else cap,
            max_slots=config.scheduler.max_num_seqs,
            max_len=config.scheduler.max_model_len,
        )
        if self._reserves_decode_cache:
            self.decode_cache.reserve()
        if config.cache.memory is not None:
            log.info("%s; decode attention: %s", config.cache.memory.describe(),
                     config.cache.decode_attention)

    @property
    def decode_cache_bytes(self) -> int:
        return self.decode_cache.max_bytes

    @decode_cache_bytes.setter
    def decode_cache_bytes(self, n: int) -> None:
        """Change the cap (before serving: not safe while the step loop runs)."""
        self.decode_cache.max_bytes = n
        self.decode_cache.reset()
        if self._reserves_decode_cache:
            self.decode_cache.reserve()

    @property
    def _reserves_decode_cache(self) -> bool:
        """CPU instances that decode touch the dense decode cache's whole cap at start-up
        (DecodeKVCache.reserve): growing it mid-serving faulted its pages in inside a
        step, which slowed a burst of first decodes (docs/MEASURED.md). A prefill
        instance never decodes; CUDA's caching allocator already reuses freed memory."""
        return torch.device(self.device).type == "cpu" and (
            self.config.kv_transfer.role != "prefill") and not self.paged_decode

    def forward(
        self, plan: StepPlan, layer_done: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        """One forward pass over every chunk of the plan; returns float32 logits, one
        row per chunk whose ``sample`` is set, in plan order."""
        input_ids: list[int] = []
        positions: list[int] = []
        logits_rows: list[int] = []
        for c in plan.chunks:
            input_ids.extend(c.token_ids)
            positions.extend(range(c.start_pos, c.start_pos + len(c.token_ids)))
            if c.sample:
                logits_rows.append(len(input_ids) - 1)
        md = build_metadata(
            [(c.start_pos, len(c.token_ids), c.block_ids) for c in plan.chunks],
            self.block_size,
            self.device,
        )
        try:
            decodes = [c for c in plan.chunks if len(c.token_ids) == 1]
            if self.paged_decode:
                md.decode_paged = True
            else:
                self.decode_cache.prepare(
                    md,
                    [(c.request_id, c.start_pos, c.block_ids) for c in decodes],
                    [c.start_pos + c.params.max_tokens for c in decodes],
                )
            return self.model.forward(
                torch.tensor(input_ids, dtype=torch.long, device=self.device),
                torch.tensor(positions, dtype=torch.long, device=self.device),
                self.kv_region.kv,
                md,
                # every token sampled (a decode-only step): all rows, no gather
                None if len(logits_rows) == len(input_ids)
                else torch.tensor(logits_rows, dtype=torch.long, device=self.device),
                layer_done,
            )
        except BaseException:
            self.decode_cache.reset()  # entries may claim positions never written
            raise

    def execute(
        self, plan: StepPlan, layer_done: Callable[[int], None] | None = None
    ) -> dict[str, SampledToken]:
        """Run the plan and sample one token for every chunk that asks for one."""
        logits = self.forward(plan, layer_done)
        sampled_chunks = [c for c in plan.chunks if c.sample]
        if not sampled_chunks:
            return {}
        tokens, logprobs, tops = sample(
            logits.cpu(),
            [c.params for c in sampled_chunks],
            [c.generator for c in sampled_chunks],
            self.default_generator,
            [c.history for c in sampled_chunks],
        )
        return {
            c.request_id: SampledToken(tokens[i], logprobs[i] if logprobs is not None else None,
                                       tops[i] if tops is not None else None)
            for i, c in enumerate(sampled_chunks)
        }
