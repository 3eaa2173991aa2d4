"""`make demo`: start `kvpush serve` on the default model, send one chat request,
print the answer and its time to first token, then stop the server."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    port = free_port()
    cmd = [
        sys.executable, "-m", "kvpush", "serve", "smollm2-135m",
        "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
        "--kv-cache-memory", "512MiB",
    ]
    print("starting:", " ".join(cmd[2:]), flush=True)
    server = subprocess.Popen(cmd)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if server.poll() is not None:
                print(f"server exited with code {server.returncode}", file=sys.stderr)
                return 1
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                print("server did not become healthy in 180 s", file=sys.stderr)
                return 1
            time.sleep(0.5)
        question = "What is the capital of France? Answer in one sentence."
        body = {
            "model": "smollm2-135m",
            "messages": [{"role": "user", "content": question}],
            "max_tokens": 64,
            "temperature": 0,
            "stream": True,
        }
        print(f"\nuser: {question}\nassistant: ", end="", flush=True)
        t0 = time.perf_counter()
        ttft = None
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                if delta and ttft is None:
                    ttft = time.perf_counter() - t0
                print(delta, end="", flush=True)
        total = time.perf_counter() - t0
        print(f"\n\ntime to first token: {ttft * 1000:.0f} ms, total: {total:.2f} s")
        return 0
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


if __name__ == "__main__":
    sys.exit(main())
