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
    from kvpush.bench.compare_config import CompareConfig

#: Summary fields per mode x rate (name in summary.json, heading in the table, unit).
COLUMNS: tuple[tuple[str, str], ...] = (
    ("median_ttft_ms", "TTFT med"), ("p90_ttft_ms", "TTFT p90"), ("p99_ttft_ms", "TTFT p99"),
    ("mean_tpot_ms", "TPOT mean"), ("median_tpot_ms", "TPOT med"),
    ("mean_itl_ms", "ITL mean"), ("median_itl_ms", "ITL med"),
)
#: Fields whose ratio X / reference is reported.
RATIO_FIELDS: tuple[str, ...] = ("median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
                                 "mean_tpot_ms", "median_itl_ms")
#: A cell with fewer completed requests than this (all repeats together) is too small
#: for a ratio to mean anything.
MIN_REQUESTS = 30
NOISE_NOTE = "inside the noise: {why} — do not read a ratio from it"


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
    # The spread over repeats: each repeat's own median TTFT and mean TPOT, min and max.
    meds = [percentile(request_ttfts(r), 50) * 1e3 for r in runs if request_ttfts(r)]
    tps = [mean(request_tpots(r)) * 1e3 for r in runs if request_tpots(r)]
    out["median_ttft_ms_range"] = [min(meds), max(meds)] if meds else None
    out["mean_tpot_ms_range"] = [min(tps), max(tps)] if tps else None
    if all("turns" in r for r in runs):  # multi-turn
        turns = sorted({t for r in runs for t in r["turns"]})
        out["per_turn"] = [{"turn": t, **turn_stats(runs, lambda x, t=t: x == t)}
                           for t in turns]
        out["turns_2plus"] = turn_stats(runs, lambda x: x > 1)
    return out


def turn_stats(runs: list[dict[str, Any]], keep: Any) -> dict[str, Any]:
    """TTFT and TPOT (ms) of the requests of ``runs`` (pooled) whose turn ``keep``
    accepts, completed ones only; ``n`` is how many."""
    ttfts, tpots = [], []
    for r in runs:
        for turn, t, e, n, err in zip(r["turns"], r["ttfts"], r["e2els"], r["output_lens"],
                                      r["errors"]):
            if keep(turn) and not err:
                ttfts.append(t)
                if n > 1:
                    tpots.append((e - t) / (n - 1))
    return {"n": len(ttfts), "median_ttft_ms": percentile(ttfts, 50) * 1e3,
            "p90_ttft_ms": percentile(ttfts, 90) * 1e3, "mean_ttft_ms": mean(ttfts) * 1e3,
            "mean_tpot_ms": mean(tpots) * 1e3, "median_tpot_ms": percentile(tpots, 50) * 1e3}


def noise_reasons(*cells: dict[str, Any]) -> list[str]:
    """Why a comparison of ``cells`` is inside its noise: a cell with fewer than
    :data:`MIN_REQUESTS` completed requests, or only one repeat; empty if neither."""
    why = []
    if any(c["completed"] < MIN_REQUESTS for c in cells):
        why.append(f"fewer than {MIN_REQUESTS} requests")
    if any(c["repeats"] < 2 for c in cells):
        why.append("one repeat")
    return why


