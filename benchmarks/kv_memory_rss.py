"""Resident memory of a `kvpush serve` instance for a given --kv-cache-memory.

Starts one instance (role both: it prefills and decodes, so it reserves the dense decode
cache on CPU like a decode instance), reads its VmRSS once /health answers, sends one
completion that decodes ``--max-tokens`` tokens, reads VmRSS and VmHWM again, prints
them with the split /kv/info reports (``kv_memory``; absent before issue 32), and stops
the instance. Run it against another checkout with ``PYTHONPATH=/that/src``; other
``kvpush serve`` flags pass through (``--decode-attention paged``, ``--role decode``).

    python benchmarks/kv_memory_rss.py ~/.cache/kvpush/models/smollm2-135m \\
        --kv-cache-memory 1GiB
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status_kib(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0])
    return out


def get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--max-model-len", default="2048")
    p.add_argument("--prompt-words", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    args, extra = p.parse_known_args()  # the rest: more `kvpush serve` flags
    port = free_port()
    cmd = [sys.executable, "-m", "kvpush", "serve", args.model, "--host", "127.0.0.1",
           "--port", str(port), "--threads", "1", "--kv-cache-memory",
           args.kv_cache_memory, "--max-model-len", args.max_model_len, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + args.startup_timeout
        while True:  # bounded by the deadline; start-up has no event to block on
            if proc.poll() is not None:
                print(proc.stderr.read(), file=sys.stderr)
                return 1
            try:
                get(base + "/health", 1.0)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError("the instance did not become healthy") from None
                time.sleep(0.2)
        ready = status_kib(proc.pid)
        info = json.loads(get(base + "/kv/info"))
        body = json.dumps({"model": info["model"], "prompt": "word " * args.prompt_words,
                           "max_tokens": args.max_tokens, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(base + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            usage = json.loads(r.read())["usage"]
        after = status_kib(proc.pid)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    mib = 1024
    print(f"kv_cache_memory {args.kv_cache_memory}, blocks {info['num_total_blocks']}, "
          f"kv_memory {json.dumps(info.get('kv_memory'))}")
    print(f"usage {usage}")
    print(f"RSS at ready {ready['VmRSS'] / mib:.0f} MiB; after the request "
          f"{after['VmRSS'] / mib:.0f} MiB; peak (VmHWM) {after['VmHWM'] / mib:.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
