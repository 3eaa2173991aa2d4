"""Soak: thousands of requests through `kvpush bench` against a `kvpush up` cluster.

For each mode (push by default; pull too with ``--modes push,pull``) it starts
`kvpush up` (1 prefill + 1 decode + router, tiny random Llama unless --model), samples
the resident memory (VmRSS from /proc) of every instance, its engine core and the
router once a second, runs `kvpush bench` (random prompts, Poisson arrivals; or with
--streams, that many requests in flight for --duration seconds), then checks:

* no failed request: every request completed, but for those whose tokens all decode to
  empty text (the random model's doing, which bench counts as failed: each is replayed
  and must come back with all its tokens; see ``empty_text_requests``);
* no leaked blocks: every instance's free-block count (GET /kv/info) is back to its
  count before the run, within --settle-timeout seconds of the last answer;
* resident memory flat after warm-up: a warm-up run first (--warmup-prompts sent at
  once, at most --max-concurrency in flight: the largest batches the measured run can
  make, so allocator high-water marks are reached before measuring), then the measured
  run (Poisson at --request-rate, at most --max-concurrency in flight); for each process,
  the highest RSS sampled during the measured run exceeds the RSS at its start by at
  most max(--rss-margin-mib, --rss-margin-pct of it).
* with --streams N: the warm-up run (--warmup-prompts) and then the measured run keep
  N requests in flight, sent as fast as they are answered, for --duration seconds in
  all (the measured run's size is the warm-up's rate times the time left); the RSS
  check is over the last --window seconds of that load.

Writes ``<out>/<mode>.json`` (bench result), ``<out>/<mode>_rss.csv`` (samples),
``<out>/summary.json`` and prints a Markdown table. Exit status 0 when every check
passed, 1 otherwise. `make soak` runs it; the figures are in benchmarks/SOAK.md.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
KVPUSH = [sys.executable, "-m", "kvpush"]


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


class Sampler(threading.Thread):
    """VmRSS of each named pid every ``interval`` seconds until stopped."""

    def __init__(self, pids: dict[str, int], interval: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.pids, self.interval = pids, interval
        self.samples: list[tuple[float, dict[str, int | None]]] = []
        self.stop_event = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        while not self.stop_event.is_set():
            self.samples.append((time.monotonic() - self.t0,
                                 {n: rss_kib(p) for n, p in self.pids.items()}))
            self.stop_event.wait(self.interval)

    def stop(self) -> None:
        self.stop_event.set()
        self.join(10)


class Up:
    """`kvpush up` as a child process; parses the instance URLs it prints."""

    def __init__(self, model: str, mode: str, log_dir: Path, extra: list[str],
                 timeout: float) -> None:
        self.log = open(log_dir / f"up-{mode}.out", "w")  # noqa: SIM115 - closed in stop()
        # round-robin: every request through the transfer path whose blocks the soak
        # counts (the cache-aware default serves short or cached prompts on decode alone)
        argv = [*KVPUSH, "up", "--model", model, "--mode", mode, "--port", "0",
                "--policy", "round-robin", "--log-dir", str(log_dir / mode), *extra]
        self.argv = argv
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.urls: dict[str, str] = {}
        self.endpoint = ""
        lines: list[str] = []
        ready = threading.Event()

        def reader() -> None:
            for line in self.proc.stdout:  # type: ignore[union-attr]
                self.log.write(line)
                self.log.flush()
                lines.append(line)
                m = re.match(r"\s+endpoint\s+(http://\S+)/v1", line)
                if m:
                    self.endpoint = m.group(1)
                m = re.match(r"\s+(prefill-\d+|decode-\d+|router)\s+(http://\S+)", line)
                if m:
                    self.urls[m.group(1)] = m.group(2)
                if line.startswith("Ctrl-C or SIGTERM"):
                    ready.set()
            ready.set()

        self.reader = threading.Thread(target=reader, daemon=True)
        self.reader.start()
        if not ready.wait(timeout) or self.proc.poll() is not None or not self.endpoint:
            self.stop()
            raise RuntimeError("kvpush up did not start:\n" + "".join(lines[-30:]))

    def pids(self) -> dict[str, int]:
        """name -> pid of each instance (its API process), its engine core
        (``<name>-core``) and the router (matched on --port)."""
        from kvpush.cluster.launcher import descendant_pids

        out = {}
        for pid in descendant_pids(self.proc.pid):
            argv = cmdline(pid)
            if "--port" not in argv:
                continue
            port = argv[argv.index("--port") + 1]
            for name, url in self.urls.items():
                if url.endswith(f":{port}"):
                    out[name] = pid
                    for child in descendant_pids(pid):
                        if "kvpush.engine.core_proc" in cmdline(child):
                            out[f"{name}-core"] = child
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.reader.join(10)
        self.log.close()


def free_blocks(url: str) -> tuple[int, int]:
    info = httpx.get(url + "/kv/info", timeout=10).json()
    return info["num_free_blocks"], info["num_total_blocks"]


def rss_verdict(samples, name: str, cut: float, margin_mib: float, margin_pct: float):
    """RSS after ``cut`` (seconds into the samples) against the RSS at ``cut``."""
    series = [(t, s[name]) for t, s in samples if s.get(name)]
    if len(series) < 10:
        return {"ok": False, "why": f"only {len(series)} samples"}
    warm = [v for t, v in series if t <= cut]
    after = [(t, v) for t, v in series if t > cut]
    base = warm[-1]
    peak = max(v for _, v in after)
    allowed = max(margin_mib * 1024, base * margin_pct / 100)
    # least-squares slope after warm-up, MiB per minute
    ts, vs = [t for t, _ in after], [v for _, v in after]
    mt, mv = statistics.fmean(ts), statistics.fmean(vs)
    den = sum((t - mt) ** 2 for t in ts) or 1.0
    slope = sum((t - mt) * (v - mv) for t, v in zip(ts, vs)) / den
    return {
        "ok": peak - base <= allowed,
        "start_mib": round(series[0][1] / 1024, 1),
        "after_warmup_mib": round(base / 1024, 1),
        "peak_after_warmup_mib": round(peak / 1024, 1),
        "end_mib": round(series[-1][1] / 1024, 1),
        "growth_mib": round((peak - base) / 1024, 1),
        "allowed_mib": round(allowed / 1024, 1),
        "slope_mib_per_min": round(slope * 60 / 1024, 2),
        "samples": len(series),
    }


NO_CONTENT = "the stream carried no content"


def empty_text_requests(bench_result: dict, model: str, endpoint: str, args,
                        num_prompts: int, seed: int) -> list[int]:
    """Failed requests that are the model's, not the server's: the stream's tokens all
    decode to empty text (a random-weight model does this for about 1 prompt in 1000),
    which `kvpush bench` counts as failed. Each is replayed through the router without
    streaming: it is one of these when it answers 200 with all --output-len tokens and
    empty text."""
    from kvpush.bench.datasets import PromptCodec, load_tokenizer, random_prompts

    idx = [i for i, e in enumerate(bench_result["errors"]) if e == NO_CONTENT]
    if not idx:
        return []
    reqs = random_prompts(PromptCodec(load_tokenizer(model)), num_prompts, args.input_len,
                          args.output_len, seed, spread=args.input_len_spread)
    out = []
    for i in idx:
        r = httpx.post(endpoint + "/v1/completions", timeout=60, json={
            "prompt": reqs[i].prompt, "max_tokens": args.output_len, "ignore_eos": True,
            "temperature": 0})
        j = r.json()
        if (r.status_code == 200 and j["choices"][0]["text"] == ""
                and j["usage"]["completion_tokens"] == args.output_len):
            out.append(i)
    return out


#: with --streams, the measured load is bench runs of about this many seconds each (sized
#: by the previous run's pace), so that it lasts --duration however fast the host is
CHUNK_S = 60.0


def merged(runs: list[tuple[int, int, int, dict]]) -> dict:
    """One bench result from consecutive runs' JSON: counts and time summed, latencies
    over every request (a single run's JSON as it is)."""
    if len(runs) == 1:
        return runs[0][3]
    js = [j for _, _, _, j in runs]
    ttft = [t for j in js for t, e in zip(j["ttfts"], j["errors"]) if not e]
    e2el = [t for j in js for t, e in zip(j["e2els"], j["errors"]) if not e]
    outs = [n for j in js for n, e in zip(j["output_lens"], j["errors"]) if not e]
    tpot = [(e - t) / (n - 1) for t, e, n in zip(ttft, e2el, outs) if n > 1]
    duration = sum(j["duration"] for j in js)
    completed = sum(j["completed"] for j in js)

    def ms(xs: list[float], q: float) -> float:
        return float(np.percentile(xs, q)) * 1e3 if xs else float("nan")

    return {"completed": completed, "failed": sum(j["failed"] for j in js),
            "duration": duration, "request_throughput": completed / duration,
            "median_ttft_ms": ms(ttft, 50), "p99_ttft_ms": ms(ttft, 99),
            "median_tpot_ms": ms(tpot, 50), "median_e2el_ms": ms(e2el, 50),
            "errors": [e for j in js for e in j["errors"]]}


def run_mode(args, mode: str, model: str, out: Path, logs: Path) -> dict:
    extra = ["--threads", "1", "--kv-cache-memory", args.kv_cache_memory,
             "--max-model-len", str(args.max_model_len), "--block-size", "16"]
    up = Up(model, mode, logs, extra, args.startup_timeout)
    result: dict = {"mode": mode, "up_command": " ".join(up.argv[2:])}
    try:
        instances = {n: u for n, u in up.urls.items() if n != "router"}
        before = {n: free_blocks(u) for n, u in instances.items()}
        pids = up.pids()
        sampler = Sampler(pids, args.sample_interval)
        sampler.start()
        in_flight = args.streams or args.max_concurrency
        common = [*KVPUSH, "bench", "--url", up.endpoint, "--dataset", "random",
                  "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                  "--input-len-spread", str(args.input_len_spread),
                  "--max-concurrency", str(in_flight), "--request-timeout", "60",
                  "--no-progress"]
        warm_seed = args.seed + 1000
        warm_json = out / f"{mode}_warmup.json"
        warm = [*common, "--num-prompts", str(args.warmup_prompts), "--request-rate", "inf",
                "--seed", str(warm_seed), "--out", str(warm_json)]
        result["warmup_command"] = "kvpush " + " ".join(warm[3:])
        load_t0 = time.monotonic()
        rc_warm = subprocess.run(warm, timeout=600, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.STDOUT).returncode
        result["warmup_exit"] = rc_warm
        cut = time.monotonic() - sampler.t0
        runs = []  # (seed, prompts, exit status, result JSON) of each measured bench run

        def measured(n: int, rate: str, seed: int, limit: float) -> None:
            path = out / f"{mode}_{len(runs)}.json" if args.streams else out / f"{mode}.json"
            cmd = [*common, "--num-prompts", str(n), "--request-rate", rate, "--seed",
                   str(seed), "--label", f"soak-{mode}", "--out", str(path)]
            result.setdefault("bench_commands", []).append("kvpush " + " ".join(cmd[3:]))
            with open(out / f"{mode}_bench.txt", "a") as txt:
                rc = subprocess.run(cmd, timeout=limit + 300, stdout=txt,
                                    stderr=subprocess.STDOUT).returncode
            runs.append((seed, n, rc, json.loads(path.read_text())))

        (out / f"{mode}_bench.txt").write_text("")
        t0 = time.monotonic()
        if args.streams:  # runs of about CHUNK_S at the last run's pace, to --duration
            wj = json.loads(warm_json.read_text())
            result["warmup_failed"] = wj["failed"]
            result["warmup_empty_text"] = empty_text_requests(
                wj, model, up.endpoint, args, args.warmup_prompts, warm_seed)
            pace, seed = wj["request_throughput"], args.seed
            while (left := args.duration - (time.monotonic() - load_t0)) > 5:
                measured(max(in_flight, round(pace * min(left, CHUNK_S))), "inf", seed,
                         4 * CHUNK_S)
                pace, seed = runs[-1][3]["request_throughput"], seed + 1
        else:
            measured(args.num_prompts, str(args.request_rate), args.seed,
                     args.num_prompts / args.request_rate * 4)
        result["bench_wall_s"] = round(time.monotonic() - t0, 1)
        result["load_s"] = round(time.monotonic() - load_t0, 1)
        if args.streams:  # the RSS check: the load's last --window seconds
            cut = time.monotonic() - sampler.t0 - args.window
        # blocks: back to the start within the settle timeout
        deadline = time.monotonic() + args.settle_timeout
        while True:
            after = {n: free_blocks(u) for n, u in instances.items()}
            if after == before or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        sampler.stop()
        with open(out / f"{mode}_rss.csv", "w", newline="") as f:
            w = csv.writer(f)
            names = sorted(pids)
            w.writerow(["t_s", *[f"{n}_rss_kib" for n in names]])
            for t, s in sampler.samples:
                w.writerow([round(t, 2), *[s.get(n) for n in names]])
        bj = merged(runs)
        empty = [f"{seed}:{i}" for seed, n, _, j in runs
                 for i in empty_text_requests(j, model, up.endpoint, args, n, seed)]
        num_prompts = sum(n for _, n, _, _ in runs)
        result.update({
            "num_prompts": num_prompts,
            "bench_exit": max(rc for _, _, rc, _ in runs),
            "completed": bj["completed"],
            "failed": bj["failed"],
            "empty_text": empty,  # counted failed by bench; the model's output, not a fault
            "real_failures": bj["failed"] - len(empty),
            "duration_s": round(bj["duration"], 1),
            "request_throughput": round(bj["request_throughput"], 2),
            "median_ttft_ms": round(bj["median_ttft_ms"], 1),
            "p99_ttft_ms": round(bj["p99_ttft_ms"], 1),
            "median_tpot_ms": round(bj["median_tpot_ms"], 2),
            "median_e2el_ms": round(bj["median_e2el_ms"], 1),
            "free_blocks_before": before,
            "free_blocks_after": after,
            "blocks_ok": after == before,
            "rss": {n: rss_verdict(sampler.samples, n, cut, args.rss_margin_mib,
                                   args.rss_margin_pct) for n in sorted(pids)},
            "measured_from_s": round(cut, 1),
        })
        result["requests_ok"] = result["real_failures"] == 0 and \
            bj["completed"] + len(empty) == num_prompts and \
            result.get("warmup_failed", 0) == len(result.get("warmup_empty_text", []))
        result["rss_ok"] = all(v["ok"] for v in result["rss"].values())
        result["ok"] = result["requests_ok"] and result["blocks_ok"] and result["rss_ok"]
        return result
    finally:
        up.stop()


def markdown(results: list[dict], args) -> str:
    lines = ["| mode | completed | failed (empty text) | wall s | req/s | median TTFT ms "
             "| p99 TTFT ms | median TPOT ms | blocks back | RSS ok |", "|---" * 10 + "|"]
    for r in results:
        lines.append(
            f"| {r['mode']} | {r['completed']} | {r['failed']} ({len(r['empty_text'])}) | "
            f"{r['duration_s']} | "
            f"{r['request_throughput']} | {r['median_ttft_ms']} | {r['p99_ttft_ms']} | "
            f"{r['median_tpot_ms']} | {'yes' if r['blocks_ok'] else 'NO'} | "
            f"{'yes' if r['rss_ok'] else 'NO'} |")
    since = f"last {args.window:g} s" if args.streams else "after warm-up"
    lines += ["", f"| mode | process | RSS start MiB | {since}: at start | peak | end | "
              "growth | allowed | slope MiB/min |", "|---" * 9 + "|"]
    for r in results:
        for n, v in r["rss"].items():
            if "start_mib" not in v:
                lines.append(f"| {r['mode']} | {n} | {v['why']} |")
                continue
            lines.append(
                f"| {r['mode']} | {n} | {v['start_mib']} | {v['after_warmup_mib']} | "
                f"{v['peak_after_warmup_mib']} | {v['end_mib']} | {v['growth_mib']} | "
                f"{v['allowed_mib']} | {v['slope_mib_per_min']} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model folder (default: a tiny random Llama, made here)")
    p.add_argument("--modes", default="push", help="comma-separated: push,pull")
    p.add_argument("--num-prompts", type=int, default=2500)
    p.add_argument("--request-rate", type=float, default=8.0)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-memory", default="16MiB")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--max-concurrency", type=int, default=16,
                   help="most requests in flight, warm-up and measured run (default: 16)")
    p.add_argument("--warmup-prompts", type=int, default=300,
                   help="requests of the warm-up burst before RSS is measured (default: 300)")
    p.add_argument("--streams", type=int, default=0,
                   help="keep this many requests in flight for --duration seconds instead "
                        "of Poisson arrivals (default: 0, Poisson)")
    p.add_argument("--duration", type=float, default=600.0,
                   help="with --streams: seconds of load, warm-up included (default: 600)")
    p.add_argument("--window", type=float, default=300.0,
                   help="with --streams: the RSS check covers the load's last this many "
                        "seconds (default: 300)")
    p.add_argument("--input-len-spread", type=float, default=0.0,
                   help="prompt lengths drawn from input-len x [1 - F, 1 + F] (kvpush "
                        "bench's flag; default: 0, all equal)")
    p.add_argument("--rss-margin-mib", type=float, default=32.0)
    p.add_argument("--rss-margin-pct", type=float, default=5.0)
    p.add_argument("--sample-interval", type=float, default=1.0)
    p.add_argument("--settle-timeout", type=float, default=30.0)
    p.add_argument("--startup-timeout", type=float, default=180.0)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/soak")
    p.add_argument("--log-dir", type=Path,
                   help="the cluster's logs (default: a temporary folder, removed)")
    args = p.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvpush-soak-") as tmp:
        logs = args.log_dir or Path(tmp) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        model = args.model
        if model is None:
            from kvpush.models.random_model import make_random_model

            model = str(make_random_model(Path(tmp) / "tiny-llama", "llama", "tiny", seed=0))
        results = []
        for mode in args.modes.split(","):
            load = (f"{args.streams} streams for {args.duration:g} s" if args.streams
                    else f"{args.num_prompts} requests at {args.request_rate}/s")
            print(f"soak: {mode} mode, {load} ...", flush=True)
            results.append(run_mode(args, mode, model, args.out, logs))
            print(json.dumps(results[-1], indent=1), flush=True)
    summary = {"args": {k: str(v) for k, v in vars(args).items()}, "results": results}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(markdown(results, args))
    ok = all(r["ok"] for r in results)
    print("soak: PASS" if ok else "soak: FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
