"""The connector's settings: kvpush's own ``KVTransferConfig``, read from vLLM's
``--kv-transfer-config`` (``kv_role``, ``engine_id``, ``kv_connector_extra_config``) and
the environment, with the names kvpush's flags use.

``kv_connector_extra_config`` keys (each also as ``$KVPUSH_<KEY upper-cased>``, the
extra config first): ``kv_transfer`` (push | pull), ``side_channel_host``,
``side_channel_port`` (required: the router names it), ``kv_secret_file`` (else
``$KVPUSH_KV_SECRET``), ``insecure_kv_params`` (act on unsigned params), ``lease_timeout``,
``heartbeat_interval``, ``fence_timeout``, ``push_layers_per_write``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from kvpush.config import KVTransferConfig
from kvpush.errors import ConfigError

ROLES = {"kv_producer": "prefill", "kv_consumer": "decode"}
_TRUE = ("1", "true", "yes", "on")


def _get(extra: Mapping[str, Any], env: Mapping[str, str], key: str) -> Any:
    if key in extra and extra[key] is not None:
        return extra[key]
    return env.get(f"KVPUSH_{key.upper()}")


def _number(extra, env, key: str, default: float, kind=float) -> Any:
    value = _get(extra, env, key)
    if value is None:
        return default
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"kvpush connector: {key} must be a number, got {value!r}") from None
    if number < 0:
        raise ConfigError(f"kvpush connector: {key} must be >= 0, got {value!r}")
    return number


def connector_config(kv_role: str | None, engine_id: str | None,
                     extra: Mapping[str, Any] | None,
                     env: Mapping[str, str] | None = None) -> KVTransferConfig:
    """The transfer config of a vLLM instance loading the connector; ConfigError says
    what is wrong in the words of vLLM's ``--kv-transfer-config``."""
    from kvpush.server.auth import SecretError, resolve_kv_secret

    env = os.environ if env is None else env
    extra = dict(extra or {})
    role = ROLES.get(kv_role or "")
    if role is None:
        raise ConfigError(f"kvpush connector: kv_role must be kv_producer (prefill) or "
                          f"kv_consumer (decode), not {kv_role!r}")
    if not engine_id:
        raise ConfigError("kvpush connector: set engine_id in --kv-transfer-config (the "
                          "router names the prefill instance by it)")
    port = _number(extra, env, "side_channel_port", 0, int)
    if not 0 < port < 65536:
        raise ConfigError("kvpush connector: side_channel_port (kv_connector_extra_config "
                          "or $KVPUSH_SIDE_CHANNEL_PORT) must be a port in 1..65535: the "
                          "router and answers name it")
    try:
        secret, _ = resolve_kv_secret(_get(extra, {}, "kv_secret_file"), env)
    except SecretError as e:
        raise ConfigError(f"kvpush connector: {e}") from None
    cfg = KVTransferConfig(
        role=role, mode=str(_get(extra, env, "kv_transfer") or "push"),
        engine_id=engine_id,
        side_channel_host=str(_get(extra, env, "side_channel_host") or "127.0.0.1"),
        side_channel_port=port,
        lease_timeout_s=_number(extra, env, "lease_timeout", 15.0),
        heartbeat_interval_s=_number(extra, env, "heartbeat_interval", 1.0),
        fence_timeout_s=_number(extra, env, "fence_timeout", 300.0),
        push_layers_per_write=_number(extra, env, "push_layers_per_write", 0, int),
        side_channel_secret=secret,
        accept_unsigned_params=str(_get(extra, env, "insecure_kv_params") or "").lower()
        in _TRUE)
    cfg.validate()
    return cfg
