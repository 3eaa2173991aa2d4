"""Run the router in-process (uvicorn in a thread) over `kvpush serve` processes, start
several instances at once, restart one on its old port, and small client helpers.
Every wait here is bounded."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

import server_helpers
from kvpush.discovery.instance_spec import parse_instance
from kvpush.router.app import Router, build_app
from kvpush.router.config import RouterConfig
from server_helpers import ServerProcess
from waits import wait_until


class Instance:
    """A `kvpush serve` process that remembers how it was started (to restart it on the
    same port after a kill)."""

    def __init__(self, model_dir: Path, *args: str, log_dir: Path, name: str,
                 port: int | None = None) -> None:
        self.model_dir, self.args, self.log_dir, self.name = model_dir, args, log_dir, name
        self.proc = _start(model_dir, args, log_dir, name, port)

    @property
    def url(self) -> str:
        return self.proc.url

    @property
    def port(self) -> int:
        return self.proc.port

    def get(self, path: str) -> dict:
        return self.proc.get(path)

    def wait_all_free(self, timeout: float = 20.0) -> dict:
        return self.proc.wait_all_free(timeout)

    def kill(self) -> None:
        """SIGKILL the whole process group (no graceful anything), then reap it."""
        import os
        import signal

        if self.proc.proc.poll() is None:
            os.killpg(self.proc.proc.pid, signal.SIGKILL)
        self.proc.proc.wait(10)
        self.proc.stop()  # closes the log

    def restart(self) -> None:
        """Start it again, same flags, same HTTP port (blocks until healthy)."""
        self.proc.stop()
        self.proc = _start(self.model_dir, self.args, self.log_dir, self.name + "-again",
                           self.port)

    def stop(self) -> None:
        self.proc.stop()


_port_lock = threading.Lock()


def _start(model_dir: Path, args: tuple[str, ...], log_dir: Path, name: str,
           port: int | None) -> ServerProcess:
    if port is None:
        return ServerProcess(model_dir, *args, log_dir=log_dir, name=name)
    # ServerProcess always picks a free port; hand it the old one instead.
    with _port_lock:
        orig = server_helpers.free_port
        server_helpers.free_port = lambda: port
        try:
            return ServerProcess(model_dir, *args, log_dir=log_dir, name=name)
        finally:
            server_helpers.free_port = orig


def _start_once_more(model_dir: Path, args: tuple[str, ...], log_dir: Path,
                     name: str) -> Instance:
    """Start an instance; if it dies at start-up (a free port taken meanwhile by another
    process on a busy machine), say why and try once more on another port."""
    try:
        return Instance(model_dir, *args, log_dir=log_dir, name=name)
    except RuntimeError as e:
        print(f"{name} failed to start, trying again: {e}", file=sys.stderr)
        return Instance(model_dir, *args, log_dir=log_dir, name=name + "-retry")


def start_instances(model_dir: Path, specs: list[tuple[str, tuple[str, ...]]],
                    log_dir: Path) -> list[Instance]:
    """Start several instances at once: specs are (name, serve flags)."""
    with ThreadPoolExecutor(len(specs)) as ex:
        futs = [ex.submit(_start_once_more, model_dir, args, log_dir, name)
                for name, args in specs]
        out, errors = [], []
        for f in futs:
            try:
                out.append(f.result())
            except Exception as e:  # noqa: BLE001 - stop the others, then raise
                errors.append(e)
    if errors:
        for inst in out:
            inst.stop()
        raise errors[0]
    return out


#: KV flags of the shared router cluster, and its short leases (fault tests kill members)
CLUSTER_KV = ("--block-size", "16", "--num-blocks", "256")
CLUSTER_FAULTY = ("--lease-timeout", "2", "--heartbeat-interval", "0.2")


@dataclass
class RouterCluster:
    """The instances the router tests share (the ``router_cluster`` fixture): a single
    role=both instance (the reference, and the colocated mode's), a push 2P2D cluster
    with short leases (fault tests kill and restart its members), a pull 1P1D pair."""

    single: Instance
    push_p: list[Instance]
    push_d: list[Instance]
    pull_p: Instance
    pull_d: Instance

    def all(self) -> list[Instance]:
        return [self.single, *self.push_p, *self.push_d, self.pull_p, self.pull_d]

    def wait_all_free(self, timeout: float = 20.0) -> None:
        """Every instance's free-block count back at its total (a test leaves the cluster
        as it found it)."""
        for inst in self.all():
            inst.wait_all_free(timeout)

    def stop(self) -> None:
        for inst in self.all():
            inst.stop()


def start_router_cluster(model_dir: Path, log_dir: Path) -> RouterCluster:
    push = ("--kv-transfer", "push", *CLUSTER_KV, *CLUSTER_FAULTY)
    pull = ("--kv-transfer", "pull", *CLUSTER_KV, *CLUSTER_FAULTY)
    specs = [("single", CLUSTER_KV),
             ("P0", ("--role", "prefill", *push)), ("P1", ("--role", "prefill", *push)),
             ("D0", ("--role", "decode", *push)), ("D1", ("--role", "decode", *push)),
             ("pullP", ("--role", "prefill", *pull)), ("pullD", ("--role", "decode", *pull))]
    insts = start_instances(model_dir, specs, log_dir)
    return RouterCluster(insts[0], insts[1:3], insts[3:5], insts[5], insts[6])


def cluster_secret() -> bytes:
    """The secret of the tests' instances and routers (server_helpers)."""
    return os.environ.get("KVPUSH_KV_SECRET", server_helpers.TEST_KV_SECRET).encode()


