"""Plain-text / markdown tables of simulation summaries."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

#: What `vllm bench serve` reports (and the push-vs-pull table of vLLM PR 35264 shows):
#: mean, median and p99 TTFT, mean TPOT and requests served per second.
COLUMNS: tuple[tuple[str, str], ...] = (
    ("label", "config"), ("rate", "offered (req/s)"), ("mean_ttft_ms", "TTFT mean (ms)"),
    ("median_ttft_ms", "TTFT med (ms)"), ("p99_ttft_ms", "TTFT p99 (ms)"),
    ("mean_tpot_ms", "TPOT mean (ms)"), ("request_throughput", "served (req/s)"),
    ("mean_descs", "descs (per transfer)"), ("unfinished", "unfinished (requests)"),
    ("overloaded", "overloaded"),
)
#: A row is overloaded when it achieves less than this share of its offered rate.
OVERLOAD_SHARE = 0.9
FOOTNOTE = (
    "descs: the mean number of NIXL descriptors per KV transfer (one per contiguous run "
    "of blocks per layer; more with --fragmentation; 0 colocated). served: completed "
    "requests / (last token - first arrival), vllm bench serve's request throughput. "
    f"OVERLOADED: requests complete at under {OVERLOAD_SHARE:g}x the rate they arrive "
    "(each measured first to last), or some are left unfinished — the queue grows, and "
    "the row's latencies depend on how many prompts were sent, not on the cluster (rate "
    "inf, all at once: unfinished only).")


def overloaded(row: dict[str, Any]) -> bool:
    """Whether ``row`` (a simulation summary) is past its cluster's capacity: some
    requests unfinished, or requests completing (first to last completion) at less than
    :data:`OVERLOAD_SHARE` of the rate they arrived (first to last arrival), so the
    queue grew. Rows sent all at once (rate inf) are judged by unfinished only."""
    if row.get("unfinished"):
        return True
    arr, fin = row.get("arrival_rate", math.nan), row.get("completion_rate", math.nan)
    return math.isfinite(arr) and math.isfinite(fin) and fin < OVERLOAD_SHARE * arr


def fmt(v: Any, digits: int = 1) -> str:
    if isinstance(v, float):
        if math.isinf(v):
            return "inf"
        if math.isnan(v):
            return "-"
        return f"{v:.{digits}f}"
    return str(v)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    out = ["| " + " | ".join(header) + " |",
           "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
    out += ["| " + " | ".join(fmt(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
    """Summaries (from :meth:`SimResult.summary`, with ``rate``) as a markdown table
    (units in the headers), then the footnote that explains descs and overloaded."""
    def cell(r: dict[str, Any], k: str) -> Any:
        if k == "overloaded":
            return "**OVERLOADED**" if overloaded(r) else ""
        v = r.get(k, "")
        return f"{v:g}" if k == "rate" and isinstance(v, float) else v

    table = markdown_table([t for _, t in COLUMNS], [[cell(r, k) for k, _ in COLUMNS]
                                                     for r in rows])
    return table + "\n\n" + FOOTNOTE
