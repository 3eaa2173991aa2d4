"""The GPU check's serving steps: P/D over NIXL on the device, `bench compare`, `bench
handoff`. Each runs real `kvpush serve` processes (through the launcher that `kvpush up`
and `kvpush bench` use) with ``--device`` set, so the KV region the NIXL agents register
is GPU memory (VRAM) when the device is CUDA.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from model_steps import BENCH_PRESET, StepContext, _prompts, expect, model_dir

#: the P/D step's prompts (token counts; block size 16: 1 to 44 blocks) and answers
PD_PROMPT_LENS = [7, 100, 333, 700]
PD_MAX_TOKENS = 16
#: how long a P/D instance may take to give every block back after the last answer
FREE_WAIT_S = 10.0


def _metrics(client, url: str) -> dict[str, float]:
    text = client.get(url + "/metrics").text
    out = {}
    for name in ("kvpush_kv_blocks_free", "kvpush_kv_blocks_total"):
        m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
        if m:
            out[name] = float(m.group(1))
    return out


def _instances(cluster) -> list[Any]:
    return [c for c in cluster.sup.children if c.spec.role in ("prefill", "decode", "both")]


def _complete(client, url: str, served: str, prompt: list[int]) -> dict[str, Any]:
    body = {"model": served, "prompt": prompt, "max_tokens": PD_MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "logprobs": 1}
    r = client.post(url + "/v1/completions", json=body)
    if r.status_code != 200:
        return {"error": f"HTTP {r.status_code}: {r.text[:200]}"}
    choice = r.json()["choices"][0]
    return {"text": choice["text"], "tokens": choice["logprobs"]["tokens"]}


def pd(ctx: StepContext) -> dict[str, Any]:
    """A colocated instance, a push pair and a pull pair (each pair: a prefill and a
    decode process, NIXL over UCX, the router in front, round-robin so that every
    request takes the P/D path) on the device, fp32 so that answers compare exactly:
    every P/D answer equals the colocated one, and every instance's free blocks return
    to their count before the requests."""
    import httpx

    from kvpush.bench.compare import Cluster, CompareConfig, ModeSpec

    figs = ctx.figures
    path = str(model_dir(ctx, "qwen3", "tiny" if ctx.quick else "small"))
    modes = ["colocated", "push", "pull"]
    ccfg = CompareConfig(modes=[ModeSpec(m) for m in modes], rates=[1.0],
                         out_dir=ctx.work / "pd", model=path, startup_timeout=120,
                         policy="round-robin", device=ctx.device, dtype="float32",
                         block_size=16, max_model_len=2048, kv_cache_memory="256MiB")
    prompts = _prompts(PD_PROMPT_LENS * 2, seed=21)  # each length twice, different ids
    with contextlib.ExitStack() as stack:
        t0 = time.perf_counter()
        clusters = {m: stack.enter_context(Cluster(ccfg, ModeSpec(m, 2), path,
                                                   ctx.work / "pd-logs" / m))
                    for m in modes}
        figs["startup_s"] = round(time.perf_counter() - t0, 1)
        client = stack.enter_context(httpx.Client(timeout=60))
        served = client.get(clusters["colocated"].url + "/v1/models").json()["data"][0]["id"]
        before = {m: {c.name: _metrics(client, c.url) for c in _instances(cl)}
                  for m, cl in clusters.items()}
        answers: dict[str, list[dict[str, Any]]] = {}
        with ThreadPoolExecutor(4) as pool:  # several at once: batched steps, both sides
            for m, cl in clusters.items():
                answers[m] = list(pool.map(
                    lambda p, url=cl.url: _complete(client, url, served, p), prompts))
        errors = [f"{m}: {a['error']}" for m, al in answers.items() for a in al if "error" in a]
        figs["errors"] = errors[:4]
        for m in ("push", "pull"):
            figs[f"{m}_equals_colocated"] = answers[m] == answers["colocated"]
            figs[f"{m}_mismatches"] = [  # (prompt tokens, first differing answer token)
                (len(p), _first_diff(a.get("tokens", []), b.get("tokens", [])))
                for p, a, b in zip(prompts, answers[m], answers["colocated"]) if a != b]
        deadline = time.monotonic() + FREE_WAIT_S
        while True:
            after = {m: {c.name: _metrics(client, c.url) for c in _instances(cl)}
                     for m, cl in clusters.items()}
            back = {f"{m}/{n}": after[m][n].get("kvpush_kv_blocks_free")
                    == before[m][n].get("kvpush_kv_blocks_free") for m in after for n in after[m]}
            if all(back.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        figs["blocks_back"] = back
        figs["blocks_free_before"] = {f"{m}/{n}": v.get("kvpush_kv_blocks_free")
                                      for m in before for n, v in before[m].items()}
        kv = {}
        for m in ("push", "pull"):
            for c in _instances(clusters[m]):
                info = client.get(c.url + "/kv/info").json()
                kv[f"{m}/{c.name}"] = {k: info.get(k) for k in ("transport", "device", "layout")
                                       if k in info}
        figs["kv_info"] = kv
    expect(not errors, f"requests failed: {errors[:2]}")
    for m in ("push", "pull"):
        expect(figs[f"{m}_equals_colocated"], f"{m}: answers differ from the colocated ones")
    expect(all(back.values()), f"free blocks not back to their start: {back}")
    return figs


def _first_diff(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _bench_model_path(ctx: StepContext) -> Path:
    from model_steps import BENCH_SHAPE

    from kvpush.models import random_model

    shape = dict(BENCH_SHAPE)
    if ctx.quick:
        shape.update(num_hidden_layers=4)
    random_model.PRESETS.setdefault(BENCH_PRESET, shape)
    return model_dir(ctx, "qwen3", BENCH_PRESET)


def _kvpush(args: list[str], timeout: float, log: Path) -> subprocess.CompletedProcess:
    """``python -m kvpush ARGS``, bounded, its output kept in ``log``; SIGTERM at the
    bound so that the clusters it started are stopped by their supervisor."""
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvpush", *args], stdout=out,
                                stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode)


def compare(ctx: StepContext, budget: float) -> dict[str, Any]:
    """`kvpush bench compare` colocated / pull / push, 2,048 in / 128 out, rates 1, 2, 4
    (the announcement's shape), bf16 on CUDA, the bench model (Qwen3-32B's KV geometry)."""
    figs = ctx.figures
    path = _bench_model_path(ctx)
    out = ctx.work / "compare"
    n_in, n_out, n_prompts = (256, 16, 4) if ctx.quick else (2048, 128, 8)
    args = ["bench", "compare", "--model", str(path), "--modes", "colocated,pull,push",
            "--rates", "1,2,4", "--input-len", str(n_in), "--output-len", str(n_out),
            "--num-prompts", str(n_prompts), "--warmup", "1", "--out", str(out),
            "--device", ctx.device, "--policy", "round-robin", "--max-model-len", "4096",
            "--kv-cache-memory", "16GiB" if ctx.device.startswith("cuda") else "1GiB",
            "--startup-timeout", "90", "--run-timeout", "60",
            "--time-limit", str(int(max(30, budget - 25)))]
    if ctx.device.startswith("cuda"):
        args += ["--dtype", "bfloat16"]
    figs["command"] = "kvpush " + " ".join(args)
    run = _kvpush(args, budget - 5, ctx.work / "compare.log")
    figs["exit"] = run.returncode
    summary = out / "summary.json"
    expect(summary.exists(), f"no summary (exit {run.returncode}); see compare.log")
    data = json.loads(summary.read_text())
    keep = ("median_ttft_ms", "p90_ttft_ms", "median_tpot_ms", "p90_tpot_ms",
            "request_throughput", "completed", "failed")
    figs["cells"] = {k: {f: v.get(f) for f in keep} for k, v in data["cells"].items()}
    figs["ratios"] = {k: {f: v.get(f) for f in ("median_ttft_ms", "median_tpot_ms")}
                      for k, v in data.get("ratios", {}).items()}
    figs["markdown"] = (out / "summary.md").read_text() if (out / "summary.md").exists() else ""
    expected = [f"{m}@{r}" for m in ("colocated", "pull", "push") for r in ("1", "2", "4")]
    missing = [c for c in expected if c not in figs["cells"]]
    failed = {k: v["failed"] for k, v in figs["cells"].items() if v.get("failed")}
    expect(not missing, f"runs missing (time limit or errors): {missing}")
    expect(not failed and run.returncode == 0, f"failed requests: {failed}, exit {run.returncode}")
    return figs


def handoff(ctx: StepContext, budget: float) -> dict[str, Any]:
    """`kvpush bench handoff`: one request at a time, colocated / push / pull side by
    side, time to the first streamed chunk at 128 and 2,048 prompt tokens."""
    figs = ctx.figures
    path = _bench_model_path(ctx)
    out = ctx.work / "handoff"
    lens = "128,512" if ctx.quick else "128,2048"
    args = ["bench", "handoff", "--model", str(path), "--prompt-lens", lens,
            "--requests", "4" if ctx.quick else "10", "--warmup", "2", "--out", str(out),
            "--device", ctx.device, "--log-dir", str(ctx.work / "handoff-logs")]
    figs["command"] = "kvpush " + " ".join(args)
    run = _kvpush(args, budget - 5, ctx.work / "handoff.log")
    figs["exit"] = run.returncode
    summary = out / "summary.json"
    expect(summary.exists(), f"no summary (exit {run.returncode}); see handoff.log")
    data = json.loads(summary.read_text())
    figs["first_chunk_median_ms"] = {n: {m: round(s["median_ms"], 2) for m, s in per.items()}
                                     for n, per in data["first_chunk"].items()}
    figs["markdown"] = (out / "summary.md").read_text() if (out / "summary.md").exists() else ""
    expect(run.returncode == 0, f"exit {run.returncode}")
    return figs
