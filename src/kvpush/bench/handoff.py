"""`kvpush bench handoff`: what the P/D hand-off adds to an idle cluster's first token.

Starts one `kvpush up` cluster per mode (colocated, push, pull by default) side by side,
then sends one streaming completion at a time, rotating between the clusters so that
each mode sees the same host state, and measures the time to the first streamed chunk
on the client. The prompt is given as token ids (no tokenizer on the path) and is new
for every request (no prefix-cache hits). The figure is the median per mode and prompt
length; "push adds" is push's median minus colocated's, "pull/push" the ratio of the two
P/D medians.

With the default tiny random model compute is negligible, so what is measured is the
serving path itself: HTTP, router, scheduling, the hand-off. After the run each P/D
request's stage timestamps are read back from the clusters' request logs (the router's
``request`` lines and the instances' ``handoff`` lines, see docs/ARCHITECTURE.md) and
the median of each stage is printed as the hand-off timeline.

    kvpush bench handoff                          # tiny random model, 8 and 128 tokens
    kvpush bench handoff --requests 40 --out /tmp/handoff
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpush.bench.compare import CompareConfig


@dataclass
class HandoffConfig:
    modes: list[str] = field(default_factory=lambda: ["colocated", "push", "pull"])
    prompt_lens: list[int] = field(default_factory=lambda: [8, 128])
    requests: int = 40
    warmup: int = 5
    output_len: int = 2
    threads: int = 1
    model: str | None = None
    out_dir: Path | None = None
    #: where the clusters' logs go (default: a temporary folder, removed after the run)
    log_dir: Path | None = None
    seed: int = 0
    #: kvpush serve's --device for every instance (None: cpu)
    device: str | None = None
    #: the push cluster's --push-layers-per-write (None: the instances' default)
    push_layers_per_write: int | None = None
    startup_timeout: float = 300.0
    request_timeout: float = 30.0

    def validate(self) -> None:
        from kvpush.bench.compare import MODES

        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise ValueError(f"modes must be some of {', '.join(MODES)}, got {self.modes}")
        if not self.prompt_lens or min(self.prompt_lens) < 1:
            raise ValueError("prompt lengths must be at least 1")
        if self.requests < 1 or self.warmup < 0 or self.output_len < 1 or self.threads < 1:
            raise ValueError("requests, output_len and threads must be >= 1, warmup >= 0")
        if self.push_layers_per_write is not None and self.push_layers_per_write < 0:
            raise ValueError("--push-layers-per-write must be 0 (auto) or more")


def tiny_model(out: Path) -> Path:
    """The default model: a random Qwen3 of the ``bench`` preset (3 layers, hidden 128)
    with the test tokenizer, built for the run."""
    from kvpush.models.random_model import make_random_model

    return make_random_model(out, "qwen3", "bench")


def first_chunk_s(client: Any, url: str, body: dict[str, Any]) -> float:
    """Seconds from sending ``body`` to the first streamed chunk that carries a token."""
    t0 = time.perf_counter()
    with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.read()[:300]!r}")
        lines = resp.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                t = time.perf_counter() - t0
                if '"error"' in line:
                    raise RuntimeError(f"error in stream: {line[:300]}")
                for _ in lines:  # drain: the connection is reused
                    pass
                return t
    raise RuntimeError("stream ended without a chunk")


def rotation(modes: Sequence[str], i: int) -> list[str]:
    """Round ``i``'s order: each mode goes first, second, ... in turn."""
    k = i % len(modes)
    return list(modes[k:]) + list(modes[:k])


def _stats(values: Sequence[float]) -> dict[str, float]:
    from kvpush.bench.metrics import percentile

    return {"median_ms": statistics.median(values) * 1e3,
            "p90_ms": percentile(values, 90) * 1e3, "min_ms": min(values) * 1e3,
            "n": len(values)}


# ---------------------------------------------------------------- the timeline
_FIELD = re.compile(r"(\w+)=(\S+)")


