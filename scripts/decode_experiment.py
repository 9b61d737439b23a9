"""Two questions about the one-block decode kernels, answered on the GPU machine.

  python3 scripts/decode_experiment.py [--out DIR] [--twice-only] [--cases PATTERN]

1. Block size: graph-replay µs of decode cases with the single block forced to 128, 256, 512
   and 1024 threads (the dispatcher sizes it from routes and output entries only; the scan
   and the zeroing also loop over the buckets, 4096 of them for LoRA E=256 x 16 slots).
2. Cold or busy: built with -DMLA_PROBE -DMLA_TWICE, the kernel runs the same alignment twice
   in one block and stamps both passes (pass 1 in kernel slot 0, pass 2 in slot 1). A second
   pass much faster than the first means the time goes to cold caches on the SM that the
   call landed on, not to the work. align_tiny and align_tiny_staged (align_warp inside
   align_tiny too) run their two passes through one rolled loop, the same instructions, so
   for them a faster second pass also measures the instruction cache. align_single's second
   pass is a second inlined copy of its code (results/PERF_LOG.md r17), so for it only the
   data and constant caches are warm. Calls with fill blocks (align_tiny_filled) run once.

``--twice-only`` skips the block sweep; ``--cases`` keeps the cases whose tuple's text
contains one of its '|'-separated parts.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import cupy

from moe_lora_align import _dispatch, _kernels
from moe_lora_align.bench import cases_matching, graph_us
from stage_probe import make_call, probe_run, reload_kernels  # same folder

CASES = [  # op, T, E, K, B, L
    ("base", 1, 64, 8, 16, None), ("base", 1, 512, 10, 16, None),
    ("base", 4, 256, 8, 16, None), ("base", 16, 256, 8, 16, None),
    ("base", 64, 256, 8, 16, None), ("base", 256, 256, 8, 16, None),
    ("base", 256, 512, 10, 16, None), ("base det", 64, 256, 8, 16, None),
    ("base det", 256, 256, 8, 16, None),
    ("lora", 1, 64, 6, 16, 16), ("lora", 1, 256, 8, 16, 16), ("lora", 16, 256, 8, 16, 16),
    ("lora", 256, 64, 6, 16, 16), ("lora", 256, 256, 8, 16, 16),
    ("pair", 1, 64, 8, 16, 4), ("pair", 64, 256, 8, 16, 16),
]
STAGES = ["entry", "rows+fill", "claim", "scan", "stores", "end"]


def forced_block(block):
    """A policy under which align_single (not align_tiny) always takes ``block`` threads."""
    return _dispatch.AlignPolicy(use_tiny=False, single_block_sizes=(block,),
                                 one_route_per_thread=0, entries_per_thread=1 << 30,
                                 buckets_per_thread=1 << 30)


def block_sweep(stream):
    res = {}
    for case in CASES:
        row = {}
        numel = case[1] * case[3]
        for block in (None, 128, 256, 512, 1024):
            if block is not None and block * _dispatch.ITEMS_PER_THREAD < numel:
                continue
            policy = _dispatch.AlignPolicy(use_tiny=False) if block is None else \
                forced_block(block)
            row[str(block or "auto")] = graph_us(make_call(case, stream, policy), stream)
        res[str(case)] = row
        print(f"  {case!s:36s} " + "  ".join(f"{k}={v:6.2f}" for k, v in row.items()),
              flush=True)
    return res


def twice(stream):
    base_opts = _kernels.current_build().options
    reload_kernels(base_opts + ("-DMLA_PROBE", "-DMLA_TWICE"))
    out = {}
    try:
        for case in CASES:
            fn = make_call(case, stream)
            us = graph_us(fn, stream)
            runs = {0: [], 1: []}
            for _ in range(15):
                b = probe_run(fn, stream)
                for k in (0, 1):
                    blocks = [blk for blk in range(160) if b[k, blk, 0, 0]]
                    for blk in blocks:
                        runs[k].append([int(b[k, blk, s, 0] - b[k, blk, 0, 0])
                                        for s in range(len(STAGES))])
            med = {k: [int(statistics.median(r[s] for r in v)) for s in range(len(STAGES))]
                   for k, v in runs.items() if v}
            out[str(case)] = {"graph_us_twice": us, "cycles": med}
            text = "; ".join(
                f"pass {k + 1}: " + " ".join(f"{n} {c}" for n, c in zip(STAGES[1:], m[1:]))
                for k, m in med.items())
            print(f"  {case!s:36s} {us:6.2f} us  {text}", flush=True)
    finally:
        reload_kernels(base_opts)
    return out


def main():
    global CASES
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("decode-out"))
    ap.add_argument("--twice-only", action="store_true", help="skip the block sweep")
    ap.add_argument("--cases", default=None, help="'|'-separated parts of the cases' text")
    args = ap.parse_args()
    CASES = cases_matching(CASES, args.cases)
    if not CASES:
        ap.error(f"--cases {args.cases!r} matches no case")
    args.out.mkdir(parents=True, exist_ok=True)
    stream = cupy.cuda.Stream(non_blocking=True)
    report = {}
    if not args.twice_only:
        print("== single-block threads (graph us per call; auto = the dispatcher's choice)")
        report["block_sweep"] = block_sweep(stream)
    print("== twice in one block (-DMLA_TWICE): median cycles from entry, 15 eager calls")
    report["twice"] = twice(stream)
    (args.out / "decode.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
