#!/bin/sh
# Spot check after the dense-cache fill change (commit "Dense decode cache: fill one
# layer at a time"): calibrate, then two of v3's workloads (the fill-heavy prefix hit
# and 512 / 16) with per-step traces.
set -e
cd "$(dirname "$0")/../../../.."
B=".venv/bin/kvpush bench compare --model smollm2-135m --step-trace"
O=benchmarks/results/sim/v4
.venv/bin/kvpush simulate calibrate --model smollm2-135m --clock wall --out $O/cpu-local.json \
  --note "calibrated just before the runs of benchmarks/results/sim/v4/run.sh"
$B --out $O/prefix_hit --label "decode-side prefix hit, tail on prefill (default): shared-prefix 1024 in (992 shared) / 16 out" \
  --dataset shared-prefix --input-len 1024 --output-len 16 --prefix-len 992 --num-prompts 16 \
  --rates 1,inf --modes pull,push --repeats 2 --time-limit 900
$B --out $O/quiet_512 --label "random 512 in / 16 out" --dataset random \
  --input-len 512 --output-len 16 --num-prompts 10 --rates 0.5,inf \
  --modes colocated:1,colocated,pull,push --repeats 2 --time-limit 1200