def signed(card: Any) -> Any:
    """``card`` (kvpush.discovery.card) signed as an instance of the tests' cluster would."""
    from kvpush.discovery.card import sign

    return sign(card, cluster_secret())


class RouterThread:
    """`build_app(Router(cfg))` served by uvicorn on a free port in a daemon thread."""

    def __init__(self, mode: str, prefill: list[str], decode: list[str],
                 timeout: float = 30.0, wait: bool = True, **kw: Any) -> None:
        import uvicorn

        kw.setdefault("health_interval_s", 0.3)
        kw.setdefault("health_timeout_s", 1.0)
        kw.setdefault("startup_timeout_s", 20.0)
        kw.setdefault("request_timeout_s", 60.0)
        kw.setdefault("kv_secret", cluster_secret())
        self.cfg = RouterConfig(mode=mode, prefill=tuple(parse_instance(u) for u in prefill),
                                decode=tuple(parse_instance(u) for u in decode), **kw)
        self.router = Router(self.cfg)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        from kvpush.server.door import uvicorn_options

        self.server = uvicorn.Server(uvicorn.Config(
            build_app(self.router, wait=wait), log_level="warning", lifespan="on", access_log=False,
            timeout_graceful_shutdown=2,
            **uvicorn_options(self.cfg.header_timeout_s, self.cfg.max_client_connections)))
        self._loop: Any = None
        self.thread = threading.Thread(target=self.server.run,
                                       kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the router did not start")
            time.sleep(0.02)
        self._loop = self.server.servers[0].get_loop() if self.server.servers else None

    def instances(self) -> list[dict]:
        return httpx.get(self.url + "/router/instances", timeout=5).json()["instances"]

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=5).text

    def wait_for(self, cond: Callable[[], bool], timeout: float = 20.0, what: str = "") -> None:
        wait_until(cond, timeout, what)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()
        assert not self.thread.is_alive(), ("the router thread did not stop; it is at:\n"
                                            + thread_stack(self.thread, self._loop))


def over_cores(rt: RouterThread) -> RouterThread:
    """``rt`` once it serves over the engine cores (stopped if it does not within 20 s)."""
    try:
        wait_until(lambda: httpx.get(rt.url + "/health", timeout=5).json().get("legs")
                   == "engine cores", 20, "the router serves over the engine cores")
    except BaseException:
        rt.stop()
        raise
    return rt


def thread_stack(thread: threading.Thread, loop: Any = None) -> str:
    """Where ``thread`` is now, and the tasks still pending on its asyncio ``loop`` (a
    failure message: read from another thread, so a best effort)."""
    import asyncio
    import traceback

    frame = sys._current_frames().get(thread.ident or -1)
    lines = traceback.format_stack(frame) if frame is not None else ["(gone)\n"]
    if loop is not None:
        try:
            tasks = list(asyncio.all_tasks(loop))
        except RuntimeError as e:  # the set changed while read
            tasks, lines = [], [*lines, f"(tasks unreadable: {e})\n"]
        for t in tasks:
            lines.append(f"pending: {t!r}\n")
    return "".join(lines)


def stream(client: httpx.Client, url: str, body: dict, chat: bool = False,
           timeout: float = 60.0) -> tuple[int, str, str | None, list[dict], Any]:
    """POST a streaming request: (status, text, finish_reason, frames, error body or None).
    In-band error frames are in ``frames`` (they carry "error")."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    text, reason, frames = "", None, []
    with client.stream("POST", url + path, json={**body, "stream": True},
                       timeout=timeout) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, "", None, [], r.json()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            frame = json.loads(line[6:])
            frames.append(frame)
            if "error" in frame:
                continue
            for ch in frame["choices"]:
                text += (ch["delta"].get("content") or "") if chat else ch["text"]
                reason = ch.get("finish_reason") or reason
    return 200, text, reason, frames, None


def sse_text(client: httpx.Client, url: str, body: dict, chat: bool = False,
             timeout: float = 60.0) -> tuple[str, str | None, list[dict]]:
    """POST a streaming request that must succeed: (text, finish_reason, frames)."""
    status, text, reason, frames, err = stream(client, url, body, chat, timeout)
    assert status == 200, (status, err)
    return text, reason, frames


def answer_text(resp: dict, chat: bool = False) -> str:
    ch = resp["choices"][0]
    return ch["message"]["content"] if chat else ch["text"]


def metric_value(text: str, name: str, labels: str = "") -> float:
    """Sum of the samples of ``name`` whose label set contains ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {") and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


# ---- one workload for the router tests: prompts, chats, their greedy references

PROMPTS = ["the quick brown fox jumps over the lazy dog " * 3, "a b c d e f g",
           "hello world " * 20]
CHATS = [[{"role": "user", "content": "hi there"}],
         [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a b c"}]]
MAX_TOKENS = 10


def body(prompt: str, **kw: Any) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **kw}


def chat_body(messages: list[dict], **kw: Any) -> dict:
    return {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, **kw}


def reference_answers(url: str) -> dict:
    """Greedy answers of one instance: [("completion"|"chat", i)] -> text."""
    out = {}
    with httpx.Client(timeout=60) as c:
        for i, prompt in enumerate(PROMPTS):
            r = c.post(url + "/v1/completions", json=body(prompt))
            out[("completion", i)] = answer_text(r.json())
        for i, msgs in enumerate(CHATS):
            r = c.post(url + "/v1/chat/completions", json=chat_body(msgs))
            out[("chat", i)] = answer_text(r.json(), chat=True)
    return out
