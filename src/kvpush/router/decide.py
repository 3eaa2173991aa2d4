"""The cache-aware policy: which decode, which prefill, and whether a prefill leg is
worth sending at all (docs/ROUTER.md, "Cache-aware routing").

Each instance's cost is the prompt tokens it would still have to compute, plus its
load: ``load_cost_tokens`` for each leg it has in flight and ``load_weight`` for each
KV token its decode legs in flight will hold (their prompts and answers)::

    cost(i) = (prompt_tokens - cached_tokens(i)) + load_cost_tokens * in_flight(i)
              + load_weight * tokens_in_flight(i)
              (+ FULL_COST when i has no room for the prompt)

An instance has no room when its engine core's latest snapshot shows fewer free KV
blocks than the prompt fills (``lacks_room``): such an instance is chosen only when
every instance is as full, and then by the same cost.

Decode is the healthy decode instance of lowest cost (ties in round-robin order). It
gets the request alone, without ``kv_transfer_params``, and computes the rest itself
from its prefix cache (decision ``local``) when what it still lacks is at most
``local_prefill_max_tokens`` *and* it holds more of the prompt than the prefill instance
would (or lacks at most ``LOCAL_ALWAYS_TOKENS``): a local prefill only pays where decode
has KV no prefill has, such as the answer it decoded in a conversation. Where both hold
as much (a fresh prompt, or a prefix both cached), the prefill instance's core does the
same work without stalling decode's running streams. Otherwise a prefill leg goes too,
to the prefill instance of lowest cost by its own cache (decision ``remote``), and
decode skips the blocks it has.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvpush.kv_cache.block_pool import BlockHash, hash_prefix_blocks

#: the answer length assumed for a request that names none (OpenAI's chat default is
#: "up to the context"; this is what the load counts for it)
DEFAULT_ANSWER_TOKENS = 256


class Decision(str, enum.Enum):
    LOCAL = "local"  # decode alone, computing the uncached part itself
    REMOTE = "remote"  # a prefill leg as well (push or pull)


DECISIONS = tuple(d.value for d in Decision)


@dataclass(eq=False)
class Route:
    """A tokenized request's routing facts (the request log line's ``decision``,
    ``prompt_tokens``, ``d_cached``, ``p_cached``)."""

    token_ids: list[int]
    #: the request's cache_salt: its chain is salted as the instances salt theirs
    cache_salt: str | None = None
    #: the answer's length bound (the request's max_tokens): with the prompt, the KV its
    #: decode leg may come to hold (the load the policy counts)
    answer_tokens: int = DEFAULT_ANSWER_TOKENS
    decision: Decision = Decision.REMOTE
    d_cached_tokens: int | None = None
    p_cached_tokens: int | None = None
    #: the local leg was refused (decode full) and the request went remote instead
    local_refused: bool = False
    _chains: dict[int, list[BlockHash]] = field(default_factory=dict, repr=False)

    @property
    def prompt_tokens(self) -> int:
        return len(self.token_ids)

    def chain(self, block_size: int) -> list[BlockHash]:
        """The prompt's full-block hashes for ``block_size`` (computed once per size)."""
        c = self._chains.get(block_size)
        if c is None:
            c = self._chains[block_size] = hash_prefix_blocks(self.token_ids, block_size,
                                                              self.cache_salt)
        return c

    def cached_tokens(self, blocks: int, block_size: int) -> int:
        return min(self.prompt_tokens, blocks * block_size)


def cost(prompt_tokens: int, cached_tokens: int, in_flight: int,
         load_cost_tokens: int, tokens_in_flight: int = 0,
         load_weight: float = 0.0) -> float:
    """Tokens left to compute, plus the load, in tokens."""
    return float(prompt_tokens - cached_tokens + load_cost_tokens * in_flight
                 + load_weight * tokens_in_flight)


#: added to the cost of an instance without room for the prompt (``lacks_room``): more
#: than any prompt's tokens and load, so every instance with room comes first
FULL_COST = 1e9


def lacks_room(prompt_tokens: int, num_free_blocks: int, block_size: int) -> bool:
    """Whether ``num_free_blocks`` free blocks cannot hold the prompt now: every block
    the prompt fills counts, its cached ones too (the free blocks include cached blocks
    no request uses, and the scheduler takes a hit on one out of them)."""
    return num_free_blocks < -(-prompt_tokens // block_size)


#: a decode that lacks at most this many tokens computes them itself even when a
#: prefill instance holds as much of the prompt (docs/ROUTER.md, the threshold's table)
LOCAL_ALWAYS_TOKENS = 16


def decide(prompt_tokens: int, d_cached_tokens: int, p_cached_tokens: int | None,
           local_prefill_max_tokens: int) -> Decision:
    """``local`` when decode lacks at most ``local_prefill_max_tokens`` of the prompt and
    holds more of it than the prefill instance would (``p_cached_tokens``; None: no
    healthy prefill instance), or lacks at most ``LOCAL_ALWAYS_TOKENS``."""
    lacks = prompt_tokens - d_cached_tokens
    if lacks > local_prefill_max_tokens:
        return Decision.REMOTE
    if (p_cached_tokens is None or d_cached_tokens > p_cached_tokens
            or lacks <= LOCAL_ALWAYS_TOKENS):
        return Decision.LOCAL
    return Decision.REMOTE

