"""Per-request measurements, their summary statistics, and vLLM's result table.

Field names and conventions follow ``vllm bench serve`` so results compare directly:
latencies in the summary are milliseconds (``mean_ttft_ms``...), the per-request lists
(``ttfts``, ``itls``) are seconds, ``std`` is the population standard deviation,
percentiles interpolate linearly (numpy's default), and a statistic over no values is 0.
TPOT is ``(e2e - ttft) / (output_tokens - 1)`` for requests with more than one output
token; ITL is every gap between consecutive content chunks of every request.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

#: Latency metrics summarized in a result, in vLLM's order.
METRICS: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}
DEFAULT_PERCENTILES: tuple[float, ...] = (90.0, 99.0)


@dataclass
class RequestResult:
    """What the client measured for one request (times in seconds)."""

    prompt_len: int
    success: bool = False
    #: Output tokens: the server's usage if it sent one, else counted by the client.
    output_tokens: int = 0
    #: Send -> first chunk carrying a token (its text may be held back: "").
    ttft: float = 0.0
    #: Gaps between consecutive chunks carrying tokens.
    itl: list[float] = field(default_factory=list)
    #: Send -> end of the stream.
    latency: float = 0.0
    #: When the request was sent, in seconds after the benchmark started (-1: never).
    start_time: float = -1.0
    #: "" on success; else the HTTP status and body, or the exception.
    error: str = ""
    #: ``usage.prompt_tokens`` as the server reported it, if it did.
    server_prompt_tokens: int | None = None
    generated_text: str = ""
    #: multi-turn data set: the conversation (0-based) and turn (1-based); 0 otherwise
    conversation: int = 0
    turn: int = 0

    @property
    def tpot(self) -> float | None:
        """(e2e - TTFT) / (output tokens - 1); None with fewer than two output tokens."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation, like ``np.percentile``;
    0.0 for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in 0..100, got {q}")
    if not values:
        return 0.0
    data = sorted(values)
    rank = (len(data) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(data) - 1)
    frac = rank - lo
    return data[lo] + (data[hi] - data[lo]) * frac if frac else float(data[lo])


def mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else 0.0


def std(values: Sequence[float]) -> float:
    """Population standard deviation (``np.std``); 0.0 for no values."""
    if not values:
        return 0.0
    m = mean(values)
    return math.sqrt(math.fsum((v - m) ** 2 for v in values) / len(values))


def percentile_key(q: float) -> str:
    """vLLM's name for a percentile: 99 -> ``p99``, 99.9 -> ``p99.9``."""
    return f"p{int(q)}" if float(q).is_integer() else f"p{q}"


def summarize(values: Sequence[float], name: str,
              percentiles: Iterable[float] = DEFAULT_PERCENTILES,
              scale: float = 1000.0) -> dict[str, float]:
    """``mean_<name>_ms``, ``median_<name>_ms``, ``std_<name>_ms`` and ``p<q>_<name>_ms``
    of ``values`` (seconds) times ``scale``."""
    out = {
        f"mean_{name}_ms": mean(values) * scale,
        f"median_{name}_ms": percentile(values, 50) * scale,
        f"std_{name}_ms": std(values) * scale,
    }
    for q in percentiles:
        out[f"{percentile_key(q)}_{name}_ms"] = percentile(values, q) * scale
    return out


def compute_metrics(results: Sequence[RequestResult], duration: float,
                    percentiles: Iterable[float] = DEFAULT_PERCENTILES) -> dict[str, Any]:
    """vLLM's aggregate fields for one run.

    Token totals and latencies count completed requests only; throughputs divide by the
    run's ``duration`` (seconds).
    """
    done = [r for r in results if r.success]
    ttfts = [r.ttft for r in done]
    e2els = [r.latency for r in done]
    tpots = [t for t in (r.tpot for r in done) if t is not None]
    itls = [gap for r in done for gap in r.itl]
    total_in = sum(r.prompt_len for r in done)
    total_out = sum(r.output_tokens for r in done)
    per_s = 1.0 / duration if duration > 0 else 0.0
    out: dict[str, Any] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) * per_s,
        "output_throughput": total_out * per_s,
        "total_token_throughput": (total_in + total_out) * per_s,
    }
    pcts = list(percentiles)
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        out.update(summarize(values, name, pcts))
    return out


