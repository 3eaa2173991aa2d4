"""A prompt string too long for the context by its size alone is refused before it is
tokenized (issue 67, point 6): a 20 MB prompt once cost the router 22.7 s of tokenizer
time before its 400."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from kvpush.models.tokenizer import load_tokenizer, max_token_bytes
from kvpush.server.chat import PromptBuilder
from kvpush.server.errors import APIError
from kvpush.server.protocol import ChatCompletionRequest, CompletionRequest

MAX_LEN = 256


class CountingTokenizer:
    """The real tokenizer, counting the texts it is asked to encode."""

    def __init__(self, tok) -> None:
        self.tok, self.encoded = tok, 0

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def encode(self, text, **kw):
        self.encoded += 1
        return self.tok.encode(text, **kw)


def test_a_prompt_too_long_by_its_size_is_refused_untokenized(tiny_llama):
    tok = CountingTokenizer(load_tokenizer(tiny_llama))
    per = max_token_bytes(tok)
    assert per > 0
    with ThreadPoolExecutor(1) as pool:
        builder = PromptBuilder(tok, "m", MAX_LEN, tok.tok.vocab_size, pool)
        fits = "hello " * 10
        assert builder.completion_job(CompletionRequest(prompt=fits, max_tokens=4),
                                      "a", 0.0).prompt_ids
        assert tok.encoded == 1
        huge = "x" * (per * MAX_LEN)  # at least MAX_LEN tokens, whatever the text
        with pytest.raises(APIError, match="by its size alone") as e:
            builder.completion_job(CompletionRequest(prompt=huge), "b", 0.0)
        assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
        chat = ChatCompletionRequest(messages=[{"role": "user", "content": huge[:-per]},
                                               {"role": "user", "content": "y" * per}])
        with pytest.raises(APIError, match="by its size alone") as e:
            builder.chat_job(chat, "c", 0.0)
        assert e.value.param == "messages"
        assert tok.encoded == 1  # neither was tokenized
