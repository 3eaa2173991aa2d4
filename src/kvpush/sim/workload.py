"""The simulated workload: `kvpush bench`'s arrival process and prompt/output lengths.

Arrivals come from :func:`kvpush.bench.settings.arrival_offsets` itself, so a simulated run
at (rate, seed) sends its requests at exactly the times `kvpush bench` would. Lengths are
fixed per run as in the bench's random / shared-prefix data sets; a shared prefix is the
same ``prefix_len`` tokens in every prompt (``prefix_id`` 0).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field


class Stage(enum.Enum):
    """Time stamps a simulated request collects, in the order they can happen."""

    ARRIVED = "arrived"                  # at the router (the client sent it)
    PREFILL_RECEIVED = "prefill_received"
    PREFILL_STARTED = "prefill_started"  # first chunk scheduled
    PREFILL_DONE = "prefill_done"        # token #1 sampled on P (or on the colocated engine)
    RELAYED = "relayed"                  # pull: router has P's answer
    DECODE_RECEIVED = "decode_received"
    DECODE_ALLOCATED = "decode_allocated"
    REGISTERED = "registered"            # push: P has D's block ids
    TRANSFER_POSTED = "transfer_posted"  # pull: READ posted / push: last WRITE posted
    TRANSFER_DONE = "transfer_done"
    NOTIFIED = "notified"                # push: D has PushDone (token #1); pull: P has PullDone
    FIRST_TOKEN = "first_token"          # engine emitted token #1 (the one the client gets)
    CLIENT_FIRST_TOKEN = "client_first_token"
    FINISHED = "finished"


@dataclass(frozen=True)
class Workload:
    num_prompts: int
    rate: float            # requests/s; math.inf = all at once
    input_len: int
    output_len: int
    seed: int = 0
    prefix_len: int = 0    # shared leading tokens of every prompt (0: none)
    #: Instances whose prefix cache already holds the shared prefix (a warm-up ran).
    prefix_cached_on: tuple[str, ...] = ()

    def validate(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if not (self.rate > 0):
            raise ValueError(f"rate must be > 0 (inf: all at once), got {self.rate}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("input and output lengths must be >= 1")
        if not 0 <= self.prefix_len < self.input_len:
            raise ValueError(f"prefix_len must be in 0..{self.input_len - 1}")
        bad = set(self.prefix_cached_on) - {"prefill", "decode"}
        if bad:
            raise ValueError(f"prefix_cached_on: unknown roles {sorted(bad)}")

    def arrivals(self) -> list[float]:
        from kvpush.bench.settings import arrival_offsets

        return arrival_offsets(self.num_prompts, self.rate, self.seed)


@dataclass
class SimRequest:
    rid: int
    arrival: float
    prompt_len: int
    output_len: int
    prefix_id: int | None = None
    prefix_len: int = 0
    stages: dict[Stage, float] = field(default_factory=dict)
    token_times: list[float] = field(default_factory=list)  # client-side, token #1 first
    descs: int = 0           # descriptors of its KV transfer(s)
    transfer_bytes: int = 0

    def mark(self, stage: Stage, t: float) -> None:
        self.stages.setdefault(stage, t)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival if self.token_times else math.nan

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        if n < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (n - 1)

    @property
    def done(self) -> bool:
        return len(self.token_times) >= self.output_len


def make_requests(w: Workload) -> list[SimRequest]:
    w.validate()
    return [SimRequest(i, t, w.input_len, w.output_len,
                       prefix_id=0 if w.prefix_len else None, prefix_len=w.prefix_len)
            for i, t in enumerate(w.arrivals())]
