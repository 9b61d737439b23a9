#!/usr/bin/env python3
"""Long fuzz run: random cases on the GPU against the NumPy backend (tests/fuzz_cases.py).

    python scripts/fuzz.py --cases 10000 --seed N [--json PATH]
    python scripts/fuzz.py --seed N --only 1234          # rerun one reported case
    python scripts/fuzz.py --numpy --cases 200           # the harness alone, no GPU
    python scripts/fuzz.py --emulator --cases 2000       # the kernels on the CPU, no GPU

Case i of seed S is drawn from numpy.random.default_rng([S, i]); every failure is printed as
"seed S case i: <describe>" with its error. Prints progress, then the totals (run / skipped as
refused / failed), the seed and the elapsed time; exits 1 on any failure (2: no GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

import numpy as np  # noqa: E402

import fuzz_cases as fc  # noqa: E402


def _parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=10000)
    p.add_argument("--seed", type=int, default=None, help="default: from the clock (printed)")
    p.add_argument("--start", type=int, default=0, help="first case index")
    p.add_argument("--only", default=None, help="comma-separated case indices to run")
    p.add_argument("--json", default=None, help="write a JSON summary here")
    p.add_argument("--numpy", action="store_true",
                   help="run the cases NumPy against NumPy (tests the harness; no GPU)")
    p.add_argument("--emulator", action="store_true",
                   help="run the kernels on the CPU emulator (tests/emulator; no GPU), cases "
                        "drawn within fuzz_cases.EMULATOR_BOUNDS")
    p.add_argument("--max-failures", type=int, default=50,
                   help="stop after this many failures (a CUDA fault poisons the context)")
    p.add_argument("--progress-s", type=float, default=10.0, help="seconds between progress lines")
    return p.parse_args()


def _warm_up(xp):
    """Compile (or load) the kernels of every dtype once, so the progress rate is the cases'."""
    import moe_lora_align as mla

    t0 = time.perf_counter()
    for dt in fc.DTYPES:
        ids = xp.zeros((4, 2), dtype=dt)
        mla.align_moe_and_lora(ids, xp.zeros(4, dtype=np.int32), 16, 8, 2)
    if xp is not np:
        xp.cuda.Device().synchronize()
    return time.perf_counter() - t0


def main():
    args = _parse()
    seed = args.seed if args.seed is not None else int(time.time()) % 1_000_000
    bounds = None
    if args.numpy:
        xp = np
        device = "numpy (harness check, no GPU)"
    elif args.emulator:
        import emulator

        t0 = time.perf_counter()
        xp = emulator.Emulator(emulator.build(dtypes=tuple(np.dtype(d) for d in fc.DTYPES)))
        bounds = fc.EMULATOR_BOUNDS
        device = f"CPU emulator (tests/emulator, built in {time.perf_counter() - t0:.1f} s)"
    else:
        try:
            import cupy
            import moe_lora_align as mla

            if not mla.gpu_available():
                raise RuntimeError("CuPy sees no CUDA device")
        except Exception as e:  # noqa: BLE001
            print(f"no GPU: {e} (use --numpy to run the harness on the NumPy backend)")
            return 2
        xp = cupy
        device = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    if args.only:
        indices = [int(x) for x in args.only.split(",") if x.strip()]
    else:
        indices = list(range(args.start, args.start + args.cases))
    print(f"fuzz: seed {seed}, {len(indices)} cases from {indices[0] if indices else 0}, "
          f"on {device}", flush=True)
    t_start = time.perf_counter()
    warm = 0.0 if args.emulator else _warm_up(xp)
    print(f"warm-up (kernel compile/load, every dtype): {warm:.1f} s", flush=True)

    state = {"last": time.perf_counter(), "done": 0, "slow": [], "by_mode": {}}

    def on_result(i, case, status, seconds, err):
        state["done"] += 1
        if case is not None:
            key = f"{case.mode}/{status}"
            state["by_mode"][key] = state["by_mode"].get(key, 0) + 1
            state["slow"].append((seconds, i, fc.describe(case)))
            state["slow"] = sorted(state["slow"], reverse=True)[:5]
        if status == "failed":
            print(f"FAIL seed {seed} case {i}: "
                  f"{fc.describe(case) if case is not None else '?'}\n    {err}", flush=True)
        now = time.perf_counter()
        if now - state["last"] >= args.progress_s:
            state["last"] = now
            el = now - t_start
            print(f"  {state['done']}/{len(indices)} cases, {el:.0f} s "
                  f"({state['done'] / max(el - warm, 1e-9):.0f} cases/s)", flush=True)

    counts, failures = fc.run_many(seed, indices, xp, on_result=on_result,
                                   max_failures=args.max_failures, bounds=bounds)
    elapsed = time.perf_counter() - t_start
    if state["slow"]:
        print("slowest cases:")
        for s, i, d in state["slow"]:
            print(f"  {s:.3f} s  case {i}: {d}")
    for f in failures:
        print(fc.failure_line(f))
    if failures:
        flag = " --emulator" if args.emulator else ""
        print(f"rerun one: python scripts/fuzz.py{flag} --seed {seed} "
              f"--only {failures[0]['case']}")
    # the totals last, so that a log's tail always shows them
    print(f"run {counts['ok']}  skipped as refused {counts['refused']}  failed "
          f"{counts['failed']}  (seed {seed}, {sum(counts.values())} of {len(indices)} cases, "
          f"{elapsed:.1f} s)")
    if args.json:
        summary = {"seed": seed, "cases": len(indices), "start": indices[0] if indices else 0,
                   "run": counts["ok"], "refused": counts["refused"],
                   "failed": counts["failed"], "elapsed_s": round(elapsed, 3),
                   "warm_up_s": round(warm, 3), "device": device, "by_mode": state["by_mode"],
                   "slowest": [{"seconds": round(s, 4), "case": i, "describe": d}
                               for s, i, d in state["slow"]],
                   "failures": failures, "stopped_early": sum(counts.values()) < len(indices),
                   "commit": os.environ.get("COMMIT")}
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
