#!/bin/sh
# v22's quiet_512 once more, the same command as benchmarks/sim_runs.sh runs (at d2430d1)
set -e
cd /work/v22run
O=benchmarks/results/sim/v22
B=".venv/bin/kvpush bench compare --model smollm2-135m --step-trace --host-probe 1 --arrivals-per-repeat"
$B --out "$O/quiet_512" --label "random 512 in / 16 out" --dataset random \
  --input-len 512 --output-len 16 --num-prompts 20 --rates 0.5,inf \
  --modes colocated:1,colocated,pull,push --repeats 3 --time-limit 1800