def parse_log_lines(lines: Sequence[str], marker: str) -> dict[str, dict[str, str]]:
    """``key=value`` fields of every log line containing ``marker``, by its
    ``transfer`` field."""
    out: dict[str, dict[str, str]] = {}
    for line in lines:
        if marker not in line:
            continue
        fields = dict(_FIELD.findall(line))
        tid = fields.get("transfer")
        if tid and tid != "-":
            out.setdefault(tid, {}).update(fields)
    return out


#: stages of the push timeline: (label, from stamp, to stamp); stamps are the ``t_*``
#: fields (CLOCK_MONOTONIC seconds, one clock for every process on the host)
PUSH_STAGES = [
    ("router: request in -> legs sent", "r_in", "r_sent"),
    ("P: leg sent -> request in engine", "r_sent", "p_added"),
    ("P: in engine -> prefill step starts", "p_added", "p_step"),
    ("P: step starts -> token #1 sampled", "p_step", "p_first"),
    ("P: token #1 -> completion sent (last WRITEs done)", "p_first", "p_done_sent"),
    ("D: leg sent -> request in engine", "r_sent", "d_added"),
    ("D: in engine -> blocks registered", "d_added", "d_registered"),
    ("P: leg sent -> registration received", "r_sent", "p_reg"),
    ("D: blocks registered -> P: registration received", "d_registered", "p_reg"),
    ("D: completion sent -> received", "p_done_sent", "d_done"),
    ("D: completion received -> token #1 out", "d_done", "d_first"),
    ("router: token #1 out -> first byte at router", "d_first", "r_first"),
    ("total: request in -> first byte at router", "r_in", "r_first"),
]
PULL_STAGES = [
    ("router: request in -> prefill leg sent", "r_in", "r_sent"),
    ("P: leg sent -> request in engine", "r_sent", "p_added"),
    ("P: in engine -> prefill step starts", "p_added", "p_step"),
    ("P: step starts -> token #1 sampled", "p_step", "p_first"),
    ("P: answer -> decode leg sent (router)", "p_first", "r_d_sent"),
    ("D: leg sent -> request in engine", "r_d_sent", "d_added"),
    ("D: in engine -> READ posted", "d_added", "d_read_post"),
    ("D: READ posted -> READ done", "d_read_post", "d_read_done"),
    ("D: READ done -> token #1 out", "d_read_done", "d_first"),
    ("router: token #1 out -> first byte at router", "d_first", "r_first"),
    ("total: request in -> first byte at router", "r_in", "r_first"),
]


def timeline(log_dir: Path, mode: str) -> list[dict[str, Any]]:
    """Median milliseconds of each stage of ``mode``'s requests, from the cluster's logs."""
    lines: list[str] = []
    for path in sorted(log_dir.glob("*.log")):
        lines.extend(path.read_text(errors="replace").splitlines())
    stamps: dict[str, dict[str, float]] = {}
    for tid, fields in parse_log_lines(lines, "handoff ").items():
        stamps[tid] = {k[2:]: float(v) for k, v in fields.items() if k.startswith("t_")}
    for tid, fields in parse_log_lines(lines, "request ").items():
        if tid in stamps:
            stamps[tid].update({k[2:]: float(v) for k, v in fields.items()
                                if k.startswith("t_")})
    rows = []
    for label, a, b in PUSH_STAGES if mode == "push" else PULL_STAGES:
        d = [s[b] - s[a] for s in stamps.values() if a in s and b in s]
        if d:
            rows.append({"stage": label, "median_ms": statistics.median(d) * 1e3,
                         "n": len(d)})
    return rows


# ---------------------------------------------------------------- the run
def compare_config(cfg: HandoffConfig, model: str, out_dir: Path) -> CompareConfig:
    """The clusters' configuration: round-robin, so every request takes the P/D path
    being measured (the cache-aware default would serve these short prompts on decode
    alone)."""
    from kvpush.bench.compare import CompareConfig, ModeSpec

    return CompareConfig(modes=[ModeSpec(m, cfg.threads) for m in cfg.modes],
                         rates=[1.0], out_dir=out_dir, model=model,
                         startup_timeout=cfg.startup_timeout, policy="round-robin",
                         device=cfg.device, push_layers_per_write=cfg.push_layers_per_write)


