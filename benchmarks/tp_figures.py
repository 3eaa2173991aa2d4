"""Tensor parallelism on the CPU (issue 52.6): TP 2 with one thread per rank against TP 1
with two threads, in one side-by-side run set.

Figures, per configuration and repeat (every configuration a fresh `kvpush up` cluster,
started, measured and stopped alone; the order alternates ABCD, DCBA, ... per repeat):

* ``prefill``: time to the first chunk of a ``--prompt-len`` (1,024) token request with
  one output token on an idle colocated instance, one request at a time (median);
* ``decode``: TPOT of ``--streams`` (8) concurrent streams on the same instance, mean over
  the streams, counted from the moment every stream has its first token (and vLLM's
  TPOT, from each stream's own first token);
* ``handoff``: the idle hand-off of `kvpush bench handoff` (first chunk, one request at a
  time, and the stage timeline from the clusters' logs): prefill TP 2 -> decode TP 1
  against TP 1 -> TP 1, push and pull (`kvpush up` gives every rank of a cluster the
  same --threads, so TP 1 -> TP 1's decode has 2 threads too; it computes nothing before
  the first chunk).

The model is SmolLM2-135M's geometry with an even head count (its 9 heads / 3 KV heads do
not split over 2 ranks): random weights built at run time (nothing is downloaded) with
the installed SmolLM2's tokenizer beside them. Prompts are token ids, new for every
request (no prefix-cache hits), the same for every configuration.

    PYTHONPATH=src python benchmarks/tp_figures.py                       # the full set
    PYTHONPATH=src python benchmarks/tp_figures.py --layers 4 --prompt-len 256 \\
        --repeats 1 --requests 2 --handoff-lens 64 --out /tmp/tp_smoke  # a smoke run

Writes summary.json and summary.md (command line, date, host CPU flags) to ``--out``
(default benchmarks/results/s52_tp). Not part of the test suite; it stops all it starts.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvpush.bench import handoff as ho
from kvpush.bench.compare import Cluster, ModeSpec, mode_order
from kvpush.bench.machine import SPEED_FLAGS, cpu_flags
from kvpush.bench.metrics import RequestResult
from kvpush.bench.stream import send_one

#: SmolLM2-135M (hidden 576, 30 layers, MLP 1536, vocab 49152, tied, head_dim 64, rope
#: 100000) with 8 query heads and 2 KV heads of 64 instead of 9 and 3 (q 512 wide, not 576)
SHAPE = dict(num_hidden_layers=30, hidden_size=576, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, intermediate_size=1536,
             max_position_embeddings=8192, rope_theta=100000.0, vocab_size=49152)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


@dataclasses.dataclass(frozen=True)
class Conf:
    label: str
    mode: str  # colocated (prefill, decode) or push / pull (the hand-off)
    threads: int  # per rank
    tp: int  # colocated: the instance's; P/D: prefill's (decode is TP 1)


def confs(handoff_modes: list[str]) -> list[Conf]:
    out = [Conf("TP2x1t", "colocated", 1, 2), Conf("TP1x2t", "colocated", 2, 1)]
    for m in handoff_modes:
        out += [Conf(f"{m} P-TP2x1t", m, 1, 2), Conf(f"{m} P-TP1x2t", m, 2, 1)]
    return out


def build_model(out: Path, layers: int) -> Path:
    """SHAPE (with ``layers`` layers) as random fp32 weights, SmolLM2's tokenizer beside."""
    from kvpush.models import random_model
    from kvpush.models.registry import resolve_model

    preset = f"smollm2-even-heads-{layers}l"
    random_model.PRESETS.setdefault(preset, {**SHAPE, "num_hidden_layers": layers})
    path = random_model.make_random_model(out, "llama", preset, tie_word_embeddings=True)
    smol = resolve_model("smollm2-135m")  # its special ids 0/1/2 are the test tokenizer's
    for name in TOKENIZER_FILES:
        shutil.copy(smol / name, path / name)
    return path


