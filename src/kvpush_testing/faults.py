"""FaultPlan: injected failures shared by the in-process transport and the side channel.

One plan object is handed to every component that should misbehave (an
``InProcTransport``, a ``SideChannel``); tests arm it, run the protocol, and then
assert on :attr:`FaultPlan.injected` that the fault really happened. All methods are
thread-safe (one lock per plan).

Knobs (all may be changed at any time with :meth:`FaultPlan.arm`):

* ``fail_posts``: the next N ``post`` calls raise ``TransferPostError``.
* ``fail_transfers``: the next N posted transfers end ``FAILED`` (nothing is written).
* ``corrupt_transfers``: the next N transfers land with one byte changed (the first
  byte of their first range, inverted), and end ``DONE``.
* ``fail_post_every``: every Nth ``post`` raises ``TransferPostError`` (0: none).
* ``transfer_delay_s``: every transfer completes this long after its post.
* ``transfer_jitter_s``: plus a random share of this (``seed``): transfers complete,
  and land, out of the order they were posted in.
* ``drop_messages``: message type name -> how many of the next such messages to drop
  on send; the key ``"*"`` matches any type.
* ``message_delay_s``: every sent message is held this long before it goes out.

Counter keys in :attr:`FaultPlan.injected`: ``"post_failures"``,
``"transfer_failures"``, ``"corruptions"``, ``"transfer_delays"``, ``"message_delays"`` and
``"message_drops"`` plus ``"message_drops:<type>"`` per type.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

ANY_MESSAGE = "*"


@dataclass
class FaultPlan:
    """A shared, thread-safe set of faults to inject, with counts of what was injected."""

    fail_posts: int = 0
    fail_post_every: int = 0
    fail_transfers: int = 0
    corrupt_transfers: int = 0
    transfer_delay_s: float = 0.0
    transfer_jitter_s: float = 0.0
    seed: int = 0
    drop_messages: dict[str, int] = field(default_factory=dict)
    message_delay_s: float = 0.0
    injected: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    _posts: int = field(default=0, repr=False, compare=False)
    _rng: random.Random = field(default_factory=random.Random, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._rng.seed(self.seed)

    def arm(self, **knobs: Any) -> None:
        """Set knobs atomically, e.g. ``plan.arm(fail_posts=1, message_delay_s=0.05)``."""
        with self._lock:
            for key, value in knobs.items():
                if key.startswith("_") or key in ("injected", "seed") or not hasattr(self, key):
                    raise AttributeError(f"unknown fault knob {key!r}")
                setattr(self, key, dict(value) if key == "drop_messages" else value)

    def clear(self) -> None:
        """Disarm every fault (the injected counts are kept)."""
        self.arm(
            fail_posts=0,
            fail_post_every=0,
            fail_transfers=0,
            corrupt_transfers=0,
            transfer_delay_s=0.0,
            transfer_jitter_s=0.0,
            drop_messages={},
            message_delay_s=0.0,
        )

    def count(self, kind: str) -> int:
        """How many faults of ``kind`` (a counter key, see module docstring) were injected."""
        with self._lock:
            return self.injected[kind]

    # -- consulted by the transports --------------------------------------------------

    def _take(self, knob: str, kind: str) -> bool:
        """True (and one fewer ``knob`` armed, one more ``kind`` injected) if armed."""
        with self._lock:
            if getattr(self, knob) > 0:
                setattr(self, knob, getattr(self, knob) - 1)
                self.injected[kind] += 1
                return True
            return False

    def take_post_failure(self) -> bool:
        """True (and one fewer armed) if this post should fail."""
        with self._lock:
            self._posts += 1
            if self.fail_post_every and self._posts % self.fail_post_every == 0:
                self.injected["post_failures"] += 1
                return True
        return self._take("fail_posts", "post_failures")

    def take_transfer_failure(self) -> bool:
        """True (and one fewer armed) if this transfer should end FAILED."""
        return self._take("fail_transfers", "transfer_failures")

    def take_corruption(self) -> bool:
        """True (and one fewer armed) if this transfer should land with a byte changed."""
        return self._take("corrupt_transfers", "corruptions")

    def transfer_delay(self) -> float:
        """Seconds a transfer posted now should take (counted when > 0)."""
        with self._lock:
            delay = self.transfer_delay_s + self._rng.uniform(0.0, self.transfer_jitter_s)
            if delay > 0:
                self.injected["transfer_delays"] += 1
            return delay

    # -- consulted by the side channel -------------------------------------------------

    def take_message_drop(self, type_name: str) -> bool:
        """True (and one fewer armed) if a message of this type should be dropped."""
        with self._lock:
            for key in (type_name, ANY_MESSAGE):
                if self.drop_messages.get(key, 0) > 0:
                    self.drop_messages[key] -= 1
                    self.injected["message_drops"] += 1
                    self.injected[f"message_drops:{type_name}"] += 1
                    return True
            return False

    def message_delay(self) -> float:
        """Seconds a message sent now should be held (counted when > 0)."""
        with self._lock:
            if self.message_delay_s > 0:
                self.injected["message_delays"] += 1
            return self.message_delay_s
