"""PNG plots of a `kvpush bench compare` summary (matplotlib, Agg backend).

matplotlib is imported inside :func:`plot_summary` only (ImportError there if it is not
installed), so importing this module is free.

* ``ttft_tpot_vs_rate.png``: median TTFT (p90 as a dashed line) and mean TPOT against
  the request rate, one line per mode; ``inf`` is the last point on a categorical axis.
  With one rate: one bar per mode (the whisker: min-max over repeats; p90 as a dash).
* ``ttft_cdf.png``: the empirical CDF of every successful request's TTFT, one panel per
  rate, one line per mode.

Every axis of latency starts at zero, and every title carries the workload (dataset,
input/output lengths, prefill + decode counts, repeats): see :func:`workload_title`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _ttfts(runs: list[dict[str, Any]], mode: str, rate: str) -> list[float]:
    from kvpush.bench.compare_report import rate_text

    return sorted(t * 1e3 for r in runs if r["mode_label"] == mode
                  and rate_text(float(r["request_rate"])) == rate
                  for t, e in zip(r["ttfts"], r["errors"]) if not e)


def workload_title(summary: dict[str, Any]) -> str:
    """The plots' title: the label, then the workload of ``summary``'s config."""
    c = summary.get("config", {})
    label = c.get("label") or "kvpush bench compare"
    if c.get("dataset") == "multi-turn":
        load = (f"multi-turn {c.get('num_conversations')} conv x {c.get('turns')} turns, "
                f"question {c.get('question_len')} / out {c.get('output_len')} tok")
    else:
        load = (f"{c.get('dataset', '?')} {c.get('input_len', '?')} in / "
                f"{c.get('output_len', '?')} out tok, {c.get('num_prompts', '?')} prompts")
    return (f"{label}\n{load}; {c.get('prefill', '?')}P + {c.get('decode', '?')}D; "
            f"{c.get('repeats', '?')} repeat(s)")


def _err(cells: list[dict[str, Any]], key: str) -> list[list[float]] | None:
    """Whiskers (below, above) from each cell's min-max over repeats, around its value."""
    rng = [(c.get(key + "_range"), c[key]) for c in cells]
    if any(r is None for r, _ in rng):
        return None
    return [[max(v - r[0], 0.0) for r, v in rng], [max(r[1] - v, 0.0) for r, v in rng]]


#: every PNG's resolution, and the narrowest figure (inches): 1000 px, room for the title
DPI = 100
MIN_WIDTH_IN = 10.0


def _title(fig: Any, text: str) -> None:
    """``text`` as the figure's title, wrapped to its width, and the panels laid out
    below it."""
    import textwrap

    chars = int(fig.get_figwidth() * 11)  # the title's font: about 11 characters an inch
    fig.suptitle(textwrap.fill(text, chars))
    fig.tight_layout()


def plot_summary(summary: dict[str, Any], runs: list[dict[str, Any]],
                 out_dir: str | Path, figures: list[Any] | None = None) -> list[Path]:
    """Write the plots of ``summary`` (and its per-request ``runs``) into ``out_dir``;
    returns their paths. With ``figures``, the matplotlib figures are appended to it
    and left open (tests read their axes) instead of closed."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    modes, rates, cells = summary["modes"], summary["rates"], summary["cells"]
    title = workload_title(summary)
    x = list(range(len(rates)))
    paths = []

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(MIN_WIDTH_IN, 4.5))
    if len(rates) == 1:  # one rate: bars, one per mode (two dots mean nothing)
        have = [m for m in modes if f"{m}@{rates[0]}" in cells]
        cs = [cells[f"{m}@{rates[0]}"] for m in have]
        xs = list(range(len(have)))
        colors = [f"C{i}" for i in xs]
        ax1.bar(xs, [c["median_ttft_ms"] for c in cs], color=colors,
                yerr=_err(cs, "median_ttft_ms"), capsize=4)
        ax1.scatter(xs, [c["p90_ttft_ms"] for c in cs], marker="_", s=400, color="k",
                    label="p90", zorder=3)
        ax2.bar(xs, [c["mean_tpot_ms"] for c in cs], color=colors,
                yerr=_err(cs, "mean_tpot_ms"), capsize=4)
        for ax, name in ((ax1, "TTFT (ms): median bar, p90 dash"), (ax2, "mean TPOT (ms)")):
            ax.set_xticks(xs, have)
            ax.set_xlabel(f"mode, at request rate {rates[0]} req/s (whisker: min-max over "
                          "repeats)")
            ax.set_ylabel(name)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3, axis="y")
        ax1.legend()
    for mode in modes if len(rates) > 1 else ():
        pts = [(i, cells[f"{mode}@{r}"]) for i, r in enumerate(rates) if f"{mode}@{r}" in cells]
        if not pts:
            continue
        xs = [i for i, _ in pts]
        line, = ax1.plot(xs, [c["median_ttft_ms"] for _, c in pts], marker="o", label=mode)
        ax1.plot(xs, [c["p90_ttft_ms"] for _, c in pts], ls="--", color=line.get_color(),
                 alpha=0.6)
        ax2.plot(xs, [c["mean_tpot_ms"] for _, c in pts], marker="o", label=mode)
    for ax, name in ((ax1, "TTFT (ms): median, p90 dashed"), (ax2, "mean TPOT (ms)")):
        if len(rates) == 1:
            break
        ax.set_xticks(x, rates)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(name)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    _title(fig, title)
    paths.append(out / "ttft_tpot_vs_rate.png")
    fig.savefig(paths[-1], dpi=DPI)
    plt.close(fig) if figures is None else figures.append(fig)

    fig, axes = plt.subplots(1, len(rates), figsize=(max(MIN_WIDTH_IN, 4 * len(rates)), 4.5),
                             squeeze=False)
    for ax, rate in zip(axes[0], rates):
        for mode in modes:
            ts = _ttfts(runs, mode, rate)
            if ts:
                ax.step(ts, [(i + 1) / len(ts) for i in range(len(ts))], where="post",
                        label=mode)
        ax.set_title(f"rate {rate}")
        ax.set_xlabel("TTFT (ms)")
        ax.set_xlim(left=0)
        ax.set_ylim(0, 1.02)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend()
    _title(fig, f"{title}: TTFT CDF")
    paths.append(out / "ttft_cdf.png")
    fig.savefig(paths[-1], dpi=DPI)
    plt.close(fig) if figures is None else figures.append(fig)
    return paths
