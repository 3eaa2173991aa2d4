"""UCX listens where the side channel listens (issue 30, finding 6): `kvpush serve`
derives UCX_NET_DEVICES from --side-channel-host unless it is set already."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

from kvpush.server import ucx_devices
from server_helpers import ServerProcess
from test_security import listening


def _own_ipv4() -> list[tuple[str, str]]:
    """(interface, IPv4 address) of every interface here that has one."""
    out = []
    for _, name in socket.if_nameindex():
        addr = ucx_devices._ipv4_address(name)
        if addr is not None:
            out.append((name, addr))
    return out


def test_hosts_map_to_devices() -> None:
    loopback = next(name for name, addr in _own_ipv4() if addr == "127.0.0.1")
    for host in ("127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.2"):
        assert ucx_devices.devices_for_host(host) == loopback, host
    for host in ("0.0.0.0", "::", "*", "[::]"):
        assert ucx_devices.devices_for_host(host) is None, host
    for name, addr in _own_ipv4():  # a specific address: the interface that has it
        if addr != "127.0.0.1":
            assert ucx_devices.devices_for_host(addr) == name
    assert ucx_devices.devices_for_host("203.0.113.77") is None  # TEST-NET-3: no one's
    assert ucx_devices.devices_for_host("no-such-host.invalid") is None


def test_apply_keeps_the_users_setting_and_says_what_it_did() -> None:
    env = {"UCX_NET_DEVICES": "mlx5_0:1,eth0"}
    got = ucx_devices.apply("127.0.0.1", env)
    assert env["UCX_NET_DEVICES"] == "mlx5_0:1,eth0" and got.value == "mlx5_0:1,eth0"
    assert "from the environment" in got.message
    env = {}
    got = ucx_devices.apply("127.0.0.1", env)
    assert env["UCX_NET_DEVICES"] == got.value == ucx_devices.devices_for_host("127.0.0.1")
    assert got.level == logging.INFO and "--side-channel-host 127.0.0.1" in got.message
    env = {"UCX_NET_DEVICES": ""}
    got = ucx_devices.apply("0.0.0.0", env)
    assert "UCX_NET_DEVICES" not in env and got.value is None
    assert got.level == logging.WARNING and "all interfaces" in got.message
    got = ucx_devices.apply("203.0.113.77", env)
    assert got.value is None and "no network interface" in got.message


@pytest.mark.timeout(180)
def test_plain_serve_binds_ucx_to_loopback(tiny_llama: Path, tmp_path: Path) -> None:
    """A plain `kvpush serve --role decode`, started without UCX_NET_DEVICES: every
    socket it listens on (HTTP, side channel, UCX) is on 127.0.0.1, and it says why."""
    srv = ServerProcess(tiny_llama, "--role", "decode", "--kv-transfer", "push",
                        "--num-blocks", "32", "--block-size", "16", "--max-model-len", "256",
                        "--log-level", "info", log_dir=tmp_path, name="decode",
                        unset_env=("UCX_NET_DEVICES",))
    try:
        info = srv.get("/kv/info")
        addrs = listening(srv.proc.pid)
        assert f"127.0.0.1:{srv.port}" in addrs
        assert f"127.0.0.1:{info['side_channel_port']}" in addrs
        assert len(addrs) > 2, addrs  # UCX's own listener(s) too
        assert all(a.startswith(("127.", "::1:")) for a in addrs), addrs
        assert "UCX_NET_DEVICES=lo" in srv.log_tail(200)
    finally:
        srv.stop()
