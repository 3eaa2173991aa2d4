"""`kvpush router`: an OpenAI-compatible front over prefill and decode instances.

Only argparse is imported at module level: `kvpush --help` builds this parser and must
stay fast.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from kvpush import cli_types
from kvpush.logs import LOG_FORMATS
from kvpush.server.admin_key import ADMIN_KEY_HELP
from kvpush.server.door import add_door_args

LOG_LEVELS = ("debug", "info", "warning", "error")


def _instance(text: str) -> Any:
    from kvpush.discovery.instance_spec import InstanceSpecError, parse_instance

    try:
        return parse_instance(text)
    except InstanceSpecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_router_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `router` sub-command on ``subparsers`` (from add_subparsers)."""
    p = subparsers.add_parser(
        "router",
        help="route OpenAI requests over prefill and decode instances (push or pull KV)",
        description=(
            "An OpenAI-compatible front (/v1/completions, /v1/chat/completions, /v1/models, "
            "/health, /metrics) over prefill and decode instances. Each instance's "
            "identity (engine id, role, transfer mode, side channel) is read from its "
            "GET /kv/info at start-up and on every health check. push: both legs at once, "
            "decode streamed back; pull: prefill, then decode with prefill's "
            "kv_transfer_params; colocated: requests forwarded as they are to role=both "
            "instances. See docs/ROUTER.md (vLLM instances too)."),
        epilog=(
            "Instance URLs: http://HOST:PORT or HOST:PORT. An instance without /kv/info "
            "(vLLM) may carry its KV identity: URL@ENGINE_ID@SIDE_HOST:SIDE_PORT (used "
            "only when its /kv/info answers 404; needed for prefill in push mode)."),
    )
    p.add_argument("--prefill", nargs="+", action="extend", type=_instance, default=[],
                   metavar="URL", help="prefill instances (kvpush serve --role prefill); "
                                       "repeat or list several")
    p.add_argument("--decode", nargs="+", action="extend", type=_instance, default=[],
                   metavar="URL", help="decode instances (kvpush serve --role decode), or "
                                       "role=both instances with --mode colocated")
    p.add_argument("--mode", choices=("push", "pull", "colocated"), default="push",
                   help="push: both legs at once (default); pull: prefill then decode; "
                        "colocated: one leg to a role=both instance, request unchanged")
    p.add_argument("--policy", choices=("round-robin", "least-outstanding", "cache-aware"),
                   default=None,
                   help="how an instance is picked for each leg (default: cache-aware with "
                        "--mode push, else round-robin). least-outstanding: fewest legs in "
                        "flight, ties round-robin; cache-aware: the longest cached prefix "
                        "weighed against load, and no prefill leg when decode lacks at most "
                        "--local-prefill-max-tokens of the prompt (docs/ROUTER.md)")
    p.add_argument("--fallback-local-prefill", action="store_true",
                   help="with no healthy prefill instance, send requests to decode without "
                        "kv_transfer_params (decode prefills locally) instead of a 503")
    ca = p.add_argument_group("cache-aware policy")
    ca.add_argument("--tokenizer", metavar="PATH_OR_NAME",
                    help="the model's tokenizer (default: the model the decode instances "
                         "serve, from their /v1/models); it must be the instances' own. "
                         "The router renders and tokenizes every request with it")
    ca.add_argument("--local-prefill-max-tokens", type=cli_types.non_negative_int,
                    default=128, metavar="N",
                    help="decode computes the prompt itself, without a prefill leg, when "
                         "its prefix cache lacks at most N of its tokens (default: 128, "
                         "from a measurement: docs/ROUTER.md)")
    ca.add_argument("--load-cost-tokens", type=cli_types.non_negative_int, default=64,
                    metavar="N",
                    help="what one leg in flight on an instance weighs against prompt "
                         "tokens it has cached (default: 64)")
    ca.add_argument("--load-weight", type=cli_types.non_negative_float, default=1.0,
                    metavar="W",
                    help="what one KV token (prompt + answer bound) of a decode leg in "
                         "flight on an instance weighs against a prompt token it would "
                         "compute (default: 1.0; docs/ROUTER.md, Placement)")
    net = p.add_argument_group("HTTP")
    net.add_argument("--host", default="127.0.0.1",
                     help="address to listen on (default: 127.0.0.1)")
    net.add_argument("--port", type=cli_types.port, default=8000, help="TCP port (default: 8000)")
    net.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                     help="logging level; info logs one line per request (default: info)")
    net.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                     help="text: one line per record, wall-clock UTC time first "
                          "(default); json: one JSON object per line")
    net.add_argument("--api-key", metavar="KEY",
                     help="require 'Authorization: Bearer KEY' from clients on every path "
                          "but /health, and send it to the instances (default: "
                          "$KVPUSH_API_KEY; unset: no key). Prefer the environment variable")
    net.add_argument("--kv-secret-file", metavar="PATH",
                     help="the cluster secret (the instances' --kv-secret-file): the router "
                          "signs every leg's kv_transfer_params with it, and instances with "
                          "a secret act only on signed ones (default: $KVPUSH_KV_SECRET; "
                          "unset: unsigned, for instances run with --insecure-kv-params)")
    net.add_argument("--admin-key", metavar="KEY", default=None, help=ADMIN_KEY_HELP)
    net.add_argument("--allow-loose-secret-file", action="store_true",
                     help="use a --kv-secret-file that group or others can read (refused "
                          "otherwise; chmod 600 it instead)")
    t = p.add_argument_group("health and timeouts")
    t.add_argument("--health-interval", type=cli_types.seconds, default=2.0, metavar="SECONDS",
                   help="seconds between health checks (/health + /kv/info) of every "
                        "instance (default: 2)")
    t.add_argument("--health-timeout", type=cli_types.seconds, default=2.0, metavar="SECONDS",
                   help="bound of each health-check answer, read whole (default: 2)")
    t.add_argument("--migration-limit", type=cli_types.non_negative_int, default=3,
                   metavar="N",
                   help="times a request may move to another decode instance when its own "
                        "is lost mid-request, continuing from the tokens already sent "
                        "(0: never; default: 3)")
    t.add_argument("--slow-checks-tolerated", type=cli_types.positive_int, default=3,
                   metavar="N",
                   help="health checks in a row that may time out before an instance "
                        "leaves the rotation (never the last of its role, nor one whose "
                        "engine core link is up; default: 3)")
    t.add_argument("--startup-timeout", type=cli_types.seconds, default=60.0, metavar="SECONDS",
                   help="how long to wait at start for a usable decode (and prefill) "
                        "instance before giving up (default: 60)")
    t.add_argument("--connect-timeout", type=cli_types.seconds, default=5.0, metavar="SECONDS",
                   help="bound of connecting to an instance (default: 5)")
    t.add_argument("--request-timeout", type=cli_types.seconds, default=60.0, metavar="SECONDS",
                   help="bound of each read of an answer once it has started (a stream's "
                        "chunks): a stream silent this long ends with an error (default: 60)")
    t.add_argument("--first-byte-timeout", type=cli_types.seconds, default=600.0,
                   metavar="SECONDS",
                   help="bound of the wait for an instance's answer to start: a prefill leg "
                        "(nothing comes before prefill is done), decode's first token, a "
                        "whole non-streaming answer; a frozen or dead instance ends its "
                        "legs sooner, at its first failed health check (default: 600)")
    add_door_args(t, max_connections=4096)
    t.add_argument("--max-outstanding-requests", type=cli_types.positive_int, default=512,
                   metavar="N",
                   help="requests held at once; more are answered 429 with Retry-After "
                        "(default: 512)")
    from kvpush.discovery.cli_args import add_discover_args

    add_discover_args(p)
    p.add_argument("--max-instances", type=cli_types.positive_int, default=256, metavar="N",
                   help="with --discover: take at most N instances from etcd (the command "
                        "line's are not counted). Cards beyond are ignored, logged at a "
                        "bounded rate, and taken in as places free up: whoever can write "
                        "cards cannot make the router check and track without bound "
                        "(default: 256)")
    p.set_defaults(func=run_router, _router_parser=p)
    return p


