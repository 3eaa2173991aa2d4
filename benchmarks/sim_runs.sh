#!/bin/sh
# The simulator's validation runs (benchmarks/SIMULATION.md section 1): calibrate this
# host, re-run the recorded workloads of benchmarks/RESULTS.md tables 1-3 (and 512 / 16)
# with per-step traces, calibrate again (how far the host drifted meanwhile).
#
#   benchmarks/sim_runs.sh OUT_DIR [SEED]   # ~80 min on 2 cores; run it on a quiet host
#
# SEED (default 0) seeds the prompts and every repeat's arrivals (bench compare --seed:
# repeat k at rate index i draws seed SEED + 1000 x i + k, k < 4). v18-v22 all ran at 0,
# so they rest on the same arrival draws (three per rate, four for the prefix-hit runs)
# and differ mostly in the host's timing; a SEED at least 4 away from every earlier
# SEED + 1000 x j (j = 0, 1, 2, ...) gives draws the simulator was never checked
# against (v23: seed 23; v24: 47; v25: 71; v26: 97; v27: 121).
#
# Repeats: 3 (4 for the short prefix-hit runs), pooled per cell: with 2, one slow step
# (148 ms among 98-116) moved a p90 by 24% from one repeat to the other (v12). Each repeat
# draws its own Poisson arrivals (--arrivals-per-repeat, since v21): with one draw for all,
# the 512-token 2-thread colocated cell at 0.5 req/s had exactly 5 of 10 requests wait a
# mixed step in every repeat, and the pooled median fell in the gap between the two groups
# (1-v20).
# quiet_512 sends 20 prompts per run (10 before v21) for the same reason.
#
# Each run is bracketed by a 1-second idle host probe (bench compare --host-probe; the
# calibrations probe before each pass): the host's speed level beside each run, which
# sim_validate.py --host-level compares with the calibrations' (SIMULATION.md 1-host).
# The calibrations also measure push's prefill step cost (a pull and a push pair side by
# side at 2 and 4 req/s, ~9 min each: handoff.push_prefill_step_s, push_prefill_block_s
# and their corun_ twins; kvpush.sim.push_step).
#
# Then (as SIMULATION.md 1-v26): copy OUT_DIR/cpu-local-pooled.json to
# OUT_DIR/cpu-local-pooled-quantiles.json, and .venv/bin/python
# benchmarks/sim_validate_sets.py --replicas 256 --set OUT=OUT/cpu-local-pooled-quantiles.json
# (OUT relative to benchmarks/results), alone and with the earlier sets' --set (1-v25
# also on OUT/cpu-local-pooled-scaled.json; 1-v26 also --without-served-kind
# prefill_burst, alone; since 1-v27 --burst-start-from OUT/cpu-local-pooled-quantiles.json
# with the earlier sets, whose calibrations measured no burst start, and
# --without-burst-start alone), and benchmarks/sim_holdout.py with every set's
# --set (the refit below keeps the decode percentile
# tables; v18-v22, made before they existed, were refitted into
# cpu-local-pooled-quantiles.json, and v23-v25 named so)
set -e
[ $# -eq 1 ] || [ $# -eq 2 ] || { echo "usage: $0 OUT_DIR [SEED]" >&2; exit 2; }
O=$1
SEED=${2:-0}
case $SEED in ''|*[!0-9]*) echo "$0: SEED must be a whole number, not '$SEED'" >&2; exit 2;; esac
cd "$(dirname "$0")/.."
B=".venv/bin/kvpush bench compare --model smollm2-135m --step-trace --host-probe 1 --arrivals-per-repeat --seed $SEED"
.venv/bin/kvpush simulate calibrate --model smollm2-135m --clock wall --out "$O/cpu-local.json" \
  --note "calibrated just before the runs of benchmarks/sim_runs.sh $O"
$B --out "$O/quiet_512" --label "random 512 in / 16 out" --dataset random \
  --input-len 512 --output-len 16 --num-prompts 20 --rates 0.5,inf \
  --modes colocated:1,colocated,pull,push --repeats 3 --time-limit 1800
$B --out "$O/long_prompts" --label "long prompts: random 1024 in / 32 out" --dataset random \
  --input-len 1024 --output-len 32 --num-prompts 12 --rates 0.25,0.5,inf \
  --modes colocated:1,colocated,pull,push --repeats 1 --time-limit 1200
$B --out "$O/short_high_rate" --label "short prompts at high rate: random 128 in / 16 out" \
  --dataset random --input-len 128 --output-len 16 --num-prompts 32 --rates 4,16,inf \
  --modes colocated,pull,push --repeats 3 --time-limit 1200
$B --out "$O/prefix_hit_tail_on_decode" --label "decode-side prefix hit, tail on decode: shared-prefix 1024 in (992 shared) / 16 out" \
  --dataset shared-prefix --input-len 1024 --output-len 16 --prefix-len 992 --num-prompts 16 \
  --rates 1,inf --modes pull,push --repeats 4 --prefix-hit-tail decode --time-limit 1200
$B --out "$O/prefix_hit" --label "decode-side prefix hit, tail on prefill (default): shared-prefix 1024 in (992 shared) / 16 out" \
  --dataset shared-prefix --input-len 1024 --output-len 16 --prefix-len 992 --num-prompts 16 \
  --rates 1,inf --modes pull,push --repeats 4 --time-limit 1200
.venv/bin/kvpush simulate calibrate --model smollm2-135m --clock wall --out "$O/cpu-local-after.json" \
  --note "calibrated just after the runs of benchmarks/sim_runs.sh $O"
# the two calibrations bracket the runs: one profile from both (kvpush.sim.refit)
.venv/bin/kvpush simulate refit "$O/cpu-local.json" "$O/cpu-local-after.json" \
  --out "$O/cpu-local-pooled.json"
# the same with the projections' table level fitted (refit --fit-table-scale, SIMULATION.md
# 1-v24): judged beside the plain profile on the sets made after it (v25: no cell gained)
.venv/bin/kvpush simulate refit "$O/cpu-local.json" "$O/cpu-local-after.json" \
  --fit-table-scale --out "$O/cpu-local-pooled-scaled.json"
