"""argparse value types shared by every `kvpush` sub-command (torch-free, import-cheap)."""

from __future__ import annotations

import argparse
import math


def port(text: str) -> int:
    """A TCP port, 0 (pick a free one) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An integer ≥ 0 (bounds where 0 means none)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive_int(text: str) -> int:
    """An integer ≥ 1 (counts, lengths)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number ≥ 0 (weights)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number of 0 or more, got {text}")
    return value


def seconds(text: str) -> float:
    """A positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def parse_size(text: str, allow_zero: bool = False) -> int:
    """'512MiB', '2GiB', '1G', '1048576' → bytes (binary units for K/M/G/T); with
    ``allow_zero``, 0 (in any unit) too."""
    from kvpush.errors import ConfigError

    s = text.strip().upper().replace(" ", "")
    units = {
        "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40,
        "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
        "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "B": 1,
    }
    unit = next((u for u in units if s.endswith(u)), "")
    num, mult = (s[: -len(unit)], units[unit]) if unit else (s, 1)
    try:
        value = float(num)
    except ValueError:
        raise ConfigError(f"cannot read {text!r} as a size (e.g. 512MiB, 2GiB)") from None
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"size must be {'>= 0' if allow_zero else '> 0'}, got {text!r}")
    if value > 0 and int(value * mult) == 0:
        raise ConfigError(f"size {text!r} is less than one byte")
    return int(value * mult)


def size(text: str, allow_zero: bool = False) -> int:
    """argparse type for a memory size (see :func:`parse_size`)."""
    from kvpush.errors import ConfigError

    try:
        return parse_size(text, allow_zero)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def size_or_zero(text: str) -> int:
    """argparse type for a memory size where 0 means "none"."""
    return size(text, allow_zero=True)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address to bind or dial) only reaches this machine."""
    import ipaddress

    h = host.strip().strip("[]")
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False
