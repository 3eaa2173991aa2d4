"""Engine outputs -> OpenAI bodies and SSE frames, for completions and chats, one
request of ``n`` choices (each output names its choice: ``RequestOutput.index``).

A chat that offered tools has each choice's text parsed into ``tool_calls``
(kvpush.server.tool_calls): whole for a body, as it comes for a stream.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from pydantic import BaseModel

from kvpush.engine.outputs import FinishReason, RequestOutput
from kvpush.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChoiceIds,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    DeltaToolCall,
    Job,
    ToolCallOut,
    TopLogprob,
    UsageInfo,
)
from kvpush.server.tool_calls import ToolCall, ToolStream, parse_tool_calls

TokenTexts = Callable[[int], tuple[str, list[int]]]


def _frame(model: BaseModel) -> bytes:
    return b"data: " + model.model_dump_json().encode() + b"\n\n"


_TEXT_MARK = "@@kvpush-text@@"
_encode_str = msgspec.json.Encoder().encode


class TextFrame:
    """The SSE frame of a plain text chunk (no logprobs, not the last), built once per
    choice from the pydantic model's own dump with a marker for the text; each token's
    frame is then two byte joins and one JSON string encode instead of a pydantic model
    built and dumped per token (the API process's largest per-token cost after the
    ASGI send: benchmarks/ENGINE.md, "Profile after the split")."""

    def __init__(self, frame_with_mark: bytes) -> None:
        head, sep, tail = frame_with_mark.partition(_encode_str(_TEXT_MARK))
        assert sep and _encode_str(_TEXT_MARK) not in tail, "the marker must occur once"
        self.head = head
        self.tail = tail

    def __call__(self, text: str) -> bytes:
        return self.head + _encode_str(text) + self.tail


@dataclass
class Choice:
    """One choice's part of the answer so far."""

    index: int
    text_parts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    text_frame: TextFrame | None = None
    #: completions' logprobs: the text offset of the next token
    offset: int = 0
    lp: Any = None
    tools: ToolStream | None = None
    #: its token ids so far (kept with return_token_ids)
    token_ids: list[int] = field(default_factory=list)


class Format:
    """Turns one request's engine outputs into an OpenAI body or SSE frames."""

    def __init__(self, job: Job, model: str, token_texts: TokenTexts) -> None:
        self.job = job
        self.model = model
        self.texts = token_texts
        self.created = int(time.time())
        #: the choices that answered so far, by index (a prefill leg answers one of n)
        self._choices: dict[int, Choice] = {}
        self.num_tokens = 0
        self.kv_transfer_params: dict[str, Any] | None = None

    @property
    def choices(self) -> list[Choice]:
        return [self._choices[i] for i in sorted(self._choices)]

    def _choice(self, index: int) -> Choice:
        choice = self._choices.get(index)
        if choice is None:
            choice = self._choices[index] = self._new_choice(index)
        return choice

    def _new_choice(self, index: int) -> Choice:
        return Choice(index)

    @property
    def done(self) -> bool:
        """Every choice that answered has finished."""
        return bool(self._choices) and all(c.finish_reason is not None
                                           for c in self._choices.values())

    def usage(self) -> UsageInfo:
        p = len(self.job.prompt_ids)
        return UsageInfo(prompt_tokens=p, completion_tokens=self.num_tokens,
                         total_tokens=p + self.num_tokens)

    def _account(self, out: RequestOutput) -> Choice:
        self.num_tokens += len(out.new_token_ids)
        choice = self._choice(out.index)
        if out.finished:
            choice.finish_reason = _reason(out)
            if out.kv_transfer_params is not None:
                self.kv_transfer_params = out.kv_transfer_params.to_wire()
        return choice

    def abort_open(self) -> None:
        """The stream ended early: every choice still open finished with abort."""
        for c in self.choices:
            if c.finish_reason is None:
                c.finish_reason = "abort"

    def _token_logprobs(self, out: RequestOutput
                        ) -> list[tuple[int, float | None, tuple[tuple[int, float], ...]]]:
        """(token id, logprob, top alternatives) of each new token."""
        if self.job.logprobs is None or not out.new_token_ids:
            return []
        n = len(out.new_token_ids)
        lps: list[float | None] = list(out.new_logprobs or [])
        lps += [None] * (n - len(lps))
        tops = list(out.new_top_logprobs or [])
        tops += [()] * (n - len(tops))
        return list(zip(out.new_token_ids, lps, tops))

    def add(self, out: RequestOutput) -> None:
        """Accumulate an output for the non-streaming body."""
        raise NotImplementedError

    def response(self) -> dict[str, Any]:
        raise NotImplementedError

    def stream_start(self) -> list[bytes]:
        return []

    def stream_chunk(self, out: RequestOutput) -> bytes | None:
        raise NotImplementedError

    def stream_finish(self, reason: str) -> bytes:
        """The last frame of a stream that ended early: every open choice ends."""
        raise NotImplementedError

    def usage_chunk(self) -> bytes:
        raise NotImplementedError

    @staticmethod
    def error_frame(err: Any) -> bytes:
        return b"data: " + json.dumps(err.body()).encode() + b"\n\n"


