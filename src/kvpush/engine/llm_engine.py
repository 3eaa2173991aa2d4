"""LLMEngine: the synchronous core of one instance — scheduler, runner and, in a P/D
role, the KV connector.

It is driven by exactly one thread (the step loop). Other threads talk to it only
through ``inbox``: typed commands (kvpush.engine.inputs: add, abort, abort a transfer,
utility calls, shutdown) from the front end and events from the transfer thread.
``process_inbox()`` applies them; ``step()`` plans a batch, runs it and returns an
EngineOutput (token ids, no text) for every request that advanced. The stop conditions
that need no text (EOS, stop token ids, max_tokens, the model's context) are checked
here; stop strings are the front end's (kvpush.engine.output_processor).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from kvpush.config import EngineConfig, dtype_name
from kvpush.engine.checks import RequestChecker
from kvpush.engine.inputs import (
    AbortRequests,
    AbortTransfer,
    AddRequest,
    GrammarReady,
    Shutdown,
    TransferThreadDied,
    Utility,
    UtilityCall,
    choice_id,
)
from kvpush.engine.model_runner import ModelRunner
from kvpush.engine.outputs import (
    EngineOutput,
    EngineSnapshot,
    EngineStats,
    FinishReason,
    RequestError,
    RequestFailure,
    UtilityReply,
    UtilityResult,
    rejected,
)
from kvpush.engine.tp.group import RankDied
from kvpush.grammar import GrammarCompiler, GrammarError
from kvpush.kv_info import KVEvents, KVInfo
from kvpush.kv_transfer.actions import AbortRequest, EmitFirstToken, FailRequest, RejectRequest
from kvpush.kv_transfer.commands import TransferUpdate
from kvpush.kv_transfer.links import TransferLinks
from kvpush.kv_transfer.params import KVTransferParams
from kvpush.models.tokenizer import load_tokenizer
from kvpush.sampling_params import SamplingParams, StructuredOutput, TopLogprobs
from kvpush.scheduler.request import Request, RequestState
from kvpush.scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)

_FINISH_STATE = {
    FinishReason.STOP: RequestState.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestState.FINISHED_LENGTH,
    FinishReason.ABORT: RequestState.FINISHED_ABORTED,
    FinishReason.ERROR: RequestState.FINISHED_ERROR,
}


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer=None, links: TransferLinks | None = None,
                 build_threads: int | None = None):
        """``build_threads``: torch threads of the calling thread while the engine is
        built (default ``config.threads``). AsyncEngine builds with 1 and gives the
        step-loop thread ``config.threads``: see AsyncEngine. ``links``: how a P/D
        instance reaches its peers (default NIXL and a ZMQ side channel)."""
        threads = config.threads if build_threads is None else build_threads
        if threads:
            torch.set_num_threads(threads)
        self.config = config
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model.path)
        self.runner = ModelRunner(config, links=links)
        if build_threads is None:
            # the builder runs the steps: time the projections' matmuls now, at its
            # thread count (else the step loop does, model/linear_pick.py)
            self.prepare_step_thread()
        self.scheduler = Scheduler(config.scheduler, config.cache)
        self.checker = RequestChecker(config)
        eos = set(config.model.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        #: structured outputs' grammars, compiled once each (llguidance: on first use)
        self.grammars = GrammarCompiler(self.tokenizer, config.model.vocab_size, eos)
        self.max_model_len = config.scheduler.max_model_len
        self.vocab_size = config.model.vocab_size
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        # a tensor-parallel rank that dies ends the step loop, like the transfer thread
        self.runner.on_rank_death(lambda why: self.inbox.put(RankDied(why)))
        #: set when a Shutdown command was applied: the loop ends
        self.stopping = False
        #: what a UtilityCall may ask for (the step loop's owner may add its own)
        self.utilities: dict[Utility, Callable[[], UtilityResult]] = {
            Utility.KV_INFO: self.kv_info}
        #: start-up work still to do on the stepping thread (prepare_step_thread), as
        #: /health's 503 "starting" says it; None once done
        self.starting: str | None = "starting: the step thread is timing its matmul kernels"
        self._replies: list[UtilityReply] = []
        #: an n > 1 request's id -> the ids of its choices still running (forked at its
        #: token #1, kept until the last ends)
        self._choices: dict[str, set[str]] = {}
        #: requests whose structured output compiles on the grammar thread (first use of
        #: a spec): added to the scheduler at its GrammarReady, so the step loop never
        #: waits on a compile
        self.compiling: dict[str, tuple[Request, KVTransferParams | None]] = {}
        self._grammar_thread: ThreadPoolExecutor | None = None
        self.connector = None
        if config.kv_transfer.enabled:
            from kvpush.kv_transfer.step_loop.connector import KVConnector

            self.connector = KVConnector(
                config, self.runner.kv_region, self.scheduler,
                post_update=self.inbox.put,
                on_death=lambda why: self.inbox.put(TransferThreadDied(why)),
                links=links, ranks=self.runner.kv_ranks())
            self.scheduler.on_preempt = self.connector.on_preempt
            self.connector.start()

    def prepare_step_thread(self) -> None:
        """Called once on the thread that will run ``step`` (at its torch thread count):
        the projections' matmul kernels are timed there (model/linear_pick.py)."""
        self.runner.model.ensure_linears()
        self.starting = None

    def shutdown(self) -> None:
        if self._grammar_thread is not None:
            self._grammar_thread.shutdown(wait=False, cancel_futures=True)
        if self.connector is not None:
            self.connector.shutdown()
        self.runner.close()  # the other tensor-parallel ranks, if any

    # ---- the inbox -------------------------------------------------------------------
    def process_inbox(self, block: bool = False,
                      timeout: float | None = None) -> list[EngineOutput]:
        """Apply queued commands and transfer events; wait for one first when ``block``.
        Returns the outputs they produced; after a Shutdown, ``stopping`` is set."""
        try:
            return self._process_inbox(block, timeout)
        finally:
            if self.connector is not None:
                self.connector.flush()  # the turn's transfer commands: one message

    def _process_inbox(self, block: bool, timeout: float | None) -> list[EngineOutput]:
        outputs: list[EngineOutput] = []
        try:
            cmd = self.inbox.get(block=block, timeout=timeout)
        except queue.Empty:
            return outputs
        while True:
            match cmd:
                case AddRequest():
                    try:
                        self._admit(cmd)
                    except RequestError as e:
                        outputs.append(rejected(cmd.request_id, e, cmd.front))
                case AbortRequests(request_ids=ids):
                    for rid in ids:
                        outputs += self._abort_choices(rid)
                case TransferUpdate() if self.connector is not None:
                    self.connector.handle_update(cmd)
                    outputs += self._apply_connector_actions()
                case GrammarReady():
                    outputs += self._grammar_ready(cmd)
                case TransferThreadDied() | RankDied():
                    raise cmd  # the step loop ends: CoreLoop fails every request
                case AbortTransfer(transfer_id=tid, why=why) if self.connector is not None:
                    self.connector.abort_transfer(tid, why)
                    outputs += self._apply_connector_actions()
                case UtilityCall():
                    self._replies.append(self._call(cmd))
                case Shutdown():
                    self.stopping = True
                    return outputs
                case _:
                    log.error("engine inbox: %r is not a command this engine takes", cmd)
            try:
                cmd = self.inbox.get_nowait()
            except queue.Empty:
                return outputs

    def _call(self, call: UtilityCall) -> UtilityReply:
        fn = self.utilities.get(call.method)
        if fn is None:
            return UtilityReply(call.call_id, error=f"no utility {call.method.value!r} here")
        try:
            return UtilityReply.of(call.call_id, fn())
        except Exception as e:  # noqa: BLE001 - the caller gets the error, the loop goes on
            log.exception("utility call %s failed", call.method.value)
            return UtilityReply(call.call_id, error=str(e))

    def take_replies(self) -> list[UtilityReply]:
        replies, self._replies = self._replies, []
        return replies

    def _apply_connector_actions(self) -> list[EngineOutput]:
        outputs: list[EngineOutput] = []
        assert self.connector is not None  # (P/D roles only)
        for action in self.connector.take_actions():
            req = self.scheduler.requests.get(action.request_id)
            if req is None:
                continue
            match action:
                case EmitFirstToken():
                    outputs.append(self._token_output(req, time.perf_counter()))
                case FailRequest(_, why):
                    outputs.append(self._finish(req, FinishReason.ERROR, [], None,
                                                RequestFailure(why)))
                case RejectRequest(_, why, code):  # its kv_transfer_params were wrong
                    outputs.append(self._finish(req, FinishReason.ERROR, [], None,
                                                RequestFailure(why, rejected=True, code=code,
                                                               param="kv_transfer_params")))
                case AbortRequest(_, why):
                    outputs.append(self._finish(req, FinishReason.ABORT, [], None,
                                                RequestFailure(why)))
        return outputs

    # ---- requests ------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_transfer_params: dict | KVTransferParams | None = None,
    ) -> Request:
        """Check and add a request (the direct API: tests, benchmarks)."""
        kv, params = self.checker.check(prompt_token_ids, params, kv_transfer_params)
        return self._admit(AddRequest(request_id, list(prompt_token_ids), params, kv),
                           compile_here=True)

    def _admit(self, cmd: AddRequest, compile_here: bool = False) -> Request:
        """Add a request the front end checked (RequestChecker); what is left to refuse
        depends on this engine's live state. A structured output not compiled yet is
        compiled on the grammar thread (``compile_here``: now, the direct API's way)."""
        if cmd.request_id in self.scheduler.requests or cmd.request_id in self.compiling:
            raise RequestError(f"request id {cmd.request_id!r} is already in use",
                               "request_id")
        req = Request(
            request_id=cmd.request_id,
            prompt_token_ids=cmd.prompt_token_ids,
            params=cmd.params,
            max_total_tokens=self.max_model_len,
            front=cmd.front,
        )
        if cmd.arrival_time:
            req.arrival_time = cmd.arrival_time
        spec = cmd.params.structured
        if spec is not None and not compile_here and not self.grammars.cached(spec):
            self.compiling[req.request_id] = (req, cmd.kv_transfer_params)
            if self._grammar_thread is None:
                self._grammar_thread = ThreadPoolExecutor(1, "kvpush-grammar")
            self._grammar_thread.submit(self._compile, req.request_id, spec)
            return req
        if spec is not None:
            try:
                req.grammar = self.grammars.grammar(spec)
            except GrammarError as e:  # the front checks specs: another front's spec
                raise RequestError(f"structured output: {e}", "response_format") from None
        self._queue(req, cmd.kv_transfer_params)
        return req

    def _queue(self, req: Request, kv: KVTransferParams | None) -> None:
        if self.connector is None or not self.connector.add_request(req, kv):
            self.scheduler.add_request(req)

    def _compile(self, request_id: str, spec: StructuredOutput) -> None:
        """On the grammar thread: compile, then tell the step loop."""
        try:
            self.grammars.check(spec)
        except GrammarError as e:  # the front checks specs: another front's spec
            self.inbox.put(GrammarReady(request_id, str(e)))
        except Exception as e:  # noqa: BLE001 - the request fails, the engine goes on
            log.exception("compiling the structured output of %s failed", request_id)
            self.inbox.put(GrammarReady(request_id, f"cannot compile: {e}"))
        else:
            self.inbox.put(GrammarReady(request_id))

    def _grammar_ready(self, ready: GrammarReady) -> list[EngineOutput]:
        """A waiting request's grammar compiled: it queues now (or is refused)."""
        entry = self.compiling.pop(ready.request_id, None)
        if entry is None:
            return []  # aborted meanwhile
        req, kv = entry
        if ready.error is not None:
            return [rejected(req.request_id, RequestError(
                f"structured output: {ready.error}", "response_format"), req.front)]
        assert req.params.structured is not None  # (only a guided request compiles)
        req.grammar = self.grammars.grammar(req.params.structured)
        self._queue(req, kv)
        return []

    def abort_request(self, request_id: str, why: str | None = None) -> EngineOutput | None:
        """End a request: aborted (its client's doing), or failed with ``why``."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            waiting = self.compiling.pop(request_id, None)
            if waiting is None:
                return None
            return EngineOutput(request_id, [], finish_reason=(
                FinishReason.ABORT if why is None else FinishReason.ERROR),
                failure=None if why is None else RequestFailure(why),
                num_prompt_tokens=waiting[0].num_prompt_tokens,
                arrival_time=waiting[0].arrival_time, front=waiting[0].front)
        if why is not None:
            return self._finish(req, FinishReason.ERROR, [], None, RequestFailure(why))
        return self._finish(req, FinishReason.ABORT, [], None)

    def _abort_choices(self, request_id: str) -> list[EngineOutput]:
        """Abort a request and every choice of it (or one choice, by its choice id)."""
        ids = sorted(self._choices.get(request_id, ())) or [request_id]
        return [out for rid in ids if (out := self.abort_request(rid)) is not None]

    def has_work(self) -> bool:
        if self.connector is not None and self.connector.has_pending_work():
            return True
        return self.scheduler.has_work()

    # ---- the step ------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        """One step: schedule, run the batch, and return its outputs."""
        try:
            return self._step()
        finally:
            if self.connector is not None:
                self.connector.flush()  # the step's transfer commands: one message

    def _step(self) -> list[EngineOutput]:
        outputs: list[EngineOutput] = []
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
        except RankDied:
            raise  # tensor parallelism: the ranks are out of step; the loop ends
        except Exception as e:  # a bug or OOM fails this batch, not the engine
            log.exception("step failed; failing %d requests", len(plan.chunks))
            outs = []
            for c in plan.chunks:
                req = self.scheduler.requests.get(c.request_id)
                if req is not None:
                    outs.append(self._finish(req, FinishReason.ERROR, [], None,
                                             RequestFailure(str(e))))
            return outputs + outs
        now = time.perf_counter()
        for req in self.scheduler.update_after_step(plan, sampled):
            outputs.append(self._token_output(req, now))
        return outputs

    def _token_output(self, req: Request, now: float) -> EngineOutput:
        """Output for the request's newest token, finishing it if a stop condition hit."""
        token = req.output_token_ids[-1]
        if req.first_token_time is None:
            req.first_token_time = now
            if self.connector is not None:
                self.connector.first_token_out(req.request_id)
            if req.params.n > 1 and req.index == 0:
                self._fork(req)
        reason = self._stop_reason(req, token)
        logprobs = [req.output_logprobs[-1]] if req.params.logprobs else None
        top = ([req.output_top_logprobs[-1]]
               if req.params.top_logprobs and req.output_top_logprobs else None)
        broken = req.grammar.error if req.grammar is not None else None
        if broken is not None:  # only a token from elsewhere (token #1 of a transfer)
            return self._finish(req, FinishReason.ERROR, [token], logprobs, RequestFailure(
                f"token {token} breaks the structured output's grammar: {broken}"), top)
        if reason is not None:
            return self._finish(req, reason, [token], logprobs, top=top)
        return EngineOutput(
            req.output_id, [token], logprobs, top, None, None, None,
            req.num_prompt_tokens, req.num_output_tokens, req.num_cached_tokens,
            req.first_token_time, req.arrival_time, req.scheduled_time, req.index,
            front=req.front,
        )

    def _fork(self, parent: Request) -> None:
        """Choices 1..n-1 of ``parent``, whose prompt KV is complete now (its token #1
        came: sampled here, or with a push): each shares the prompt's blocks and samples
        its own continuation (Scheduler.fork). A P/D request's KV moved once."""
        ids = [choice_id(parent.request_id, i) for i in range(1, parent.params.n)]
        self._choices[parent.request_id] = {parent.request_id, *ids}
        spec = parent.params.structured
        for i in reversed(range(1, parent.params.n)):
            child = Request(ids[i - 1], parent.prompt_token_ids, parent.params.choice(i),
                            parent.max_total_tokens, arrival_time=parent.arrival_time,
                            index=i, output_id=parent.request_id, front=parent.front)
            if spec is not None:
                child.grammar = self.grammars.grammar(spec)  # (compiled: a copy)
            self.scheduler.fork(parent, child)

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        p = req.params
        if not p.ignore_eos and token in self.eos_token_ids:
            return FinishReason.STOP
        if token in p.stop_token_ids:  # a frozenset: O(1) per token (SamplingParams)
            return FinishReason.STOP
        if req.grammar is not None and req.grammar.finished:  # complete, ended
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
        failure: RequestFailure | None = None,
        top: list[TopLogprobs] | None = None,
    ) -> EngineOutput:
        keep, kv_params = False, None
        if self.connector is not None:
            ok = reason in (FinishReason.STOP, FinishReason.LENGTH)
            keep, kv_params = self.connector.on_finish(
                req, ok, failure.message if failure is not None else None)
        self.scheduler.finish(req.request_id, _FINISH_STATE[reason], keep_blocks=keep)
        more = False
        live = self._choices.get(req.output_id)
        if live is not None:
            live.discard(req.request_id)
            more = bool(live)
            if not more:
                del self._choices[req.output_id]
        return EngineOutput(
            req.output_id, new_tokens, logprobs, top, reason, failure, kv_params or None,
            req.num_prompt_tokens, req.num_output_tokens, req.num_cached_tokens,
            req.first_token_time, req.arrival_time, req.scheduled_time, req.index, more,
            req.front,
        )

    def kv_info(self, engine_id: str = "", kv_events: KVEvents | None = None,
                request_plane: str | None = None,
                request_plane_members: bool = False) -> KVInfo:
        """What /kv/info shows, with the parts its core loop owns (CoreLoop.kv_info)."""
        s = self.stats()
        cache = self.config.cache
        ident: dict[str, Any] = {"engine_id": engine_id, "role": "both",
                                 "kv_transfer": None, "side_channel": None}
        if self.connector is not None:
            ident.update(self.connector.info())
        return KVInfo(
            **ident,
            model=self.config.served_model_name,
            dtype=dtype_name(self.config.dtype),
            dtype_reason=self.config.dtype_reason,
            block_size=cache.block_size,
            max_model_len=self.max_model_len,
            vocab_size=self.config.model.vocab_size,
            layout=dataclasses.asdict(self.runner.kv_region.layout),
            **self.runner.tp_info(),
            num_free_blocks=s.num_free_blocks,
            num_total_blocks=s.num_total_blocks,
            kv_memory={**(cache.memory.as_dict() if cache.memory is not None else {}),
                       "decode_attention": cache.decode_attention},
            kv_events=kv_events,
            request_plane=request_plane,
            request_plane_members=request_plane_members,
        )

    def snapshot(self) -> EngineSnapshot:
        """The gauges, transfer counters and start-up state as of now (step-loop thread)."""
        c = self.connector
        return EngineSnapshot(self.stats(), c.stats() if c is not None else None,
                              self.starting)

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

