"""align_tiny against align_single at decode sizes, in one process (GPU machine).

  python3 scripts/tiny_experiment.py [--json PATH] [--baseline DIR] [--variant NAME=DIR]...
                                     [--runs NAME,...] [--run NAME=FIELD=INT,...[:det]]...
                                     [--cases PART|PART...] [--turns N] [--routing skewed]

Every case is timed with graph replay (moe_lora_align.bench.graph_us) under each of RUNS'
dispatcher settings: align_tiny as dispatched ("tiny"), align_tiny with four buckets a
thread wherever its block has fewer threads than buckets ("tiny4"), align_single ("single"),
and the dispatcher's default but with one block up to any fill size ("no coop": the
cooperative launch otherwise takes the largest LoRA fills), ``deterministic=True`` through
align_tiny ("det") and through align_single ("det single"), the cooperative launch without
fill blocks ("no fill blocks", "det no fill blocks": its counting blocks fill first; the
prefill cases), and align_tiny without fill blocks ("no tiny fill blocks", "det no tiny fill
blocks", "no coop no tiny fill blocks": block 0 fills first), and the mid band through
align_tiny (or past its routes the cooperative launch) instead of the cluster, with and
without fill blocks ("no cluster", "no cluster tiny fill blocks", "no fill blocks no
cluster"); ``--run NAME=FIELD=INT,...[:det]`` adds a run under those AlignPolicy fields.
Sources of earlier commits (``--baseline``, ``--variant``) run without fill blocks. With
``--baseline`` also align_tiny compiled from the kernel sources in DIR (an earlier commit's
``kernels/``, cases it can run: a thread per bucket), and with each ``--variant`` the kernel
sources in DIR under the default dispatcher but a thread per bucket up to 1024 buckets
(NAME=DIR:1: sources that have only that; NAME=DIR:det: with ``deterministic=True``). Runs
take turns (``--turns``, three by default), so drift hits all; each result is checked
against the NumPy backend first. ``--routing skewed`` draws every case's routes as the
benchmark's skewed rows (most routes on a few hot experts) instead of uniformly.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import cupy
import numpy as np

import moe_lora_align as mla
from moe_lora_align import _kernels
from moe_lora_align.bench import (cases_matching, check_against_numpy, graph_us, lora_inputs,
                                  routing)
from moe_lora_align.testing import segment_starts

CASES = [  # op, T, E, K, B, L
    ("base", 1, 8, 2, 16, None), ("base", 1, 64, 8, 16, None), ("base", 1, 512, 10, 16, None),
    ("base", 4, 64, 8, 16, None), ("base", 4, 256, 8, 16, None), ("base", 3, 512, 10, 16, None),
    ("base", 16, 64, 8, 16, None), ("base", 16, 256, 8, 16, None),
    ("base", 64, 256, 8, 16, None), ("base", 256, 8, 2, 16, None),
    ("base", 256, 64, 8, 16, None), ("base", 256, 128, 8, 16, None),
    ("base", 256, 256, 8, 16, None),
    ("base", 256, 512, 10, 16, None),
    # align_tiny's staged row (tiny_stage_from) and the cluster beside it
    ("base", 128, 64, 8, 16, None), ("base", 128, 256, 8, 16, None),
    ("base", 192, 256, 8, 16, None), ("base", 384, 256, 8, 16, None),
    ("base", 512, 256, 8, 64, None), ("base", 512, 512, 8, 16, None),
    ("lora", 1, 64, 6, 16, 4), ("lora", 1, 64, 8, 16, 4), ("lora", 4, 64, 8, 16, 4), ("lora", 2, 128, 8, 16, 16),
    ("lora", 16, 64, 6, 16, 16), ("lora", 16, 128, 4, 16, 4),
    ("lora", 256, 64, 6, 16, 16), ("lora", 256, 256, 8, 16, 4),
    ("lora", 1, 256, 8, 16, 16), ("lora", 16, 256, 8, 16, 16), ("lora", 64, 256, 8, 16, 16),
    ("lora", 16, 256, 8, 16, 4),
    # base + LoRA pairs in the cluster's range over at most 1024 LoRA buckets: the cluster
    # pair, or ("no cluster") base in block 0 and a block a LoRA row
    ("pair", 288, 256, 8, 16, 4), ("pair", 512, 256, 8, 16, 4), ("pair", 512, 256, 8, 16, 2),
    ("lora", 128, 256, 8, 16, 16),
    # deterministic align_tiny's chunks' groups (tiny_chunk_ranks_from) over 1024 and 2048 buckets
    ("lora", 64, 256, 8, 16, 4), ("lora", 16, 256, 8, 16, 8), ("lora", 256, 256, 8, 16, 8),
    ("lora", 256, 256, 8, 16, 16), ("lora", 512, 256, 8, 16, 16), ("lora", 256, 256, 8, 64, 16),
    ("lora", 512, 256, 8, 64, 16), ("pair", 16, 256, 8, 16, 16), ("pair", 256, 256, 8, 16, 16),
    # 2048 routes over a few slots: align_tiny or the cluster (cluster_min_routes)
    ("lora", 256, 256, 8, 16, 1), ("lora", 256, 256, 8, 16, 2), ("pair", 256, 256, 8, 16, 1),
    ("lora", 512, 256, 8, 16, 1),
    ("pair", 256, 256, 8, 64, 16),
    ("pair", 1, 64, 8, 16, 4), ("pair", 64, 128, 8, 16, 4), ("pair", 256, 64, 8, 16, 16),
    # the mid band past align_tiny's routes: the cluster, or without it ("no cluster") the
    # cooperative launch
    ("base", 512, 256, 8, 16, None), ("base", 1024, 128, 8, 64, None),
    ("base", 1024, 256, 8, 64, None), ("base", 1024, 512, 10, 64, None),
    # prefill, the cooperative launch ("no fill blocks" against its default)
    ("base", 4096, 256, 8, 64, None), ("base", 16384, 256, 8, 64, None),
    ("base", 65536, 256, 8, 64, None), ("base", 16384, 8, 8, 64, None),
    ("lora", 4096, 256, 8, 64, 16), ("lora", 16384, 256, 8, 64, 16),
    ("lora", 16384, 256, 8, 64, 4), ("lora", 4096, 64, 8, 64, 4),
    # the cooperative launch's fill blocks between 147K and 540K output entries, and at the
    # free-order bounds (661K entries; 196608 routes)
    ("base", 32768, 256, 8, 64, None), ("lora", 2048, 256, 8, 64, 16),
    ("lora", 8192, 256, 8, 64, 4), ("lora", 3072, 256, 8, 64, 16),
    ("lora", 1024, 256, 8, 64, 16), ("pair", 4096, 256, 8, 64, 16),
    ("lora", 24576, 256, 8, 64, 2),
    # the anchors' rows nearest the 3 % rule on the H100 (r50): few experts at 65536 tokens,
    # and one slot of 16 tokens
    ("base", 65536, 64, 8, 64, None), ("base", 65536, 128, 8, 64, None),
    ("base", 65536, 512, 10, 64, None), ("lora", 16, 128, 4, 16, 1),
    ("lora", 16, 256, 8, 16, 1), ("lora", 16, 64, 6, 16, 1),
    # past 32 slots: a block a row (tiny_row_blocks_max_rows) or the launches before it
    ("lora", 1, 256, 8, 16, 64), ("lora", 16, 256, 8, 16, 33), ("lora", 16, 256, 8, 16, 64),
    ("lora", 16, 64, 8, 16, 128), ("lora", 256, 256, 8, 16, 64), ("lora", 256, 64, 6, 16, 48),
    ("lora", 512, 128, 8, 16, 100), ("pair", 16, 256, 8, 16, 64), ("pair", 256, 128, 8, 16, 48),
    # a cluster a row (cluster_rows) up to what one cluster holds
    ("lora", 8192, 256, 8, 64, 16),
    # (K=4 past 1024 tokens: the emulator test of every run skips them, as they cost minutes)
    ("lora", 1200, 256, 4, 64, 16), ("lora", 1536, 256, 4, 64, 16),
    ("lora", 1536, 256, 8, 64, 16), ("lora", 1024, 256, 8, 64, 8), ("lora", 1024, 256, 8, 64, 4),
    ("lora", 2048, 256, 4, 16, 16), ("lora", 2048, 128, 4, 16, 16), ("lora", 1024, 64, 8, 64, 2),
    # the r57 cuts of a cluster a row (12288 routes, deterministic 16384), 4 to 16 slots
    ("lora", 1280, 256, 8, 64, 16), ("lora", 1280, 256, 8, 64, 4), ("lora", 1536, 256, 8, 64, 4),
    ("lora", 2048, 256, 8, 64, 8), ("lora", 4096, 128, 4, 64, 4), ("lora", 4096, 128, 4, 64, 16),
    # a cluster a row past 12288 routes over fewer slots (each cluster reads every route)
    ("lora", 3072, 256, 8, 64, 8), ("lora", 4096, 256, 8, 64, 8), ("lora", 2048, 256, 8, 64, 4),
    ("lora", 4096, 256, 8, 64, 4), ("lora", 2048, 512, 8, 64, 2),
    ("lora", 1536, 256, 8, 64, 2), ("lora", 3072, 256, 8, 64, 4),
    ("lora", 6144, 256, 8, 64, 8), ("lora", 8192, 256, 8, 64, 8),
    # base + LoRA with base on a cluster and a cluster a LoRA row (cluster_rows_pair)
    ("pair", 1536, 256, 4, 64, 8), ("pair", 2048, 256, 4, 64, 8), ("pair", 2048, 256, 4, 64, 15),
    ("pair", 3072, 256, 4, 64, 4), ("pair", 1536, 256, 8, 64, 8),
    # the same past 8 slots and 12288 routes, and over 2 slots
    ("pair", 1280, 256, 8, 64, 16), ("pair", 1536, 256, 8, 64, 16), ("pair", 1536, 256, 4, 64, 2),
    ("pair", 1536, 256, 8, 64, 2), ("pair", 2048, 256, 8, 64, 8), ("pair", 2048, 256, 8, 64, 4),
    ("pair", 4096, 256, 8, 64, 8),
    # the row pair's cut against the cluster pair (pair_row_blocks_over_cluster_max_routes)
    ("pair", 320, 256, 8, 16, 4), ("pair", 384, 256, 8, 16, 4), ("pair", 448, 256, 8, 16, 4),
    ("pair", 384, 256, 8, 16, 2), ("pair", 272, 256, 8, 16, 2),
    # the sorting cooperative pair past 32768 routes (its LoRA side's bitmaps read as runs)
    ("pair", 16384, 256, 8, 64, 16),
]


def make_call(case, stream, det=False, policy=None, kind="uniform"):
    """A checked callable of one case through the public paths (plans for base and pair),
    dispatched with ``policy`` (an ``AlignPolicy``; None: the default); ``kind``: the
    routing (bench.routing)."""
    op, T, E, K, B, L = case
    rng = np.random.default_rng(T * 7 + E)
    ids = routing(rng, T, K, E, kind)
    d_ids = cupy.asarray(ids)
    if op == "base":
        plan = mla.AlignPlan(T, K, E, B, deterministic=det, policy=policy)
        fn = lambda: plan(d_ids, stream=stream)  # noqa: E731
        checks = [(lambda r: r, mla.moe_align_block_size(ids, B, E),
                   lambda: segment_starts(ids, E, B))]
    else:
        mapping, lora_ids, enabled = lora_inputs(rng, T, L)
        dm, dl = cupy.asarray(mapping), cupy.asarray(lora_ids)
        ref_l = mla.moe_lora_align_block_size(ids, mapping, B, E, L, lora_ids=lora_ids)
        lora_check = (lambda r: r, ref_l,
                      lambda: segment_starts(ids, E, B, rows=L, mapping=mapping))
        if op == "pair":
            plan = mla.AlignPlan(T, K, E, B, max_loras=L, deterministic=det, policy=policy)
            fn = lambda: plan(d_ids, dm, lora_ids=dl, stream=stream)  # noqa: E731
            checks = [(lambda r: r[0], mla.moe_align_block_size(ids, B, E),
                       lambda: segment_starts(ids, E, B)), (lambda r: r[1],) + lora_check[1:]]
        else:
            P, M = mla.buffer_sizes(T * K, E, B)
            out = [cupy.full((L, P), T * K, np.int32), cupy.full((L, M), -1, np.int32),
                   cupy.zeros(L, np.int32)]
            fn = lambda: mla.moe_lora_align_block_size(  # noqa: E731
                d_ids, dm, B, E, L, lora_ids=dl, out=out, stream=stream, deterministic=det,
                policy=policy)
            checks = [lora_check]
    with stream:
        res = fn()
    stream.synchronize()
    for pick, ref, starts in checks:
        if det:  # ranks in flat-index order: every entry as the NumPy backend's
            if not all(np.array_equal(cupy.asnumpy(g), np.asarray(r))
                       for g, r in zip(pick(res), ref)):
                raise AssertionError("deterministic result differs from the NumPy backend")
        else:
            check_against_numpy(pick(res), ref, starts)
    return fn


# Sources of earlier commits know no fill blocks: their runs have none.
NO_TINY_FILL = {"tiny_fill_blocks_from": 1 << 62, "tiny_fill_blocks_one_row_from": 1 << 62}
ONE = {"tiny_one_bucket_max": 1024, **NO_TINY_FILL,
       "coop_fill_blocks_from": 1 << 62}
NO_COOP = {"coop_over_single_entries": 1 << 30,
           "coop_over_filled_single_entries": 1 << 30}
RUNS = [  # name, AlignPolicy fields, kernel sources (None: the package's), one bucket a
          # thread only, deterministic
    ("tiny", {}, None, False, False), ("tiny4", {"tiny_one_bucket_max": 0}, None, False, False),
    ("single", {"use_tiny": False}, None, False, False),
    ("no coop", NO_COOP, None, False, False),
    ("det", {}, None, False, True), ("det single", {"use_tiny": False}, None, False, True),
    ("no fill blocks", {"coop_fill_blocks_from": 1 << 62}, None, False, False),
    ("entries bound only", {"coop_fill_blocks_free_below": 0}, None, False, False),
    ("det no fill blocks", {"coop_fill_blocks_from": 1 << 62}, None, False, True),
    ("no tiny fill blocks", NO_TINY_FILL, None, False, False),
    ("det no tiny fill blocks", NO_TINY_FILL, None, False, True),
    ("no coop no tiny fill blocks", {**NO_COOP, **NO_TINY_FILL}, None, False, False),
    ("no cluster", {"cluster_min_routes": 1 << 30}, None, False, False),
    ("no cluster tiny fill blocks", {"cluster_min_routes": 1 << 30, "tiny_fill_blocks_from": 0,
                                     "tiny_fill_blocks_one_row_from": 0},
     None, False, False),
    ("no fill blocks no cluster", {"cluster_min_routes": 1 << 30,
                                   "coop_fill_blocks_from": 1 << 62}, None, False, False)]

VARIANT_FLAGS = {"1", "det", "default"}


def parse_variant(spec):
    """``--variant NAME=DIR[:1][:det][:default]`` as a RUNS entry: the kernel sources in DIR
    without fill blocks (unless ``default``: the default policy), a thread per bucket only
    (``1``), deterministic (``det``)."""
    name, rest = spec.split("=", 1)
    directory, *flags = rest.split(":")
    if not name or "=" in directory or not set(flags) <= VARIANT_FLAGS:  # no '=' in a name
        raise ValueError(f"--variant {spec!r}: NAME=DIR[:1][:det][:default]")
    return (name, {} if "default" in flags else ONE, Path(directory).resolve(), "1" in flags,
            "det" in flags)


def parse_run(spec):
    """``--run NAME=FIELD=INT,...[:det]`` as a RUNS entry: the package's kernels under those
    AlignPolicy fields."""
    name, fields = spec.split("=", 1)
    fields, _, det = fields.partition(":")
    if not name or det not in ("", "det"):
        raise ValueError(f"--run {spec!r}: NAME=FIELD=INT,...[:det]")
    settings = {k: int(v) for k, v in (f.split("=") for f in fields.split(","))}
    return (name, settings, None, False, det == "det")


def medians_in_turns(names, time_run, turns=3):
    """One case's µs under each named run, the runs taking turns ``turns`` times so drift hits
    all alike: ``(medians, every time)``. ``time_run(name)`` returns µs, or None where the
    run does not apply (it then has no entry)."""
    times = {}
    for _ in range(turns):
        for name in names:
            t = time_run(name)
            if t is not None:
                times.setdefault(name, []).append(t)
    return {n: statistics.median(v) for n, v in times.items()}, times


def use_kernels(directory):
    """Compile and load the kernels from ``directory`` (None: the package's own)."""
    _kernels.use_build(_kernels.KernelBuild(source_dir=directory))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--baseline", type=Path, help="kernel sources of an earlier commit")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=DIR[:1][:det][:default]: kernel sources of another commit, "
                         "without fill blocks unless :default (the default policy)")
    ap.add_argument("--runs", help="comma-separated names of RUNS to keep (default: all)")
    ap.add_argument("--run", action="append", default=[],
                    help="NAME=FIELD=INT,...[:det]: one more run under those AlignPolicy fields")
    ap.add_argument("--turns", type=int, default=3, help="turns of every run per case")
    ap.add_argument("--cases", default="",
                    help="'|'-separated parts of the printed case tuples to keep (default: all)")
    ap.add_argument("--routing", choices=("uniform", "skewed"), default="uniform")
    args = ap.parse_args()
    stream = cupy.cuda.Stream(non_blocking=True)
    report = {}
    keep = args.runs.split(",") if args.runs else [r[0] for r in RUNS]
    runs = [r for r in RUNS if r[0] in keep]
    runs += [parse_variant(v) for v in args.variant] + [parse_run(r) for r in args.run]
    if args.baseline:
        runs.append(("base tiny", ONE, args.baseline.resolve(), True, False))
    print(f"{'case':40s} " + " ".join(f"{n:>10s}" for n, _, _, _, _ in runs)
          + f"   (graph us, median of {args.turns} in turn; {args.routing} routing)")
    by_name = {r[0]: r for r in runs}
    for case in cases_matching(CASES, args.cases):
        op, T, E, K, B, L = case

        def time_run(name):
            _, settings, directory, one_only, det = by_name[name]
            if one_only and E * (L or 1) > 1024:
                return None  # kernels with a thread per bucket only
            use_kernels(directory)
            return graph_us(make_call(case, stream, det, mla.AlignPolicy(**settings),
                                      args.routing), stream)

        med, times = medians_in_turns(list(by_name), time_run, args.turns)
        use_kernels(None)
        report[str(case)] = {"median_us": med, "all_us": times}
        print(f"{case!s:40s} " + " ".join(f"{med[n]:10.2f}" if n in med else f"{'-':>10s}"
                                          for n, _, _, _, _ in runs), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
