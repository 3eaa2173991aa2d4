"""The streamed text chunks' fast frames (one template per request, the text JSON-encoded
into it) are byte for byte what the pydantic models would have dumped, for completions
and chat, whatever the text holds; chunks with logprobs or a finish reason keep the
models' own path."""

from __future__ import annotations

import json

import pytest

from kvpush.engine.outputs import FinishReason, RequestOutput
from kvpush.sampling_params import SamplingParams
from kvpush.server.formats import ChatFormat, CompletionFormat, _frame
from kvpush.server.protocol import (
    ChatCompletionChunk,
    ChatStreamChoice,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    Job,
)

TEXTS = ["", "hi", ' a"b\\c', "é✓😀", "\x00\x01\x1f\x7f", "\u2028\u2029", "</script>",
         "\n\t\r\b\f", "@@kvpush-text@@", "data: [DONE]\n\n"]


def _job(logprobs: bool = False) -> Job:
    params = SamplingParams(max_tokens=16, logprobs=logprobs, top_logprobs=0)
    return Job("req-1", [1, 2, 3], params, 0.0, True, False)


def _texts(tid: int) -> tuple[str, list[int]]:
    return f"t{tid}", list(f"t{tid}".encode())


@pytest.mark.parametrize("text", TEXTS)
def test_completion_text_frames_match_the_models(text):
    fmt = CompletionFormat(_job(), "m", _texts)
    first = fmt.stream_chunk(RequestOutput("req-1", [7], "x"))  # builds the template
    frame = fmt.stream_chunk(RequestOutput("req-1", [8], text))
    want = _frame(CompletionResponse(id="req-1", created=fmt.created, model="m",
                                     choices=[CompletionChoice(text=text)]))
    assert frame == want
    assert json.loads(first[6:])["choices"][0]["text"] == "x"
    assert fmt.num_tokens == 2


@pytest.mark.parametrize("text", TEXTS)
def test_chat_text_frames_match_the_models(text):
    fmt = ChatFormat(_job(), "m", _texts)
    fmt.stream_chunk(RequestOutput("req-1", [7], "x"))
    frame = fmt.stream_chunk(RequestOutput("req-1", [8], text))
    want = _frame(ChatCompletionChunk(
        id="req-1", created=fmt.created, model="m",
        choices=[ChatStreamChoice(delta=DeltaMessage(content=text))]))
    assert frame == want


def test_last_chunk_and_logprob_chunks_keep_the_model_path():
    fmt = ChatFormat(_job(), "m", _texts)
    last = fmt.stream_chunk(RequestOutput("req-1", [9], "end", finished=True,
                                          finish_reason=FinishReason.LENGTH))
    choice = json.loads(last[6:])["choices"][0]
    assert choice["finish_reason"] == "length" and choice["delta"] == {"content": "end"}
    fmt = CompletionFormat(_job(logprobs=True), "m", _texts)
    frame = fmt.stream_chunk(RequestOutput("req-1", [5], "t5", new_logprobs=[-0.5]))
    choice = json.loads(frame[6:])["choices"][0]
    assert choice["logprobs"]["tokens"] == ["t5"]
    assert choice["logprobs"]["token_logprobs"] == [-0.5]
