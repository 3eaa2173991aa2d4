"""`kvpush bench compare`'s tables: the runs of each mode x rate pooled, the ratios
against the reference mode, and the markdown report (summary.json / summary.md)."""

from __future__ import annotations

import math
import os
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpush.bench.metrics import mean, percentile

if TYPE_CHECKING:
    from kvpush.bench.compare import CompareConfig

#: Summary fields per mode x rate (name in summary.json, heading in the table, unit).
COLUMNS: tuple[tuple[str, str], ...] = (
    ("median_ttft_ms", "TTFT med"), ("p90_ttft_ms", "TTFT p90"), ("p99_ttft_ms", "TTFT p99"),
    ("mean_tpot_ms", "TPOT mean"), ("median_tpot_ms", "TPOT med"),
    ("mean_itl_ms", "ITL mean"), ("median_itl_ms", "ITL med"),
)
#: Fields whose ratio X / reference is reported.
RATIO_FIELDS: tuple[str, ...] = ("median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
                                 "mean_tpot_ms", "median_itl_ms")


def rate_text(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def usable_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def request_ttfts(run: dict[str, Any]) -> list[float]:
    """The times to first token (s) of a run's requests that did not fail."""
    return [t for t, e in zip(run["ttfts"], run["errors"]) if not e]


def request_tpots(run: dict[str, Any]) -> list[float]:
    """The time per output token (s) of a run's requests that did not fail and produced
    two or more tokens: (end-to-end - TTFT) / (tokens - 1)."""
    return [(e - t) / (n - 1) for e, t, n, err in
            zip(run["e2els"], run["ttfts"], run["output_lens"], run["errors"])
            if not err and n > 1]


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Statistics over the requests of several runs (repeats) pooled together, in ms."""
    ttfts = [t for r in runs for t in request_ttfts(r)]
    tpots = [x for r in runs for x in request_tpots(r)]
    itls = [g for r in runs for gaps, e in zip(r["itls"], r["errors"]) if not e for g in gaps]
    out: dict[str, Any] = {}
    for name, vals in (("ttft", ttfts), ("tpot", tpots), ("itl", itls)):
        out[f"mean_{name}_ms"] = mean(vals) * 1e3
        for q, key in ((50, "median"), (90, "p90"), (99, "p99")):
            out[f"{key}_{name}_ms"] = percentile(vals, q) * 1e3
    out["request_throughput"] = mean([r["request_throughput"] for r in runs])
    out["completed"] = sum(r["completed"] for r in runs)
    out["failed"] = sum(r["failed"] for r in runs)
    out["repeats"] = len(runs)
    return out


def summarize_runs(runs: list[dict[str, Any]], cfg: CompareConfig) -> dict[str, Any]:
    labels = [m.label for m in cfg.modes]
    rates = [rate_text(r) for r in cfg.rates]
    ref = next((m for m in ("push", "vllm-push") if m in labels), labels[-1])
    cells: dict[str, dict[str, Any]] = {}
    for label in labels:
        for rate in rates:
            sel = [r for r in runs if r["mode_label"] == label
                   and rate_text(float(r["request_rate"])) == rate]
            if sel:
                cells[f"{label}@{rate}"] = pooled(sel)
    ratios: dict[str, dict[str, Any]] = {}
    for label in labels:
        if label == ref:
            continue
        for rate in rates:
            a, b = cells.get(f"{label}@{rate}"), cells.get(f"{ref}@{rate}")
            if a is None or b is None:
                continue
            entry = {f: (a[f] / b[f] if b[f] else None) for f in RATIO_FIELDS}
            per_rep = []  # the same ratio within each repeat (runs close in time)
            for rep in range(cfg.repeats):
                ra = [r for r in runs if r["mode_label"] == label and r["repeat"] == rep
                      and rate_text(float(r["request_rate"])) == rate]
                rb = [r for r in runs if r["mode_label"] == ref and r["repeat"] == rep
                      and rate_text(float(r["request_rate"])) == rate]
                if ra and rb and rb[0]["median_ttft_ms"]:
                    per_rep.append(ra[0]["median_ttft_ms"] / rb[0]["median_ttft_ms"])
            entry["median_ttft_ratio_per_repeat"] = per_rep
            ratios[f"{label}/{ref}@{rate}"] = entry
    conf = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    conf["modes"] = labels
    conf["rates"] = rates
    return {"config": conf, "reference": ref, "modes": labels, "rates": rates,
            "cells": cells, "ratios": ratios, "machine": machine_note()}


def machine_note() -> str:
    import platform

    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        mem = float("nan")
    return (f"{usable_cores()} usable cores, {mem:.0f} GiB, {platform.machine()}, "
            f"{platform.system()} {platform.release()}, Python {platform.python_version()}")


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def markdown_report(summary: dict[str, Any]) -> str:
    c = summary["config"]
    threads = ", ".join(f"{k}: {v}" for k, v in (c.get("threads") or {}).items())
    lines = [
        f"### {c.get('label') or 'kvpush bench compare'}",
        "",
        f"Model `{c.get('model') or 'smollm2-135m'}`, dataset {c['dataset']} "
        f"{c['input_len']} in / {c['output_len']} out"
        + (f" (prefix {c['prefix_len']})" if c.get("prefix_len") else "")
        + f", {c['num_prompts']} prompts per run (+{c['warmup']} warm-up), seed "
        f"{c['seed']}, {c['repeats']} repeat(s) in alternating order"
        + (", each repeat with its own arrivals" if c.get("arrivals_per_repeat") else "")
        + f"; P/D "
        f"{c['prefill']} prefill + {c['decode']} decode. Torch threads per instance: "
        f"{threads or '-'} (P/D: one share of the cores per instance; colocated: all on "
        "its one instance). Machine: " + summary["machine"] + ". Latencies in ms, "
        "requests of all repeats pooled; req/s is the mean over repeats.",
        "",
        "| mode | rate | " + " | ".join(h for _, h in COLUMNS) + " | req/s | ok | failed |",
        "|---|---|" + "---:|" * (len(COLUMNS) + 3),
    ]
    for mode in summary["modes"]:
        for rate in summary["rates"]:
            cell = summary["cells"].get(f"{mode}@{rate}")
            if cell is None:
                lines.append(f"| {mode} | {rate} | " + " | ".join("-" * 1 for _ in COLUMNS)
                             + " | - | - | not run |")
                continue
            lines.append(f"| {mode} | {rate} | "
                         + " | ".join(_fmt(cell[k]) for k, _ in COLUMNS)
                         + f" | {cell['request_throughput']:.3f} | {cell['completed']} | "
                         f"{cell['failed']} |")
    if summary["ratios"]:
        ref = summary["reference"]
        lines += ["", f"Ratios against {ref} (> 1: {ref} is better):", "",
                  "| ratio | rate | TTFT med | TTFT p90 | TTFT p99 | TPOT mean | ITL med "
                  "| TTFT med per repeat |",
                  "|---|---|---:|---:|---:|---:|---:|---|"]
        for key, r in summary["ratios"].items():
            pair, rate = key.rsplit("@", 1)
            per = ", ".join(f"{x:.2f}" for x in r["median_ttft_ratio_per_repeat"])
            lines.append(f"| {pair} | {rate} | "
                         + " | ".join(_fmt(r[f], 2) for f in RATIO_FIELDS)
                         + f" | {per or '-'} |")
    if summary.get("skipped"):
        lines += ["", "Skipped (time limit): " + "; ".join(summary["skipped"])]
    return "\n".join(lines)
