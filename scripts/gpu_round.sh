#!/usr/bin/env bash
# A GPU round in one run on the GPU machine; logs and JSON go to $OUT (or ./gpu-out).
# Usage: scripts/gpu_round.sh STEP...   with the steps (in the order given):
#   tests      the GPU test suite (the CUDA compile tests are CI's: skipped here); about 270 s
#              with the kernel cache warm, more without (r52: tests_rest alone ran past 300 s
#              on a machine that had built only the probe kernels), so a call with other
#              steps may split it: tests_kernels (tests/test_gpu_kernels.py, about 120 s)
#              and tests_rest (every other test), each with its own log; give a call's limit
#              room past TESTS_S, or the log never comes back
#              (PYTEST_ARGS: extra words, split on spaces; PYTEST_K: a -k expression, kept whole);
#              the CPU-emulator tests are CI's and are deselected here
#   fuzz       scripts/fuzz.py long mode (FUZZ_CASES, default 10000; FUZZ_SEED)
#   memcheck racecheck synccheck initcheck
#              compute-sanitizer over the GPU tests (SAN_FILES and SAN_K select; racecheck over
#              all of them takes longer than one call: split it by SAN_FILES)
#   bench      the benchmark, quick grid;  benchfull  the full grid
#   det        scripts/det_experiment.py: deterministic mode against the default path
#   steps      scripts/profile_calls.py --steps: where a prepared eager call's host time goes
#   eager      scripts/eager_ab.py: the eager table's paths at a few sizes, for the package
#              of EAGER_TREE (a carried folder of another commit's moe_lora_align and kernels)
#              and for this checkout, EAGER_TURNS turns (default 3) in alternating order
#              (EAGER_S: seconds a run); eager.txt, eager.json
#   decode     scripts/tiny_experiment.py (DECODE_RUNS, DECODE_CASES, DECODE_BASELINE: a folder
#              of an earlier commit's kernels/, copied in as an untracked folder; the device
#              has no .git) and stage_probe.py --stamps-only (STAMPS_ONLY); each kernel set
#              compiles for about 15 s first, so give them minutes (DECODE_S, STAMPS_S)
#   bounds     scripts/bounds.py (BOUNDS_CASES, BOUNDS_S): issue 18's target rows against the
#              same launches with emptied kernels, their probe stamps and a fill of their
#              bytes; bounds.txt, bounds.json
#   twice      scripts/decode_experiment.py --twice-only (TWICE_CASES, TWICE_S): the one-block
#              decode kernels' alignment twice in one block, pass against pass (cold caches
#              or work); twice.txt, twice.json
#   stamps     stage_probe.py --stamps-only alone (STAMPS_ONLY, STAMPS_S; STAMPS_BY_BLOCK: kernel
#              slots such as "order,coop" whose last blocks to list one by one, with their SMs;
#              STAMPS_KERNELS: a carried kernels/ folder to build instead, e.g. a branch's):
#              stamps_only.txt;
#              with STAMPS_POLICY (AlignPolicy fields as NAME=INT,...) a second run under that
#              policy: stamps_only_policy.txt
#   ab         scripts/tiny_experiment.py once for each line of AB_FILE (default
#              scripts/ab_runs.txt, where the next round's A/B runs are listed: its arguments,
#              quoted as in a shell; '#' lines are comments); AB_PICK: the line numbers to run
#              (counting argument lines only, from 1; default all); AB_S: seconds each.
#              A line "tree=DIR ARGS" runs DIR's script and package (another commit's tree).
#              Into ab.txt, and the results of every line into ab.json
#   anchors    scripts/anchors_replay.py: every anchors row in graph replay, for the package of
#              ANCHORS_TREE (default ab_53c4e4e: `git archive 53c4e4e moe_lora_align kernels`
#              unpacked there and carried) and for this checkout, ANCHORS_TURNS turns (default
#              2) in alternating order; replay.json (every run), and anchors_compare.py's
#              verdict of each turn in replay.txt
# Every step's exit status and summary lines also go to $OUT/summary.txt (one small file, for
# when the returned output or files are cut short).
# Old spellings: quick = tests memcheck racecheck bench; full = the same with benchfull.
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
step() { echo; echo "=== $* ($(date +%T))"; }
# A step's end: its exit status and its log's summary lines (pytest's, the sanitizer's), also
# into summary.txt, one small file that says how every step ended when the returned output
# and files are cut short.
finish() {  # name, status, [log]
  local line="$1 rc=$2"
  [ -n "${3:-}" ] && line="$line: $(grep -E "passed|failed|SUMMARY" "$3" 2>/dev/null | tail -2 | tr '\n' ' ')"
  echo "$line" | tee -a "$OUT/summary.txt"
}
# stage_probe.py's probe build and stamps of the STAMPS_ONLY cases, into the file given;
# with STAMPS_POLICY, once more under that policy, into FILE_policy.txt.
stamps() {
  local file=$1 policy
  for policy in "" ${STAMPS_POLICY:+"$STAMPS_POLICY"}; do
    timeout ${STAMPS_S:-180} python3 scripts/stage_probe.py --stamps-only \
      --only "${STAMPS_ONLY:-"', 1, "}" ${policy:+--policy "$policy"} \
      ${STAMPS_BY_BLOCK:+--by-block "$STAMPS_BY_BLOCK"} ${STAMPS_KERNELS:+--kernels "$STAMPS_KERNELS"} \
      --out /tmp/stage-probe 2>&1 | tee "$file" | tail -40
    finish "stamps${policy:+ ($policy)}" "${PIPESTATUS[0]}"
    file=${1%.txt}_policy.txt
  done
}
# The JSON files matching a glob (under /tmp) as one file, keyed by name less /tmp/ and .json.
merge_json() {  # glob, output
  python3 -c 'import glob, json, sys; json.dump({p[5:-5]: json.load(open(p)) for p in sorted(glob.glob(sys.argv[1]))}, open(sys.argv[2], "w"), indent=0)' "$1" "$2"
}
STEPS="$*"
[ "$STEPS" = quick ] || [ -z "$STEPS" ] && STEPS="tests memcheck racecheck bench"
[ "$STEPS" = full ] && STEPS="tests memcheck racecheck benchfull"

