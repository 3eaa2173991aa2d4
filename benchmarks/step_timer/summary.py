"""Mean and median wall / CPU ms of the steps logged by sitecustomize.py, by instance
kind and step size: ``python benchmarks/step_timer/summary.py DIR [--tokens N]``."""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path)
    ap.add_argument("--tokens", type=int, default=None, help="only steps of N tokens")
    args = ap.parse_args()
    rows: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
    for f in args.dir.glob("steps.*.txt"):
        for line in f.read_text().splitlines():
            tag, ntok, _n, _hook, wall, cpu = line.split()
            if args.tokens is None or int(ntok) == args.tokens:
                rows[(tag, int(ntok))].append((float(wall), float(cpu)))
    print("| instance | tokens | steps | wall med | wall mean | cpu med | cpu mean |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for (tag, ntok), v in sorted(rows.items()):
        w, c = [x[0] for x in v], [x[1] for x in v]
        print(f"| {tag} | {ntok} | {len(v)} | {statistics.median(w):.2f} | "
              f"{statistics.fmean(w):.2f} | {statistics.median(c):.2f} | "
              f"{statistics.fmean(c):.2f} |")


if __name__ == "__main__":
    main()
