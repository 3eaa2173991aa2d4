"""The router's tokenizer: each request is tokenized once, here, to know which instance
already holds its prefix.

Where the tokenizer comes from: ``--tokenizer PATH_OR_NAME``, else the model the decode
instances serve, as their ``GET /v1/models`` says (``root``: the model directory, which
``kvpush up`` and a single-host cluster share; else the model's ``id``). It is loaded
once, in the background after start-up, with the instances' own code
(``kvpush.engine.llm_engine.load_tokenizer``, chat templates by
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


class PromptTokenizer:
    """Token ids of a request's prompt, once a tokenizer is loaded (``load``)."""

    def __init__(self, source: str | None = None) -> None:
        #: --tokenizer, or what /v1/models named
        self.source = source
        self.state = TokenizerState.NONE
        self.why: str | None = None
        self._tok: Any = None

    @property
    def ready(self) -> bool:
        return self.state is TokenizerState.READY

    async def load(self, source: str | None, executor: Executor | None = None) -> bool:
        """Load ``source`` (the --tokenizer flag wins over it) on a worker thread; logs
        and returns False when it cannot."""
        src = self.source or source
        if src is None:
            self.state, self.why = TokenizerState.FAILED, "no instance named its model"
            logger.warning("no tokenizer (%s): routing without the prefix caches", self.why)
            return False
        self.state = TokenizerState.LOADING
        from kvpush.engine.llm_engine import load_tokenizer

        try:
            tok = await asyncio.get_running_loop().run_in_executor(executor, load_tokenizer,
                                                                    src)
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
