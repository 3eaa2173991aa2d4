"""ModelRunner: owns the model and the KV region; turns a StepPlan into sampled tokens.

With ``--tensor-parallel-size N`` > 1 each rank has one: rank 0's (the step loop's)
starts the other ranks (kvpush.engine.tp.group) and sends them each step's chunks before
running them itself; theirs (kvpush.engine.rank_proc) run the same ``run_chunks``
without logits. Each holds its part of the model (kvpush.model.parallel) and a KV
region of its KV heads only, under the block ids every rank shares.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from kvpush.config import EngineConfig
from kvpush.engine.tp.group import RankDied, RankGroup, all_reduce
from kvpush.engine.tp.plan import StepChunk
from kvpush.kv_cache.kv_region import KVRegion
from kvpush.model.attention import DecodeKVCache, build_metadata
from kvpush.model.loader import load_model
from kvpush.model.parallel import TPShard
from kvpush.model.sampler import sample
from kvpush.sampling_params import SampledToken
from kvpush.scheduler.scheduler import StepPlan

log = logging.getLogger("kvpush.engine")


class ModelRunner:
    def __init__(self, config: EngineConfig, rank: int = 0, links: Any = None):
        """``rank``: this process's tensor-parallel rank (0: the step loop's, which
        starts the others when ``config.tensor_parallel_size`` > 1)."""
        self.config = config
        self.device = config.device
        self.block_size = config.cache.block_size
        n = config.tensor_parallel_size
        #: this rank's part of the model (None: one rank holds it all)
        self.shard = TPShard.of(config.model, n, rank) if n > 1 else None
        #: rank 0's handle on the other ranks (None: one rank, or not rank 0)
        self.group: RankGroup | None = None
        if n > 1 and rank == 0:
            # the other ranks load their parts while this one loads its own
            self.group = RankGroup(config, logging.getLevelName(log.getEffectiveLevel()),
                                   links)
        try:
            self._build(config)
            if self.group is not None:
                self.group.wait_ready()
                tp = self.tp_info()["tensor_parallel"]
                log.info("tensor parallelism: %d ranks over %s; KV heads by rank: %s", n,
                         tp["backend"], [r["kv_heads"] for r in tp["ranks"]])
        except BaseException:
            if self.group is not None:
                self.group.close()
            raise

    def _build(self, config: EngineConfig) -> None:
        self.model = load_model(
            config.model, config.dtype.torch(), config.device, config.scheduler.max_model_len,
            self.shard)
        if self.shard is not None:
            self.model.all_reduce = all_reduce
        # the most rows a step's projections and its logits take (linear_pick.py's padded
        # shapes are compiled up to these on the stepping thread)
        self.model.step_rows = (config.scheduler.max_num_batched_tokens,
                                config.scheduler.max_num_seqs)
        # this rank's KV heads only (all of them on one rank)
        self.kv_region = KVRegion(self.model.cfg, config.cache, config.device)
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
            config.dtype.torch(),
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
        row per chunk whose ``sample`` is set, in plan order. At TP > 1 the other ranks
        get the chunks first; a failure then raises RankDied (the instance ends)."""
        chunks = [StepChunk(c.request_id, c.token_ids, c.start_pos, c.block_ids, c.sample,
                            c.params.max_tokens) for c in plan.chunks]
        if self.group is None:
            return self.run_chunks(chunks, layer_done)
        try:
            self.group.send_step(chunks)
            return self.run_chunks(chunks, layer_done)
        except RankDied:
            raise
        except Exception as e:
            raise self.group.failure(e) from e

    def run_chunks(
        self, chunks: list[StepChunk], layer_done: Callable[[int], None] | None = None,
        logits: bool = True,
    ) -> torch.Tensor:
        """The forward pass of ``forward``, on every rank; ``logits=False`` (the ranks
        but 0): no final norm, no LM head, an empty result."""
        input_ids: list[int] = []
        positions: list[int] = []
        logits_rows: list[int] = []
        for c in chunks:
            input_ids.extend(c.token_ids)
            positions.extend(range(c.start_pos, c.start_pos + len(c.token_ids)))
            if c.sample:
                logits_rows.append(len(input_ids) - 1)
        md = build_metadata(
            [(c.start_pos, len(c.token_ids), c.block_ids) for c in chunks],
            self.block_size,
            self.device,
        )
        try:
            decodes = [c for c in chunks if len(c.token_ids) == 1]
            if self.paged_decode:
                md.decode_paged = True
            else:
                self.decode_cache.prepare(
                    md,
                    [(c.request_id, c.start_pos, c.block_ids) for c in decodes],
                    [c.start_pos + c.max_tokens for c in decodes],
                )
            return self.model.forward(
                torch.tensor(input_ids, dtype=torch.long, device=self.device),
                torch.tensor(positions, dtype=torch.long, device=self.device),
                self.kv_region.kv,
                md,
                # every token sampled (a decode-only step): all rows, no gather
                None if logits and len(logits_rows) == len(input_ids)
                else torch.tensor(logits_rows if logits else [], dtype=torch.long,
                                  device=self.device),
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
            [c.grammar for c in sampled_chunks],
        )
        return {
            c.request_id: SampledToken(tokens[i], logprobs[i] if logprobs is not None else None,
                                       tops[i] if tops is not None else None)
            for i, c in enumerate(sampled_chunks)
        }

    # ---- tensor parallelism ---------------------------------------------------------
    def on_rank_death(self, callback: Callable[[str], None]) -> None:
        """``callback(why)`` when another rank dies unasked (not at TP 1)."""
        if self.group is not None:
            self.group.set_on_death(callback)

    def tp_info(self) -> dict:
        """The instance's tensor parallelism, as /kv/info shows it: its size and, above
        1, each rank's heads (the KV region of each holds its ``kv_heads`` of every
        block; ``layout`` describes one rank's region)."""
        n = self.config.tensor_parallel_size
        info: dict = {"tensor_parallel_size": n, "tensor_parallel": None}
        if n > 1:
            model = self.config.model
            info["tensor_parallel"] = {
                "backend": "nccl" if self.device.startswith("cuda") else "gloo",
                "kv_heads_replicated": n > model.num_kv_heads,
                "ranks": [TPShard.of(model, n, r).describe() for r in range(n)],
                "embedding": "replicated",
                "lm_head": "replicated; rank 0 computes the logits and samples",
            }
        return info

    def kv_ranks(self) -> list:
        """P/D at TP > 1: ranks 1..N-1's regions and the proxies that post their KV
        (engine/tp/kv_ranks.py); empty otherwise."""
        return list(self.group.kv_ranks) if self.group is not None else []

    def close(self) -> None:
        """Stop the other ranks (rank 0 at TP > 1; nothing otherwise)."""
        if self.group is not None:
            self.group.close()
