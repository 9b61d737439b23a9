"""align_cluster against the dispatcher's other picks, in one process (GPU machine).

  python3 scripts/cluster_experiment.py [--json PATH] [--cases mid|all]

Every case runs through the public paths (plans for base and pair) under each of RUNS'
policies: the dispatcher without clusters ("no clust": one block, the cooperative launch,
count + place), the default policy, one cluster wherever it runs ("cluster"), and the cluster with other block
sizes; with --baseline also the cluster kernel compiled from an earlier commit's kernel
sources. Graph replay (moe_lora_align.bench.graph_us), the runs taking turns three times so
drift hits all, the median kept; every result is checked against the NumPy backend first
(scripts/tiny_experiment.py: make_call).
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
from tiny_experiment import make_call, medians_in_turns, use_kernels  # noqa: E402

CASES = [  # op, T, E, K, B, L
    ("base", 256, 128, 8, 16, None), ("base", 256, 256, 8, 16, None),
    ("base", 256, 512, 10, 16, None), ("base", 1024, 128, 8, 64, None),
    ("base", 1024, 256, 8, 64, None), ("base", 1024, 512, 10, 64, None),
    ("base", 64, 256, 8, 16, None), ("base", 128, 256, 8, 16, None),
    ("base", 512, 256, 8, 64, None), ("base", 2048, 256, 8, 64, None),
    ("base", 4096, 256, 8, 64, None), ("base", 8192, 256, 8, 64, None),
    ("base", 16, 64, 8, 16, None), ("base", 1, 64, 8, 16, None),
    ("lora", 256, 256, 8, 16, 16), ("lora", 64, 256, 8, 16, 16), ("lora", 16, 256, 8, 16, 16),
    ("lora", 256, 256, 8, 16, 4), ("lora", 1024, 256, 8, 64, 16), ("lora", 4096, 256, 8, 64, 16),
    ("lora", 1024, 64, 6, 16, 4),
    ("pair", 256, 256, 8, 16, 16), ("pair", 1024, 256, 8, 64, 4), ("pair", 4096, 256, 8, 64, 16),
    ("pair", 64, 128, 8, 16, 4),
]
EVERYWHERE = {"cluster_min_routes": 0, "cluster_max_routes": 1 << 30,
              "cluster_max_buckets": 1 << 30}
RUNS = [  # name, AlignPolicy fields
    ("no clust", {"cluster_max_routes": 0}),
    ("default", {}),
    ("cluster", EVERYWHERE),
    ("cl 512", dict(EVERYWHERE, cluster_min_block=512)),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--baseline", type=Path,
                    help="kernel sources of an earlier commit: one more run, its cluster kernel")
    args = ap.parse_args()
    runs = [(name, settings, None) for name, settings in RUNS]
    if args.baseline:
        runs.append(("cl base", EVERYWHERE, args.baseline.resolve()))
    stream = cupy.cuda.Stream(non_blocking=True)
    report = {}
    print(f"{'case':40s} " + " ".join(f"{n:>9s}" for n, _, _ in runs)
          + "   (graph us, median of 3 in turn)")
    by_name = {name: (settings, directory) for name, settings, directory in runs}
    for case in CASES:
        def time_run(name):
            settings, directory = by_name[name]
            use_kernels(directory)
            try:
                fn = make_call(case, stream, False, mla.AlignPolicy(**settings))
            except ValueError as e:
                print(f"  {name}: refused: {e}", file=sys.stderr)
                return float("nan")
            return graph_us(fn, stream)

        med, times = medians_in_turns(list(by_name), time_run)
        use_kernels(None)
        report[str(case)] = {"median_us": med, "all_us": times}
        print(f"{case!s:40s} " + " ".join(f"{med[n]:9.2f}" for n, _, _ in runs), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
