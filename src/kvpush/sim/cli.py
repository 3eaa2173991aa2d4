"""`kvpush simulate {run,calibrate,plan,profiles}`: argument parsing only; the work is in
:mod:`kvpush.sim.cluster`, :mod:`kvpush.sim.calibrate` and :mod:`kvpush.sim.plan`."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any


def _floats(text: str) -> list[float]:
    try:
        return [math.inf if t.strip() == "inf" else float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers, got {text!r}") from None


def _words(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _ints(text: str) -> list[int]:
    try:
        return [int(t) for t in _words(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers, got {text!r}") from None


#: The profile a run or plan uses without --profile: the announcement's 1P+1D hardware.
DEFAULT_PROFILE = "h200-tp8-qwen3-32b"

RUN_EXAMPLE = f"""\
example (the default profile, {DEFAULT_PROFILE}; 1 prefill + 1 decode; 3 rates):
  kvpush simulate run --rate 1,4,8 --modes pull,push --prefill 1 --decode 1 \\
      --input-len 2048 --output-len 128 --num-prompts 200

The table's latencies are in ms and rates in req/s; descs is the mean number of NIXL
descriptors per KV transfer; a row whose requests complete at under 0.9x the rate they
arrive (or are left unfinished) is marked OVERLOADED: its queue grows.
`kvpush simulate profiles` lists the profiles.
"""


def _workload_args(p: argparse.ArgumentParser, rate_help: str) -> None:
    p.add_argument("--profile", default=DEFAULT_PROFILE, metavar="NAME_OR_FILE",
                   help="a profile JSON file or a built-in name (`kvpush simulate "
                        f"profiles`; default: {DEFAULT_PROFILE})")
    p.add_argument("--rate", type=_floats, required=True, metavar="R[,R...]", help=rate_help)
    p.add_argument("--input-len", type=int, default=2048, metavar="TOKENS")
    p.add_argument("--output-len", type=int, default=128, metavar="TOKENS")
    p.add_argument("--num-prompts", type=int, default=200, metavar="N")
    p.add_argument("--seed", type=int, default=0, help="arrival seed (as `kvpush bench`)")
    p.add_argument("--prefix-len", type=int, default=0, metavar="TOKENS",
                   help="tokens every prompt shares (a prefix-cache workload; default 0)")
    p.add_argument("--prefix-cached-on", type=_words, default=[], metavar="ROLE[,ROLE]",
                   help="roles whose prefix cache holds the shared prefix from the start "
                        "(prefill, decode)")
    p.add_argument("--no-prefill-prefix-cache", dest="prefill_prefix_cache",
                   action="store_false",
                   help="prefill instances keep no prefix cache (decode-side-only hits)")
    p.add_argument("--fragmentation", type=float, default=0.0, metavar="F",
                   help="0: block ids contiguous; 1: no two blocks adjacent (one descriptor "
                        "per layer per block)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")


def add_simulate_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "simulate", help="discrete-event simulation of push/pull/colocated clusters",
        description="Simulate an xPyD cluster (router, prefill, decode, KV hand-off) on a "
                    "hardware profile; calibrate a profile on this machine; plan the "
                    "smallest split for latency targets. See docs/SIMULATOR.md.")
    sub = p.add_subparsers(dest="sim_command", metavar="ACTION", required=True)

    r = sub.add_parser("run", help="one workload on xPyD push / pull (or colocated)",
                       description="Simulate one workload on xPyD push / pull (or "
                                   "colocated) at each --rate.",
                       epilog=RUN_EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    _workload_args(r, "request rate(s) per second (inf: all at once)")
    r.add_argument("--modes", type=_words, default=["pull", "push"], metavar="M[,M]",
                   help="colocated, pull, push (default: pull,push)")
    r.add_argument("--prefill", type=int, default=1, metavar="X",
                   help="prefill instances (colocated runs X + Y instances)")
    r.add_argument("--decode", type=int, default=1, metavar="Y", help="decode instances")
    r.set_defaults(func=_run)

    c = sub.add_parser("calibrate", help="measure this machine's profile: the engine's "
                       "steps alone, fitted per thread count, and a NIXL transfer probe")
    c.add_argument("--model", metavar="NAME_OR_DIR",
                   help="a kvpush model name or folder (default: the default model)")
    c.add_argument("--out", required=True, metavar="PROFILE", help="JSON file to write")
    c.add_argument("--threads", type=_ints, default=[1, 2], metavar="N[,N]",
                   help="torch thread counts to fit a step model for (default: 1,2)")
    c.add_argument("--quick", action="store_true", help="very few samples (tests)")
    c.add_argument("--no-transfer", dest="transfer", action="store_false",
                   help="skip the NIXL transfer probe (assume a loopback link)")
    c.add_argument("--note", default="", help="a note stored in the profile (e.g. the load)")
    c.set_defaults(func=_calibrate)

    pl = sub.add_parser("plan", help="smallest xPyD split and mode meeting latency targets")
    _workload_args(pl, "request rate per second")
    pl.add_argument("--ttft-p90", type=float, required=True, metavar="MS")
    pl.add_argument("--tpot-p90", type=float, required=True, metavar="MS")
    pl.add_argument("--max-instances", type=int, default=8, metavar="N")
    pl.add_argument("--modes", type=_words, default=["colocated", "pull", "push"])
    pl.add_argument("--plot", default="sim_plan.png", metavar="PNG",
                    help="where to draw the frontier (default: sim_plan.png)")
    pl.set_defaults(func=_plan)

    pr = sub.add_parser("profiles", help="list the built-in profiles")
    pr.set_defaults(func=_profiles)
    return p


def _workload(args: argparse.Namespace, rate: float):
    from kvpush.sim.workload import Workload

    return Workload(args.num_prompts, rate, args.input_len, args.output_len, args.seed,
                    args.prefix_len, tuple(args.prefix_cached_on))


def _fail(e: Exception) -> int:
    print(f"kvpush simulate: {e}", file=sys.stderr)
    return 2


def _run(args: argparse.Namespace) -> int:
    from kvpush.sim.cluster import ClusterConfig, simulate
    from kvpush.sim.profile import load_profile
    from kvpush.sim.report import format_rows

    rows = []
    try:  # ProfileError is a ValueError
        prof = load_profile(args.profile)
        for rate in args.rate:
            w = _workload(args, rate)
            for mode in args.modes:
                cfg = ClusterConfig(mode, args.prefill, args.decode, args.fragmentation,
                                    prefill_prefix_cache=args.prefill_prefix_cache)
                s = simulate(prof, w, cfg).summary()
                s["rate"] = rate
                rows.append(s)
    except ValueError as e:
        return _fail(e)
    print(f"profile {prof.name}: {args.input_len} in / {args.output_len} out tokens, "
          f"{args.num_prompts} prompts, fragmentation {args.fragmentation}")
    print(format_rows(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from kvpush.sim.calibrate import CalibrationPlan, calibrate

    plan = CalibrationPlan.quick() if args.quick else CalibrationPlan(
        threads=tuple(args.threads))
    calibrate(args.model, args.out, plan, transfer=args.transfer, note=args.note)
    return 0


def _plan(args: argparse.Namespace) -> int:
    from kvpush.sim.plan import PlanTargets, format_plan, plan_cluster, plot_frontier
    from kvpush.sim.profile import load_profile

    try:
        result = plan_cluster(load_profile(args.profile), _workload(args, args.rate[0]),
                              PlanTargets(args.ttft_p90, args.tpot_p90), args.max_instances,
                              tuple(args.modes), args.fragmentation, args.prefill_prefix_cache)
    except ValueError as e:
        return _fail(e)
    print(format_plan(result))
    path = plot_frontier(result, args.plot)
    print(f"frontier plot: {path}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_dict(), f, indent=1)
    return 0 if result.best is not None else 1


def _profiles(args: argparse.Namespace) -> int:
    from kvpush.sim.profile import builtin_profiles, load_profile

    for name in builtin_profiles():
        print(f"{name}: {load_profile(name).description}")
    return 0
