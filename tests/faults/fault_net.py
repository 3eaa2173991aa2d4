"""Test "hosts" on one machine: network namespaces joined by veth pairs to a bridge.

``Net`` creates, with names and addresses unique to it:

* a switch namespace holding a bridge;
* one namespace per host (``P``, ``D``, ``R``), each with a veth whose other end is on
  the bridge and an address ``10.A.B.<n>/24`` (``Net.ip(host)``);
* a veth from the test's own namespace to the bridge (``10.A.B.1``), so the test reaches
  every host directly;
* per host a second address ``10.A.(B+1).<n>`` on its loopback for its side channel
  (``Net.side_ip(host)``), reached from the others through a :class:`LinkProxy` (see
  fault_proxy.py) that listens for it inside each peer's namespace.

``Net.delete()`` removes every namespace (and so every veth) it made; it runs on failure
too. Everything is done with ``ip`` (iproute2) and ``tc``; it needs root.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import secrets
import socket
import subprocess
import threading
from pathlib import Path

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no iproute2, no permission)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


def why_unavailable() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); run the fault matrix as root"
    name = f"kvchk{secrets.token_hex(3)}"
    try:
        r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True,
                           timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`ip netns add` failed: {e}"
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)
    return None


class Net:
    def __init__(self, hosts: tuple[str, ...] = ("P", "D", "R")) -> None:
        self.tag = secrets.token_hex(2)
        self.a, self.b = random.randrange(100, 250), random.randrange(0, 254, 2)
        self.hosts = hosts
        self.switch = f"kvsw-{self.tag}"
        self.ns = {h: f"kv{h.lower()}-{self.tag}" for h in hosts}
        self.veth = {h: f"kv{self.tag}{h.lower()}" for h in hosts}  # name inside host ns
        self.root_veth = f"kv{self.tag}t"
        self._made: list[str] = []
        try:
            self._build()
        except Exception:
            self.delete()
            raise

    def ip(self, host: str) -> str:
        return f"10.{self.a}.{self.b}.{11 + self.hosts.index(host)}"

    def side_ip(self, host: str) -> str:
        return f"10.{self.a}.{self.b + 1}.{11 + self.hosts.index(host)}"

    @property
    def test_ip(self) -> str:
        return f"10.{self.a}.{self.b}.1"

    def _build(self) -> None:
        sw = self.switch
        _ip("netns", "add", sw)
        self._made.append(sw)
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for h in self.hosts:
            ns = self.ns[h]
            _ip("netns", "add", ns)
            self._made.append(ns)
            inner, outer = self.veth[h], f"kv{self.tag}{h.lower()}s"
            _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "netns", sw)
            _ip("-n", sw, "link", "set", outer, "master", "br0")
            _ip("-n", sw, "link", "set", outer, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{self.ip(h)}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            _ip("-n", ns, "addr", "add", f"{self.side_ip(h)}/32", "dev", "lo")
        # the test's own namespace on the bridge too
        outer = f"kv{self.tag}ts"
        _ip("link", "add", self.root_veth, "type", "veth", "peer", "name", outer)
        _ip("link", "set", outer, "netns", sw)
        _ip("-n", sw, "link", "set", outer, "master", "br0")
        _ip("-n", sw, "link", "set", outer, "up")
        _ip("addr", "add", f"{self.test_ip}/24", "dev", self.root_veth)
        _ip("link", "set", self.root_veth, "up")
        # each host reaches every other host's side-channel address through a proxy that
        # listens for it on its own loopback (LinkProxy)
        for h in self.hosts:
            for other in self.hosts:
                if other != h:
                    _ip("-n", self.ns[h], "addr", "add", f"{self.side_ip(other)}/32",
                        "dev", "lo")

    def exec_prefix(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns[host]]

    def rate_limit(self, host: str, rate: str | None) -> None:
        """tbf on ``host``'s veth (its egress), or none when ``rate`` is None."""
        dev = self.veth[host]
        subprocess.run(["tc", "-n", self.ns[host], "qdisc", "del", "dev", dev, "root"],
                       capture_output=True, timeout=20)
        if rate is not None:
            r = subprocess.run(["tc", "-n", self.ns[host], "qdisc", "add", "dev", dev, "root",
                                "tbf", "rate", rate, "burst", "16kb", "latency", "2s"],
                               capture_output=True, text=True, timeout=20)
            if r.returncode != 0:
                raise RuntimeError(f"tc tbf on {dev}: {r.stderr.strip()}")

    def sent_bytes(self, host: str) -> int:
        """Bytes ``host`` has sent on its veth (its root qdisc's counter)."""
        r = subprocess.run(["tc", "-s", "-n", self.ns[host], "qdisc", "show", "dev",
                            self.veth[host]], capture_output=True, text=True, timeout=20)
        for line in r.stdout.splitlines():
            words = line.split()
            if words[:1] == ["Sent"]:
                return int(words[1])
        raise RuntimeError(f"no qdisc counter on {self.veth[host]}: {r.stdout}{r.stderr}")

    def delete(self) -> None:
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made.clear()
        _ip("link", "del", self.root_veth, check=False)  # gone with the switch anyway

    def leftovers(self) -> list[str]:
        """Namespaces of this Net that still exist (empty after delete())."""
        r = _ip("netns", "list", check=False)
        return [line.split()[0] for line in r.stdout.splitlines()
                if line.split() and line.split()[0].endswith(f"-{self.tag}")]


def socket_in_ns(ns: str) -> socket.socket:
    """A TCP socket created inside namespace ``ns`` (it stays there; the caller's own
    namespace is untouched: the switch happens on a short-lived thread)."""
    out: dict = {}

    def work() -> None:
        try:
            fd = os.open(Path("/var/run/netns") / ns, os.O_RDONLY)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns({ns}): {os.strerror(err)}")
                out["sock"] = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            finally:
                os.close(fd)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            out["err"] = e

    t = threading.Thread(target=work, name=f"setns-{ns}")
    t.start()
    t.join(10)
    if "err" in out:
        raise out["err"]
    return out["sock"]


@contextlib.contextmanager
def net_or_skip():
    """Yield a Net, deleting it afterwards; pytest.skip when namespaces are unavailable."""
    import pytest

    why = why_unavailable()
    if why is not None:
        pytest.skip(why)
    net = Net()
    try:
        yield net
    finally:
        net.delete()
        assert not net.leftovers(), net.leftovers()
