"""A deterministic stand-in for kvpush.engine.async_engine.AsyncEngine, for server tests.

It "generates" the prompt's tokens in reverse order (cycling), one every
``token_delay`` seconds, honours max_tokens / EOS / stop_token_ids / stop strings /
ignore_eos / logprobs, reserves KV blocks for the whole request at admission and gives
them back however the request ends, and records what happened so tests can assert that
aborts reach the engine and that no block leaks. Failure knobs let tests exercise the
server's error paths.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpush.config import EngineConfig
from kvpush.engine.outputs import EngineStats, FinishReason, RequestError, RequestOutput
from kvpush.engine.request_stats import RequestStatsTracker
from kvpush.kv_info import KVInfo
from kvpush.kv_transfer.params import KVTransferParams
from kvpush.sampling_params import SamplingParams
from stand_in import make_kv_info


def fake_logprob(i: int) -> float:
    """The logprob the fake reports for output token number ``i``."""
    return -0.25 * (i % 4 + 1)


def fake_top_logprobs(n: int) -> tuple[tuple[int, float], ...]:
    """The top alternatives the fake reports at every position: ids 100, 101, ...
    (never a sampled token of the tests' prompts), most likely first."""
    return tuple((100 + j, -0.1 * (j + 1)) for j in range(n))


def fake_token(prompt_ids: list[int], i: int) -> int:
    """Output token number ``i``: the prompt read backwards, over and over."""
    return prompt_ids[-(1 + i % len(prompt_ids))]


@dataclass
class _Active:
    params: SamplingParams
    blocks: int
    aborted: bool = False
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class FakeEngine:
    """An EngineClient (kvpush.engine.client) without a model."""

    def __init__(self, config: EngineConfig, tokenizer: Any, *, token_delay: float = 0.001):
        self.config = config
        self.tokenizer = tokenizer
        self.token_delay = token_delay
        self.num_blocks = config.cache.num_blocks
        self.free_blocks = self.num_blocks
        self.active: dict[str, _Active] = {}
        #: (request_id, prompt_token_ids, params) of every request the engine accepted
        self.requests: list[tuple[str, list[int], SamplingParams]] = []
        self.aborted: list[str] = []  # requests that ended because of an abort
        self.abort_calls: list[str] = []  # ids passed to abort()
        self.finished: dict[str, FinishReason] = {}
        self.started = False
        self.shut_down = False
        self.transfers_aborted: list[str] = []
        self.transfer_sink: Any = None
        self.stats_sink: Any = None
        self.request_stats = RequestStatsTracker()
        self.healthy = True
        self.loop: asyncio.AbstractEventLoop | None = None
        # failure knobs, each used by the next request only
        self.fail_with: BaseException | None = None  # raised before the first yield
        self.error_after: int | None = None  # finish with FinishReason.ERROR after n tokens
        self.raise_after: int | None = None  # raise RuntimeError after n tokens

    # --------------------------------------------------------------- engine contract

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()  # must be called inside the running loop
        self.started = True

    async def shutdown(self) -> None:
        self.shut_down = True
        for act in self.active.values():
            act.aborted = True
            act.wake.set()

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.active), num_waiting=0, num_free_blocks=self.free_blocks,
            num_total_blocks=self.num_blocks, num_preemptions=0, prefix_cache_hit_tokens=0,
            prefix_cache_query_tokens=sum(len(r[1]) for r in self.requests),
        )

    def is_healthy(self) -> bool:
        return self.healthy and self.started and not self.shut_down

    def health_problem(self) -> str | None:
        return None if self.is_healthy() else "the engine step loop is not running"

    def starting(self) -> str | None:
        return None

    def kv_stats(self) -> None:
        return None  # role both: no transfers

    async def kv_info(self) -> KVInfo:
        return make_kv_info(engine_id="fake", num_free_blocks=self.free_blocks,
                            num_total_blocks=self.num_blocks)

    async def kv_cache_blocks(self) -> dict[str, Any] | None:
        return None  # no prefix caching here

    def kv_params(self, raw: object) -> KVTransferParams | None:
        """Checked as a prefill instance would (the fake has no role of its own)."""
        return None if raw is None else KVTransferParams.parse(raw, "prefill")

    def abort_transfer(self, transfer_id: str, why: str = "aborted by the router") -> None:
        self.transfers_aborted.append(transfer_id)

    def set_transfer_sink(self, sink: Any) -> None:
        self.transfer_sink = sink

    def set_stats_sink(self, sink: Any) -> None:
        """As the engine core: its outputs' request metrics, on its clock."""
        self.stats_sink = sink

    async def abort(self, request_id: str) -> None:
        self.abort_calls.append(request_id)
        act = self.active.get(request_id)
        if act is not None:
            act.aborted = True
            act.wake.set()

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        kv_transfer_params: KVTransferParams | None = None,
    ) -> AsyncIterator[RequestOutput]:
        gen = self._generate(request_id, prompt_token_ids, params, kv_transfer_params)
        try:
            async for out in gen:
                stats = self.request_stats.observe([out], time.perf_counter())
                if stats is not None and self.stats_sink is not None:
                    self.stats_sink(stats)
                yield out
        finally:
            await gen.aclose()  # the request ends now, as the core's would

    async def _generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        kv_transfer_params: KVTransferParams | None = None,
    ) -> AsyncIterator[RequestOutput]:
        if not self.started or self.shut_down:
            raise RuntimeError("engine is not running")
        if self.fail_with is not None:
            exc, self.fail_with = self.fail_with, None
            raise exc
        if request_id in self.active:
            raise RequestError(f"request id {request_id!r} is already running", code="duplicate")
        plen = len(prompt_token_ids)
        limit = self.config.scheduler.max_model_len
        if plen == 0 or plen + params.max_tokens > limit:
            raise RequestError(f"{plen} + {params.max_tokens} tokens exceed {limit}",
                               param="max_tokens")
        bs = self.config.cache.block_size
        need = -(-(plen + params.max_tokens) // bs)
        if need > self.free_blocks:
            raise RequestError("not enough free KV blocks")
        error_after, self.error_after = self.error_after, None
        raise_after, self.raise_after = self.raise_after, None
        act = _Active(params, need)
        # the engine's own clock (time.perf_counter), as the real one reports it: arrival,
        # first scheduled (blocks reserved), first token
        arrival = scheduled = time.perf_counter()
        first_time: float | None = None
        self.free_blocks -= need
        self.active[request_id] = act
        self.requests.append((request_id, list(prompt_token_ids), params, kv_transfer_params))
        reason: FinishReason | None = None
        try:
            eos = set(self.config.model.eos_token_ids)
            out_ids: list[int] = []
            emitted = ""
            hold = max((len(s) for s in params.stop), default=1) - 1
            for i in range(params.max_tokens):
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(act.wake.wait(), self.token_delay)
                if act.aborted:
                    reason = FinishReason.ABORT
                    yield RequestOutput(request_id, [], "", finished=True, finish_reason=reason,
                                        num_prompt_tokens=plen, num_output_tokens=i)
                    return
                if error_after is not None and i >= error_after:
                    reason = FinishReason.ERROR
                    yield RequestOutput(request_id, [], "", finished=True, finish_reason=reason,
                                        error="injected engine failure",
                                        num_prompt_tokens=plen, num_output_tokens=i)
                    return
                if raise_after is not None and i >= raise_after:
                    raise RuntimeError("injected engine crash")
                tok = fake_token(prompt_token_ids, i)
                if first_time is None:
                    first_time = time.perf_counter()
                step_reason = None
                if tok in params.stop_token_ids or (tok in eos and not params.ignore_eos):
                    step_reason = FinishReason.STOP
                else:
                    out_ids.append(tok)
                full = self.tokenizer.decode(out_ids, skip_special_tokens=True)
                visible = full
                hits = [(full.find(s), s) for s in params.stop if s in full]
                if hits:
                    idx, s = min(hits)
                    visible = full[: idx + (len(s) if params.include_stop_str_in_output else 0)]
                    step_reason = FinishReason.STOP
                elif step_reason is None and i == params.max_tokens - 1:
                    step_reason = FinishReason.LENGTH
                elif step_reason is None:
                    visible = full[: len(full) - hold].rstrip("\ufffd")
                new_text = visible[len(emitted):] if visible.startswith(emitted) else ""
                emitted += new_text
                ktp = None
                if step_reason is not None and kv_transfer_params is not None:
                    ktp = dataclasses.replace(kv_transfer_params, transfer_id="echo")
                reason = step_reason
                yield RequestOutput(
                    request_id, [tok], new_text, finished=reason is not None,
                    finish_reason=reason,
                    new_logprobs=[fake_logprob(i)] if params.logprobs else None,
                    new_top_logprobs=([fake_top_logprobs(params.top_logprobs)]
                                      if params.top_logprobs else None),
                    num_prompt_tokens=plen, num_output_tokens=i + 1, kv_transfer_params=ktp,
                    first_token_time=first_time, arrival_time=arrival,
                    scheduled_time=scheduled,
                )
                if reason is not None:
                    return
        finally:
            self.free_blocks += need
            del self.active[request_id]
            if reason is None or reason == FinishReason.ABORT:
                self.aborted.append(request_id)
            else:
                self.finished[request_id] = reason


# ------------------------------------------------------------------ a tiny test model

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'tool' %}{{ raise_exception('tool messages are not supported') }}"
    "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "user assistant system: how are you? I am fine, thank you very much.",
    "Prefill and decode run on different machines; the KV cache moves by push.",
    "numbers 0 1 2 3 4 5 6 7 8 9 and héllo wörld ünïcode ✓ 日本",
]


def build_tokenizer(path: Path) -> Any:
    """A small byte-level BPE tokenizer that adds BOS (like Llama) and has a chat
    template that writes BOS itself, saved to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(path)
    return fast


def make_test_model(path: Path, *, max_model_len: int = 128, num_blocks: int = 64,
                    block_size: int = 16) -> tuple[EngineConfig, Any]:
    """(EngineConfig, tokenizer) of a tiny model folder at ``path`` (no weights: the fake
    engine does not need any)."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(path)
    eos = [tokenizer.convert_tokens_to_ids("</s>"), tokenizer.convert_tokens_to_ids("<|im_end|>")]
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 1024, "rms_norm_eps": 1e-6,
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": eos,
    }))
    config = EngineConfig.build(path, served_model_name="tiny-test", max_model_len=max_model_len,
                                num_blocks=num_blocks, block_size=block_size,
                                max_num_batched_tokens=max(max_model_len, block_size))
    return config, tokenizer
