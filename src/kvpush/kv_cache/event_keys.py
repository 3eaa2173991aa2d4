"""EventKeys: what makes an instance's KV-event stream useless to a non-member.

The events name cached blocks by their chained hashes. Unkeyed, anyone who can read them
can test guesses (hash a candidate prompt, look for its chain): a prompt with a 4-digit
PIN fell to 10,000 guesses in 1.6 s. With the cluster secret, an instance publishes
``tag(h)`` instead, a keyed BLAKE2b of each hash under a key derived from the secret
(and serves the same tags at ``/kv/cache_blocks``); the router, which holds the same
derived keys, tags the prompt chain it looks up. The PUB socket is a CURVE server
(kvpush.crypto.curve, its own key pairs, ZAP admitting the member key), so only a
member can subscribe at all. Neither key is the secret: a router holding them can
neither sign side-channel messages nor grants with them.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from kvpush.crypto.curve import CurveKeys, derive_curve_keys
from kvpush.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

#: bytes of a published tag (a block hash is 16)
TAG_BYTES = 16


@dataclass(frozen=True, repr=False)
class EventKeys:
    hash_key: bytes
    curve: CurveKeys

    def __repr__(self) -> str:  # never show a key
        return "EventKeys(...)"

    @classmethod
    def from_secret(cls, secret: bytes) -> EventKeys:
        key = hmac.new(secret, b"kvpush kv events hash v1", hashlib.sha256).digest()
        return cls(key, derive_curve_keys(secret, b"kv events"))

    def tag(self, h: bytes) -> bytes:
        """The published name of block hash ``h``."""
        return hashlib.blake2b(h, key=self.hash_key, digest_size=TAG_BYTES).digest()

    def tag_events(self, events: list[KVEvent]) -> list[KVEvent]:
        out: list[KVEvent] = []
        for ev in events:
            if isinstance(ev, BlockStored):
                out.append(BlockStored([self.tag(h) for h in ev.hashes]))
            elif isinstance(ev, BlockRemoved):
                out.append(BlockRemoved([self.tag(h) for h in ev.hashes]))
            else:
                assert isinstance(ev, AllBlocksCleared)
                out.append(ev)
        return out
