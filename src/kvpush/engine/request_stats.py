"""The one rule that turns a request's outputs into request metrics (TTFT, inter-token
gaps, token counts, and, once it finished, its end-to-end, queue, prefill and decode
times), written into an :class:`IterationStats` that kvpush.server.metrics observes.

Two places keep clocks with it: the engine core (:class:`RequestStatsTracker`, one clock
per request it runs, whichever front sent it: its own API process or a router over the
request plane; its figures ride the API process's ``EngineOutputs``) and a front that
serves requests over engines it does not own (the router; kvpush.server.metrics'
``RequestTimer``), with its own clock.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvpush.engine.outputs import EngineOutput, FinishedRequestStats, IterationStats

#: outcomes whose request histograms are observed (aborted, failed, refused: counted only)
FINISHED_OK = ("stop", "length")


class RequestClock:
    """One request's times: ``arrival`` and every output's ``now`` on the keeper's clock;
    queue and prefill from the engine's own stamps (one engine core's clock)."""

    __slots__ = ("arrival", "prompt_tokens", "first_token", "last_token", "num_tokens",
                 "engine_arrival", "scheduled", "engine_first")

    def __init__(self, arrival: float, prompt_tokens: int) -> None:
        self.arrival = arrival
        self.prompt_tokens = prompt_tokens
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.num_tokens = 0
        self.engine_arrival: float | None = None
        self.scheduled: float | None = None
        self.engine_first: float | None = None

    def on_output(self, stats: IterationStats, num_new_tokens: int, now: float,
                  engine_arrival: float | None = None, scheduled: float | None = None,
                  engine_first: float | None = None) -> None:
        """An output bringing ``num_new_tokens`` at ``now``. The prompt's tokens count
        with the first token; n tokens at once are n gaps of 1/n of the interval (the
        first's companions: none), so the gaps sum to the decode time."""
        if engine_arrival:
            self.engine_arrival = engine_arrival
        if scheduled is not None:
            self.scheduled = scheduled
        if engine_first is not None:
            self.engine_first = engine_first
        if num_new_tokens <= 0:
            return
        if self.last_token is None:
            self.first_token = now
            stats.num_prompt_tokens += self.prompt_tokens
            stats.ttft_s.append(now - self.arrival)
            gaps, gap = num_new_tokens - 1, 0.0
        else:
            gaps, gap = num_new_tokens, (now - self.last_token) / num_new_tokens
        if gaps:
            stats.itl_s.extend([gap] * gaps)
        self.last_token = now
        self.num_tokens += num_new_tokens
        stats.num_generation_tokens += num_new_tokens

    def finish(self, stats: IterationStats, outcome: str, now: float) -> None:
        """The request ended with ``outcome``; only stop and length add its phases."""
        if outcome not in FINISHED_OK:
            return
        decode = None
        if self.first_token is not None and self.last_token is not None:
            decode = self.last_token - self.first_token
        queue = prefill = None
        if self.scheduled is not None:  # the engine's stamps only: one clock
            if self.engine_arrival is not None:
                queue = max(0.0, self.scheduled - self.engine_arrival)
            if self.engine_first is not None:
                prefill = max(0.0, self.engine_first - self.scheduled)
        stats.finished.append(FinishedRequestStats(now - self.arrival, decode,
                                                   self.num_tokens, queue, prefill))


class RequestStatsTracker:
    """The engine core's clocks: one per request it is running, from the request's first
    output to its last (a request refused or ended before any output brought a token
    leaves no figures)."""

    def __init__(self) -> None:
        self._clocks: dict[str | tuple[str, int], RequestClock] = {}

    def __len__(self) -> int:
        return len(self._clocks)

    def observe(self, outputs: Iterable[EngineOutput], now: float) -> IterationStats | None:
        """What ``outputs``, handed to their fronts at ``now`` (the core's clock, that of
        their stamps), add; None when nothing."""
        stats = IterationStats()
        clocks = self._clocks
        for out in outputs:
            # a choice past the first of an n > 1 request: its own clock, the prompt's
            # tokens counted once (with choice 0)
            rid = out.request_id if not out.index else (out.request_id, out.index)
            clock = clocks.get(rid)
            if clock is None:
                if out.finish_reason is not None and not out.new_token_ids:
                    continue
                clock = clocks[rid] = RequestClock(
                    out.arrival_time, 0 if out.index else out.num_prompt_tokens)
            clock.on_output(stats, len(out.new_token_ids), now, out.arrival_time,
                            out.scheduled_time, out.first_token_time)
            if out.finish_reason is not None:
                del clocks[rid]
                clock.finish(stats, out.finish_reason.value, now)
        return stats if stats.num_generation_tokens or stats.finished else None
