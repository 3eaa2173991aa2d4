"""Start `kvpush serve` processes on 127.0.0.1 with free ports, and stop them."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from kvpush.cluster import launcher
from kvpush.crypto.auth import ParamsSigner

_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def free_port() -> int:
    """A free port on 127.0.0.1 that this test process has not handed out before: several
    instances started at once (start_instances) can otherwise get the same one, and the
    loser's health check may then see the winner answer (router_helpers patches this to
    restart an instance on its old port)."""
    with _handed_out_lock:
        for _ in range(100):
            port = launcher.free_port()
            if port not in _handed_out:
                _handed_out.add(port)
                return port
    raise RuntimeError("no fresh free port in 100 tries")


#: The cluster secret of the test session: every `kvpush serve` a test starts gets it
#: (unless the test gives its own, or --insecure-kv-params), and so does every in-process
#: router, which signs the legs' kv_transfer_params with it as `kvpush up` does.
TEST_KV_SECRET = os.urandom(16).hex()


def sign_kv(params: dict, to: dict, role: str, peer: dict | None = None) -> dict:
    """``params`` signed as the router signs them, for the instance whose /kv/info is
    ``to`` (``peer``: the other side's /kv/info)."""
    return ParamsSigner(TEST_KV_SECRET.encode()).sign(
        params, role=role, engine_id=to["engine_id"],
        peer_engine_id=peer["engine_id"] if peer else None)


def push_kv(tid: str, p_info: dict, d_info: dict) -> tuple[dict, dict]:
    """A push transfer's two legs' ``kv_transfer_params``, signed as the router signs
    them: (prefill's, decode's), for the instances whose /kv/info are given."""
    p_kv = sign_kv({"do_remote_decode": True, "transfer_id": tid}, p_info, "prefill")
    d_kv = sign_kv({"do_remote_prefill": True, "transfer_id": tid,
                    "remote_host": p_info["side_channel_host"],
                    "remote_port": p_info["side_channel_port"],
                    "remote_engine_id": p_info["engine_id"], "remote_request_id": tid},
                   d_info, "decode", p_info)
    return p_kv, d_kv


class ServerProcess:
    def __init__(self, model_dir: Path, *args: str, log_dir: Path, name: str = "server",
                 timeout: float = 90.0, unset_env: tuple[str, ...] = (),
                 command: tuple[str, ...] = ("-m", "kvpush", "serve")):
        """``unset_env``: variables the server starts without (UCX_NET_DEVICES is set
        to lo otherwise). ``command``: what the interpreter runs before MODEL_DIR
        (e.g. ``-m kvpush_testing.serve --die-when PATH``)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}-{self.port}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "UCX_NET_DEVICES": "lo",
               "NIXL_LOG_LEVEL": "WARN"}
        if "--kv-secret-file" not in args and "--insecure-kv-params" not in args:
            env.setdefault("KVPUSH_KV_SECRET", TEST_KV_SECRET)
        for var in unset_env:
            env.pop(var, None)
        cmd = [sys.executable, *command, str(model_dir), "--host", "127.0.0.1",
               "--port", str(self.port), "--threads", "1", "--log-level", "warning",
               # serve's default is auto (bf16 on bf16 CPUs): pin fp32 so the tests'
               # token-for-token comparisons mean the same on every host
               *(() if "--dtype" in args else ("--dtype", "float32")), *args]
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"{name} exited {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{name} not healthy in {timeout} s:\n{self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-n:])
        except OSError:
            return ""

    def get(self, path: str) -> dict:
        r = httpx.get(self.url + path, timeout=10)
        r.raise_for_status()
        return r.json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()

    def wait_all_free(self, timeout: float = 20.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            info = self.get("/kv/info")
            if info["num_free_blocks"] == info["num_total_blocks"]:
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"blocks not all free: {info}")
            time.sleep(0.05)


@contextlib.contextmanager
def uvicorn_server(app: Any) -> Iterator[str]:
    """Serve an ASGI app in this process on a free 127.0.0.1 port (a uvicorn thread);
    yields its URL and stops it on exit."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                           access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
    assert not thread.is_alive()


def child_pids(pid: int) -> list[int]:
    """The child processes of ``pid`` (from /proc)."""
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def all_child_pids(pid: int) -> list[int]:
    """The children of every thread of ``pid`` (tensor-parallel ranks are forked by a
    thread of the engine core, so ``child_pids`` does not list them)."""
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
            for c in (task / "children").read_text().split()]


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def closed_by_peer(s: socket.socket, timeout: float) -> bytes | None:
    """What the peer sent on ``s`` before closing it, or None when it is still open
    after ``timeout``."""
    s.settimeout(timeout)
    got = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return got
            got += chunk
    except (ConnectionResetError, BrokenPipeError):
        return got
    except TimeoutError:
        return None


@contextlib.contextmanager
def raised_descriptor_limit(need: int) -> Iterator[None]:
    """This process's soft descriptor limit raised to what the hard limit allows (up to
    4,096) for the block, then put back; the test is skipped below ``need``."""
    import resource

    import pytest

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)
    if want < need:
        pytest.skip(f"the hard descriptor limit ({hard}) is below the {need} this test needs")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