def _fail(message: str, code: int = 2) -> int:
    print(f"kvpush router: error: {message}", file=sys.stderr)
    return code


def build_config(args: argparse.Namespace) -> Any:
    """The RouterConfig for parsed arguments (raises RouterConfigError)."""
    from kvpush.router.config import RouterConfig, RouterConfigError
    from kvpush.server.admin_key import resolve_admin_key
    from kvpush.server.auth import SecretError, resolve_api_key, resolve_kv_secret

    try:
        secret, warning = resolve_kv_secret(
            args.kv_secret_file, allow_loose=getattr(args, "allow_loose_secret_file", False))
    except SecretError as e:
        raise RouterConfigError(str(e)) from None
    if warning:
        print(f"kvpush router: warning: {warning}", file=sys.stderr)
    from kvpush.discovery.cli_args import resolve_target
    from kvpush.discovery.target import TargetError

    try:
        discover = resolve_target(args.discover, args)
    except TargetError as e:
        raise RouterConfigError(str(e)) from None
    return RouterConfig(discover=discover,
        mode=args.mode, prefill=tuple(args.prefill), decode=tuple(args.decode),
        policy=args.policy or ("cache-aware" if args.mode == "push" else "round-robin"),
        tokenizer=args.tokenizer, local_prefill_max_tokens=args.local_prefill_max_tokens,
        load_cost_tokens=args.load_cost_tokens, load_weight=args.load_weight,
        fallback_local_prefill=args.fallback_local_prefill,
        health_interval_s=args.health_interval, health_timeout_s=args.health_timeout,
        migration_limit=args.migration_limit,
        slow_checks_tolerated=args.slow_checks_tolerated,
        startup_timeout_s=args.startup_timeout, connect_timeout_s=args.connect_timeout,
        request_timeout_s=args.request_timeout, first_byte_timeout_s=args.first_byte_timeout,
        max_outstanding_requests=args.max_outstanding_requests,
        max_instances=args.max_instances,
        header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
        max_client_connections=args.max_client_connections,
        api_key=resolve_api_key(args.api_key), kv_secret=secret,
        admin_key=resolve_admin_key(getattr(args, "admin_key", None)))


