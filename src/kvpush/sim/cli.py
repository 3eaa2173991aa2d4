"""`kvpush simulate {run,calibrate,plan,profiles}`: argument parsing only; the work is in
:mod:`kvpush.sim.cluster`, :mod:`kvpush.sim.calibrate` and :mod:`kvpush.sim.plan`."""

from __future__ import annotations

import argparse
import dataclasses
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


def _workload_args(p: argparse.ArgumentParser, rate_help: str) -> None:
    p.add_argument("--profile", required=True, metavar="NAME_OR_FILE",
                   help="a profile JSON file or a built-in name (`kvpush simulate profiles`)")
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
    p.add_argument("--step-scale", type=float, default=1.0, metavar="F",
                   help="multiply every step time, and what an arrival adds to a step "
                        "(host.arrival_step_s), by F (a shared or slower host; default 1)")
    p.add_argument("--replicas", type=int, default=1, metavar="N",
                   help="for a profile with step noise (host.step_noise or "
                        "step_noise_quantiles, calibrated profiles): simulate N noise "
                        "seeds and pool their requests, as `kvpush bench compare "
                        "--repeats` pools repeats (default 1)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")


def add_simulate_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "simulate", help="discrete-event simulation of push/pull/colocated clusters",
        description="Simulate an xPyD cluster (router, prefill, decode, KV hand-off) on a "
                    "hardware profile; calibrate a profile on this machine; plan the "
                    "smallest split for latency targets. See docs/SIMULATOR.md.")
    sub = p.add_subparsers(dest="sim_command", metavar="ACTION", required=True)

    r = sub.add_parser("run", help="simulate one workload on one or more configurations")
    _workload_args(r, "request rate(s) per second (inf: all at once)")
    r.add_argument("--modes", type=_words, default=["pull", "push"], metavar="M[,M]",
                   help="colocated, pull, push (default: pull,push)")
    r.add_argument("--prefill", type=int, default=1, metavar="X")
    r.add_argument("--decode", type=int, default=1, metavar="Y")
    r.set_defaults(func=_run)

    c = sub.add_parser("calibrate", help="measure this machine's profile")
    c.add_argument("--model", metavar="NAME_OR_DIR",
                   help="a kvpush model name or folder (default: the default model)")
    c.add_argument("--out", required=True, metavar="PROFILE", help="JSON file to write")
    c.add_argument("--threads", type=_ints, default=[1, 2], metavar="N[,N]",
                   help="torch thread counts to fit a step model for (default: 1,2)")
    c.add_argument("--quick", action="store_true", help="very few samples (tests)")
    c.add_argument("--no-transfer", dest="transfer", action="store_false",
                   help="skip the NIXL transfer probe (use PLATFORM.md's figures)")
    c.add_argument("--note", default="", help="a note stored in the profile (e.g. the load)")
    c.add_argument("--clock", choices=("auto", "wall", "cpu"), default="auto",
                   help="time steps by wall clock or by the stepping thread's CPU time "
                        "(auto: CPU time when the load average exceeds the cores)")
    c.add_argument("--corun", action="store_true",
                   help="also measure host.corun_slowdown (a 1-thread engine's steps beside "
                        "a busy neighbour engine process); off by default because on a "
                        "shared VM it varies from run to run (docs/SIMULATOR.md)")
    c.add_argument("--no-served", dest="served", action="store_false",
                   help="skip the served probe (host.served_factors: a real instance, the "
                        "router and a streaming client run a short workload per thread "
                        "count, about a minute each, to measure how much longer steps take "
                        "in the server than in the engine alone)")
    c.set_defaults(func=_calibrate)

    rf = sub.add_parser("refit", help="fit a calibrated profile's step models again from "
                        "the samples it recorded (no engine runs); several profiles of one "
                        "host: fit their samples pooled")
    rf.add_argument("profile", metavar="PROFILE", nargs="+",
                    help="profiles written by calibrate (several: the same model and plan, "
                         "e.g. calibrated before and after a set of runs)")
    rf.add_argument("--out", required=True, metavar="PROFILE", help="JSON file to write")
    rf.add_argument("--fit-table-scale", action="store_true",
                    help="fit the level of the measured projection-matmul table with the "
                         "linear terms (token_rows_scale) instead of taking it as timed: "
                         "for a host whose matmul timing ran apart from its steps")
    rf.set_defaults(func=_refit)

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


def _load(args: argparse.Namespace):
    from kvpush.sim.profile import ProfileError, load_profile

    try:
        prof = load_profile(args.profile)
        return prof.scaled(args.step_scale) if args.step_scale != 1.0 else prof
    except ProfileError as e:
        print(f"kvpush simulate: {e}", file=sys.stderr)
        return None


def _workload(args: argparse.Namespace, rate: float):
    from kvpush.sim.workload import Workload

    return Workload(args.num_prompts, rate, args.input_len, args.output_len, args.seed,
                    args.prefix_len, tuple(args.prefix_cached_on))


def _run(args: argparse.Namespace) -> int:
    from kvpush.sim.cluster import ClusterConfig, simulate_pooled, summarize
    from kvpush.sim.report import format_rows

    prof = _load(args)
    if prof is None:
        return 2
    rows = []
    try:
        for rate in args.rate:
            w = _workload(args, rate)
            for mode in args.modes:
                cfg = ClusterConfig(mode, args.prefill, args.decode, args.fragmentation,
                                    prefill_prefix_cache=args.prefill_prefix_cache)
                s = summarize(simulate_pooled(prof, w, cfg, args.replicas))
                s["rate"] = rate
                rows.append(s)
    except ValueError as e:
        print(f"kvpush simulate: {e}", file=sys.stderr)
        return 2
    print(f"profile {prof.name}: {args.input_len} in / {args.output_len} out, "
          f"{args.num_prompts} prompts, fragmentation {args.fragmentation}")
    print(format_rows(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from kvpush.sim.calibrate import CalibrationPlan, calibrate

    plan = CalibrationPlan.quick() if args.quick else CalibrationPlan()
    if not args.quick:
        plan = dataclasses.replace(plan, threads=tuple(args.threads), corun=args.corun,
                                   served=args.served)
    calibrate(args.model, args.out, plan, transfer=args.transfer, note=args.note,
              clock=args.clock)
    return 0


def _refit(args: argparse.Namespace) -> int:
    import json

    from kvpush.sim.profile import ProfileError, profile_from_dict
    from kvpush.sim.refit import pool_calibrations, refit_profile

    try:
        datas = []
        for path in args.profile:
            with open(path, encoding="utf-8") as f:
                datas.append(json.load(f))
        data = refit_profile(pool_calibrations(datas), fit_table_scale=args.fit_table_scale)
        profile_from_dict(data, args.out)
    except (OSError, ValueError, KeyError, TypeError) as e:  # ProfileError is a ValueError
        kind = "bad profile" if isinstance(e, (ProfileError, KeyError, TypeError)) else "error"
        print(f"kvpush simulate refit: {kind}: {e}", file=sys.stderr)
        return 2
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from kvpush.sim.plan import PlanTargets, format_plan, plan_cluster, plot_frontier

    prof = _load(args)
    if prof is None:
        return 2
    targets = PlanTargets(args.ttft_p90, args.tpot_p90)
    try:
        w = _workload(args, args.rate[0])
        result = plan_cluster(prof, w, targets, args.max_instances, tuple(args.modes),
                              args.fragmentation, args.prefill_prefix_cache, args.replicas)
    except ValueError as e:
        print(f"kvpush simulate: {e}", file=sys.stderr)
        return 2
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
