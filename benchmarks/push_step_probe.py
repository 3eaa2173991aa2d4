"""Measure push's extra cost per prefill step on this host and add it to a profile.

`kvpush simulate calibrate` measures ``handoff.push_prefill_step_s`` with its served
probe (kvpush.sim.corun.probe_push_step: the same 128-token prompts through a 1P1D pull
pair and a push pair running side by side, in short turns alternating, P's prefill steps
measured against the profile's engine-alone model). Profiles calibrated before it
existed lack the figure; this script measures it now and writes a copy of PROFILE with
it (``measured.push_step`` and a note saying when), leaving PROFILE as it was.

    V=benchmarks/results/sim/v14
    .venv/bin/python benchmarks/push_step_probe.py $V/cpu-local-pooled.json \\
        --out $V/cpu-local-pooled-push-step.json --turns 8

Run it on a quiet host (~1.5 minutes with the default 8 turns).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--model", default="smollm2-135m")
    args = ap.parse_args(argv)
    if args.turns < 1:
        ap.error("--turns must be >= 1")
    from kvpush.models.registry import resolve_model
    from kvpush.sim.corun import probe_push_step
    from kvpush.sim.profile import engine_step_model, profile_from_dict

    data = json.loads(args.profile.read_text())
    # residuals against the engine-alone fit, as calibrate measures them
    engine = engine_step_model(data, data["roles"]["prefill"])
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out = probe_push_step(str(resolve_model(args.model)), engine, turns=args.turns)
    data.setdefault("measured", {})["push_step"] = {**out, "started_utc": started}
    for key in ("push_prefill_step_s", "push_prefill_corun_step_s"):
        data["handoff"][key] = out[key]
    data.setdefault("notes", []).append(
        f"handoff.push_prefill_step_s and push_prefill_corun_step_s measured {started} by "
        f"benchmarks/push_step_probe.py ({args.turns} turns), after the rest of this profile")
    profile_from_dict(data, str(args.out))  # refuse to write what cannot be loaded
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out}: push_prefill_step_s {out['push_prefill_step_s']}, "
          f"push_prefill_corun_step_s {out['push_prefill_corun_step_s']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
