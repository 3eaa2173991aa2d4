"""What crosses from rank 0 to the other tensor-parallel ranks.

At start-up, a :class:`RankSetup` pickled on the rank's stdin (as the engine core gets
its own: the config never appears on a command line). Then, per step, one msgspec
msgpack :data:`RankMessage` on a ZMQ PAIR socket per rank (``ipc://`` in rank 0's private
folder, kvpush.engine.tp.group): :class:`RankStep` with the step's chunks as plain data
(token ids, positions, block tables, which request, whether its last token is sampled,
its ``max_tokens`` for the dense decode cache), or :class:`RankStop`. Sampling
parameters stay on rank 0, which alone samples. Every rank runs the same forward pass
over the same chunks (``ModelRunner.run_chunks``), so the ranks' collectives line up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from kvpush.config import EngineConfig


class StepChunk(msgspec.Struct, array_like=True, frozen=True):
    """One request's tokens in a step (``scheduler.ScheduledChunk`` without sampling)."""

    request_id: str
    token_ids: list[int]
    start_pos: int  # position of token_ids[0]
    block_ids: list[int]  # the request's whole block table: the same ids on every rank
    sample: bool  # rank 0 samples after this chunk's last token
    max_tokens: int  # the request's max_tokens (how long its dense decode entry grows)


class RankStep(msgspec.Struct, tag="step", array_like=True, frozen=True):
    chunks: list[StepChunk]


class RankStop(msgspec.Struct, tag="stop", array_like=True, frozen=True):
    """Rank 0 is stopping cleanly: leave the process group and exit 0."""


RankMessage = RankStep | RankStop


@dataclass(frozen=True)
class RankSetup:
    """Everything a rank process needs to join (pickled on its stdin)."""

    #: the instance's config, with this rank's device and without the KV transfer
    #: settings (no cluster secret: the ranks never talk to peers)
    config: EngineConfig
    rank: int
    #: rank 0's FileStore in its private folder (start-up reports, the process group's
    #: rendezvous)
    store_path: str
    #: rank 0's PAIR socket for this rank's plans
    plan_address: str
    #: the instance's random token: the rank's first message on each of its sockets
    token: bytes
    log_level: str = "INFO"
    #: P/D instances: rank 0's PAIR socket for this rank's KV posts (kv_ranks.py), the
    #: links that build its transport, and the instance's engine id (None: no KV transfer)
    kv_address: str | None = None
    links: Any = None
    engine_id: str = ""
