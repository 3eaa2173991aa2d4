"""RouterKeys: what the router holds of the cluster secret (issue 40, finding 7).

The router signs grants (``kv_transfer_params``, ``/kv/abort``) and follows members-only
KV events; it needs nothing else of the secret. So it keeps only the keys derived for
those two uses: the grant key (grants.py) and the event keys (kv_cache/event_keys.py).
Neither lets anyone join the side channel (CURVE keys and message MACs come from the
secret by other derivations), so a compromised router is not a side-channel member.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpush.kv_cache.event_keys import EventKeys
from kvpush.kv_transfer.grants import grant_key


@dataclass(frozen=True, repr=False)
class RouterKeys:
    grant_key: bytes
    events: EventKeys

    def __repr__(self) -> str:  # never show a key
        return "RouterKeys(...)"

    @classmethod
    def from_secret(cls, secret: bytes) -> RouterKeys:
        return cls(grant_key(secret), EventKeys.from_secret(secret))
