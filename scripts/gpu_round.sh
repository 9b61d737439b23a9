#!/usr/bin/env bash
# The whole GPU round in one run on the GPU machine: versions, GPU tests, compute-sanitizer
# (memcheck on the GPU tests, racecheck on the shared-memory kernels), then the benchmark.
# Logs and JSON go to $OUT (or ./gpu-out). Usage: scripts/gpu_round.sh [quick|full]
set -u
MODE=${1:-quick}
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
step() { echo; echo "=== $* ($(date +%T))"; }

step versions
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "import sys, cupy, numpy; print(sys.version); print('cupy', cupy.__version__, 'numpy', numpy.__version__, 'cuda runtime', cupy.cuda.runtime.runtimeGetVersion())"
  echo "commit: $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null)"
} 2>&1 | tee "$OUT/versions.txt"

step install
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2

step "GPU tests"
timeout 420 python3 -m pytest tests -q -x -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/tests.log" | tail -25
echo "tests rc=${PIPESTATUS[0]}"

SAN_K=${SAN_K:-"not 65536 and not 8192-4096 and not many_buckets"}
if [ "$MODE" != "bench" ]; then
  step "memcheck"
  timeout ${MEMCHECK_S:-300} compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 20 \
    python3 -m pytest tests/test_gpu_kernels.py tests/test_gpu_streams.py -q -x -p no:cacheprovider \
    -k "$SAN_K" 2>&1 | tee "$OUT/memcheck.log" | tail -8
  echo "memcheck rc=${PIPESTATUS[0]}"
  step "racecheck"
  timeout ${RACECHECK_S:-240} compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 9 --print-limit 20 \
    python3 -m pytest tests/test_gpu_kernels.py -q -x -p no:cacheprovider \
    -k "${RACE_K:-(test_base or test_lora) and (-3- or -255- or -4096-) and not many_buckets}" 2>&1 | tee "$OUT/racecheck.log" | tail -8
  echo "racecheck rc=${PIPESTATUS[0]}"
fi

if [ -n "${PROFILE:-}" ]; then
  step "ncu profile"
  timeout 180 ncu --clock-control none --profile-from-start off --section SpeedOfLight \
    --section WarpStateStats --section LaunchStats -k regex:align \
    python3 scripts/profile_kernels.py > "$OUT/ncu.txt" 2>&1
  echo "ncu rc=$?"
  grep -E "^  align|Duration|Memory Throughput|Registers Per|Stall|Warp Cycles Per Issued" "$OUT/ncu.txt" | head -80
fi

if [ "$MODE" != "test" ]; then
  step "benchmark ($MODE)"
  BENCH_ARGS="--json $OUT/bench.json --table $OUT/bench.txt --plot $OUT/bench.png"
  [ "$MODE" = "full" ] || BENCH_ARGS="--quick $BENCH_ARGS"
  timeout ${BENCH_S:-400} python3 -m moe_lora_align.bench $BENCH_ARGS 2>"$OUT/bench.progress"
  echo "bench rc=$?"
fi