step versions
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "import sys, cupy, numpy; print(sys.version); print('cupy', cupy.__version__, 'numpy', numpy.__version__, 'cuda runtime', cupy.cuda.runtime.runtimeGetVersion(), 'nvrtc', cupy.cuda.nvrtc.getVersion())"
  # NVRTC's build decides register allocation (spills) and CuPy's kernel-cache key
  python3 -m pip list 2>/dev/null | grep -i -E "^(nvidia-cuda-nvrtc|cuda-toolkit|torch|jax) " || true
  echo "commit: $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null)"
  echo "steps: $STEPS"
} 2>&1 | tee "$OUT/versions.txt"
{ head -2 "$OUT/versions.txt" | tail -1 | cut -d, -f1; grep "^commit:" "$OUT/versions.txt"; } \
  > "$OUT/summary.txt"

step install
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2

GPU_TESTS="tests/test_gpu_kernels.py tests/test_gpu_streams.py tests/test_gpu_sizes.py
  tests/test_gpu_limits.py tests/test_gpu_hostile.py tests/test_gpu_determinism.py
  tests/test_gpu_threads.py tests/test_gpu_prepared.py tests/test_gpu_compat.py
  tests/test_gpu_torch_ops.py tests/test_gpu_fuzz.py"
SAN_K=${SAN_K:-"not 65536 and not 8192-4096 and not many_buckets and not slow and not huge and not largest and not 16384"}
sanitize() {  # tool, extra options, test selection
  local tool=$1; shift
  step "$tool"
  MLA_SANITIZER=$tool FUZZ_CASES=${SAN_FUZZ_CASES:-150} timeout ${SAN_S:-280} compute-sanitizer --tool "$tool" "$@" \
    --error-exitcode 9 --print-limit 20 python3 -m pytest ${SAN_FILES:-$GPU_TESTS} -q -x -p no:cacheprovider \
    -k "$SAN_K and not threads and not scratch_bytes" 2>&1 | tee "$OUT/$tool.log" | tail -6
  finish "$tool" "${PIPESTATUS[0]}" "$OUT/$tool.log"
}
for s in $STEPS; do
  case $s in
    tests)
      step "GPU tests"
      timeout ${TESTS_S:-420} python3 -m pytest tests -q -p no:cacheprovider -m "not emulator" \
        --ignore=tests/test_compile.py ${PYTEST_ARGS:-} ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 \
        | tee "$OUT/tests.log" | tail -25
      finish tests "${PIPESTATUS[0]}" "$OUT/tests.log" ;;
    tests_kernels|tests_rest)
      step "GPU tests ($s)"
      if [ "$s" = tests_kernels ]; then SEL="tests/test_gpu_kernels.py"
      else SEL="tests --ignore=tests/test_gpu_kernels.py"; fi
      timeout ${TESTS_S:-420} python3 -m pytest $SEL -q -p no:cacheprovider -m "not emulator" \
        --ignore=tests/test_compile.py ${PYTEST_ARGS:-} ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 \
        | tee "$OUT/$s.log" | tail -25
      finish "$s" "${PIPESTATUS[0]}" "$OUT/$s.log" ;;
    fuzz)
      step "fuzz (long)"
      timeout ${FUZZ_S:-420} python3 scripts/fuzz.py --cases ${FUZZ_CASES:-10000} \
        --seed ${FUZZ_SEED:-20261203} --json "$OUT/fuzz.json" 2>&1 | tee "$OUT/fuzz.log" | tail -8
      finish fuzz "${PIPESTATUS[0]}" "$OUT/fuzz.log" ;;
    memcheck) sanitize memcheck ;;
    racecheck) sanitize racecheck --racecheck-report hazard ;;
    synccheck) sanitize synccheck ;;
    initcheck) sanitize initcheck ;;
    bench|benchfull)
      step "benchmark ($s)"
      BENCH_ARGS="--json $OUT/bench.json --table $OUT/bench.txt --plot $OUT/bench.png"
      [ "$s" = benchfull ] || BENCH_ARGS="--quick $BENCH_ARGS"
      timeout ${BENCH_S:-400} python3 -m moe_lora_align.bench $BENCH_ARGS 2>"$OUT/bench.progress"
      finish bench $? ;;
    det)
      step "deterministic against default"
      timeout ${DET_S:-200} python3 scripts/det_experiment.py --json "$OUT/det.json" 2>&1 \
        | tee "$OUT/det.txt" | tail -20
      finish det "${PIPESTATUS[0]}" ;;
    eager)
      step "eager paths: this checkout${EAGER_TREE:+ against $EAGER_TREE}"
      rm -f /tmp/eager_*.json; : > "$OUT/eager.txt"; rc=0
      for turn in $(seq "${EAGER_TURNS:-3}"); do
        order=". ${EAGER_TREE:-}"; [ $((turn % 2)) = 0 ] && order="${EAGER_TREE:-} ."
        for tree in $order; do
          dir=$(cd "$tree" && pwd)
          PYTHONPATH=$dir timeout ${EAGER_S:-150} python3 scripts/eager_ab.py --label "$tree" \
            --json "/tmp/eager_${turn}_$(basename "$dir").json" \
            < /dev/null 2>&1 | tee -a "$OUT/eager.txt" | tail -5
          [ "${PIPESTATUS[0]}" = 0 ] || rc=1
        done
      done
      merge_json "/tmp/eager_*.json" "$OUT/eager.json"
      finish eager $rc ;;
    steps)
      step "eager call steps"
      timeout ${STEPS_S:-200} python3 scripts/profile_calls.py --steps 2>&1 \
        | tee "$OUT/steps.txt" | tail -40
      finish steps "${PIPESTATUS[0]}" ;;
    decode)
      step "decode kernels"
      timeout ${DECODE_S:-300} python3 scripts/tiny_experiment.py --runs "${DECODE_RUNS:-tiny,det}" \
        ${DECODE_BASELINE:+--baseline "$DECODE_BASELINE"} ${DECODE_CASES:+--cases "$DECODE_CASES"} \
        --json "$OUT/tiny.json" 2>&1 | tee "$OUT/tiny.txt" | tail -30
      finish tiny_experiment "${PIPESTATUS[0]}"
      stamps "$OUT/stamps.txt" ;;
    bounds)
      step "issue 18's rows and their bounds"
      timeout ${BOUNDS_S:-300} python3 scripts/bounds.py ${BOUNDS_CASES:+--cases "$BOUNDS_CASES"} \
        --out "$OUT" 2>&1 | tail -40
      finish bounds "${PIPESTATUS[0]}" ;;
    twice)
      step "decode twice in one block"
      timeout ${TWICE_S:-240} python3 scripts/decode_experiment.py --twice-only \
        ${TWICE_CASES:+--cases "$TWICE_CASES"} --out /tmp/decode-out 2>&1 \
        | tee "$OUT/twice.txt" | tail -30
      finish twice "${PIPESTATUS[0]}"
      cp /tmp/decode-out/decode.json "$OUT/twice.json" 2>/dev/null ;;
    stamps)
      step "stage stamps"
      stamps "$OUT/stamps_only.txt" ;;
    ab)
      n=0
      rm -f /tmp/ab[0-9]*.json
      while IFS= read -r line; do
        case $line in ''|'#'*) continue ;; esac
        n=$((n + 1))
        if [ -n "${AB_PICK:-}" ] && ! [[ " $AB_PICK " == *" $n "* ]]; then continue; fi
        step "A/B $n: $line" | tee -a "$OUT/ab.txt"
        # "tree=DIR ARGS": DIR's own package and script (another commit's whole tree, carried
        # in: its host side with its kernels); paths in ARGS stay relative to this root
        tree=. path=${PYTHONPATH:-}
        case $line in tree=*)
          tree=${line%% *}; tree=${tree#tree=}; line=${line#* }; path=$tree${path:+:$path} ;;
        esac
        eval "args=($line)"
        PYTHONPATH=$path \
        timeout ${AB_S:-300} python3 $tree/scripts/tiny_experiment.py "${args[@]}" \
          --json "/tmp/ab$n.json" < /dev/null 2>&1 | tee -a "$OUT/ab.txt" | tail -30
        finish "ab$n" "${PIPESTATUS[0]}"
      done < "${AB_FILE:-scripts/ab_runs.txt}"
      merge_json "/tmp/ab[0-9]*.json" "$OUT/ab.json" ;;
    anchors)
      step "every anchors row: this checkout against ${ANCHORS_TREE:-ab_53c4e4e}"
      rm -f /tmp/replay_*.json; : > "$OUT/replay.txt"; rc=0
      for turn in $(seq "${ANCHORS_TURNS:-2}"); do
        order="old now"; [ $((turn % 2)) = 0 ] && order="now old"  # drift hits both
        for who in $order; do
          tree=(); [ $who = old ] && tree=(--tree "${ANCHORS_TREE:-ab_53c4e4e}")
          timeout ${ANCHORS_S:-200} python3 scripts/anchors_replay.py "${tree[@]}" \
            --json /tmp/replay_${who}_$turn.json > /dev/null 2>&1 || rc=$?
        done
        python3 scripts/anchors_compare.py /tmp/replay_now_$turn.json \
          --against /tmp/replay_old_$turn.json >> "$OUT/replay.txt" 2>&1 || rc=$?
      done
      merge_json "/tmp/replay_*.json" "$OUT/replay.json"
      grep -E "baseline rows timed|over:" "$OUT/replay.txt"
      finish anchors "$rc" ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