def noise_note(why: list[str]) -> str:
    return NOISE_NOTE.format(why=" / ".join(why)) if why else ""


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def turn_ratios(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Per-turn ratios of cell ``a`` to the reference cell ``b`` (multi-turn): median
    TTFT of turn 1 and of turns 2+, mean TPOT of turns 2+, median TTFT of each turn."""
    first = lambda c: next((t for t in c["per_turn"] if t["turn"] == 1), None)  # noqa: E731
    fa, fb = first(a), first(b)
    by_turn = {t["turn"]: t for t in b["per_turn"]}
    return {
        "turn1_median_ttft_ms": (_ratio(fa["median_ttft_ms"], fb["median_ttft_ms"])
                                 if fa and fb else None),
        "turns_2plus_median_ttft_ms": _ratio(a["turns_2plus"]["median_ttft_ms"],
                                             b["turns_2plus"]["median_ttft_ms"]),
        "turns_2plus_mean_tpot_ms": _ratio(a["turns_2plus"]["mean_tpot_ms"],
                                           b["turns_2plus"]["mean_tpot_ms"]),
        "per_turn_median_ttft_ms": [
            {"turn": t["turn"], "ratio": _ratio(t["median_ttft_ms"],
                                                by_turn[t["turn"]]["median_ttft_ms"])}
            for t in a["per_turn"] if t["turn"] in by_turn],
    }


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
            entry["noise"] = noise_reasons(a, b)
            if "per_turn" in a and "per_turn" in b:
                entry["turns"] = turn_ratios(a, b)
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
    from kvpush.bench.machine import cpu_flags

    return (f"{cpu_flags()}; {usable_cores()} usable cores, {mem:.0f} GiB, "
            f"{platform.machine()}, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}")


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def _span(r: list[float] | None) -> str:
    return f"{r[0]:.1f}-{r[1]:.1f}" if r else "-"


def _tp_text(c: dict[str, Any]) -> str:
    """Tensor parallelism of the kvpush instances, where any is above 1."""
    every = c.get("tensor_parallel_size") or 1
    p_tp, d_tp = c.get("prefill_tp") or every, c.get("decode_tp") or every
    if max(every, p_tp, d_tp) == 1:
        return ""
    return f" (P TP {p_tp}, D TP {d_tp}; colocated TP {every})"


def markdown_report(summary: dict[str, Any]) -> str:
    c = summary["config"]
    threads = ", ".join(f"{k}: {v}" for k, v in (c.get("threads") or {}).items())
    if c["dataset"] == "multi-turn":
        think = (f", think time {c.get('think_time', 0):g} s {c.get('think_time_dist')}"
                 if c.get("think_time") else "")
        workload = (f"dataset multi-turn: {c['num_conversations']} conversations of "
                    f"{c['turns']} turns per run (+{c['warmup']} warm-up), system prompt "
                    f"{c['system_prompt_len']}, questions {c['question_len']}, answers "
                    f"{c['output_len']} tokens{think}, seed ")
    else:
        workload = (f"dataset {c['dataset']} {c['input_len']} in / {c['output_len']} out"
                    + (f" (prefix {c['prefix_len']})" if c.get("prefix_len") else "")
                    + f", {c['num_prompts']} prompts per run (+{c['warmup']} warm-up), "
                    "seed ")
    lines = [
        f"### {c.get('label') or 'kvpush bench compare'}",
        "",
        f"Model `{c.get('model') or 'smollm2-135m'}`, " + workload
        + f"{c['seed']}, {c['repeats']} repeat(s) in alternating order"
        + (", each repeat with its own arrivals" if c.get("arrivals_per_repeat") else "")
        + f"; P/D "
        f"{c['prefill']} prefill + {c['decode']} decode{_tp_text(c)}. Torch threads per "
        f"rank (an instance at TP 1 is one rank): {threads or '-'} (P/D: one share of the "
        "cores per rank; colocated: all on its one instance). Machine: "
        + summary["machine"] + ". Latencies in ms, "
        "requests of all repeats pooled; req/s is the mean over repeats; min-max: the "
        "lowest and highest of each repeat's own value.",
        "",
        "| mode | rate | " + " | ".join(h for _, h in COLUMNS)
        + " | TTFT med min-max | TPOT mean min-max | req/s | ok | failed |",
        "|---|---|" + "---:|" * (len(COLUMNS) + 5),
    ]
    for mode in summary["modes"]:
        for rate in summary["rates"]:
            cell = summary["cells"].get(f"{mode}@{rate}")
            if cell is None:
                lines.append(f"| {mode} | {rate} | " + " | ".join("-" * 1 for _ in COLUMNS)
                             + " | - | - | - | - | not run |")
                continue
            lines.append(f"| {mode} | {rate} | "
                         + " | ".join(_fmt(cell[k]) for k, _ in COLUMNS)
                         + f" | {_span(cell.get('median_ttft_ms_range'))}"
                         f" | {_span(cell.get('mean_tpot_ms_range'))}"
                         + f" | {cell['request_throughput']:.3f} | {cell['completed']} | "
                         f"{cell['failed']} |")
    if summary["ratios"]:
        ref = summary["reference"]
        lines += ["", f"Ratios against {ref} (> 1: {ref} is better):", "",
                  "| ratio | rate | TTFT med | TTFT p90 | TTFT p99 | TPOT mean | ITL med "
                  "| TTFT med per repeat | noise |",
                  "|---|---|---:|---:|---:|---:|---:|---|---|"]
        for key, r in summary["ratios"].items():
            pair, rate = key.rsplit("@", 1)
            per = ", ".join(f"{x:.2f}" for x in r["median_ttft_ratio_per_repeat"])
            lines.append(f"| {pair} | {rate} | "
                         + " | ".join(_fmt(r[f], 2) for f in RATIO_FIELDS)
                         + f" | {per or '-'} | {noise_note(r.get('noise', [])) or '-'} |")
        noisy = [k for k, r in summary["ratios"].items() if r.get("noise")]
        if noisy:
            lines += ["", f"Note: {', '.join(noisy)}: "
                      + "; ".join(sorted({noise_note(summary['ratios'][k]['noise'])
                                          for k in noisy}))
                      + f". A difference is only worth reading with {MIN_REQUESTS}+ "
                      "requests a cell and 2+ repeats whose min-max ranges do not overlap."]
    lines += _turn_lines(summary)
    if summary.get("skipped"):
        lines += ["", "Skipped (time limit): " + "; ".join(summary["skipped"])]
    return "\n".join(lines)


def _turn_lines(summary: dict[str, Any]) -> list[str]:
    """The multi-turn tables: each cell per turn, and the per-turn ratios."""
    cells = {k: v for k, v in summary["cells"].items() if "per_turn" in v}
    if not cells:
        return []
    lines = ["", "Per turn (ms; 2+: every turn after the first):", "",
             "| mode | rate | turn | n | TTFT med | TTFT p90 | TPOT mean |",
             "|---|---|---|---:|---:|---:|---:|"]
    for key, cell in cells.items():
        mode, rate = key.rsplit("@", 1)
        for name, t in [(str(t["turn"]), t) for t in cell["per_turn"]] + [
                ("2+", cell["turns_2plus"])]:
            lines.append(f"| {mode} | {rate} | {name} | {t['n']} | "
                         f"{_fmt(t['median_ttft_ms'])} | {_fmt(t['p90_ttft_ms'])} | "
                         f"{_fmt(t['mean_tpot_ms'])} |")
    turns = {k: r["turns"] for k, r in summary["ratios"].items() if "turns" in r}
    if turns:
        ref = summary["reference"]
        lines += ["", f"Per-turn ratios against {ref} (> 1: {ref} is better):", "",
                  "| ratio | rate | turn 1 TTFT med | turns 2+ TTFT med | turns 2+ TPOT mean "
                  "| TTFT med by turn |", "|---|---|---:|---:|---:|---|"]
        for key, r in turns.items():
            pair, rate = key.rsplit("@", 1)
            by_turn = ", ".join(f"{t['turn']}: {_fmt(t['ratio'], 2)}"
                                for t in r["per_turn_median_ttft_ms"])
            lines.append(f"| {pair} | {rate} | {_fmt(r['turn1_median_ttft_ms'], 2)} | "
                         f"{_fmt(r['turns_2plus_median_ttft_ms'], 2)} | "
                         f"{_fmt(r['turns_2plus_mean_tpot_ms'], 2)} | {by_turn or '-'} |")
    return lines
