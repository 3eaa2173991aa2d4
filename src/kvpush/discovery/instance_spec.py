"""How an instance is named on a command line: its base URL, optionally with its KV
identity (no heavy imports).

An instance is named by its base URL. kvpush instances tell routers who they are at
``GET /kv/info``; instances without that endpoint (vLLM) can be given their KV identity
in the URL itself, ``URL@ENGINE_ID@SIDE_HOST:SIDE_PORT``, which is used only when
``/kv/info`` answers 404. ``kvpush router --prefill/--decode`` (kvpush.router.config)
and ``kvpush serve --advertise-url`` (kvpush.discovery.cli_args) parse them here.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit


class InstanceSpecError(ValueError):
    """An instance spec that cannot be parsed (the CLI prints it and exits 2)."""


@dataclass(frozen=True)
class Identity:
    """What decode needs to know about a prefill instance before prefill answers (push):
    its engine id and side-channel address (vLLM: ``VLLM_NIXL_SIDE_CHANNEL_HOST/PORT`` and
    the ``engine_id`` of ``--kv-transfer-config``)."""

    engine_id: str
    side_channel_host: str
    side_channel_port: int


@dataclass(frozen=True)
class InstanceSpec:
    url: str  # normalized: scheme://host:port, no trailing slash
    explicit: Identity | None = None  # from URL@ENGINE_ID@HOST:PORT (instances without /kv/info)


def _port(text: str, what: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise InstanceSpecError(f"{what}: invalid port {text!r}") from None
    if not 0 < port < 65536:
        raise InstanceSpecError(f"{what}: port must be in 1..65535, got {port}")
    return port


def parse_instance(spec: str) -> InstanceSpec:
    """``http://host:port``, ``host:port``, or either followed by
    ``@ENGINE_ID@SIDE_HOST:SIDE_PORT``."""
    parts = spec.strip().split("@")
    if len(parts) not in (1, 3):
        raise InstanceSpecError(
            f"instance {spec!r}: expected URL or URL@ENGINE_ID@SIDE_HOST:SIDE_PORT")
    raw = parts[0].rstrip("/")
    if "://" not in raw:
        raw = "http://" + raw
    u = urlsplit(raw)
    if u.scheme not in ("http", "https") or not u.hostname or u.path or u.query:
        raise InstanceSpecError(f"instance {spec!r}: expected http://HOST:PORT")
    try:
        port = u.port
    except ValueError:
        raise InstanceSpecError(f"instance {spec!r}: invalid port") from None
    url = f"{u.scheme}://{u.netloc}"
    if port is None:
        raise InstanceSpecError(f"instance {spec!r}: the URL needs a port")
    explicit = None
    if len(parts) == 3:
        engine_id, side = parts[1], parts[2]
        host, sep, sport = side.rpartition(":")
        if not engine_id or not sep or not host:
            raise InstanceSpecError(
                f"instance {spec!r}: expected URL@ENGINE_ID@SIDE_HOST:SIDE_PORT")
        explicit = Identity(engine_id, host, _port(sport, f"instance {spec!r}"))
    return InstanceSpec(url, explicit)
