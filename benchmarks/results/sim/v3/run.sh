#!/bin/sh
# The simulator's validation runs of benchmarks/SIMULATION.md 1c (results in this folder):
# calibrate, the four workloads of RESULTS.md tables 1-3 and 512 / 16 with per-step
# traces, calibrate again. Its commands became benchmarks/sim_runs.sh (same commands,
# same order; the profiles' notes named this script).
exec "$(dirname "$0")/../../../sim_runs.sh" benchmarks/results/sim/v3