def host_flags() -> dict[str, bool]:
    """AVX2, AVX-512F, AVX512-BF16 and AMX: yes or no, from lscpu's Flags line."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        text = ""
    flags = set(next((ln.split(":", 1)[1].split() for ln in text.splitlines()
                      if ln.startswith("Flags:")), []))
    return {f: f in flags for f in SPEED_FLAGS}


def prompt(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, vocab) for _ in range(n)]


def body(served: str, ids: list[int], max_tokens: int) -> dict[str, Any]:
    return {"model": served, "prompt": ids, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}


def measure_prefill(client: Any, url: str, served: str, a: argparse.Namespace) -> list[float]:
    """First-chunk seconds of ``--requests`` one-token requests (after the warm-up)."""
    times = []
    for i in range(a.warmup + a.requests):
        t = ho.first_chunk_s(client, url, body(served, prompt(a.seed + i, a.prompt_len,
                                                               a.vocab), 1))
        if i >= a.warmup:
            times.append(t)
    return times


async def _streams(url: str, served: str, a: argparse.Namespace, seed: int,
                   out_len: int) -> list[RequestResult]:
    import httpx

    results = [RequestResult(prompt_len=a.decode_prompt_len) for _ in range(a.streams)]
    limits = httpx.Limits(max_connections=a.streams + 2)
    async with httpx.AsyncClient(timeout=a.request_timeout, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(
            send_one(client, url + "/v1/completions",
                     body(served, prompt(seed + k, a.decode_prompt_len, a.vocab), out_len),
                     r, False, t0, a.request_timeout) for k, r in enumerate(results)))
    bad = [r.error for r in results if not r.success]
    if bad:
        raise RuntimeError(f"{len(bad)} of {a.streams} streams failed: {bad[0]}")
    return results


def measure_decode(url: str, served: str, a: argparse.Namespace) -> dict[str, float]:
    """Mean TPOT (ms) of ``--streams`` streams at once, after one short warm-up round."""
    asyncio.run(_streams(url, served, a, a.seed + 10_000, 4))
    res = asyncio.run(_streams(url, served, a, a.seed + 20_000, a.decode_len))
    stamps = []
    for r in res:  # each token chunk's time since the round started
        t = [r.start_time + r.ttft]
        for gap in r.itl:
            t.append(t[-1] + gap)
        stamps.append(t)
    all_in = max(t[0] for t in stamps)  # every stream has its first token: all decode
    steady = [(t[-1] - s[0]) / (len(s) - 1) for t in stamps
              if len(s := [x for x in t if x >= all_in]) > 1]
    vllm = [r.tpot for r in res if r.tpot is not None]
    if not steady or not vllm:
        raise RuntimeError("no stream had two tokens: raise --decode-len")
    return {"tpot_all_decoding_ms": statistics.fmean(steady) * 1e3,
            "tpot_vllm_ms": statistics.fmean(vllm) * 1e3}


def measure_handoff(client: Any, url: str, served: str,
                    a: argparse.Namespace) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for n in a.handoff_lens:
        times = []
        for i in range(a.warmup + a.requests):
            ids = prompt(a.seed + 1000 * n + i, n, a.vocab)
            t = ho.first_chunk_s(client, url, body(served, ids, 2))
            if i >= a.warmup:
                times.append(t)
        out[str(n)] = times
    return out


def run_one(c: Conf, rep: int, model: str, tmp: Path, a: argparse.Namespace) -> dict:
    import httpx

    hcfg = ho.HandoffConfig(modes=[c.mode], threads=c.threads,
                            startup_timeout=a.startup_timeout)
    ccfg = ho.compare_config(hcfg, model, tmp)
    ccfg = dataclasses.replace(
        ccfg, dtype=a.dtype, max_model_len=a.max_model_len,
        tensor_parallel_size=c.tp if c.mode == "colocated" else 1,
        prefill_tp=c.tp if c.mode != "colocated" else None, decode_tp=1)
    logs = tmp / "logs" / c.label.replace(" ", "_") / f"rep{rep}"
    with Cluster(ccfg, ModeSpec(c.mode, c.threads), model, logs) as cl, \
            httpx.Client(timeout=a.request_timeout) as client:
        served = client.get(cl.url + "/v1/models").json()["data"][0]["id"]
        if c.mode == "colocated":
            got: dict[str, Any] = {"prefill_s": measure_prefill(client, cl.url, served, a)}
            got.update(measure_decode(cl.url, served, a))
            return got
        got = {"first_chunk_s": measure_handoff(client, cl.url, served, a)}
    got["timeline"] = ho.timeline(logs, c.mode)  # the logs are complete once stopped
    return got


def aggregate(c: Conf, runs: list[dict]) -> dict[str, Any]:
    med = statistics.median
    if c.mode == "colocated":
        return {"prefill_ms": [med(r["prefill_s"]) * 1e3 for r in runs],
                "tpot_all_decoding_ms": [r["tpot_all_decoding_ms"] for r in runs],
                "tpot_vllm_ms": [r["tpot_vllm_ms"] for r in runs]}
    stages: dict[str, list[float]] = {}
    for r in runs:
        for row in r["timeline"]:
            stages.setdefault(row["stage"], []).append(row["median_ms"])
    return {"first_chunk_ms": {n: [med(r["first_chunk_s"][n]) * 1e3 for r in runs]
                               for n in runs[0]["first_chunk_s"]},
            "timeline_ms": {s: med(v) for s, v in stages.items()}}


def fmt(values: list[float]) -> str:
    """Median over repeats, with each repeat's figure when there are several."""
    m = f"{statistics.median(values):.1f}"
    return m if len(values) == 1 else f"{m} ({' / '.join(f'{v:.1f}' for v in values)})"


