"""What the KV connector asks of the engine after the transfer thread's word: the
engine takes these from ``KVConnector.take_actions`` and applies them to its requests."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EmitFirstToken:
    request_id: str


@dataclass(frozen=True, slots=True)
class FailRequest:
    request_id: str
    why: str


@dataclass(frozen=True, slots=True)
class RejectRequest:
    """A 400 (``code``, e.g. ``prefill_not_needed``), not a 5xx."""

    request_id: str
    why: str
    code: str | None = None


@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: str
    why: str


EngineAction = EmitFirstToken | FailRequest | RejectRequest | AbortRequest
