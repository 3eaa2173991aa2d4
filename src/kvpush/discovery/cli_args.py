"""The membership flags of `kvpush serve` (--register) and `kvpush router` (--discover),
and their checking. Import-cheap (argparse only): the parsers are built for --help."""

from __future__ import annotations

import argparse
from typing import Any

from kvpush import cli_types
from kvpush.discovery.target import (
    EtcdTarget,
    TargetError,
    add_etcd_auth_args,
    parse_target,
    resolve_auth,
)

WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def add_register_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("membership (etcd)")
    g.add_argument("--register", metavar="etcd://HOST:PORT/PREFIX",
                   help="once ready, write this instance's card (role, URL, engine id, side "
                        "channel, model, KV layout) in etcd under PREFIX, bound to a lease "
                        "kept alive; on SIGTERM the key goes first, then requests in flight "
                        "finish (docs/ROUTER.md, membership)")
    g.add_argument("--register-ttl", type=cli_types.positive_int, default=10,
                   metavar="SECONDS",
                   help="lease TTL: a crashed instance leaves the routers' view within it "
                        "(default: 10, at least 2)")
    g.add_argument("--advertise-url", metavar="URL",
                   help="the URL routers reach this instance at (default: http://HOST:PORT "
                        "of --host/--port; needed when --host is a wildcard)")
    g.add_argument("--drain-grace", type=cli_types.seconds, default=1.0, metavar="SECONDS",
                   help="on SIGTERM, how long the instance keeps taking requests after its "
                        "key is deleted, for the routers to see it go (default: 1)")
    add_etcd_auth_args(g)


def add_discover_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("membership (etcd)")
    g.add_argument("--discover", metavar="etcd://HOST:PORT/PREFIX",
                   help="watch PREFIX in etcd: instances that register there (kvpush serve "
                        "--register) join and leave the pool while the router runs, beside "
                        "any --prefill/--decode given")
    add_etcd_auth_args(g)


def resolve_target(text: str | None, args: argparse.Namespace) -> EtcdTarget | None:
    """The target of --register / --discover with its credentials (raises TargetError)."""
    if not text:
        return None
    return parse_target(text, resolve_auth(args))


def advertise_url(args: argparse.Namespace, port: int) -> str:
    """The URL the instance's card names (raises TargetError)."""
    if args.advertise_url:
        from kvpush.router.config import RouterConfigError, parse_instance

        try:
            spec: Any = parse_instance(args.advertise_url)
        except RouterConfigError as e:
            raise TargetError(f"--advertise-url: {e}") from None
        return spec.url
    if args.host in WILDCARD_HOSTS:
        raise TargetError(f"--host {args.host!r} is not an address routers can reach: give "
                          "--advertise-url http://ADDRESS:PORT (in Kubernetes, the pod IP)")
    host = f"[{args.host}]" if ":" in args.host else args.host
    return f"http://{host}:{port}"