def markdown(s: dict[str, Any]) -> str:
    f, a, yn = s["figures"], s["settings"], s["host"]["flags"]
    flags = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in yn.items())
    lines = [f"# Tensor parallelism on the CPU (issue 52.6), {s['date']}", "",
             f"Host: {s['host']['cpu']}; lscpu: {flags}; load average (1 min) before / "
             "after: {:.1f} / {:.1f}. dtype {}.".format(*s["host"]["load_1min_before_after"],
                                                      s["dtype"]),
             f"Model: {s['model']}.", "", "```", s["command"], "```", "",
             f"One run set, {a['repeats']} repeat(s), configurations alternating; every "
             "figure is the median over repeats (each repeat's in brackets).", "",
             f"## Colocated instance: {a['prompt_len']}-token prefill, decode at "
             f"{a['streams']} streams", "",
             "| configuration | prefill ms (1 output token, idle) | TPOT ms, all decoding | "
             "TPOT ms (vLLM's) |", "|---|---:|---:|---:|"]
    for label, g in f.items():
        if "prefill_ms" in g:
            lines.append(f"| {label} | {fmt(g['prefill_ms'])} | "
                         f"{fmt(g['tpot_all_decoding_ms'])} | {fmt(g['tpot_vllm_ms'])} |")
    hand = {k: g for k, g in f.items() if "first_chunk_ms" in g}
    if hand:
        lens = list(next(iter(hand.values()))["first_chunk_ms"])
        lines += ["", "## Idle hand-off, decode TP 1 (`bench handoff`'s first chunk, "
                  "output 2 tokens; P-TP1x2t's decode has 2 threads too)", "",
                  "| configuration | " + " | ".join(f"{n} tokens ms" for n in lens) + " |",
                  "|---" + "|---:" * len(lens) + "|"]
        lines += [f"| {k} | " + " | ".join(fmt(g["first_chunk_ms"][n]) for n in lens) + " |"
                  for k, g in hand.items()]
        for mode in dict.fromkeys(k.split()[0] for k in hand):
            cols = {k: g["timeline_ms"] for k, g in hand.items() if k.split()[0] == mode}
            lines += ["", f"{mode} hand-off timeline (median ms per stage, all lengths):",
                      "", "| stage | " + " | ".join(cols) + " |", "|---" + "|---:" * len(cols)
                      + "|"]
            lines += [f"| {st} | " + " | ".join(f"{t.get(st, float('nan')):.1f}" for t in
                                              cols.values()) + " |" for st in next(
                                                  iter(cols.values()))]
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",")]

    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--layers", type=int, default=30, help="model layers (default: 30)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=1024, help="the prefill's tokens")
    p.add_argument("--requests", type=int, default=5,
                   help="measured prefills (and hand-offs per length) per run")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests first")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--decode-prompt-len", type=int, default=128)
    p.add_argument("--decode-len", type=int, default=64, help="output tokens per stream")
    p.add_argument("--handoff-lens", type=ints, default=[128, 1024], metavar="N[,N]")
    p.add_argument("--handoff-modes", default="push,pull",
                   help="push, pull or both; empty: no hand-off figures")
    p.add_argument("--dtype", default=None, help="kvpush serve's --dtype (default: auto)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "s52_tp")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from kvpush.auto_dtype import choose

    a = parse(argv)
    a.vocab = SHAPE["vocab_size"]
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop the clusters too
    order = confs([m for m in a.handoff_modes.split(",") if m])
    runs: dict[str, list[dict]] = {c.label: [] for c in order}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="kvpush-tp-") as td:
        tmp = Path(td)
        t0 = time.monotonic()
        model = str(build_model(tmp / "model", a.layers))
        print(f"[tp] model built in {time.monotonic() - t0:.0f} s", flush=True)
        for rep in range(a.repeats):
            for c in mode_order(order, rep):
                t0 = time.monotonic()
                runs[c.label].append(run_one(c, rep, model, tmp, a))
                print(f"[tp] repeat {rep} {c.label}: {time.monotonic() - t0:.0f} s",
                      flush=True)
    load.append(os.getloadavg()[0])
    shape = {**SHAPE, "num_hidden_layers": a.layers}
    summary = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host": {"cpu": cpu_flags(), "flags": host_flags(), "load_1min_before_after": load},
        "dtype": a.dtype or choose("cpu").dtype.value,
        "model": "random Llama, SmolLM2-135M's shape but 8 heads / 2 KV heads: "
                 + ", ".join(f"{k} {v}" for k, v in shape.items()),
        "settings": {k: v for k, v in vars(a).items() if k != "out"},
        "figures": {c.label: aggregate(c, runs[c.label]) for c in order},
        "runs": runs,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (a.out / "summary.md").write_text(markdown(summary) + "\n")
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
