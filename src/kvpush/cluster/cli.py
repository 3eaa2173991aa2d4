"""`kvpush up`: a whole prefill/decode cluster on this host, in one command.

Only argparse (and the standard library) is imported at module level: `kvpush --help`
builds this parser and must not pay for torch or httpx.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpush import cli_types
from kvpush.cli_types import role_tensor_parallel as role_tp
from kvpush.kv_info import decode_kv_info
from kvpush.logs import LOG_FORMATS
from kvpush.server.admin_key import ADMIN_KEY_HELP

if TYPE_CHECKING:
    from kvpush.cluster.launcher import Child, ChildSpec, Supervisor
    from kvpush.cluster.supervision import Stop

HOST = "127.0.0.1"

EPILOG = """\
Start order: every instance at once, then (all healthy) the router with their URLs. The
endpoint, the instances and their roles, an example request and the log folder are
printed once the router is healthy. Each child runs in its own process group with its
output in <log-dir>/<name>.log; the children are killed by the kernel if `kvpush up`
itself dies (Linux PDEATHSIG). A child whose free port was taken before it could bind
it (between the probe and the child's start) is started again on a new free port, up to
3 times (the router's only with --port 0); the refused attempt's log stays as
<name>.port-<N>.log.

Stopping: Ctrl-C, SIGTERM or SIGHUP sends SIGTERM to every child, waits --stop-timeout
seconds (a second Ctrl-C: no wait), SIGKILLs what is left and reaps all.

An instance that exits while the cluster serves is started again on its port
(--restart-tries, --restart-backoff); the router takes it out of rotation and back at
its health checks. The router's exit, or every instance of a role out past its tries,
stops the cluster.

Exit status: 0 after a requested stop (also during start-up); 1 if a child fails to start
(exits, or is not healthy within --startup-timeout) or the cluster stops on its own (the
log tail of the child that stopped it is printed); 2 for a usage error (model not
installed, port in use, bad counts).

Engine flags: any `kvpush serve` flag not listed here goes after --, to every instance
(`kvpush up MODEL --decode 2 -- --max-num-seqs 8 --no-prefix-caching`), or to one role
with --prefill-args/--decode-args 'FLAGS'; they are checked with `kvpush serve`'s parser
before anything starts. `up` sets --host, --port, --role, --kv-transfer, --register and
the tensor parallelism itself (its own flags say how).

Children inherit the environment, plus PYTHONUNBUFFERED=1 and, unless set,
UCX_NET_DEVICES=lo and NIXL_LOG_LEVEL=WARN (every instance is on this host).

Security: every instance binds 127.0.0.1, the router --host (default 127.0.0.1). The
instances sign their side-channel messages with a random secret made for this cluster
(KVPUSH_KV_SECRET in the children's environment; an existing KVPUSH_KV_SECRET is used
instead). With --api-key (or KVPUSH_API_KEY) the router and every instance require
'Authorization: Bearer KEY'; the key reaches the children through their environment,
never their command line or logs.
"""



UP_USAGE = ("kvpush up [MODEL] [flags] [-- SERVE_FLAGS]\n"
            "       (SERVE_FLAGS: `kvpush serve` flags for every instance; one role: "
            "--prefill-args/--decode-args 'FLAGS')")

#: `kvpush serve` flags that `up` sets itself, with the `up` flag that says it instead
UP_SETS = {
    "--host": "the instances listen on 127.0.0.1; the router's address is up's --host",
    "--port": "up picks free ports; the router's is up's --port",
    "--role": "up's --prefill N / --decode M, or --mode colocated",
    "--kv-transfer": "up's --mode push|pull",
    "--kv-transfer-config": "up's --mode push|pull",
    "--register": "up's --discover", "--register-ttl": "up's --discover",
    "--tensor-parallel-size": "up's -tp, --prefill-tp, --decode-tp",
    "-tp": "up's -tp, --prefill-tp, --decode-tp",
    "--kv-secret-file": "up makes one secret per cluster (or takes KVPUSH_KV_SECRET)",
    "--api-key": "up's --api-key", "--admin-key": "up's --admin-key",
}


def _serve_parser(where: str) -> argparse.ArgumentParser:
    """`kvpush serve`'s parser, reporting its errors as `kvpush up`'s ``where``."""
    from kvpush.cli_types import Parser
    from kvpush.server.cli import add_serve_parser

    serve = add_serve_parser(Parser(prog="kvpush").add_subparsers())
    serve.prog = f"kvpush up ({where})"
    serve.usage = UP_USAGE
    return serve


def serve_flag_hint(flag: str) -> str | None:
    """What `kvpush up` says of an unknown ``flag`` that `kvpush serve` takes."""
    name = flag.split("=", 1)[0]
    if name not in _serve_parser("")._option_string_actions or name in UP_SETS:
        return None
    return (f"a `kvpush serve` flag: give it to every instance after --, as in "
            f"`kvpush up [MODEL] -- {name} ...`, or to one role with "
            f"--prefill-args/--decode-args '{name} ...'")


def role_serve_flags(args: argparse.Namespace, role: str) -> list[str]:
    """The `kvpush serve` flags the user gave a ``role`` instance: those after -- and
    the role's --prefill-args/--decode-args."""
    import shlex

    own = getattr(args, f"{role}_args", "") if role in ("prefill", "decode") else ""
    return [*getattr(args, "serve_args", []), *shlex.split(own or "")]


def check_serve_flags(args: argparse.Namespace, roles: list[str]) -> None:
    """Check each role's engine flags with `kvpush serve`'s parser (its "did you mean"
    and refusals; exit 2 on a problem) and refuse those `up` sets itself."""
    for role in dict.fromkeys(roles):
        flags = role_serve_flags(args, role)
        where = f"serve flags of the {role} instances"
        serve = _serve_parser(where)
        for tok in flags:
            name = tok.split("=", 1)[0]
            if name in UP_SETS:
                serve.error(f"{name} is set by kvpush up ({UP_SETS[name]})")
        serve.parse_args(["MODEL", *flags])


def add_up_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `up` sub-command on ``subparsers`` (from add_subparsers)."""
    p = subparsers.add_parser(
        "up",
        help="start prefill and decode instances and the router on this host",
        description=(
            "Start N prefill and M decode instances (`kvpush serve`) and the router\n"
            "(`kvpush router`) as child processes on 127.0.0.1 with free ports, wait until\n"
            "all are healthy, print the endpoint, and serve until Ctrl-C or SIGTERM; then\n"
            "stop every child."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage=UP_USAGE,
    )
    if isinstance(p, cli_types.Parser):  # (under a plain argparse parent: no -- tail)
        p.keep_tail("serve_args", serve_flag_hint)
    p.add_argument("model_pos", nargs="?", metavar="MODEL",
                   help="model folder, the name of a model installed with `kvpush models "
                        "install` or its Hugging Face id, as for `kvpush serve` (default: "
                        "the default model, smollm2-135m)")
    p.add_argument("--model", metavar="NAME_OR_DIR",
                   help="the same as MODEL")
    p.add_argument("--host", default=HOST,
                   help="address the router listens on (default: 127.0.0.1; 0.0.0.0 for "
                        "all); the instances listen on 127.0.0.1 whatever it is")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="model name clients send in `model` (default: MODEL as given, or "
                        "the model folder's name)")
    p.add_argument("--mode", choices=("push", "pull", "colocated"), default="push",
                   help="push: prefill WRITEs the KV into decode's blocks as it is computed "
                        "(default); pull: decode READs it after prefill (vLLM "
                        "NixlConnector); colocated: one --role both instance behind the "
                        "router, for comparison")
    p.add_argument("--prefill", type=cli_types.positive_int, metavar="N",
                   help="prefill instances (default: 1; not with --mode colocated)")
    p.add_argument("--decode", type=cli_types.positive_int, metavar="M",
                   help="decode instances (default: 1; not with --mode colocated)")
    p.add_argument("--port", type=cli_types.port, default=8000,
                   help="the router's port (default: 8000; 0: a free port)")
    p.add_argument("--log-dir", type=Path, metavar="DIR",
                   help="folder for the children's logs (default: a new folder under "
                        "<kvpush cache>/logs, where the newest 20 and any written to in the "
                        "last day are kept)")
    p.add_argument("--startup-timeout", type=cli_types.seconds, default=300.0, metavar="SECONDS",
                   help="how long every child may take to become healthy (default: 300)")
    p.add_argument("--stop-timeout", type=cli_types.seconds, default=20.0, metavar="SECONDS",
                   help="how long children may take to stop after SIGTERM before SIGKILL "
                        "(default: 20)")
    p.add_argument("--restart-tries", type=cli_types.non_negative_int, default=3, metavar="N",
                   help="an instance that exits while the cluster serves is started again "
                        "on its port up to N times, after 1, 2, 4... s (--restart-backoff), "
                        "its tries back once it has served 60 s; past them it stays out, "
                        "and the cluster stops once every instance of a role is out "
                        "(default: 3; 0: any exit stops the cluster)")
    p.add_argument("--restart-backoff", type=cli_types.seconds, default=1.0, metavar="SECONDS",
                   help="the first restart's delay, doubled for each next one up to 30 s "
                        "(default: 1)")
    p.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                   help="the children's logs: text (wall-clock UTC time first; default) "
                        "or json (one object per line)")

    eng = p.add_argument_group("instances (passed to each `kvpush serve`)")
    eng.add_argument("--threads", type=cli_types.positive_int, metavar="T",
                     help=cli_types.THREADS_PER_RANK_HELP)
    eng.add_argument("--max-model-len", type=int, metavar="TOKENS")
    eng.add_argument("--kv-cache-memory", metavar="SIZE",
                     help="each instance's KV memory in all, e.g. 512MiB, 2GiB (a decode "
                          "instance's dense decode cache included; at tensor parallelism "
                          "N each rank's, its slice of every block)")
    eng.add_argument("--decode-cache-memory", metavar="SIZE",
                     help="dense decode cache size, taken out of --kv-cache-memory by "
                          "the decode instances and reserved at start-up (default: half "
                          "of it, capped; 0: off; prefill instances have none)")
    eng.add_argument("--block-size", type=int, metavar="TOKENS")
    eng.add_argument("--device", metavar="DEVICE",
                     help="cpu or cuda[:N], every instance alike (default: serve's, cpu)")
    eng.add_argument("--dtype", metavar="DTYPE",
                     help="auto, float32, bfloat16 or float16; every instance of one "
                          "host resolves auto alike (default: serve's, auto)")
    cli_types.add_role_tensor_parallel_args(
        eng, "every instance", "--threads and --kv-cache-memory are then per rank ")
    eng.add_argument("--shuffle-free-blocks", type=int, nargs="?", const=0, metavar="SEED",
                     help="scatter every instance's KV block ids (fragmented-KV "
                          "benchmarks; see `kvpush serve --help`)")
    eng.add_argument("--prefix-hit-tail", choices=("prefill", "decode"),
                     help="push: who computes the tail when decode holds every full block "
                          "of a prompt (see `kvpush serve --help`; default: prefill)")
    eng.add_argument("--push-layers-per-write", type=int, metavar="N",
                     help="push: layers per WRITE during a prefill step (see `kvpush serve "
                          "--help`; default: 1 on CUDA, by 50 ms of compute on CPU)")
    eng.add_argument("--kv-digest", action="store_true",
                     help="every instance checks the KV it receives against prefill's "
                          "digests (see `kvpush serve --help`)")
    eng.add_argument("--prefill-args", metavar="'FLAGS'", default="",
                     help="`kvpush serve` flags for the prefill instances only, one "
                          "string (e.g. '--max-num-batched-tokens 4096'; one flag alone: "
                          "--prefill-args=--no-prefix-caching); after those given to every "
                          "instance after --")
    eng.add_argument("--decode-args", metavar="'FLAGS'", default="",
                     help="`kvpush serve` flags for the decode instances only (e.g. "
                          "'--max-num-seqs 64')")

    p.add_argument("--api-key", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on the router and every instance "
                        "(default: $KVPUSH_API_KEY; unset: no key)")
    p.add_argument("--admin-key", metavar="KEY", default=None,
                   help="the router's and every instance's " + ADMIN_KEY_HELP)

    mb = p.add_argument_group(
        "membership (etcd)",
        "--discover: the cluster runs through an etcd that `up` starts: instances "
        "register (kvpush serve --register), the router watches (kvpush router "
        "--discover). From another terminal, --add-prefill/--add-decode/--remove NAME "
        "change the running cluster (with its --log-dir, default the newest)")
    mb.add_argument("--discover", action="store_true",
                    help="start an etcd and run the cluster through it")
    ctl = mb.add_mutually_exclusive_group()
    ctl.add_argument("--add-prefill", action="store_true",
                     help="add a prefill instance to the running `up --discover`, and exit")
    ctl.add_argument("--add-decode", action="store_true",
                     help="add a decode instance to the running `up --discover`, and exit")
    ctl.add_argument("--remove", metavar="NAME",
                     help="drain instance NAME (e.g. decode-1) of the running `up "
                          "--discover`, and exit")

    rt = p.add_argument_group("router (passed to `kvpush router`)")
    rt.add_argument("--policy", choices=("round-robin", "least-outstanding", "cache-aware"),
                    help="how the router picks an instance (default: the router's: "
                         "cache-aware with --mode push)")
    rt.add_argument("--load-weight", type=cli_types.non_negative_float, metavar="W",
                    help="cache-aware placement: the weight of one KV token in flight on "
                         "a decode against one prompt token to compute (default: the "
                         "router's; docs/ROUTER.md)")
    rt.add_argument("--health-interval", type=cli_types.seconds, metavar="SECONDS",
                    help="how often the router checks its instances (default: the router's)")
    rt.add_argument("--migration-limit", type=cli_types.non_negative_int, metavar="N",
                    help="times a request may move to another decode instance when its own "
                         "is lost (0: never; default: the router's, 3)")
    cli_types.refuse_vllm_flags(p)
    p.set_defaults(func=run_up)
    return p


# ---- the plan: which processes, with which arguments --------------------------------
def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def model_arg(args: argparse.Namespace) -> str | None:
    """The model named by MODEL or --model (ValueError when both, differing)."""
    positional, flag = getattr(args, "model_pos", None), args.model
    if positional and flag and positional != flag:
        raise ValueError(f"two models: MODEL {positional} and --model {flag}; give one")
    return positional or flag


def dial_host(host: str) -> str:
    """The address to reach a server listening on ``host`` from this host (URL form)."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def instance_roles(args: argparse.Namespace) -> list[str]:
    """The role of each instance to start, prefill ones first."""
    if args.mode == "colocated":
        return ["both"]
    return ["prefill"] * (args.prefill or 1) + ["decode"] * (args.decode or 1)


def default_threads(num_ranks: int, cores: int | None = None) -> int:
    """One share of the cores per rank process (an instance at TP 1 is one rank), so
    engines on one host do not oversubscribe."""
    return max(1, (cores or usable_cores()) // max(1, num_ranks))


def spec_tp(spec: ChildSpec) -> int:
    """The tensor parallelism a `kvpush serve` child was started with (1: none)."""
    argv = spec.argv
    if "--tensor-parallel-size" in argv:
        return int(argv[argv.index("--tensor-parallel-size") + 1])
    return 1


def serve_argv(args: argparse.Namespace, model: str, role: str, port: int,
               threads: int) -> list[str]:
    """`kvpush serve`'s command line for one instance; ``threads`` is per rank."""
    argv = [sys.executable, "-m", "kvpush", "serve", model, "--host", HOST,
            "--port", str(port), "--role", role, "--threads", str(threads),
            *_log_format(args)]
    tp = role_tp(args, role)
    if tp > 1:
        argv += ["--tensor-parallel-size", str(tp)]
    if getattr(args, "served_model_name", None):
        argv += ["--served-model-name", args.served_model_name]
    if role != "both":
        argv += ["--kv-transfer", args.mode]
        if args.prefix_hit_tail is not None:
            argv += ["--prefix-hit-tail", args.prefix_hit_tail]
        if args.push_layers_per_write is not None:
            argv += ["--push-layers-per-write", str(args.push_layers_per_write)]
        if getattr(args, "kv_digest", False):
            argv += ["--kv-digest"]
    for flag, value in (("--max-model-len", args.max_model_len),
                        ("--kv-cache-memory", args.kv_cache_memory),
                        ("--decode-cache-memory", args.decode_cache_memory),
                        ("--block-size", args.block_size), ("--dtype", args.dtype),
                        ("--device", getattr(args, "device", None)),
                        ("--shuffle-free-blocks", args.shuffle_free_blocks)):
        if value is not None:
            argv += [flag, str(value)]
    etcd = getattr(args, "etcd_url", None)
    if etcd:
        from kvpush.cluster.membership import REGISTER_TTL_S

        argv += ["--register", etcd, "--register-ttl", str(REGISTER_TTL_S)]
    return argv + role_serve_flags(args, role)  # last: the user's flags win


def _log_format(args: argparse.Namespace) -> list[str]:
    fmt = getattr(args, "log_format", "text")
    return [] if fmt == "text" else ["--log-format", fmt]


def router_argv(args: argparse.Namespace, port: int, prefill: list[str],
                decode: list[str]) -> list[str]:
    argv = [sys.executable, "-m", "kvpush", "router", "--mode", args.mode,
            "--host", getattr(args, "host", HOST), "--port", str(port), *_log_format(args)]
    if prefill:
        argv += ["--prefill", *prefill]
    if decode:
        argv += ["--decode", *decode]
    if args.policy is not None:
        argv += ["--policy", args.policy]
    if getattr(args, "load_weight", None) is not None:
        argv += ["--load-weight", str(args.load_weight)]
    if args.health_interval is not None:
        argv += ["--health-interval", str(args.health_interval)]
    if getattr(args, "migration_limit", None) is not None:
        argv += ["--migration-limit", str(args.migration_limit)]
    etcd = getattr(args, "etcd_url", None)
    if etcd:
        argv += ["--discover", etcd]
    return argv


def plan_instances(args: argparse.Namespace, model: str,
                   router_port: int = 0) -> list[ChildSpec]:
    """One spec per instance, each on its own free port (never the router's)."""
    from kvpush.cluster.launcher import ChildSpec, free_port

    roles = instance_roles(args)
    threads = args.threads or default_threads(sum(role_tp(args, r) for r in roles))
    specs, seen = [], {"prefill": 0, "decode": 0, "both": 0}
    taken = {router_port}
    for role in roles:
        name = f"{'instance' if role == 'both' else role}-{seen[role]}"
        seen[role] += 1
        port = free_port(HOST)
        while port in taken:
            port = free_port(HOST)
        taken.add(port)
        specs.append(ChildSpec(name, role, serve_argv(args, model, role, port, threads), port))
    return specs


def plan_router(args: argparse.Namespace, port: int, instances: list[Child]) -> ChildSpec:
    from kvpush.cluster.launcher import ChildSpec

    urls = {role: [c.url for c in instances if c.spec.role == role]
            for role in ("prefill", "decode", "both")}
    if getattr(args, "etcd_url", None):  # the router finds them in etcd
        argv = router_argv(args, port, [], [])
    elif args.mode == "colocated":  # one --role both instance serves whole requests
        argv = router_argv(args, port, [], urls["both"])
    else:
        argv = router_argv(args, port, urls["prefill"], urls["decode"])
    return ChildSpec("router", "router", argv, port, dial_host(getattr(args, "host", HOST)))


def child_env(api_key: str | None = None, admin_key: str | None = None) -> dict[str, str]:
    """The children's environment: ours, plus the cluster's side-channel secret (a fresh
    random one unless KVPUSH_KV_SECRET is set), the API key and the admin key (if any)."""
    import secrets

    from kvpush.server.admin_key import ADMIN_KEY_ENV
    from kvpush.server.auth import API_KEY_ENV, KV_SECRET_ENV

    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("UCX_NET_DEVICES", "lo")
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    if not env.get(KV_SECRET_ENV, "").strip():
        env[KV_SECRET_ENV] = secrets.token_hex(32)
    env.pop(API_KEY_ENV, None)
    if api_key:
        env[API_KEY_ENV] = api_key
    if admin_key:
        env[ADMIN_KEY_ENV] = admin_key
    return env


# ---- running it -----------------------------------------------------------------------
def _say(message: str = "") -> None:
    print(message, flush=True)


def _fail(message: str) -> int:
    print(f"kvpush up: error: {message}", file=sys.stderr, flush=True)
    return 2


def _report(child: Child, reason: str) -> None:
    tail = child.log_tail()
    body = "\n".join(f"  | {line}" for line in tail.splitlines()) or "  | (empty)"
    print(f"kvpush up: error: {child.name} ({child.url}) {reason}; last lines of "
          f"{child.log_path}:\n{body}", file=sys.stderr, flush=True)


def usage_problem(args: argparse.Namespace) -> str | None:
    if getattr(args, "discover", False) and args.mode == "colocated":
        return "--discover runs prefill and decode instances: use --mode push or pull"
    if args.mode == "colocated" and (args.prefill or args.decode):
        return ("--mode colocated runs one --role both instance; --prefill/--decode do "
                "not apply")
    if args.mode == "colocated" and (getattr(args, "prefill_tp", None)
                                     or getattr(args, "decode_tp", None)):
        return ("--mode colocated runs one --role both instance; --prefill-tp/--decode-tp "
                "do not apply (use --tensor-parallel-size)")
    return None


#: default log folders (<cache>/logs/up-*) kept when `kvpush up` makes a new one ...
KEEP_LOG_DIRS = 20
#: ... besides any written to within this many seconds (a cluster still running)
KEEP_RECENT_LOGS_S = 24 * 3600.0


def prune_log_dirs(base: Path, keep: int = KEEP_LOG_DIRS,
                   recent_s: float = KEEP_RECENT_LOGS_S) -> list[Path]:
    """Remove the oldest ``up-*`` folders under ``base`` beyond the newest ``keep``
    (their names start with the time they were made), except any with a file written
    to within ``recent_s`` seconds; returns what was removed."""
    import shutil

    dirs = sorted((d for d in base.glob("up-*") if d.is_dir()), key=lambda d: d.name)
    removed = []
    now = time.time()
    for d in dirs[:max(0, len(dirs) - keep)]:
        try:
            newest = max((f.stat().st_mtime for f in d.iterdir()), default=d.stat().st_mtime)
        except OSError:
            continue
        if now - newest < recent_s:
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


def _make_log_dir(args: argparse.Namespace) -> Path:
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
        return args.log_dir.resolve()
    from kvpush.models.registry import cache_root

    base = cache_root() / "logs"
    base.mkdir(parents=True, exist_ok=True)
    prune_log_dirs(base)
    return Path(tempfile.mkdtemp(prefix=time.strftime("up-%Y%m%d-%H%M%S-"), dir=base))


def _describe(child: Child, headers: dict[str, str]) -> str:
    import httpx

    extra = ""
    if child.spec.role in ("prefill", "decode"):
        try:
            info = decode_kv_info(httpx.get(f"{child.url}/kv/info", timeout=2,
                                            headers=headers).content)
            extra = f"  engine {info.engine_id}, side channel {info.side_channel}"
        except (httpx.HTTPError, ValueError):  # (MalformedAnswer: a ValueError)
            pass
    return (f"  {child.name:<11} {child.url}  role {child.spec.role}, "
            f"TP {spec_tp(child.spec)}{extra}")


def _served_model(child: Child, headers: dict[str, str]) -> str | None:
    import httpx

    try:
        return str(httpx.get(f"{child.url}/v1/models", timeout=2,
                             headers=headers).json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return None


def _router_routing(router: Child) -> str | None:
    """How the router routes, from its /health (open without a key): a line for the
    banner, loud when it cannot serve (no tokenizer)."""
    import httpx

    try:
        health = httpx.get(f"{router.url}/health", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return None
    if not isinstance(health, dict):
        return None
    error = health.get("error")
    if isinstance(error, dict) and error.get("code") == "no_tokenizer":
        return f"  WARNING     {error.get('message')}"
    routing = health.get("routing")
    return f"  {'routing':<11} {routing}" if routing else None


def _banner(args: argparse.Namespace, instances: list[Child], router: Child,
            log_dir: Path, started: float, api_key: str | None = None) -> None:
    from kvpush.server.auth import auth_header

    headers = auth_header(api_key)
    model = _served_model(instances[0], headers)
    body = '{%s"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}' % (
        f'"model": "{model}", ' if model else "")
    _say(f"\nkvpush up: ready in {time.monotonic() - started:.1f} s ({args.mode} mode)")
    listen = getattr(args, "host", HOST)
    _say(f"  endpoint    {router.url}/v1"
         + (f"  (listening on {listen})" if listen != router.spec.host else ""))
    for child in instances:
        _say(_describe(child, headers))
    _say(f"  {'router':<11} {router.url}  mode {args.mode}"
         + (f", policy {args.policy}" if args.policy else ""))
    routing = _router_routing(router)
    if routing is not None:
        _say(routing)
    _say(f"  logs        {log_dir}")
    auth = ' -H "Authorization: Bearer $KVPUSH_API_KEY"' if api_key else ""
    _say(f"try:\n  curl -s {router.url}/v1/chat/completions{auth} -H 'Content-Type: "
         f"application/json' \\\n    -d '{body}'")
    _say("Ctrl-C or SIGTERM stops the cluster.\n")


#: times a child whose port was taken before it bound is started again on a new one
PORT_RETRIES = 3


def port_clash(child: Child) -> bool:
    """Whether ``child`` exited because its port was taken (`kvpush serve`'s or uvicorn's
    bind error): the free port was probed before the child, a new process, bound it."""
    return child.poll() is not None and "address already in use" in child.log_tail().lower()


def start_healthy(sup: Supervisor, specs: list[ChildSpec], timeout: float,
                  retry_ports: bool = True) -> list[Child]:
    """Spawn ``specs`` and wait until all are healthy. One that exits because its port
    was taken in the meantime is started again on a new free port (``retry_ports``; up
    to :data:`PORT_RETRIES` times); any other failure raises ``ChildFailed``."""
    from kvpush.cluster.launcher import ChildFailed, ChildSpec, free_port

    children = [sup.spawn(spec) for spec in specs]
    taken = {spec.port for spec in specs}
    retries = PORT_RETRIES if retry_ports else 0
    while True:
        try:
            sup.wait_healthy(children, timeout)
            return children
        except ChildFailed as e:
            if retries == 0 or not port_clash(e.child):
                raise
            retries -= 1
            old = e.child
            port = free_port(HOST)
            while port in taken:
                port = free_port(HOST)
            taken.add(port)
            argv = list(old.spec.argv)
            argv[argv.index("--port") + 1] = str(port)
            # keep the refused attempt's log beside the new one (same child name)
            kept = old.log_path.with_name(f"{old.name}.port-{old.spec.port}.log")
            with contextlib.suppress(OSError):
                old.log_path.rename(kept)
                old.log_path = kept
            _say(f"kvpush up: {old.name}: port {old.spec.port} was taken before it could "
                 f"bind; starting it again on port {port}")
            children[children.index(old)] = sup.spawn(
                ChildSpec(old.name, old.spec.role, argv, port, old.spec.host))


def _serve(sup: Supervisor, args: argparse.Namespace, model: str, port: int,
           log_dir: Path, api_key: str | None = None) -> int:
    from kvpush.cluster.launcher import ChildFailed, StopRequested
    from kvpush.cluster.membership import ControlError, etcd_url

    started = time.monotonic()
    specs = plan_instances(args, model, router_port=port)
    threads = specs[0].argv[specs[0].argv.index("--threads") + 1]
    if args.mode == "colocated":
        roles = f"1 role=both instance (TP {role_tp(args, 'both')})"
    else:
        roles = " + ".join(f"{sum(s.role == r for s in specs)} {r} (TP {role_tp(args, r)})"
                           for r in ("prefill", "decode"))
        roles += " instance(s)"
    _say(f"kvpush up: starting {roles} of {model} ({args.mode} mode, "
         f"{threads} torch thread(s) per rank), then the router on port {port}")
    _say(f"kvpush up: logs in {log_dir}")
    try:
        if args.discover:
            etcd = _start_etcd(sup, args, log_dir, taken={port, *(s.port for s in specs)})
            args.etcd_url = etcd_url(etcd)
            specs = plan_instances(args, model, router_port=port)  # now with --register
            _say(f"kvpush up: etcd at {etcd.url} ({args.etcd_url})")
        instances = start_healthy(sup, specs, args.startup_timeout)
        # the router's port: a --port the user chose is theirs to fix if it was taken
        (router,) = start_healthy(sup, [plan_router(args, port, instances)],
                                  args.startup_timeout, retry_ports=not args.port)
    except ChildFailed as e:
        _report(e.child, e.reason)
        _stop(sup, "start-up failed")
        return 1
    except ControlError as e:  # no etcd binary
        _stop(sup, "start-up failed")
        return _fail(str(e))
    except StopRequested as e:
        _stop(sup, f"{e} during start-up")
        return 0
    _banner(args, instances, router, log_dir, started, api_key)
    ranks = sum(spec_tp(s) for s in specs)
    control = _control(sup, args, model, log_dir, ranks) if args.discover else None
    try:
        stop = _keep(sup, args)
    finally:
        if control is not None:
            control.close()
    if stop is not None:
        _report(stop.child, stop.detail)
        _stop(sup, stop.why)
        return 1
    _stop(sup, sup.signals.last or "stop")
    return 0


def _keep(sup: Supervisor, args: argparse.Namespace) -> Stop | None:
    """Watch the children until a stop signal (None) or a :class:`Stop`, restarting
    instances that exit (`kvpush.cluster.supervision`)."""
    from kvpush.cluster.launcher import WATCH_INTERVAL_S
    from kvpush.cluster.supervision import Keeper, RestartPolicy

    policy = RestartPolicy(tries=args.restart_tries, first_delay_s=args.restart_backoff,
                           startup_timeout_s=args.startup_timeout)
    keeper = Keeper(sup, policy, _say)
    while not sup.signals.requested:
        stop = keeper.tick()
        if stop is not None:
            return stop
        time.sleep(WATCH_INTERVAL_S)
    return None


def _start_etcd(sup: Supervisor, args: argparse.Namespace, log_dir: Path,
                taken: set[int]) -> Child:
    from kvpush.cluster.launcher import free_port
    from kvpush.cluster.membership import etcd_spec

    ports = []
    while len(ports) < 2:
        p = free_port(HOST)
        if p not in taken and p not in ports:
            ports.append(p)
    (etcd,) = start_healthy(sup, [etcd_spec(log_dir / "etcd-data", *ports)],
                            args.startup_timeout, retry_ports=False)
    return etcd


def _control(sup: Supervisor, args: argparse.Namespace, model: str, log_dir: Path,
             ranks: int) -> Any:
    """The control socket of `up --discover` (kvpush.cluster.membership); ``ranks``: the
    rank processes of the instances started (an added instance gets the threads of one
    more share)."""
    from kvpush.cluster.launcher import ChildSpec, free_port
    from kvpush.cluster.membership import ControlServer

    threads = args.threads or default_threads(ranks + 1)
    counts = {r: sum(c.spec.role == r for c in sup.children) for r in ("prefill", "decode")}

    def plan(role: str) -> ChildSpec:
        name = f"{role}-{counts[role]}"
        counts[role] += 1
        port = free_port(HOST)
        return ChildSpec(name, role, serve_argv(args, model, role, port, threads), port)

    def start(spec: ChildSpec) -> Child:
        (child,) = start_healthy(sup, [spec], args.startup_timeout)
        return child

    control = ControlServer(log_dir, sup, plan, start, _say)
    _say(f"kvpush up: live changes from another terminal: kvpush up --add-decode | "
         f"--add-prefill | --remove NAME  [--log-dir {log_dir}]")
    return control


def _send_control(args: argparse.Namespace) -> int:
    from kvpush.cluster.membership import Command, ControlError, find_control, send

    if args.remove:
        cmd = Command("remove", args.remove)
    else:
        cmd = Command("add", "prefill" if args.add_prefill else "decode")
    try:
        reply = send(find_control(args.log_dir), cmd,
                     timeout=args.startup_timeout + args.stop_timeout)
    except ControlError as e:
        return _fail(str(e))
    print(reply)
    return 0 if reply.startswith("ok") else 1


def _stop(sup: Supervisor, why: str) -> None:
    t0 = time.monotonic()
    _say(f"kvpush up: {why}: stopping {len(sup.children)} process(es)")
    sup.stop()
    killed = f"; SIGKILLed: {', '.join(sup.killed)}" if sup.killed else ""
    _say(f"kvpush up: stopped in {time.monotonic() - t0:.1f} s{killed}")


def run_up(args: argparse.Namespace) -> int:
    if args.add_prefill or args.add_decode or args.remove:
        return _send_control(args)
    problem = usage_problem(args)
    if problem:
        return _fail(problem)
    check_serve_flags(args, instance_roles(args))
    from kvpush.cluster.launcher import StopSignals, Supervisor, free_port, port_is_free
    from kvpush.errors import ConfigError
    from kvpush.models.registry import DEFAULT_MODEL, resolve_model

    try:
        name = model_arg(args) or DEFAULT_MODEL
    except ValueError as e:
        return _fail(str(e))
    try:
        model_dir = resolve_model(name)
    except ConfigError as e:
        return _fail(str(e))
    # A folder is passed on absolute; a name is passed on so it is served under that name.
    model = str(model_dir.resolve()) if Path(name).expanduser().exists() else name
    port = args.port or free_port(args.host)
    if not port_is_free(port, args.host):
        return _fail(f"port {port} on {args.host} is in use; choose another with --port "
                     "(0: a free port)")
    from kvpush.server.auth import resolve_api_key

    api_key = resolve_api_key(args.api_key)
    if api_key is None and not cli_types.is_loopback(args.host):
        _say(f"kvpush up: warning: the router listens on {args.host} without an API key: "
             "anyone who reaches this address can use it (--api-key or KVPUSH_API_KEY)")
    log_dir = _make_log_dir(args)
    signals = StopSignals().install()  # before any child exists: no window without cleanup
    try:
        env = child_env(api_key, (args.admin_key or "").strip() or None)
        with Supervisor(log_dir, env, signals, args.stop_timeout) as sup:
            return _serve(sup, args, model, port, log_dir, api_key)
    finally:
        signals.restore()
