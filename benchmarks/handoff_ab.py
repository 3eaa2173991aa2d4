"""`kvpush bench handoff`'s method with push at two commits side by side (issue 61).

    PYTHONPATH=src .venv/bin/python benchmarks/handoff_ab.py \\
        --base-src /path/to/checkout-of-main/src --out /tmp/handoff_ab

Starts colocated, push on the ``--base-src`` code ("push-main": that cluster's processes
get ``PYTHONPATH=BASE_SRC``), push and pull on this checkout, then sends one streaming
request at a time, rotating between the four as the bench does (new prompt each time),
so that both pushes see the same host state. Prints, per prompt length, the median time
to the first chunk, push over colocated, pull/push, the prefill step ("P: step starts
-> token #1 sampled") of both pushes and pull, and decode's registration in flight
("D: blocks registered -> P: registration received"), from the clusters' handoff lines.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import random
import re
import statistics
import time
from collections import defaultdict
from pathlib import Path

import httpx

from kvpush.bench.compare import Cluster, ModeSpec
from kvpush.bench.handoff import (
    HandoffConfig,
    compare_config,
    first_chunk_s,
    rotation,
    timelines_on,
    tiny_model,
)

NAMES = ["colocated", "push-main", "push", "pull"]
_FIELD = re.compile(r"(\w+)=(\S+)")


def run(base_src: str, out: Path, lens: list[int], requests: int, warmup: int) -> dict:
    model = out / "model"
    if not model.exists():
        tiny_model(model)
    ccfg = compare_config(HandoffConfig(modes=["colocated", "push", "pull"]), str(model), out)
    load = [os.getloadavg()]
    res: dict[str, dict[str, float]] = {}
    with contextlib.ExitStack() as stack:
        timelines_on(stack)  # the hand-off lines the step figures come from
        clusters = {}
        own = os.environ.get("PYTHONPATH")  # this checkout's (the docstring's src)
        for name in NAMES:  # a cluster's children take the environment it starts with
            if name == "push-main":
                os.environ["PYTHONPATH"] = base_src
            try:
                clusters[name] = stack.enter_context(Cluster(
                    ccfg, ModeSpec(name.split("-")[0], 1), str(model), out / "logs" / name))
            finally:
                if own is None:
                    os.environ.pop("PYTHONPATH", None)
                else:
                    os.environ["PYTHONPATH"] = own
        client = stack.enter_context(httpx.Client(timeout=120))
        served = client.get(clusters["push"].url + "/v1/models").json()["data"][0]["id"]
        rng = random.Random(0)
        for n in lens:
            times: dict[str, list[float]] = {name: [] for name in NAMES}
            for i in range(warmup + requests):
                for name in rotation(NAMES, i):
                    body = {"model": served, "stream": True, "max_tokens": 2,
                            "temperature": 0, "ignore_eos": True,
                            "prompt": [rng.randrange(4, 1000) for _ in range(n)]}
                    t = first_chunk_s(client, clusters[name].url, body)
                    if i >= warmup:
                        times[name].append(t)
            res[str(n)] = {name: statistics.median(v) * 1e3 for name, v in times.items()}
            print(n, {name: round(v, 1) for name, v in res[str(n)].items()}, flush=True)
        load.append(os.getloadavg())
    time.sleep(0.5)  # the last handoff lines
    return {"first_chunk_ms": res, "load": load}


def by_length(log_dir: Path, lens: list[int], warmup: int) -> dict[str, list[dict]]:
    """Each prompt length's transfers (stamps), in the order their steps ran."""
    stamps: dict[str, dict[str, float]] = defaultdict(dict)
    for path in glob.glob(str(log_dir / "*.log")):
        for line in Path(path).read_text(errors="replace").splitlines():
            fields = dict(_FIELD.findall(line))
            tid = fields.get("transfer")
            if "transfer=" in line and tid and tid != "-":
                stamps[tid].update({k[2:]: float(v) for k, v in fields.items()
                                    if k.startswith("t_")})
    recs = sorted((s for s in stamps.values() if "p_step" in s and "p_first" in s),
                  key=lambda s: s["p_step"])
    per = len(recs) // len(lens)
    return {str(n): recs[i * per + warmup:(i + 1) * per] for i, n in enumerate(lens)}


def median_ms(recs: list[dict], a: str, b: str) -> float:
    d = [(s[b] - s[a]) * 1e3 for s in recs if a in s and b in s]
    return statistics.median(d) if d else float("nan")


def table(out: Path, result: dict, lens: list[int], warmup: int) -> str:
    logs = {name: by_length(out / "logs" / name, lens, warmup)
            for name in ("push-main", "push", "pull")}
    rows = ["| tokens | colocated | push main / now | pull | push - colocated | pull/push | "
            "P step: push main / now, pull | D reg. -> P |", "|---|---:|---|---:|---|---|---|---|"]
    for n in map(str, lens):
        r = result["first_chunk_ms"][n]
        step = [median_ms(logs[k][n], "p_step", "p_first") for k in ("push-main", "push", "pull")]
        reg = [median_ms(logs[k][n], "d_registered", "p_reg") for k in ("push-main", "push")]
        rows.append(
            f"| {n} | {r['colocated']:.1f} | {r['push-main']:.1f} / {r['push']:.1f} | "
            f"{r['pull']:.1f} | {r['push-main'] - r['colocated']:+.1f} / "
            f"{r['push'] - r['colocated']:+.1f} | {r['pull'] / r['push-main']:.2f} / "
            f"{r['pull'] / r['push']:.2f} | {step[0]:.2f} / {step[1]:.2f}, {step[2]:.2f} "
            f"| {reg[0]:.2f} / {reg[1]:.2f} |")
    load = " -> ".join(", ".join(f"{x:.1f}" for x in la) for la in result["load"])
    return ("\n".join(rows) + "\n\nMedian ms (main / now); D reg. -> P: decode's registration in "
            f"flight. Load average (1, 5, 15 min), start -> end: {load}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-src", required=True, help="the src/ folder of the other checkout")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompt-lens", default="128,1024")
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    lens = [int(x) for x in args.prompt_lens.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    result = run(args.base_src, args.out, lens, args.requests, args.warmup)
    (args.out / "ab.json").write_text(json.dumps(result, indent=1) + "\n")
    text = table(args.out, result, lens, args.warmup)
    (args.out / "ab.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