def _reason(out: RequestOutput) -> str:
    r = out.finish_reason
    return "abort" if r is None else FinishReason(r).value


class CompletionFormat(Format):
    def _new_choice(self, index: int) -> Choice:
        lp = CompletionLogprobs() if self.job.logprobs is not None else None
        return Choice(index, lp=lp)

    def _logprobs(self, out: RequestOutput, choice: Choice, into: CompletionLogprobs) -> None:
        top = self.job.logprobs or 0
        for tid, lp, alts in self._token_logprobs(out):
            text, _ = self.texts(tid)
            into.tokens.append(text)
            into.token_logprobs.append(lp)
            if top and lp is not None:
                # the top alternatives, and the sampled token where it is not among them
                # (as OpenAI's legacy API: up to logprobs + 1 entries); keyed by text, so
                # tokens that read alike share one entry, the most likely one's
                entries: dict[str, float] = {}
                for a, a_lp in alts[:top]:
                    entries.setdefault(self.texts(a)[0], a_lp)
                entries.setdefault(text, lp)
                into.top_logprobs.append(entries)
            else:
                into.top_logprobs.append(None)
            into.text_offset.append(choice.offset)
            choice.offset += len(text)

    def add(self, out: RequestOutput) -> None:
        choice = self._account(out)
        choice.text_parts.append(out.new_text)
        if self.job.return_token_ids:
            choice.token_ids += out.new_token_ids
        if choice.lp is not None:
            self._logprobs(out, choice, choice.lp)

    def _choice_out(self, index: int, text: str, ids: list[int], prompt: bool = True,
                    **kw: Any) -> CompletionChoice:
        """A choice of the answer; with return_token_ids (vLLM's), its ``token_ids`` and
        (``prompt``) the prompt's."""
        if not self.job.return_token_ids:
            return CompletionChoice(index=index, text=text, **kw)
        return CompletionChoiceIds(index=index, text=text, token_ids=ids,
                                   prompt_token_ids=self.job.prompt_ids if prompt else None,
                                   **kw)

    def response(self) -> dict[str, Any]:
        return CompletionResponse(
            id=self.job.request_id, created=self.created, model=self.model,
            choices=[self._choice_out(c.index, "".join(c.text_parts), c.token_ids,
                                      logprobs=c.lp, finish_reason=c.finish_reason)
                     for c in self.choices],
            usage=self.usage(), kv_transfer_params=self.kv_transfer_params,
        ).model_dump(mode="json")

    def _chunk(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> bytes:
        return _frame(CompletionResponse(id=self.job.request_id, created=self.created,
                                         model=self.model, choices=choices, usage=usage))

    def stream_chunk(self, out: RequestOutput) -> bytes | None:
        choice = self._account(out)
        lp = None
        if choice.lp is not None and out.new_token_ids:
            lp = CompletionLogprobs()
            self._logprobs(out, choice, lp)
        if not out.new_token_ids and not out.new_text and not out.finished:
            return None  # one chunk per token, even one whose text is held back
        if lp is None and not out.finished and not self.job.return_token_ids:
            if choice.text_frame is None:
                choice.text_frame = TextFrame(self._chunk(
                    [CompletionChoice(index=choice.index, text=_TEXT_MARK)]))
            return choice.text_frame(out.new_text)
        reason = choice.finish_reason if out.finished else None
        first = not choice.token_ids  # the prompt's ids go with a choice's first tokens
        if self.job.return_token_ids:
            choice.token_ids += out.new_token_ids
        return self._chunk([self._choice_out(choice.index, out.new_text, out.new_token_ids,
                                             first, logprobs=lp, finish_reason=reason)])

    def stream_finish(self, reason: str) -> bytes:
        open_ = [c for c in self.choices if c.finish_reason is None]
        for c in open_:
            c.finish_reason = reason
        return self._chunk([CompletionChoice(index=c.index, text="", finish_reason=reason)
                            for c in open_])

    def usage_chunk(self) -> bytes:
        return self._chunk([], self.usage())


def _tool_call_out(call: ToolCall) -> ToolCallOut:
    return ToolCallOut.model_validate(call.wire())


class ChatFormat(Format):
    def _new_choice(self, index: int) -> Choice:
        job = self.job
        return Choice(index, lp=ChatLogprobs(content=[]) if job.logprobs is not None else None,
                      tools=ToolStream(job.tools) if job.tools is not None and job.stream
                      else None)

    def _logprobs(self, out: RequestOutput) -> list[ChatTokenLogprob]:
        top = self.job.logprobs or 0
        items = []
        for tid, lp, alts in self._token_logprobs(out):
            text, raw = self.texts(tid)
            listed = []
            for a, a_lp in alts[:top]:
                a_text, a_raw = self.texts(a)
                listed.append(TopLogprob(token=a_text, logprob=a_lp, bytes=a_raw))
            items.append(ChatTokenLogprob(token=text, logprob=lp, bytes=raw,
                                          top_logprobs=listed))
        return items

    def _finish_reason(self, choice: Choice, called: bool) -> str | None:
        """A choice that called tools and stopped says so (OpenAI: not for a named
        tool_choice, whose call was asked for)."""
        r = choice.finish_reason
        if called and r == "stop" and self.job.tool_calls_finish:
            return "tool_calls"
        return r

    def add(self, out: RequestOutput) -> None:
        choice = self._account(out)
        choice.text_parts.append(out.new_text)
        if choice.lp is not None and choice.lp.content is not None:
            choice.lp.content.extend(self._logprobs(out))

    def _message(self, choice: Choice) -> tuple[ChatResponseMessage, str | None]:
        text: str | None = "".join(choice.text_parts)
        calls: list[ToolCall] = []
        if self.job.tools is not None and text:
            text, calls = parse_tool_calls(self.job.tools, text)
        msg = ChatResponseMessage(content=text,
                                  tool_calls=[_tool_call_out(c) for c in calls])
        return msg, self._finish_reason(choice, bool(calls))

    def response(self) -> dict[str, Any]:
        choices = []
        for c in self.choices:
            msg, reason = self._message(c)
            choices.append(ChatChoice(index=c.index, message=msg, logprobs=c.lp,
                                      finish_reason=reason))
        return ChatCompletionResponse(
            id=self.job.request_id, created=self.created, model=self.model,
            choices=choices, usage=self.usage(), kv_transfer_params=self.kv_transfer_params,
        ).model_dump(mode="json")

    def _chunk(self, choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> bytes:
        return _frame(ChatCompletionChunk(id=self.job.request_id, created=self.created,
                                          model=self.model, choices=choices, usage=usage))

    def stream_start(self) -> list[bytes]:
        return [self._chunk([ChatStreamChoice(index=i,
                                              delta=DeltaMessage(role="assistant", content=""))])
                for i in range(self.job.params.n)]

    def _tool_delta(self, choice: Choice, text: str, final: bool) -> DeltaMessage:
        """The delta of ``text`` through the choice's tool-call parser."""
        assert choice.tools is not None
        done = len(choice.tools.calls)
        content, calls = choice.tools.feed(text)
        if final:
            more, last = choice.tools.finish()
            content, calls = content + more, calls + last
        deltas = [DeltaToolCall.model_validate(c.wire(done + k)) for k, c in enumerate(calls)]
        return DeltaMessage(content=content or None, tool_calls=deltas or None)

    def stream_chunk(self, out: RequestOutput) -> bytes | None:
        choice = self._account(out)
        lp = None
        if choice.lp is not None and out.new_token_ids:
            lp = ChatLogprobs(content=self._logprobs(out))
        if not out.new_token_ids and not out.new_text and not out.finished:
            return None  # one chunk per token, even one whose text is held back
        if choice.tools is not None:
            delta = self._tool_delta(choice, out.new_text, out.finished)
            if delta.content is None and delta.tool_calls is None and lp is None \
                    and not out.finished:
                return None  # held: it may be a call
            reason = (self._finish_reason(choice, bool(choice.tools.calls))
                      if out.finished else None)
            return self._chunk([ChatStreamChoice(index=choice.index, delta=delta,
                                                 logprobs=lp, finish_reason=reason)])
        if lp is None and not out.finished:  # a token (or text) to send
            if choice.text_frame is None:
                choice.text_frame = TextFrame(self._chunk(
                    [ChatStreamChoice(index=choice.index,
                                      delta=DeltaMessage(content=_TEXT_MARK))]))
            return choice.text_frame(out.new_text)
        reason = choice.finish_reason if out.finished else None
        delta = (DeltaMessage(content=out.new_text) if out.new_text or out.new_token_ids
                 else DeltaMessage())
        return self._chunk([ChatStreamChoice(index=choice.index, delta=delta, logprobs=lp,
                                             finish_reason=reason)])

    def stream_finish(self, reason: str) -> bytes:
        open_ = [c for c in self.choices if c.finish_reason is None]
        for c in open_:
            c.finish_reason = reason
        return self._chunk([ChatStreamChoice(index=c.index, delta=DeltaMessage(),
                                             finish_reason=reason) for c in open_])

    def usage_chunk(self) -> bytes:
        return self._chunk([], self.usage())
