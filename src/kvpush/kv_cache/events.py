"""Prefix-cache change events, as instances publish them to the router (issue 31).

A minimal copy written by the router part to the shared interface; the events part owns
the real module (the main session keeps that one).

Wire: one ZMQ frame pair per batch on a PUB socket, ``[b"kv", payload]``, the payload a
msgpack-encoded, tagged :class:`KVEventBatch`. ``seq`` starts at 1 and grows by one per
batch for the life of the instance, so a subscriber sees a gap as a jump in ``seq`` and
a restart as a new ``engine_id``.
"""

from __future__ import annotations

import msgspec

#: the topic frame every batch is published under
TOPIC = b"kv"


class BlockStored(msgspec.Struct, tag=True):
    """Full blocks newly cached, by chained block hash, in chain order."""

    hashes: list[bytes]


class BlockRemoved(msgspec.Struct, tag=True):
    """Cached blocks evicted."""

    hashes: list[bytes]


class AllBlocksCleared(msgspec.Struct, tag=True):
    """The whole prefix cache was dropped."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, tag=True):
    engine_id: str
    seq: int
    events: list[KVEvent]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(data: bytes) -> KVEventBatch:
    """The batch in ``data`` (msgspec.DecodeError / ValidationError when malformed)."""
    return _decoder.decode(data)
