"""Deterministic mode against the default path, in one process (GPU machine).

  python3 scripts/det_experiment.py [--json PATH]

Every case runs six ways: the default (free-order) path; deterministic as the dispatcher
picks ("det", the default policy); deterministic without the one-cluster kernel
("no_cluster": ``cluster_max_routes_deterministic=0``, so the mid band takes one block or the
cooperative launch); deterministic with one cluster up to its 65536 routes ("cluster_64k");
deterministic with every segment sorted after the free-order kernels at any size
("sorted": inside the cooperative launch, align_order after count + place;
``sort_min_buckets=0``); deterministic through the kernels' own ordered ranks ("ordered",
``sort_for_determinism=False``; the cooperative kernel still sorts where its per-warp
counters do not fit). In the cluster range all but no_cluster run the cluster kernel. Graph replay, the runs taking turns three times, the median
kept; every result is checked against the NumPy backend first (scripts/tiny_experiment.py:
make_call, exactly when deterministic).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import cupy

import moe_lora_align as mla
from moe_lora_align.bench import graph_us

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_experiment import make_call, medians_in_turns  # noqa: E402

CASES = [  # op, T, E, K, B, L
    ("base", 1, 64, 8, 16, None), ("base", 64, 256, 8, 16, None),
    ("base", 256, 128, 8, 16, None), ("base", 256, 256, 8, 16, None),
    ("base", 256, 512, 10, 16, None), ("base", 512, 256, 8, 16, None),
    ("base", 1024, 128, 8, 64, None), ("base", 1024, 256, 8, 64, None),
    ("base", 1024, 512, 10, 64, None), ("lora", 256, 256, 8, 16, 4),
    ("pair", 256, 256, 8, 16, 4), ("pair", 1024, 128, 8, 64, 4),
    ("base", 2048, 256, 8, 64, None), ("base", 4096, 256, 8, 64, None),
    ("base", 8192, 256, 8, 64, None), ("lora", 2048, 256, 8, 64, 4),
    ("base", 16384, 256, 8, 64, None),
    ("base", 65536, 256, 8, 64, None), ("base", 16384, 8, 2, 64, None),
    ("lora", 16, 256, 8, 16, 16), ("lora", 256, 256, 8, 16, 16),
    ("lora", 1024, 256, 8, 64, 16), ("lora", 4096, 256, 8, 64, 16),
    ("lora", 16384, 256, 8, 64, 16), ("lora", 4096, 64, 6, 64, 4),
    ("pair", 4096, 256, 8, 64, 16), ("pair", 16384, 256, 8, 64, 16),
]
RUNS = [  # name, deterministic, AlignPolicy fields
    ("default", False, {}),
    ("det", True, {}),
    ("no_cluster", True, {"cluster_max_routes_deterministic": 0}),
    ("cluster_64k", True, {"cluster_max_routes_deterministic": 65536}),
    ("sorted", True, {"sort_min_buckets": 0}),
    ("ordered", True, {"sort_for_determinism": False}),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--only", default="",
                    help="only cases whose printed tuple contains one of these ('|' between)")
    ap.add_argument("--runs", default="", help="only these runs, comma-separated")
    args = ap.parse_args()
    CASES[:] = [c for c in CASES if any(o in str(c) for o in args.only.split("|"))]
    if args.runs:
        RUNS[:] = [r for r in RUNS if r[0] in args.runs.split(",") + ["default", "det"]]
    stream = cupy.cuda.Stream(non_blocking=True)
    report = {}
    print(f"{'case':40s} " + " ".join(f"{n:>9s}" for n, _, _ in RUNS)
          + "  det/default  (graph us, median of 3 in turn)")
    by_name = {name: (det, settings) for name, det, settings in RUNS}
    for case in CASES:
        def time_run(name):
            det, settings = by_name[name]
            return graph_us(make_call(case, stream, det, mla.AlignPolicy(**settings)), stream)

        med, times = medians_in_turns(list(by_name), time_run)
        report[str(case)] = {"median_us": med, "all_us": times}
        print(f"{case!s:40s} " + " ".join(f"{med[n]:9.2f}" for n, _, _ in RUNS)
              + f"  {med['det'] / med['default']:6.2f}x", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
