"""A decode instance killed under steady load, and what the clients see (issue 63, point 6).

Starts `kvpush up` (push, 1 prefill, 2 decode, round-robin, tiny random Qwen3 unless
--model), sends streaming requests at --rate per second (Poisson arrivals, --prompt
random token ids, --max-tokens output tokens, ignore_eos) for --duration seconds, and
SIGKILLs one decode's process group a third of the way in. `up` restarts it; the router
migrates the requests it carried. Prints, as JSON: requests ok / failed, the TTFT p50 /
p99 of all requests and of those in flight at the kill (the migrated ones among them),
the migrations the router counted, the time from the kill until the restarted decode
is back in rotation and until it has served a leg again.

    PYTHONPATH=src .venv/bin/python benchmarks/migration_kill.py --rate 8 --duration 30

Not part of the test suite. Everything it starts it stops.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from router_overhead import child, free_port, listener_pid, model_or_tiny  # noqa: E402

from kvpush.bench.metrics import percentile  # noqa: E402


class Load:
    """Requests sent at Poisson times from one thread each; their fates."""

    def __init__(self, url: str, args: argparse.Namespace) -> None:
        self.url, self.args = url, args
        self.results: list[dict] = []
        self.threads: list[threading.Thread] = []
        self.rng = random.Random(0)

    def run(self, until: float) -> None:
        while time.monotonic() < until:
            t = threading.Thread(target=self._one, daemon=True)
            t.start()
            self.threads.append(t)
            time.sleep(self.rng.expovariate(self.args.rate))
        for t in self.threads:
            t.join(120)

    def _one(self) -> None:
        a = self.args
        body = {"prompt": [self.rng.randrange(10, 1000) for _ in range(a.prompt)],
                "max_tokens": a.max_tokens, "ignore_eos": True, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        r = {"start": time.monotonic(), "ttft": None, "ok": False, "tokens": 0}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body,
                              timeout=120) as resp:
                if resp.status_code != 200:
                    r["error"] = f"HTTP {resp.status_code}"
                for line in resp.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    frame = json.loads(line[6:])
                    if "error" in frame:
                        r["error"] = frame["error"]["message"]
                    elif frame.get("choices") and r["ttft"] is None:
                        r["ttft"] = time.monotonic() - r["start"]
                    if frame.get("usage"):
                        r["tokens"] = frame["usage"]["completion_tokens"]
            r["ok"] = "error" not in r and r["tokens"] == a.max_tokens
        except httpx.HTTPError as e:
            r["error"] = repr(e)
        r["end"] = time.monotonic()
        self.results.append(r)


def _decode_pid(up_pid: int, skip: set[int]) -> tuple[int, int]:
    """(pid, port) of a `kvpush serve --role decode` child of `up`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in skip:
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat[1]) == up_pid and b"--role" in argv and \
                argv[argv.index(b"--role") + 1] == b"decode":
            return int(entry.name), int(argv[argv.index(b"--port") + 1])
    raise RuntimeError("no decode child of kvpush up")


def _instance(url: str, port: int) -> dict:
    insts = httpx.get(url + "/router/instances", timeout=10).json()["instances"]
    return next(i for i in insts if i["url"].endswith(f":{port}"))


def _ms(xs: list[float], q: float) -> float | None:
    """The ``q``-th percentile of ``xs`` seconds, in ms (kvpush bench's; None: none)."""
    return round(1e3 * percentile(xs, q), 1) if xs else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--rate", type=float, default=8.0)
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmpdir = Path(tmp)
        model = model_or_tiny(args.model, tmpdir)
        port = free_port()
        argv = [sys.executable, "-m", "kvpush", "up", model, "--decode", "2", "--port",
                str(port), "--policy", "round-robin", "--health-interval", "0.5",
                "--restart-backoff", "0.5"]
        with child(argv, tmpdir / "up.log", f"http://127.0.0.1:{port}", timeout=300) as url:
            router_pid = listener_pid(port)
            up_pid = int(Path(f"/proc/{router_pid}/stat").read_text().rsplit(")", 1)[1]
                         .split()[1])  # the router's parent: `kvpush up`
            load = Load(url, args)
            t0 = time.monotonic()
            runner = threading.Thread(target=load.run, args=(t0 + args.duration,))
            runner.start()
            time.sleep(args.duration / 3)
            pid, dport = _decode_pid(up_pid, set())
            before = _instance(url, dport)
            killed = time.monotonic()
            os.killpg(pid, signal.SIGKILL)
            back = serves = None
            while runner.is_alive() or (back is None and time.monotonic() - killed < 120):
                inst = _instance(url, dport)
                if back is None and inst["healthy"] and inst["engine_id"] != before["engine_id"]:
                    back, base = time.monotonic() - killed, inst["requests"]
                if back is not None and serves is None and inst["requests"] > base:
                    serves = time.monotonic() - killed
                time.sleep(0.1)
            runner.join()
            metrics = httpx.get(url + "/metrics", timeout=10).text
        migrations = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                         if line.startswith("kvpush_router_migrations_total"))
        res = load.results
        hit = [r for r in res if r["start"] < killed < r["end"]]
        summary = {
            "command": " ".join(sys.argv), "rate": args.rate, "duration_s": args.duration,
            "prompt": args.prompt, "max_tokens": args.max_tokens,
            "requests": len(res), "ok": sum(r["ok"] for r in res),
            "failed": sum(not r["ok"] for r in res),
            "errors": sorted({r.get("error", "short") for r in res if not r["ok"]})[:5],
            "in_flight_at_kill": len(hit), "migrations": migrations,
            "ttft_ms_p50": _ms([r["ttft"] for r in res if r["ttft"]], 50),
            "ttft_ms_p99": _ms([r["ttft"] for r in res if r["ttft"]], 99),
            "in_flight_ttft_ms_p99": _ms([r["ttft"] for r in hit if r["ttft"]], 99),
            "in_flight_e2e_s_max": round(max((r["end"] - r["start"] for r in hit),
                                             default=0), 2),
            "back_in_rotation_s": None if back is None else round(back, 2),
            "serves_again_s": None if serves is None else round(serves, 2),
            "mean_e2e_s": round(statistics.mean(r["end"] - r["start"] for r in res), 2),
        }
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
