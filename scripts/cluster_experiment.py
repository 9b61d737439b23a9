"""align_cluster against the dispatcher's other picks, in one process (GPU machine).

  python3 scripts/cluster_experiment.py [--json PATH] [--baseline DIR] [--blocks N]
                                        [--cases PART|PART...] [--turns N]

Every case runs through the public paths (plans for base and pair) under each of RUNS'
policies: the dispatcher without clusters ("no clust": one block, the cooperative launch,
count + place), the default policy, one cluster wherever it runs ("cluster"), and the cluster with other block
sizes; with --baseline also the cluster kernel compiled from an earlier commit's kernel
sources. With --blocks N (16: sm_90's non-portable maximum) also clusters of N blocks:
the package's sources compiled with -DCLUSTER_BLOCKS=N, the dispatcher's CLUSTER_BLOCKS set to
N in this process for those runs only ("cl N": the default policy; "cl N all": the cluster
wherever it runs), and the cluster kernels allowed a non-portable size. Graph replay (moe_lora_align.bench.graph_us), the runs taking turns three times so
drift hits all, the median kept; every result is checked against the NumPy backend first
(scripts/tiny_experiment.py: make_call).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import cupy
import numpy as np

import moe_lora_align as mla
from moe_lora_align import _dispatch, _kernels, _launch
from moe_lora_align.bench import cases_matching, graph_us

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_experiment import make_call, medians_in_turns  # noqa: E402

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
    # the cooperative launch's sizes that a cluster of 16 blocks holds (up to 131072 routes)
    ("base", 16384, 256, 8, 64, None), ("lora", 2048, 256, 8, 64, 16),
]
EVERYWHERE = {"cluster_min_routes": 0, "cluster_max_routes": 1 << 30,
              "cluster_max_buckets": 1 << 30}
RUNS = [  # name, AlignPolicy fields
    ("no clust", {"cluster_max_routes": 0}),
    ("default", {}),
    ("cluster", EVERYWHERE),
    ("cl 512", dict(EVERYWHERE, cluster_min_block=512)),
]


PORTABLE_BLOCKS = _dispatch.CLUSTER_BLOCKS
CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14


def use_source(source):
    """Compile and load the kernels of one run, unless they are loaded already: ``source`` an
    earlier commit's kernel directory, None (the package's own), or a cluster size (the
    package's sources with -DCLUSTER_BLOCKS, and the dispatcher's CLUSTER_BLOCKS set to it in
    this process: an experiment's setting only, as shipped both are PORTABLE_BLOCKS)."""
    blocks = source if isinstance(source, int) else PORTABLE_BLOCKS
    options = _kernels.COMPILE_OPTIONS
    if blocks != PORTABLE_BLOCKS:
        options += (f"-DCLUSTER_BLOCKS={blocks}",)
    build = _kernels.KernelBuild(source_dir=None if isinstance(source, int) else source,
                                 options=options)
    if build == _kernels.current_build():
        return
    _kernels.use_build(build)
    _dispatch.CLUSTER_BLOCKS = blocks
    _launch.checked_launch.cache_clear()
    if blocks > PORTABLE_BLOCKS:  # load the cluster kernels now, allowed past 8 blocks
        device = cupy.cuda.Device()
        kernels = _kernels.kernels_for(np.int32, device.id,
                                       _launch.device_limits(device.id).smem_optin)
        for key in [k for k in kernels.names if k[0] in ("cluster", "cluster_pair")]:
            cupy.cuda.driver.funcSetAttribute(
                kernels.handle(key), CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--baseline", type=Path,
                    help="kernel sources of an earlier commit: one more run, its cluster kernel")
    ap.add_argument("--blocks", type=int, help="also clusters of this many blocks (9 to 16)")
    ap.add_argument("--cases", default="",
                    help="'|'-separated parts of the printed case tuples to keep (default: all)")
    ap.add_argument("--turns", type=int, default=3, help="turns of every run per case")
    args = ap.parse_args()
    runs = [(name, settings, None) for name, settings in RUNS]
    if args.baseline:
        runs.append(("cl base", EVERYWHERE, args.baseline.resolve()))
    if args.blocks:
        runs += [(f"cl {args.blocks}", {}, args.blocks),
                 (f"cl {args.blocks} all", EVERYWHERE, args.blocks)]
    stream = cupy.cuda.Stream(non_blocking=True)
    report = {}
    print(f"{'case':40s} " + " ".join(f"{n:>9s}" for n, _, _ in runs)
          + f"   (graph us, median of {args.turns} in turn)")
    by_name = {name: (settings, source) for name, settings, source in runs}
    for case in cases_matching(CASES, args.cases):
        def time_run(name):
            settings, source = by_name[name]  # source: a kernel directory or a cluster size
            use_source(source)
            try:
                fn = make_call(case, stream, False, mla.AlignPolicy(**settings))
            except ValueError as e:
                print(f"  {name}: refused: {e}", file=sys.stderr)
                return float("nan")
            return graph_us(fn, stream)

        med, times = medians_in_turns(list(by_name), time_run, args.turns)
        use_source(None)
        report[str(case)] = {"median_us": med, "all_us": times}
        print(f"{case!s:40s} " + " ".join(f"{med[n]:9.2f}" for n, _, _ in runs), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
