"""The front end's half of a request's output: the engine core's token ids become text
here, incrementally, once per token (kvpush.engine.detokenizer), with stop strings
applied. A stop string ends the request on this side first: the output says STOP and the
caller aborts the request in the core (``RequestStream.stopped_early``), as vLLM's
front end does; every other stop condition (EOS, stop token ids, max_tokens, the
context) is the core's, which needs no text.
"""

from __future__ import annotations

from kvpush.engine.detokenizer import IncrementalDetokenizer
from kvpush.engine.outputs import EngineOutput, FinishReason, RequestOutput
from kvpush.sampling_params import SamplingParams


class RequestStream:
    """One request's (one choice's) detokenizer and stop strings."""

    __slots__ = ("request_id", "index", "detok", "stopped_early")

    def __init__(self, request_id: str, tokenizer, params: SamplingParams, index: int = 0):
        self.request_id = request_id
        self.index = index  # the choice of an n > 1 request
        self.detok = IncrementalDetokenizer(tokenizer, params.stop,
                                            params.include_stop_str_in_output)
        #: a stop string ended the request before the core did: abort it there
        self.stopped_early = False

    def process(self, out: EngineOutput) -> RequestOutput:
        detok = self.detok
        tokens = out.new_token_ids
        reason = out.finish_reason
        logprobs, top = out.new_logprobs, out.new_top_logprobs
        for i, token in enumerate(tokens):
            detok.add(token)
            if detok.stopped:  # the text is cut at the stop string
                if i + 1 < len(tokens):
                    tokens = tokens[: i + 1]
                    logprobs = logprobs[: i + 1] if logprobs is not None else None
                    top = top[: i + 1] if top is not None else None
                if reason is None:
                    self.stopped_early = True
                if reason in (None, FinishReason.LENGTH):
                    reason = FinishReason.STOP
                break
        finished = reason is not None
        failure = out.failure
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=tokens,
            new_text=detok.take(final=finished),
            finished=finished,
            finish_reason=reason,
            new_logprobs=logprobs,
            new_top_logprobs=top,
            num_prompt_tokens=out.num_prompt_tokens,
            num_output_tokens=out.num_output_tokens - (len(out.new_token_ids) - len(tokens)),
            num_cached_tokens=out.num_cached_tokens,
            error=failure.message if failure is not None else None,
            first_token_time=out.first_token_time,
            arrival_time=out.arrival_time,
            scheduled_time=out.scheduled_time,
            kv_transfer_params=out.kv_transfer_params,
            index=self.index,
        )


class ChoiceTexts:
    """The RequestStreams of a request's ``n`` choices: each output goes to its own."""

    __slots__ = ("streams", "open")

    def __init__(self, request_id: str, tokenizer, params: SamplingParams):
        self.streams = [RequestStream(request_id, tokenizer, params, i)
                        for i in range(params.n)]
        self.open = set(range(params.n))

    def process(self, out: EngineOutput) -> RequestOutput | None:
        """The output as text; None for a choice that has ended here already (a stop
        string ended it; the core's last word of it comes after)."""
        if out.index not in self.open:
            return None
        res = self.streams[out.index].process(out)
        if res.finished:
            self.open.discard(out.index)
        return res

    def stopped_early(self, index: int) -> bool:
        """A stop string ended choice ``index`` here before the core did."""
        return self.streams[index].stopped_early

    @property
    def done(self) -> bool:
        """Every choice has ended."""
        return not self.open
