"""Two questions about the one-block decode kernel, answered on the GPU machine.

  python3 scripts/decode_experiment.py [--out DIR]

1. Block size: graph-replay µs of decode cases with the single block forced to 128, 256, 512
   and 1024 threads (the dispatcher sizes it from routes and output entries only; the scan
   and the zeroing also loop over the buckets, 4096 of them for LoRA E=256 x 16 slots).
2. Cold or busy: built with -DMLA_PROBE -DMLA_TWICE, the kernel runs the same alignment twice
   in one block and stamps both passes. A second pass much faster than the first means the
   time goes to cold caches (constants) on the SM that the call landed on, not to the work.
   Caveat (results/PERF_LOG.md r17): align_in_one_block is inlined, so the second pass runs
   a second copy of the code and says nothing about the instruction cache.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import cupy

from moe_lora_align import _dispatch, _kernels
from moe_lora_align.bench import graph_us
from stage_probe import make_call, probe_run, reload_kernels  # same folder

CASES = [  # op, T, E, K, B, L
    ("base", 1, 64, 8, 16, None), ("base", 1, 512, 10, 16, None),
    ("base", 64, 256, 8, 16, None), ("base", 256, 256, 8, 16, None),
    ("base", 256, 512, 10, 16, None),
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
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("decode-out"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    stream = cupy.cuda.Stream(non_blocking=True)
    print("== single-block threads (graph us per call; auto = the dispatcher's choice)")
    report = {"block_sweep": block_sweep(stream)}
    print("== twice in one block (-DMLA_TWICE): median cycles from entry, 15 eager calls")
    report["twice"] = twice(stream)
    (args.out / "decode.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
