"""LLMEngine: the synchronous core of one instance — scheduler, runner, detokenizers
and, in a P/D role, the KV connector.

It is driven by exactly one thread (AsyncEngine's step loop). Other threads talk to it
only through ``inbox``: commands (add, abort, stop) from the front end and events from
the transfer thread. ``process_inbox()`` applies them; ``step()`` plans a batch, runs it
and returns the new output of every request that advanced. Stop conditions (EOS, stop
token ids, stop strings, max_tokens, the model's context) are checked here.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time

import torch

from kvpush.config import EngineConfig, dtype_name
from kvpush.engine.detokenizer import IncrementalDetokenizer
from kvpush.engine.model_runner import ModelRunner
from kvpush.engine.outputs import EngineStats, FinishReason, RequestError, RequestOutput
from kvpush.kv_cache.block_pool import hash_prompt_chain
from kvpush.kv_transfer.commands import (
    AbortRequest,
    EmitFirstToken,
    FailRequest,
    RejectRequest,
)
from kvpush.kv_transfer.state import KVTransferParams, chain_problem
from kvpush.sampling_params import SamplingParams, TopLogprobs
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
    def __init__(self, config: EngineConfig, tokenizer=None, faults=None,
                 build_threads: int | None = None):
        """``build_threads``: torch threads of the calling thread while the engine is
        built (default ``config.threads``). AsyncEngine builds with 1 and gives the
        step-loop thread ``config.threads``: see AsyncEngine."""
        threads = config.threads if build_threads is None else build_threads
        if threads:
            torch.set_num_threads(threads)
        self.config = config
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model.path)
        self.runner = ModelRunner(config)
        if build_threads is None:
            # the builder runs the steps: time the projections' matmuls now, at its
            # thread count (else the step loop does, model/linear_pick.py)
            self.prepare_step_thread()
        self.scheduler = Scheduler(config.scheduler, config.cache)
        self.detoks: dict[str, IncrementalDetokenizer] = {}
        eos = set(config.model.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.max_model_len = config.scheduler.max_model_len
        self.vocab_size = config.model.vocab_size
        self.inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self.connector = None
        if config.kv_transfer.enabled:
            from kvpush.kv_transfer.connector import KVConnector

            self.connector = KVConnector(
                config,
                self.runner.kv_region,
                self.scheduler,
                post_event=lambda ev: self.inbox.put(("kv", ev)),
                faults=faults,
            )
            self.scheduler.on_preempt = self.connector.on_preempt
            self.connector.start()

    def prepare_step_thread(self) -> None:
        """Called once on the thread that will run ``step`` (at its torch thread count):
        the projections' matmul kernels are timed there (model/linear_pick.py)."""
        self.runner.model.ensure_linears()

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()

    # ---- the inbox -------------------------------------------------------------------
    def process_inbox(self, block: bool = False, timeout: float | None = None) -> list:
        """Apply queued commands and transfer events; wait for one first when ``block``.
        Returns outputs they produced; the string "stop" in it means: stop the loop."""
        try:
            return self._process_inbox(block, timeout)
        finally:
            if self.connector is not None:
                self.connector.flush()  # the turn's transfer commands: one message

    def _process_inbox(self, block: bool, timeout: float | None) -> list:
        outputs: list = []
        try:
            cmd = self.inbox.get(block=block, timeout=timeout)
        except queue.Empty:
            return outputs
        while True:
            kind = cmd[0]
            if kind == "stop":
                outputs.append("stop")
                return outputs
            if kind == "add":
                try:
                    self.add_request(*cmd[1:])
                except RequestError as e:
                    out = _error_output(cmd[1], str(e))
                    out.extra = {"rejected": True, "param": e.param, "code": e.code,
                                 "status_code": e.status_code}
                    outputs.append(out)
            elif kind == "abort":
                out = self.abort_request(cmd[1])
                if out is not None:
                    outputs.append(out)
            elif kind == "kv":
                self.connector.handle_event(cmd[1])
                outputs += self._apply_connector_actions()
            elif kind == "kv_abort" and self.connector is not None:
                self.connector.abort_transfer(cmd[1], cmd[2])
                outputs += self._apply_connector_actions()
            try:
                cmd = self.inbox.get_nowait()
            except queue.Empty:
                return outputs

    def _apply_connector_actions(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for action in self.connector.take_actions():
            req = self.scheduler.requests.get(action.request_id)
            if req is None:
                continue
            match action:
                case EmitFirstToken():
                    outputs.append(self._token_output(req, time.perf_counter()))
                case FailRequest(_, why):
                    outputs.append(self._finish(req, FinishReason.ERROR, [], None, why))
                case RejectRequest(_, why):  # the request's kv_transfer_params were wrong
                    out = self._finish(req, FinishReason.ERROR, [], None, why)
                    out.extra = {**out.extra, "rejected": True,
                                 "param": "kv_transfer_params", "code": None}
                    outputs.append(out)
                case AbortRequest(_, why):
                    outputs.append(self._finish(req, FinishReason.ABORT, [], None, why))
        return outputs

    # ---- requests ------------------------------------------------------------------
    def kv_params(self, raw: dict | KVTransferParams | None) -> KVTransferParams | None:
        """A request's ``kv_transfer_params`` checked once, typed (RequestError: a 400).
        Thread-safe: the front end calls it before the request is queued."""
        if raw is None or isinstance(raw, KVTransferParams):
            return raw
        if self.connector is None:
            raise RequestError(
                "kv_transfer_params given, but this instance runs with --role both",
                "kv_transfer_params",
            )
        return KVTransferParams.parse(raw, self.connector.role, self.connector.params_signer,
                                      self.connector.engine_id)

    def leg_params(self, params: SamplingParams,
                   kv: KVTransferParams | None) -> SamplingParams:
        """The sampling parameters the request runs with: a push or pull prefill leg
        ends with token #1, whose logprob travels with the KV (the one place that says
        so; the router sends max_tokens=1 too, as vLLM's proxies do)."""
        if kv is not None and kv.do_remote_decode and self.connector is not None \
                and self.connector.role == "prefill":
            return dataclasses.replace(params, max_tokens=1, logprobs=True)
        return params

    def validate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_transfer_params: dict | KVTransferParams | None = None,
    ) -> KVTransferParams | None:
        """Raise RequestError for a request this engine can never serve; returns its
        typed kv_transfer_params. Thread-safe."""
        return self._checked(prompt_token_ids, params, kv_transfer_params)[0]

    def _checked(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_transfer_params: dict | KVTransferParams | None,
    ) -> tuple[KVTransferParams | None, SamplingParams]:
        """``validate``'s checks; returns the typed params and the sampling parameters
        the request runs with (``leg_params``)."""
        kv = self.kv_params(kv_transfer_params)
        params = self.leg_params(params, kv)
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestError("the prompt is empty", "prompt")
        if kv is not None and kv.prompt_hashes is not None:
            # pull: the blocks prefill lent hold its prompt's KV; READ them only for it
            problem = chain_problem(
                kv.prompt_hashes,
                hash_prompt_chain(prompt_token_ids, self.config.cache.block_size,
                                  salt=params.cache_salt),
                "the lent KV's", "this request's")
            if problem:
                raise RequestError(f"kv_transfer_params: {problem}", "kv_transfer_params",
                                   "kv_prompt_mismatch")
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
        return kv, params

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_transfer_params: dict | KVTransferParams | None = None,
    ) -> Request:
        kv, params = self._checked(prompt_token_ids, params, kv_transfer_params)
        if request_id in self.scheduler.requests:
            raise RequestError(f"request id {request_id!r} is already in use", "request_id")
        req = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            max_total_tokens=self.max_model_len,
        )
        if self.connector is None or not self.connector.add_request(req, kv):
            self.scheduler.add_request(req)
        self.detoks[request_id] = IncrementalDetokenizer(
            self.tokenizer, req.params.stop, req.params.include_stop_str_in_output
        )
        return req

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return None
        return self._finish(req, FinishReason.ABORT, [], None)

    def has_work(self) -> bool:
        if self.connector is not None and self.connector.has_pending_work():
            return True
        return self.scheduler.has_work()

    # ---- the step ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step: schedule, run the batch, and return its outputs."""
        try:
            return self._step()
        finally:
            if self.connector is not None:
                self.connector.flush()  # the step's transfer commands: one message

    def _step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        layer_hook = None
        if self.connector is not None:
            self.connector.before_schedule()
            outputs += self._apply_connector_actions()
            if outputs:
                # token #1 of a pushed request (or a failure) goes out now, not after a
                # forward pass it has no part in; the caller steps again at once
                return outputs
        plan = self.scheduler.schedule()
        if plan.empty:
            return outputs
        if self.connector is not None:
            layer_hook = self.connector.layer_hook(plan)
        try:
            sampled = self.runner.execute(plan, layer_hook)
        except Exception as e:  # a bug or OOM fails this batch, not the engine
            log.exception("step failed; failing %d requests", len(plan.chunks))
            outs = []
            for c in plan.chunks:
                req = self.scheduler.requests.get(c.request_id)
                if req is not None:
                    outs.append(self._finish(req, FinishReason.ERROR, [], None, str(e)))
            return outputs + outs
        now = time.perf_counter()
        for req in self.scheduler.update_after_step(plan, sampled):
            outputs.append(self._token_output(req, now))
        return outputs

    def _token_output(self, req: Request, now: float) -> RequestOutput:
        """Output for the request's newest token, finishing it if a stop condition hit."""
        token = req.output_token_ids[-1]
        if req.first_token_time is None:
            req.first_token_time = now
            if self.connector is not None:
                self.connector.first_token_out(req.request_id)
        detok = self.detoks[req.request_id]
        detok.add(token)
        reason = self._stop_reason(req, token, detok)
        logprobs = [req.output_logprobs[-1]] if req.params.logprobs else None
        top = ([req.output_top_logprobs[-1]]
               if req.params.top_logprobs and req.output_top_logprobs else None)
        if reason is not None:
            return self._finish(req, reason, [token], logprobs, top=top)
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=[token],
            new_text=detok.take(final=False),
            new_logprobs=logprobs,
            new_top_logprobs=top,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=req.num_cached_tokens,
            first_token_time=req.first_token_time,
            arrival_time=req.arrival_time,
        )

    def _stop_reason(
        self, req: Request, token: int, detok: IncrementalDetokenizer
    ) -> FinishReason | None:
        p = req.params
        if detok.stopped:
            return FinishReason.STOP
        if not p.ignore_eos and token in self.eos_token_ids:
            return FinishReason.STOP
        if token in p.stop_token_ids:  # a frozenset: O(1) per token (SamplingParams)
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
        top: list[TopLogprobs] | None = None,
    ) -> RequestOutput:
        keep, kv_params = False, None
        if self.connector is not None:
            ok = reason in (FinishReason.STOP, FinishReason.LENGTH)
            keep, kv_params = self.connector.on_finish(req, ok, error)
        self.scheduler.finish(req.request_id, _FINISH_STATE[reason], keep_blocks=keep)
        detok = self.detoks.pop(req.request_id, None)
        text = detok.take(final=True) if detok is not None else ""
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_tokens,
            new_text=text,
            finished=True,
            finish_reason=reason,
            new_logprobs=logprobs,
            new_top_logprobs=top,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=req.num_cached_tokens,
            error=error,
            first_token_time=req.first_token_time,
            arrival_time=req.arrival_time,
            extra={"kv_transfer_params": kv_params} if kv_params else {},
        )

    def kv_info(self) -> dict:
        s = self.stats()
        cache = self.config.cache
        info = {
            "engine_id": "",
            "role": "both",
            "kv_transfer": None,
            "side_channel": None,
            **(self.connector.info() if self.connector is not None else {}),
            "model": self.config.served_model_name,
            # weights' and activations' dtype (the KV cache's is the layout's) and why
            "dtype": dtype_name(self.config.dtype),
            "dtype_reason": self.config.dtype_reason,
            "block_size": self.config.cache.block_size,
            "layout": dataclasses.asdict(self.runner.kv_region.layout),
            "num_free_blocks": s.num_free_blocks,
            "num_total_blocks": s.num_total_blocks,
            # how --kv-cache-memory was split (kv_cache/budget.py)
            "kv_memory": {
                **(cache.memory.as_dict() if cache.memory is not None else {}),
                "decode_attention": cache.decode_attention,
            },
        }
        return info

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


def _error_output(request_id: str, message: str) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        new_token_ids=[],
        new_text="",
        finished=True,
        finish_reason=FinishReason.ERROR,
        error=message,
    )