def _loop_factory() -> Any:
    """uvloop's event loop when it is installed (uvicorn's own choice too: its
    transports cost less per write and per wake-up), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run_router(args: argparse.Namespace) -> int:
    from kvpush.router.config import RouterConfigError

    try:
        cfg = build_config(args)
    except RouterConfigError as e:
        args._router_parser.error(str(e))  # usage + message, exit 2
    from kvpush.logs import setup_logging

    setup_logging(args.log_level, args.log_format)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health check
    import asyncio

    from kvpush.router.app import Router, serve_forever
    from kvpush.router.pool import RouterStartupError
    from kvpush.server.cli import bind_listener, cannot_listen

    # bound before the wait for the instances (up to --startup-timeout): a port in use
    # is an error at once, and a port that `kvpush up` probed free is held from the start
    try:
        listener = bind_listener(args.host, args.port)
    except OSError as e:
        return _fail(cannot_listen(args.host, args.port, e))
    log = logging.getLogger("kvpush.router")
    router = Router(cfg)
    log.info("%s router, %s, %d prefill and %d decode instances%s%s; checking them",
             cfg.mode, cfg.policy, len(cfg.prefill), len(cfg.decode),
             f", more from {cfg.discover}" if cfg.discover else "",
             ", API key required" if cfg.api_key else "")
    from kvpush.cli_types import is_loopback

    if cfg.api_key is None and not is_loopback(args.host):
        log.warning("listening on %s without an API key: anyone who reaches this address "
                    "can use the router (--api-key or KVPUSH_API_KEY)", args.host)
    try:
        main = serve_forever(router, args.host, listener.getsockname()[1], args.log_level,
                             sockets=[listener])
        factory = _loop_factory()
        if factory is not None and hasattr(asyncio, "Runner"):  # Python 3.11+
            with asyncio.Runner(loop_factory=factory) as runner:
                started = runner.run(main)
        else:
            started = asyncio.run(main)
    except RouterConfigError as e:
        return _fail(f"misconfigured instance(s):\n{e}")
    except RouterStartupError as e:
        return _fail(str(e), code=1)
    return 0 if started else 1
