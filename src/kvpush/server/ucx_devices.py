"""``UCX_NET_DEVICES`` from ``--side-channel-host``: UCX listens where the side channel does.

NIXL's UCX backend opens listening TCP sockets (its connection manager, the TCP
transport) on every network device ``UCX_NET_DEVICES`` names, and on all of them when
it is unset: a plain ``kvpush serve --role decode`` with its side channel on 127.0.0.1
still accepted UCX connections on every interface of the host. UCX has no
authentication of its own (docs/SECURITY.md), so `kvpush serve` sets the variable itself
unless the user did, before NIXL is imported or its agent created:

* a loopback host (127.0.0.1, ::1, localhost) -> the loopback interface (``lo``);
* a specific address (or a name that resolves to one) -> the interface that has it,
  found with the standard library (``socket.if_nameindex`` and the ``SIOCGIFADDR``
  ioctl for IPv4, ``/proc/net/if_inet6`` for IPv6);
* a wildcard (0.0.0.0, ::) -> left unset: the side channel listens on all interfaces,
  so UCX does too, and the start-up log says so;
* an address no interface has -> left unset, with a warning (the side channel could not
  bind it either).

On RDMA hosts UCX also uses verbs devices (``mlx5_0:1``), which a network interface's
name leaves out: set ``UCX_NET_DEVICES`` yourself there (e.g. ``mlx5_0:1,eth0``); an
explicit value is always kept.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import struct
from collections.abc import MutableMapping
from dataclasses import dataclass

ENV = "UCX_NET_DEVICES"
#: hosts that bind every interface (ZMQ spells it "*")
WILDCARDS = frozenset({"0.0.0.0", "::", "*", ""})
#: ioctl request: the (primary) IPv4 address of an interface (linux/sockios.h)
SIOCGIFADDR = 0x8915
#: interface names are at most IFNAMSIZ - 1 bytes
IFNAMSIZ = 16


def _ipv4_address(name: str) -> str | None:
    """The IPv4 address of interface ``name``, or None (no address, not Linux)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not a POSIX system
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            ifreq = fcntl.ioctl(s.fileno(), SIOCGIFADDR,
                                struct.pack("256s", name.encode()[:IFNAMSIZ - 1]))
        except OSError:
            return None
    return socket.inet_ntoa(ifreq[20:24])  # struct ifreq: name, then a sockaddr_in


def _ipv6_addresses() -> list[tuple[ipaddress.IPv6Address, str]]:
    """(address, interface) of every IPv6 address here (Linux: /proc/net/if_inet6)."""
    out = []
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                cols = line.split()
                if len(cols) >= 6:
                    out.append((ipaddress.IPv6Address(int(cols[0], 16)), cols[5]))
    except OSError:
        pass
    return out


def interface_of(address: str) -> str | None:
    """The name of the network interface that has ``address`` (an IP), or None."""
    ip = ipaddress.ip_address(address)
    if ip.version == 4:
        for _, name in socket.if_nameindex():
            if _ipv4_address(name) == str(ip):
                return name
        return None
    return next((name for addr, name in _ipv6_addresses() if addr == ip), None)


def is_wildcard(host: str) -> bool:
    """Whether binding ``host`` listens on every interface (0.0.0.0, ::, ZMQ's *)."""
    h = host.strip().strip("[]")
    if h in WILDCARDS:
        return True
    try:
        return ipaddress.ip_address(h).is_unspecified
    except ValueError:
        return False


def _resolve(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """``host`` as an IP address (a name is resolved, first answer; OSError if not)."""
    h = host.strip().strip("[]")
    try:
        return ipaddress.ip_address(h)
    except ValueError:
        info = socket.getaddrinfo(h, None, type=socket.SOCK_STREAM)
        return ipaddress.ip_address(info[0][4][0])


def devices_for_host(host: str) -> str | None:
    """``UCX_NET_DEVICES`` for a side channel bound at ``host``: the interface that has
    the address, or None where UCX should (wildcard) or must (no such interface here)
    be left to use every device. See the module's docstring."""
    if is_wildcard(host):
        return None
    try:
        ip = _resolve(host)
    except OSError:
        return None
    if ip.is_loopback:
        # 127.0.0.2 and friends are no interface's own address, but all go through the
        # loopback interface: the one that has 127.0.0.1 ("lo" on Linux)
        return interface_of("127.0.0.1") or interface_of("::1") or "lo"
    return interface_of(str(ip))


@dataclass(frozen=True)
class UCXDevicesChoice:
    """What :func:`apply` did, for the start-up log."""

    value: str | None  # UCX_NET_DEVICES now (None: unset)
    level: int  # logging level of the message
    message: str


def apply(host: str, environ: MutableMapping[str, str]) -> UCXDevicesChoice:
    """Set ``UCX_NET_DEVICES`` in ``environ`` from the side-channel ``host`` unless it is
    set already (then it is kept); says what it did."""
    current = environ.get(ENV, "").strip()
    if current:
        return UCXDevicesChoice(current, logging.INFO,
                                f"{ENV}={current} (from the environment)")
    devices = devices_for_host(host)
    if devices is not None:
        environ[ENV] = devices
        return UCXDevicesChoice(devices, logging.INFO,
                                f"{ENV}={devices}: UCX listens on the interface of "
                                f"--side-channel-host {host}")
    environ.pop(ENV, None)
    if is_wildcard(host):
        why = f"--side-channel-host {host} listens on all interfaces"
    else:
        why = f"no network interface here has the address of --side-channel-host {host}"
    return UCXDevicesChoice(None, logging.WARNING,
                            f"{why}: {ENV} is left unset, so UCX listens on all interfaces "
                            f"(set {ENV} to restrict it)")
