"""LLMEngine: the synchronous core of one instance — scheduler, runner, detokenizers.

It is driven by exactly one thread (AsyncEngine's step loop). ``step()`` plans a batch,
runs it and returns the new output of every request that advanced. Stop conditions
(EOS, stop token ids, stop strings, max_tokens, the model's context) are checked here.
"""

from __future__ import annotations

import logging
import time

import torch

from kvpush.config import EngineConfig
from kvpush.engine.detokenizer import IncrementalDetokenizer
from kvpush.engine.model_runner import ModelRunner
from kvpush.engine.outputs import EngineStats, FinishReason, RequestError, RequestOutput
from kvpush.sampling_params import SamplingParams
from kvpush.scheduler.request import Request, RequestState
from kvpush.scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)

_FINISH_STATE = {
    FinishReason.STOP: RequestState.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestState.FINISHED_LENGTH,
    FinishReason.ABORT: RequestState.FINISHED_ABORTED,
    FinishReason.ERROR: RequestState.FINISHED_ERROR,
}


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer=None):
        if config.threads:
            torch.set_num_threads(config.threads)
        self.config = config
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model.path)
        self.runner = ModelRunner(config)
        self.scheduler = Scheduler(config.scheduler, config.cache)
        self.detoks: dict[str, IncrementalDetokenizer] = {}
        eos = set(config.model.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.max_model_len = config.scheduler.max_model_len
        self.vocab_size = config.model.vocab_size

    # ---- requests ------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError for a request this engine can never serve. Thread-safe."""
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestError("the prompt is empty", "prompt")
        if any(not isinstance(t, int) or t < 0 or t >= self.vocab_size for t in prompt_token_ids):
            raise RequestError(
                f"prompt token ids must be integers in [0, {self.vocab_size})", "prompt"
            )
        if n + params.max_tokens > self.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {n + params.max_tokens} tokens ({n} in the "
                f"prompt, {params.max_tokens} for the completion). Please reduce the "
                "prompt or max_tokens.",
                "max_tokens" if n < self.max_model_len else "prompt",
                "context_length_exceeded",
            )

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> Request:
        self.validate(prompt_token_ids, params)
        if request_id in self.scheduler.requests:
            raise RequestError(f"request id {request_id!r} is already in use", "request_id")
        req = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            max_total_tokens=self.max_model_len,
        )
        self.scheduler.add_request(req)
        self.detoks[request_id] = IncrementalDetokenizer(
            self.tokenizer, params.stop, params.include_stop_str_in_output
        )
        return req

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return None
        return self._finish(req, FinishReason.ABORT, [], None)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- the step ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if plan.empty:
            return []
        try:
            sampled = self.runner.execute(plan)
        except Exception as e:  # a bug or OOM fails this batch, not the engine
            log.exception("step failed; failing %d requests", len(plan.chunks))
            outs = []
            for c in plan.chunks:
                req = self.scheduler.requests.get(c.request_id)
                if req is not None:
                    outs.append(self._finish(req, FinishReason.ERROR, [], None, str(e)))
            return outs
        now = time.perf_counter()
        outputs: list[RequestOutput] = []
        for req in self.scheduler.update_after_step(plan, sampled):
            token = req.output_token_ids[-1]
            if req.first_token_time is None:
                req.first_token_time = now
            detok = self.detoks[req.request_id]
            detok.add(token)
            reason = self._stop_reason(req, token, detok)
            logprobs = [req.output_logprobs[-1]] if req.params.logprobs else None
            if reason is not None:
                outputs.append(self._finish(req, reason, [token], logprobs))
            else:
                outputs.append(
                    RequestOutput(
                        request_id=req.request_id,
                        new_token_ids=[token],
                        new_text=detok.take(final=False),
                        new_logprobs=logprobs,
                        num_prompt_tokens=req.num_prompt_tokens,
                        num_output_tokens=req.num_output_tokens,
                        num_cached_tokens=req.num_cached_tokens,
                        first_token_time=req.first_token_time,
                        arrival_time=req.arrival_time,
                    )
                )
        return outputs

    def _stop_reason(
        self, req: Request, token: int, detok: IncrementalDetokenizer
    ) -> FinishReason | None:
        p = req.params
        if detok.stopped:
            return FinishReason.STOP
        if not p.ignore_eos and token in self.eos_token_ids:
            return FinishReason.STOP
        if token in p.stop_token_ids:
            return FinishReason.STOP
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= req.max_total_tokens:
            return FinishReason.LENGTH
        return None

    def _finish(
        self,
        req: Request,
        reason: FinishReason,
        new_tokens: list[int],
        logprobs: list[float] | None,
        error: str | None = None,
    ) -> RequestOutput:
        self.scheduler.finish(req.request_id, _FINISH_STATE[reason])
        detok = self.detoks.pop(req.request_id, None)
        text = detok.take(final=True) if detok is not None else ""
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_tokens,
            new_text=text,
            finished=True,
            finish_reason=reason,
            new_logprobs=logprobs,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=req.num_cached_tokens,
            error=error,
            first_token_time=req.first_token_time,
            arrival_time=req.arrival_time,
        )

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            num_free_blocks=s.pool.num_free,
            num_total_blocks=s.pool.num_blocks,
            num_preemptions=s.num_preemptions,
            prefix_cache_hit_tokens=s.prefix_hit_tokens,
            prefix_cache_query_tokens=s.prefix_query_tokens,
        )
