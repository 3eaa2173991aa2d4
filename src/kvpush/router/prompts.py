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
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from kvpush.router.answers import fetch
from kvpush.router.pool import Pool, describe_error

if TYPE_CHECKING:
    import httpx

    from kvpush.router.config import RouterConfig

logger = logging.getLogger("kvpush.router")


class TokenizerState(enum.Enum):
    NONE = "none"  # not loaded yet
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"


class _Card(msgspec.Struct):
    id: str = ""
    root: str | None = None
    max_model_len: int | None = None


class _Models(msgspec.Struct):
    data: list[_Card]


def first_model(answer: bytes) -> tuple[str | None, str | None, int]:
    """A ``/v1/models`` answer's first model (kvpush's and vLLM's alike): the tokenizer
    to load (its directory when it exists on this host, else its id), its name, and its
    context (0: not said). None for what the answer does not name; ValueError when it
    is not such an answer."""
    try:
        card = msgspec.json.decode(answer, type=_Models).data[0]
    except (msgspec.DecodeError, IndexError) as e:
        raise ValueError(f"not a /v1/models answer: {e}") from None
    name = card.id or None
    source = card.root if card.root and Path(card.root).is_dir() else name
    return source, name, max(card.max_model_len or 0, 0)


class PromptTokenizer:
    """The model's tokenizer as the router loads it (``load``), and what it knows of the
    model from ``/v1/models``."""

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

    async def load(self, source: str | None) -> bool:
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
            tok = await asyncio.get_running_loop().run_in_executor(None, load_tokenizer, src)
        except Exception as e:  # noqa: BLE001 - said: the router serves nothing
            self.state, self.why = TokenizerState.FAILED, f"{type(e).__name__}: {e}"
            logger.warning("cannot load the tokenizer %s (%s): the router cannot serve "
                           "(give it --tokenizer)", src, self.why)
            return False
        self._tok, self.source, self.state = tok, src, TokenizerState.READY
        logger.info("tokenizer %s loaded", src)
        return True


async def load_model_tokenizer(tok: PromptTokenizer, cfg: RouterConfig, pool: Pool,
                               client: httpx.AsyncClient) -> None:
    """Load ``tok``: --tokenizer, else the model a healthy (proven) decode instance's
    /v1/models names (with --discover, asked again until a decode has joined)."""
    import httpx

    source = None
    while True:
        for inst in pool.by_role["decode"]:
            if not inst.healthy:  # proven first: an unproven URL gets no API key
                continue
            try:
                # (whole within the deadline and the health answers' cap)
                r = await fetch(client, "GET", inst.url + "/v1/models", cfg.health_timeout_s)
                if r.status_code != 200:
                    raise ValueError(f"HTTP {r.status_code}")
                source, name, context = first_model(r.content)
            except (httpx.HTTPError, ValueError) as e:
                logger.info("/v1/models of %s: %s", inst.url, describe_error(e))
                continue
            tok.max_model_len = max(tok.max_model_len, context)
            tok.served_model = tok.served_model or name
            if source is not None:
                break
        if source is not None or cfg.tokenizer or cfg.discover is None:
            break
        # --discover: no decode has joined yet; ask again when one may have
        await asyncio.sleep(cfg.health_interval_s)
    await tok.load(source)
