"""PNG plots of a `kvpush bench compare` summary (matplotlib, Agg backend).

matplotlib is imported inside :func:`plot_summary` only (ImportError there if it is not
installed), so importing this module is free.

* ``ttft_tpot_vs_rate.png``: median TTFT (p90 as a dashed line) and mean TPOT against
  the request rate, one line per mode; ``inf`` is the last point on a categorical axis.
* ``ttft_cdf.png``: the empirical CDF of every successful request's TTFT, one panel per
  rate, one line per mode.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _ttfts(runs: list[dict[str, Any]], mode: str, rate: str) -> list[float]:
    from kvpush.bench.compare_report import rate_text

    return sorted(t * 1e3 for r in runs if r["mode_label"] == mode
                  and rate_text(float(r["request_rate"])) == rate
                  for t, e in zip(r["ttfts"], r["errors"]) if not e)


def plot_summary(summary: dict[str, Any], runs: list[dict[str, Any]],
                 out_dir: str | Path) -> list[Path]:
    """Write the plots of ``summary`` (and its per-request ``runs``) into ``out_dir``;
    returns their paths."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    modes, rates, cells = summary["modes"], summary["rates"], summary["cells"]
    title = summary.get("config", {}).get("label") or "kvpush bench compare"
    x = list(range(len(rates)))
    paths = []

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in modes:
        pts = [(i, cells[f"{mode}@{r}"]) for i, r in enumerate(rates) if f"{mode}@{r}" in cells]
        if not pts:
            continue
        xs = [i for i, _ in pts]
        line, = ax1.plot(xs, [c["median_ttft_ms"] for _, c in pts], marker="o", label=mode)
        ax1.plot(xs, [c["p90_ttft_ms"] for _, c in pts], ls="--", color=line.get_color(),
                 alpha=0.6)
        ax2.plot(xs, [c["mean_tpot_ms"] for _, c in pts], marker="o", label=mode)
    for ax, name in ((ax1, "TTFT (ms): median, p90 dashed"), (ax2, "mean TPOT (ms)")):
        ax.set_xticks(x, rates)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    paths.append(out / "ttft_tpot_vs_rate.png")
    fig.savefig(paths[-1], dpi=80)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(rates), figsize=(4 * len(rates), 3.5), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        for mode in modes:
            ts = _ttfts(runs, mode, rate)
            if ts:
                ax.step(ts, [(i + 1) / len(ts) for i in range(len(ts))], where="post",
                        label=mode)
        ax.set_title(f"rate {rate}")
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{title}: TTFT CDF")
    fig.tight_layout()
    paths.append(out / "ttft_cdf.png")
    fig.savefig(paths[-1], dpi=80)
    plt.close(fig)
    return paths
