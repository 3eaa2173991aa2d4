"""KV cache events: what an instance's prefix cache gained and lost, for the router.

An instance with prefix caching publishes every change of its cache on a ZMQ PUB socket
(its address: ``/kv/info`` → ``kv_events.endpoint``), one message per batch::

    [b"kv", encode_batch(KVEventBatch(engine_id, seq, events))]

- ``BlockStored(hashes)``: full blocks newly findable by these hashes, in chain order
  (each hash is ``hash_prefix_blocks`` of the tokens up to the end of its block, so a
  subscriber that computes the same chain from a prompt finds its cached prefix).
- ``BlockRemoved(hashes)``: blocks evicted (their slot reused): no longer findable.
- ``AllBlocksCleared()``: the whole cache was dropped (what is still cached, if
  anything, follows in a ``BlockStored`` of the same batch).

``seq`` starts at 1 and grows by one per batch for the life of the instance (a restart
shows as a new ``engine_id``). A subscriber that sees a gap, or has just connected, takes
the snapshot ``GET /kv/cache_blocks`` (every hash cached as of batch ``seq`` S) and
applies the batches with seq > S. Events apply in order; a hash stored twice without a
removal in between does not happen (the pool caches one block per hash).

msgpack on the wire, tagged structs (field ``type``), as the side channel's messages.
"""

from __future__ import annotations

import msgspec

#: The ZMQ topic frame that comes before every batch.
TOPIC = b"kv"


class BlockStored(msgspec.Struct, tag=True):
    """Full blocks newly cached, by their chained block hash, in chain order."""

    hashes: list[bytes]


class BlockRemoved(msgspec.Struct, tag=True):
    """Cached blocks evicted: their hashes no longer hit."""

    hashes: list[bytes]


class AllBlocksCleared(msgspec.Struct, tag=True):
    """Every cached block dropped (reset of the prefix cache)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, tag=True):
    """The events of one or more engine steps, numbered ``seq`` (1, 2, ...)."""

    engine_id: str
    seq: int
    events: list[KVEvent]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    """The payload frame of ``batch`` (msgpack)."""
    return _encoder.encode(batch)


def decode_batch(data: bytes) -> KVEventBatch:
    """A payload frame back into its batch (msgspec.DecodeError / ValidationError if it
    is not one)."""
    return _decoder.decode(data)


def apply_events(cached: set[bytes], events: list[KVEvent]) -> None:
    """Apply ``events`` in order to the set of cached hashes ``cached`` (in place): what
    the publisher's snapshot and any subscriber's index do with a batch."""
    for ev in events:
        match ev:
            case BlockStored(hashes):
                cached.update(hashes)
            case BlockRemoved(hashes):
                cached.difference_update(hashes)
            case AllBlocksCleared():
                cached.clear()
