"""The membership flags of `kvpush serve` (--register) and `kvpush router` (--discover),
and their checking. Import-cheap (argparse only): the parsers are built for --help."""

from __future__ import annotations

import argparse

from kvpush import cli_types
from kvpush.discovery.target import (
    EtcdTarget,
    TargetError,
    add_etcd_auth_args,
    parse_target,
    resolve_auth,
)

WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def lease_ttl(text: str) -> int:
    """A registration lease TTL: whole seconds, at least 2 (renewed every third)."""
    value = cli_types.positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2 seconds, got {value}")
    return value


def http_url(text: str) -> str:
    """An instance URL routers can reach (http(s)://HOST:PORT), normalized."""
    from kvpush.discovery.instance_spec import InstanceSpecError, parse_instance

    try:
        return parse_instance(text).url
    except InstanceSpecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_register_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("membership (etcd)")
    g.add_argument("--register", metavar="etcd://HOST:PORT/PREFIX",
                   help="once ready, write this instance's card (role, URL, engine id, side "
                        "channel, model, KV layout) in etcd under PREFIX, bound to a lease "
                        "kept alive; on SIGTERM the key goes first, then requests in flight "
                        "finish (docs/ROUTER.md, membership)")
    g.add_argument("--register-ttl", type=lease_ttl, default=10,
                   metavar="SECONDS",
                   help="lease TTL: a crashed instance leaves the routers' view within it "
                        "(default: 10, at least 2)")
    g.add_argument("--advertise-url", type=http_url, metavar="URL",
                   help="the URL routers reach this instance at (default: http://HOST:PORT "
                        "of --host/--port; needed when --host is a wildcard). The instance "
                        "proves its membership (POST /kv/prove) for this URL and for the "
                        "address a router's challenge comes in on, no other: behind NAT "
                        "(a Kubernetes Service) give the URL routers use")
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
        return str(args.advertise_url)
    if args.host in WILDCARD_HOSTS:
        raise TargetError(f"--host {args.host!r} is not an address routers can reach: give "
                          "--advertise-url http://ADDRESS:PORT (in Kubernetes, the pod IP)")
    host = f"[{args.host}]" if ":" in args.host else args.host
    return f"http://{host}:{port}"