def timelines_on(stack: contextlib.ExitStack) -> None:
    """The instances' hand-off lines are DEBUG records: the clusters started within
    ``stack`` log them (their environment, kvpush.logs), whatever their level."""
    from kvpush.kv_transfer.timeline import log as timeline_log
    from kvpush.logs import DEBUG_LOGGERS_ENV

    before = os.environ.get(DEBUG_LOGGERS_ENV)
    os.environ[DEBUG_LOGGERS_ENV] = ",".join(filter(None, (before, timeline_log.name)))

    def restore() -> None:
        if before is None:
            os.environ.pop(DEBUG_LOGGERS_ENV, None)
        else:
            os.environ[DEBUG_LOGGERS_ENV] = before

    stack.callback(restore)


def run_handoff(cfg: HandoffConfig, log=print) -> dict[str, Any]:
    import httpx

    from kvpush.bench.compare import Cluster, ModeSpec
    from kvpush.bench.machine import cpu_flags

    cfg.validate()
    with contextlib.ExitStack() as stack:
        timelines_on(stack)
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvpush-handoff-")))
        logs = cfg.log_dir or tmp / "logs"
        model = cfg.model or str(tiny_model(tmp / "model"))
        ccfg = compare_config(cfg, model, tmp)
        clusters = {}
        for mode in cfg.modes:
            log(f"[handoff] starting {mode} cluster")
            clusters[mode] = stack.enter_context(
                Cluster(ccfg, ModeSpec(mode, cfg.threads), model, logs / mode))
        client = stack.enter_context(httpx.Client(timeout=cfg.request_timeout))
        served = client.get(clusters[cfg.modes[0]].url + "/v1/models").json()["data"][0]["id"]
        vocab = _vocab_size(model)
        rng = random.Random(cfg.seed)
        results: dict[str, dict[str, Any]] = {}
        for n in cfg.prompt_lens:
            times: dict[str, list[float]] = {m: [] for m in cfg.modes}
            for i in range(cfg.warmup + cfg.requests):
                for mode in rotation(cfg.modes, i):
                    body = {"model": served, "stream": True, "max_tokens": cfg.output_len,
                            "temperature": 0, "ignore_eos": True,
                            "prompt": [rng.randrange(4, vocab) for _ in range(n)]}
                    t = first_chunk_s(client, clusters[mode].url, body)
                    if i >= cfg.warmup:
                        times[mode].append(t)
            results[str(n)] = {m: _stats(v) for m, v in times.items()}
            log("[handoff] " + f"{n} tokens: " + ", ".join(
                f"{m} {s['median_ms']:.1f} ms" for m, s in results[str(n)].items()))
        timelines = {m: timeline(logs / m, m) for m in cfg.modes if m != "colocated"}
    summary = {"config": {k: (str(v) if isinstance(v, Path) else v)
                          for k, v in vars(cfg).items() if k not in ("out_dir", "log_dir")},
               "cpu_flags": cpu_flags(), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                               time.gmtime()),
               "first_chunk": results, "timeline": timelines}
    if cfg.out_dir is not None:
        cfg.out_dir.mkdir(parents=True, exist_ok=True)
        (cfg.out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        (cfg.out_dir / "summary.md").write_text(markdown(summary) + "\n")
    return summary


def _vocab_size(model: str) -> int:
    from kvpush.config import ModelConfig
    from kvpush.models.registry import resolve_model

    return ModelConfig.from_dir(resolve_model(model)).vocab_size


def markdown(summary: dict[str, Any]) -> str:
    """The first-chunk table and the timelines, as Markdown."""
    res = summary["first_chunk"]
    modes = list(next(iter(res.values())))
    head = "| prompt | " + " | ".join(modes)
    extra = []
    if "colocated" in modes and "push" in modes:
        extra.append("push adds")
    if "pull" in modes and "push" in modes:
        extra.append("pull/push")
    lines = [f"Time to first chunk, median of {summary['config']['requests']} per mode "
             f"(p90 in brackets), one request at a time, modes interleaved; "
             f"{summary['date']}; CPU flags: {summary['cpu_flags']}", "",
             head + "".join(f" | {e}" for e in extra) + " |",
             "|---" * (1 + len(modes) + len(extra)) + "|"]
    for n, row in res.items():
        cells = [f"{row[m]['median_ms']:.1f} ({row[m]['p90_ms']:.1f}) ms" for m in modes]
        if "push adds" in extra:
            cells.append(f"{row['push']['median_ms'] - row['colocated']['median_ms']:+.1f} ms")
        if "pull/push" in extra:
            cells.append(f"{row['pull']['median_ms'] / row['push']['median_ms']:.2f}x")
        lines.append(f"| {n} tokens | " + " | ".join(cells) + " |")
    for mode, rows in summary["timeline"].items():
        if rows:
            lines += ["", f"{mode} hand-off timeline (median ms per stage, all prompt "
                      "lengths; stages overlap where legs run concurrently):", "",
                      "| stage | ms | n |", "|---|---:|---:|"]
            lines += [f"| {r['stage']} | {r['median_ms']:.2f} | {r['n']} |" for r in rows]
    return "\n".join(lines)


def add_handoff_parser(subparsers: Any) -> argparse.ArgumentParser:
    from kvpush.bench.compare import comma_list
    from kvpush.cli_types import positive_int

    p = subparsers.add_parser(
        "handoff", help="idle-cluster time to first chunk: colocated vs push vs pull",
        description=(__doc__ or "").split("\n\n")[1].replace("\n", " "),
        epilog="Example: kvpush bench handoff --requests 40 --out /tmp/handoff")
    p.add_argument("--modes", default="colocated,push,pull", type=comma_list(str.strip),
                   help="clusters to compare (default: colocated,push,pull)")
    p.add_argument("--prompt-lens", type=comma_list(positive_int), default=[8, 128],
                   metavar="N[,N]",
                   help="prompt lengths in tokens (default: 8,128)")
    p.add_argument("--requests", type=positive_int, default=40, metavar="N",
                   help="measured requests per mode and length (default: 40)")
    p.add_argument("--warmup", type=int, default=5, metavar="N",
                   help="unmeasured rounds first (default: 5)")
    p.add_argument("--output-len", type=positive_int, default=2, metavar="N",
                   help="max_tokens per request (default: 2)")
    p.add_argument("--threads", type=positive_int, default=1,
                   help="torch threads per instance (default: 1)")
    p.add_argument("--model", metavar="NAME_OR_DIR",
                   help="a kvpush model (default: a tiny random Qwen3 built for the run)")
    p.add_argument("--out", type=Path, metavar="DIR", help="write summary.json/.md here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", metavar="DEVICE",
                   help="every instance's --device: cpu or cuda[:N] (default: cpu)")
    p.add_argument("--log-dir", type=Path, metavar="DIR",
                   help="keep the clusters' logs (request and handoff lines) here")
    p.add_argument("--push-layers-per-write", type=int, metavar="N",
                   help="the push cluster's layers per WRITE during a prefill step (0: "
                        "auto; default: the instances' own)")
    p.set_defaults(func=run_handoff_cli)
    return p


def run_handoff_cli(args: argparse.Namespace) -> int:
    cfg = HandoffConfig(modes=args.modes, prompt_lens=args.prompt_lens,
                        requests=args.requests, warmup=args.warmup,
                        output_len=args.output_len, threads=args.threads, model=args.model,
                        out_dir=args.out, seed=args.seed, log_dir=args.log_dir,
                        device=args.device,
                        push_layers_per_write=args.push_layers_per_write)
    try:
        summary = run_handoff(cfg, log=lambda s: print(s, flush=True))
    except ValueError as e:
        print(f"kvpush bench handoff: {e}")
        return 2
    print(markdown(summary))
    return 0
