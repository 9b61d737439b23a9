#!/usr/bin/env bash
# One device call for a change to the cluster kernel: its tests first (stop on a failure),
# its stamps and the deterministic mid band, then the full GPU tests, memcheck over the
# cluster tests, racecheck over a few, and the benchmark. Logs go to $OUT.
set -u
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"; export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_kernels.py -k cluster \
  tests/test_gpu_determinism.py 2>&1 | tail -4 | tee "$OUT/tests_cluster.log"
[ "${PIPESTATUS[0]}" = 0 ] || { echo "cluster tests failed"; exit 1; }
timeout 90 python3 scripts/stage_probe.py --stamps-only --only "${PROBE_ONLY:-512, 10}" \
  --out "$OUT/probe" 2>&1 | tail -12 | tee "$OUT/probe.txt"
timeout 150 python3 scripts/det_experiment.py --runs no_cluster --json "$OUT/det_mid.json" \
  --only "${DET_ONLY:-('base', 256|('base', 512|('base', 1024|('lora', 256, 256, 8, 16, 4)|('pair', 256|('pair', 1024}" \
  2>&1 | tee "$OUT/det_mid.txt" | tail -12
SAN_FILES=tests/test_gpu_kernels.py SAN_K="cluster" SAN_S=150 scripts/gpu_round.sh tests memcheck bench \
  2>&1 | grep -v "^\s*$" | tail -30
SAN_FILES=tests/test_gpu_kernels.py SAN_K="cluster and det and (pair or one_expert or 8192)" SAN_S=90 \
  scripts/gpu_round.sh racecheck 2>&1 | tail -3