def turn_metrics(results: Sequence[RequestResult],
                 percentiles: Iterable[float] = DEFAULT_PERCENTILES) -> dict[str, Any]:
    """TTFT and TPOT (ms) of some requests (one turn, or several): ``n`` is how many
    completed (what the statistics are over), ``failed`` how many did not, and
    ``mean_input_len`` their mean prompt length."""
    done = [r for r in results if r.success]
    out: dict[str, Any] = {"n": len(done), "failed": len(results) - len(done),
                           "mean_input_len": mean([r.prompt_len for r in done])}
    pcts = list(percentiles)
    out.update(summarize([r.ttft for r in done], "ttft", pcts))
    out.update(summarize([t for t in (r.tpot for r in done) if t is not None], "tpot", pcts))
    return out


def per_turn_metrics(results: Sequence[RequestResult],
                     percentiles: Iterable[float] = DEFAULT_PERCENTILES
                     ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(one :func:`turn_metrics` per turn, with its ``turn``, in turn order; the same
    over every turn after the first, ``turns_2plus``) of a multi-turn run."""
    pcts = list(percentiles)
    turns = sorted({r.turn for r in results if r.turn > 0})
    per_turn = [{"turn": t, **turn_metrics([r for r in results if r.turn == t], pcts)}
                for t in turns]
    return per_turn, turn_metrics([r for r in results if r.turn > 1], pcts)


def format_turn_table(per_turn: Sequence[dict[str, Any]],
                      turns_2plus: dict[str, Any] | None = None) -> str:
    """The per-turn figures of a multi-turn run, as lines under vLLM's table."""
    head = f"{'turn':<6}{'n':>4}{'failed':>7}{'input':>8}{'TTFT med':>10}{'TTFT p90':>10}" \
           f"{'TPOT mean':>11}"
    lines = ["{:-^56}".format("Per turn (ms; input: mean prompt tokens)"), head]
    rows = [(str(t["turn"]), t) for t in per_turn]
    if turns_2plus is not None and len(per_turn) > 1:
        rows.append(("2+", turns_2plus))
    for name, t in rows:
        lines.append(f"{name:<6}{t['n']:>4}{t['failed']:>7}{t['mean_input_len']:>8.0f}"
                     f"{t['median_ttft_ms']:>10.2f}{t.get('p90_ttft_ms', 0.0):>10.2f}"
                     f"{t['mean_tpot_ms']:>11.2f}")
    lines.append("=" * 56)
    return "\n".join(lines)


def _line(label: str, value: Any) -> str:
    if isinstance(value, float):
        return f"{label:<40} {value:<10.2f}"
    return f"{label:<40} {value!s:<10}"


def format_table(result: dict[str, Any],
                 percentiles: Iterable[float] = DEFAULT_PERCENTILES) -> str:
    """The result as vLLM prints it at the end of ``vllm bench serve``."""
    rate = result.get("request_rate", "inf")
    conc = result.get("max_concurrency")
    lines = [
        "{:=^50}".format(" Serving Benchmark Result "),
        _line("Successful requests:", result["completed"]),
        _line("Failed requests:", result["failed"]),
        _line("Maximum request concurrency:", conc if conc is not None else "None"),
        _line("Request rate configured (RPS):", rate),
        _line("Benchmark duration (s):", float(result["duration"])),
        _line("Total input tokens:", result["total_input_tokens"]),
        _line("Total generated tokens:", result["total_output_tokens"]),
        _line("Request throughput (req/s):", float(result["request_throughput"])),
        _line("Output token throughput (tok/s):", float(result["output_throughput"])),
        _line("Total Token throughput (tok/s):", float(result["total_token_throughput"])),
    ]
    for name in METRICS:
        title, short = METRIC_TITLES[name]
        lines.append(f"{title:-^50}")
        lines.append(_line(f"Mean {short} (ms):", float(result[f"mean_{name}_ms"])))
        lines.append(_line(f"Median {short} (ms):", float(result[f"median_{name}_ms"])))
        for q in percentiles:
            key = percentile_key(q)
            value = result.get(f"{key}_{name}_ms")
            if value is not None:
                lines.append(_line(f"P{key[1:]} {short} (ms):", float(value)))
    lines.append("=" * 50)
    if result.get("per_turn"):
        lines.append(format_turn_table(result["per_turn"], result.get("turns_2plus")))
    return "\n".join(lines)
