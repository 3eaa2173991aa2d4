"""Plain-text / markdown tables of simulation summaries."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

COLUMNS: tuple[tuple[str, str], ...] = (
    ("label", "config"), ("rate", "rate"), ("median_ttft_ms", "TTFT med"),
    ("p90_ttft_ms", "TTFT p90"), ("median_tpot_ms", "TPOT med"), ("p90_tpot_ms", "TPOT p90"),
    ("request_throughput", "req/s"), ("mean_descs", "descs"), ("unfinished", "unfinished"),
)


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
    """Summaries (from :meth:`SimResult.summary`, with ``rate``) as a markdown table; ms."""
    def cell(r: dict[str, Any], k: str) -> Any:
        v = r.get(k, "")
        return f"{v:g}" if k == "rate" and isinstance(v, float) else v

    return markdown_table([t for _, t in COLUMNS], [[cell(r, k) for k, _ in COLUMNS]
                                                    for r in rows])
