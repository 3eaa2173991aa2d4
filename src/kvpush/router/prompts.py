"""The router's tokenizer: the model's, loaded once, for its front (kvpush.router.front),
which renders chats and tokenizes every request with it as an instance would.

Where it comes from: ``--tokenizer PATH_OR_NAME``, else the model the decode instances
serve, as their ``GET /v1/models`` says (``root``: the model directory, which ``kvpush
up`` and a single-host cluster share; else the model's ``id``). It is loaded in the
background after start-up with the instances' own code
(``kvpush.models.tokenizer.load_tokenizer``), so the router's token ids are the
instances' token ids. Until it has loaded, requests wait (then 503 "starting"); a
router that cannot load it says why and serves nothing.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

logger = logging.getLogger("kvpush.router")

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


def model_id(models: Any) -> str | None:
    """The served model's name in a ``/v1/models`` answer (None: it names none)."""
    try:
        mid = models["data"][0].get("id")
    except (KeyError, IndexError, TypeError, AttributeError):
        return None
    return mid if isinstance(mid, str) and mid else None


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
        #: the model's name as a decode's /v1/models said it (its ``id``)
        self.served_model: str | None = None
        self.state = TokenizerState.NONE
        self.why: str | None = None
        self._tok: Any = None
        #: the model's context (0: unknown), as /v1/models or /kv/info said it
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
            logger.warning("no tokenizer (%s): the router cannot serve (give it "
                           "--tokenizer)", self.why)
            return False
        self.state = TokenizerState.LOADING
        from kvpush.models.tokenizer import load_tokenizer

        try:
            tok = await asyncio.get_running_loop().run_in_executor(executor, load_tokenizer,
                                                                    src)
        except Exception as e:  # noqa: BLE001 - the router works without one
            self.state, self.why = TokenizerState.FAILED, f"{type(e).__name__}: {e}"
            logger.warning("cannot load the tokenizer %s (%s): the router cannot serve "
                           "(give it --tokenizer)", src,
                           self.why)
            return False
        self._tok, self.source, self.state = tok, src, TokenizerState.READY
        logger.info("tokenizer %s loaded", src)
        return True

    def use(self, tokenizer: Any, source: str = "given") -> None:
        """Use an already loaded tokenizer (tests)."""
        self._tok, self.source, self.state = tokenizer, source, TokenizerState.READY
