"""`make demo`: start a push-mode cluster with `kvpush up` (one prefill and one decode
instance of the default model, and the router), send a few chat requests through the
router, print each answer and its time to first token, then stop the cluster with
SIGTERM and check that it exited cleanly with no process left behind.

Exits non-zero if anything failed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx

from kvpush.cluster.launcher import alive, descendant_pids, free_port

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Name the three primary colors.",
    "Give me one tip for writing clear code.",
]
MAX_TOKENS = 48
READY_S = 180.0
STOP_S = 60.0
READY_LINE = "stops the cluster"  # the last line of `kvpush up`'s banner


def start_cluster(port: int) -> tuple[subprocess.Popen, threading.Event]:
    cmd = [sys.executable, "-m", "kvpush", "up", "--mode", "push", "--port", str(port),
           "--max-model-len", "2048", "--kv-cache-memory", "512MiB"]
    print("$ kvpush", " ".join(cmd[3:]), flush=True)
    # Its own session: a Ctrl-C of `make demo` reaches only this script, which then stops
    # the cluster with SIGTERM like any supervisor would.
    up = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
    ready = threading.Event()

    def echo() -> None:  # show `kvpush up`'s own output, and notice its banner
        assert up.stdout is not None
        for line in up.stdout:
            print(f"  [up] {line}", end="", flush=True)
            if READY_LINE in line:
                ready.set()

    threading.Thread(target=echo, name="up-output", daemon=True).start()
    return up, ready


def wait_ready(up: subprocess.Popen, ready: threading.Event, base: str) -> None:
    deadline = time.monotonic() + READY_S
    while not ready.wait(0.2):
        if up.poll() is not None:
            raise RuntimeError(f"kvpush up exited with code {up.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the cluster was not ready in {READY_S:.0f} s")
    r = httpx.get(f"{base}/health", timeout=5)
    if r.status_code != 200:
        raise RuntimeError(f"router /health answered {r.status_code}: {r.text}")


def ask(client: httpx.Client, base: str, question: str) -> tuple[float, float, int]:
    """Stream one greedy chat answer; (time to first token, total seconds, tokens)."""
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    print(f"\nuser: {question}\nassistant: ", end="", flush=True)
    t0 = time.perf_counter()
    ttft: float | None = None
    tokens = 0
    with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode(errors='replace')}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                delta = choice["delta"].get("content") or ""
                if delta and ttft is None:
                    ttft = time.perf_counter() - t0
                print(delta, end="", flush=True)
    total = time.perf_counter() - t0
    if ttft is None:
        raise RuntimeError("the answer was empty")
    print(f"\n  -> time to first token {ttft * 1000:.0f} ms, {tokens} tokens in "
          f"{total:.2f} s", flush=True)
    return ttft, total, tokens


def decisions(client: httpx.Client, base: str) -> str:
    """What the cache-aware router did with the requests (from its /metrics): `remote`
    sent a prefill leg (push), `local` let decode compute a short or cached prompt."""
    text = client.get(base + "/metrics").text
    found = re.findall(r'^kvpush_router_route_decisions_total\{decision="(\w+)"\} (\S+)',
                       text, re.M)
    counts = [f"{name} {float(n):.0f}" for name, n in found if float(n) > 0]
    return (", ".join(counts) or "none counted") + (
        " (local: decode computed the prompt itself, too short or too well cached for a "
        "prefill leg to pay; remote: prefill computed it and pushed the KV)")


def stop_cluster(up: subprocess.Popen, children: set[int]) -> bool:
    """SIGTERM `kvpush up`; True if it exited 0 in time and left no process behind."""
    if up.poll() is None:
        up.send_signal(signal.SIGTERM)
    try:
        code = up.wait(STOP_S)
    except subprocess.TimeoutExpired:
        print(f"\ndemo: kvpush up did not exit {STOP_S:.0f} s after SIGTERM; killing it",
              file=sys.stderr)
        up.kill()
        up.wait()
        code = None
    left = alive(children)
    for pid in left:  # should never happen; do not leave them running anyway
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    ok = code == 0 and not left
    print(f"\ndemo: cluster stopped (kvpush up exit code {code}, "
          f"{len(children)} child process(es), {len(left)} left behind)"
          + ("" if ok else " -- FAILED"), flush=True)
    return ok


def main() -> int:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    up, ready = start_cluster(port)
    children: set[int] = set()
    ok = False
    try:
        wait_ready(up, ready, base)
        children.update(descendant_pids(up.pid))
        print(f"demo: cluster ready in {time.monotonic() - started:.1f} s; "
              f"{len(QUESTIONS)} chat requests through the router at {base}/v1", flush=True)
        ttfts = []
        with httpx.Client(timeout=120) as client:
            for question in QUESTIONS:
                ttfts.append(ask(client, base, question)[0])
            decided = decisions(client, base)
        print("\ndemo: time to first token (push mode, through the router): "
              + ", ".join(f"{t * 1000:.0f} ms" for t in ttfts)
              + " (the first includes the prefill/decode handshake and warm-up)", flush=True)
        print("demo: the router's decisions: " + decided, flush=True)
        ok = True
    except (RuntimeError, httpx.HTTPError) as e:
        print(f"\ndemo: FAILED: {e}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("\ndemo: interrupted", file=sys.stderr, flush=True)
    finally:
        children.update(descendant_pids(up.pid) if up.poll() is None else [])
        stopped = stop_cluster(up, children)
    print(f"demo: {'done' if ok and stopped else 'FAILED'} in "
          f"{time.monotonic() - started:.1f} s", flush=True)
    return 0 if ok and stopped else 1


if __name__ == "__main__":
    sys.exit(main())
