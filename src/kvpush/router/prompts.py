"""The router's tokenizer: each request is tokenized once, here, to know which instance
already holds its prefix.

Where the tokenizer comes from: ``--tokenizer PATH_OR_NAME``, else the model the decode
instances serve, as their ``GET /v1/models`` says (``root``: the model directory, which
``kvpush up`` and a single-host cluster share; else the model's ``id``). It is loaded
once, in the background after start-up, with the instances' own code
(``kvpush.models.tokenizer.load_tokenizer``, chat templates by
``kvpush.server.chat``), so the router's token ids are the instances' token ids. A
router that cannot load it logs why and routes as before it had one (no cache-aware
choice, a prefill leg for every request).

What goes on the wire. A completion's string prompt is sent on as its token ids (the
instances skip tokenizing it; the answer's shape does not change). A chat request is
sent on as the client sent it: turning it into a completion would change the answer's
shape (``chat.completion`` objects, ``delta`` frames), so its ids serve the routing only
and each instance renders the template itself, with the same tokenizer, to the same ids.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

from kvpush.models.tokenizer import max_token_bytes, tokens_at_least

logger = logging.getLogger("kvpush.router")

#: bodies above this size are tokenized on a worker thread (as the instances do:
#: kvpush.server.chat.INLINE_BODY_BYTES)
INLINE_BODY_BYTES = 4096


class TokenizerState(enum.Enum):
    NONE = "none"  # not loaded yet
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"


def model_source(models: Any) -> str | None:
    """The tokenizer to load from a ``/v1/models`` answer: the model's directory when it
    exists on this host, else its id (None: the answer names no model)."""
    try:
        card = models["data"][0]
    except (KeyError, IndexError, TypeError):
        return None
    root = card.get("root") if isinstance(card, dict) else None
    if isinstance(root, str) and root and Path(root).is_dir():
        return root
    mid = card.get("id") if isinstance(card, dict) else None
    return mid if isinstance(mid, str) and mid else None


def prompt_text_bytes(kind: str, body: dict[str, Any]) -> int:
    """UTF-8 bytes of the text a prompt carries (completion prompt strings, chat message
    contents; token id lists count 0): a lower bound on what the tokenizer gets."""
    def size(text: Any) -> int:
        return len(text.encode("utf-8", "replace")) if isinstance(text, str) else 0

    if kind == "chat":
        total = 0
        messages = body.get("messages")
        for msg in messages if isinstance(messages, list) else ():
            content = msg.get("content") if isinstance(msg, dict) else None
            if isinstance(content, list):
                total += sum(size(part.get("text")) for part in content
                             if isinstance(part, dict))
            else:
                total += size(content)
        return total
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return sum(size(p) for p in prompt)
    return size(prompt)


def prompt_too_long(kind: str, body: dict[str, Any], max_token_bytes: int,
                    max_model_len: int) -> str | None:
    """Why a prompt is too long for the model, judged by its size alone (no
    tokenizing), or None. No token of the vocabulary spells more than
    ``max_token_bytes`` bytes, so a text of B bytes is at least ceil(B /
    max_token_bytes) tokens; above ``max_model_len`` no instance could take it."""
    if max_token_bytes < 1 or max_model_len < 1:
        return None
    at_least = tokens_at_least(prompt_text_bytes(kind, body), max_token_bytes)
    if at_least <= max_model_len:
        return None
    return (f"the prompt is too long: its text alone is at least {at_least} tokens, and "
            f"the model's context is {max_model_len} tokens")


def model_max_len(models: Any) -> int:
    """The model's context from a ``/v1/models`` answer (kvpush and vLLM both say
    ``max_model_len``), 0 when it does not say."""
    try:
        n = models["data"][0].get("max_model_len")
    except (KeyError, IndexError, TypeError, AttributeError):
        return 0
    return n if isinstance(n, int) and n > 0 else 0


class PromptTokenizer:
    """Token ids of a request's prompt, once a tokenizer is loaded (``load``)."""

    def __init__(self, source: str | None = None) -> None:
        #: --tokenizer, or what /v1/models named
        self.source = source
        self.state = TokenizerState.NONE
        self.why: str | None = None
        self._tok: Any = None
        #: the longest token in UTF-8 bytes (0: unknown), and the model's context
        #: (0: unknown; from /v1/models): a prompt is refused by its size when its text
        #: alone would exceed the context (``prompt_too_long``)
        self.max_token_bytes = 0
        self.max_model_len = 0

    @property
    def ready(self) -> bool:
        return self.state is TokenizerState.READY

    @property
    def tokenizer(self) -> Any:
        """The loaded tokenizer (None until ``ready``)."""
        return self._tok

    async def load(self, source: str | None, executor: Executor | None = None) -> bool:
        """Load ``source`` (the --tokenizer flag wins over it) on a worker thread; logs
        and returns False when it cannot."""
        src = self.source or source
        if src is None:
            self.state, self.why = TokenizerState.FAILED, "no instance named its model"
            logger.warning("no tokenizer (%s): routing without the prefix caches", self.why)
            return False
        self.state = TokenizerState.LOADING
        from kvpush.models.tokenizer import load_tokenizer

        try:
            tok = await asyncio.get_running_loop().run_in_executor(executor, load_tokenizer,
                                                                    src)
            self.max_token_bytes = max_token_bytes(tok)
        except Exception as e:  # noqa: BLE001 - the router works without one
            self.state, self.why = TokenizerState.FAILED, f"{type(e).__name__}: {e}"
            logger.warning("cannot load the tokenizer %s (%s): routing without the prefix "
                           "caches (round-robin, a prefill leg for every request)", src,
                           self.why)
            return False
        self._tok, self.source, self.state = tok, src, TokenizerState.READY
        logger.info("tokenizer %s loaded: routing on the instances' prefix caches", src)
        return True

    def use(self, tokenizer: Any, source: str = "given") -> None:
        """Use an already loaded tokenizer (tests)."""
        self._tok, self.source, self.state = tokenizer, source, TokenizerState.READY
        self.max_token_bytes = max_token_bytes(tokenizer)

    def too_long(self, kind: str, body: dict[str, Any]) -> str | None:
        """Why the prompt cannot fit the model, by its size (see ``prompt_too_long``)."""
        if not self.ready:
            return None
        return prompt_too_long(kind, body, self.max_token_bytes, self.max_model_len)

    async def prompt_ids(self, kind: str, body: dict[str, Any], body_bytes: int,
                         executor: Executor | None = None) -> list[int] | None:
        """The prompt's token ids, as the instances will compute them, or None when
        there is no tokenizer or the body is not one the router can tokenize (the
        instance will judge it)."""
        if not self.ready:
            return None
        if body_bytes <= INLINE_BODY_BYTES:
            return self._ids(kind, body)
        return await asyncio.get_running_loop().run_in_executor(executor, self._ids, kind,
                                                                body)

    def _ids(self, kind: str, body: dict[str, Any]) -> list[int] | None:
        from kvpush.server import chat

        try:
            if kind == "chat":
                from kvpush.server.protocol import ChatCompletionRequest

                req = ChatCompletionRequest.model_validate(body)
                return chat.encode_chat(self._tok, chat.normalize_messages(req.messages))
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0],
                                                                            (str, list)):
                prompt = prompt[0]
            if isinstance(prompt, str):
                return chat.encode_text(self._tok, prompt, add_special_tokens=True) or None
            if (isinstance(prompt, list) and prompt
                    and all(type(t) is int for t in prompt)):
                return list(prompt)
            return None
        except Exception as e:  # noqa: BLE001 - a body the instance will answer 400 to
            logger.debug("not tokenized (%s): routed without the prefix caches", e)
            return None
