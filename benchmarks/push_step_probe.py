"""Measure push's extra cost per prefill step on this host and add it to a profile.

`kvpush simulate calibrate` measures ``handoff.push_prefill_step_s`` (and, since session
13, the per-block ``push_prefill_block_s`` and their ``corun_`` twins) with its served
probe (kvpush.sim.push_step.probe_push_step: the same 128-token prompts through a 1P1D
pull pair and a push pair running side by side, in short turns alternating, at each
load, P's prefill steps measured against the profile's engine-alone model). Profiles
calibrated before that lack the figures; this script measures them now and writes a
copy of PROFILE with them (``measured.push_step`` and a note saying when), leaving
PROFILE as it was.

    V=benchmarks/results/sim/v20
    .venv/bin/python benchmarks/push_step_probe.py $V/cpu-local-pooled.json \\
        --out $V/cpu-local-pooled-push-step.json

Run it on a quiet host (~9 minutes with the default loads, calibrate's; v14's figure
came from ``--loads 2:8:24:8``, one load, ~3.5 minutes). ``--reprice`` serves nothing:
it fits the figures again from the traces the profile's record stored (after a change
to the fit; calibrations and this script keep them since commit 9900d06).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from kvpush.sim.calibrate import PUSH_STEP_KEYS, CalibrationPlan

    default_loads = CalibrationPlan().push_step_loads
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--loads", default=None,
                    help="comma-separated RATE:PROMPTS_PER_TURN:TURNS:OUTPUT_LEN loads "
                         "(default: calibrate's, "
                         + ",".join(":".join(f"{v:g}" for v in ld) for ld in default_loads)
                         + ")")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--reprice", action="store_true",
                    help="serve nothing: fit the figures again from the probe traces "
                         "PROFILE's measured.push_step stored (calibrations since "
                         "commit 9900d06 keep them), against PROFILE's engine-alone fit; "
                         "a pooled profile's calibrations are refitted one by one and "
                         "their figures averaged, as refit pools them")
    args = ap.parse_args(argv)
    from kvpush.models.registry import resolve_model
    from kvpush.sim.profile import engine_step_model
    from kvpush.sim.push_step import ProbeLoad, probe_push_step

    try:
        loads = [ProbeLoad(float(r), int(p), int(t), int(o)) for r, p, t, o in (
            spec.split(":") for spec in args.loads.split(","))] if args.loads else list(
            default_loads)
    except ValueError:
        ap.error(f"--loads: expected RATE:PROMPTS_PER_TURN:TURNS:OUTPUT_LEN,..., "
                 f"got {args.loads!r}")
    if any(ld.turns < 1 or ld.prompts_per_turn < 1 or ld.rate <= 0 for ld in loads):
        ap.error("--loads: every rate must be > 0, prompts per turn and turns >= 1")

    data = json.loads(args.profile.read_text())
    # residuals against the engine-alone fit, as calibrate measures them
    engine = engine_step_model(data, data["roles"]["prefill"])
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    block_size = int(data["instance"]["block_size"])
    if args.reprice:
        return reprice_profile(args, data, engine, block_size)
    out = probe_push_step(str(resolve_model(args.model)), engine, block_size, loads)
    data.setdefault("measured", {})["push_step"] = {**out, "started_utc": started}
    for key in PUSH_STEP_KEYS:
        data["handoff"][key] = out[key]
    spec = ",".join(":".join(f"{v:g}" for v in ld) for ld in loads)
    data.setdefault("notes", []).append(
        f"handoff.{', '.join(PUSH_STEP_KEYS)} measured {started} by "
        f"benchmarks/push_step_probe.py (--loads {spec}), after the rest of this profile")
    return write_profile(data, args.out)


def reprice_profile(args: argparse.Namespace, data: dict, engine, block_size: int) -> int:
    from kvpush.sim.calibrate import PUSH_STEP_KEYS
    from kvpush.sim.push_step import describe, reprice, without_fit

    record = data.get("measured", {}).get("push_step")
    records = record if isinstance(record, list) else [record or {}]
    try:
        outs = [reprice(r, engine, block_size) for r in records]
    except ValueError as e:
        print(f"error: {args.profile}: {e}", file=sys.stderr)
        return 2
    for i, out in enumerate(outs):
        records[i] = r = {**without_fit(records[i]), **out}
        print(f"{r.get('started_utc', '?')}: {describe(out)}")
    data["measured"]["push_step"] = records if isinstance(record, list) else records[0]
    for key in PUSH_STEP_KEYS:
        data["handoff"][key] = round(sum(o[key] for o in outs) / len(outs), 7)
    data.setdefault("notes", []).append(
        f"handoff.{', '.join(PUSH_STEP_KEYS)} refitted from the stored probe traces by "
        "benchmarks/push_step_probe.py --reprice")
    return write_profile(data, args.out)


def write_profile(data: dict, out: Path) -> int:
    """Write ``data`` to ``out`` once it loads as a profile, and say what it carries."""
    from kvpush.sim.calibrate import PUSH_STEP_KEYS
    from kvpush.sim.profile import profile_from_dict

    profile_from_dict(data, str(out))  # refuse to write what cannot be loaded
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {out}: " + ", ".join(f"{k} {data['handoff'][k]}" for k in PUSH_STEP_KEYS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
