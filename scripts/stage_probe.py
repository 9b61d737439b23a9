"""Where the time goes, on the GPU machine: floor kernels, per-stage timestamps, eager profile.

  python3 scripts/stage_probe.py [--out DIR] [--stamps-only] [--only PARTS] [--by-block SLOTS]

1. Floor ladder: graph-replay µs of tiny kernels that do one piece of an alignment each
   (empty, one load and store, barriers, a grid ticket), so each stage has a price.
2. The real kernels at representative sizes: graph µs as built, then rebuilt with -DMLA_PROBE
   (thread 0 of every block stamps SM clock and global timer at stage boundaries, see
   kernels/align_common.cuh) and one call's stamps printed per stage.
3. Shared-memory carveout preference at 100 %: graph µs again (SM reconfiguration between
   kernels with different shared-memory needs).
4. Host cost of an eager call: per-call µs of the plan, and a cProfile of its top entries.
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import cupy
import numpy as np

import moe_lora_align as mla
from moe_lora_align import _kernels
from moe_lora_align.bench import GRAPH_CALLS, cases_matching, graph_us, lora_inputs, routing

FLOOR_SRC = r"""
extern "C" __global__ void empty() {}
extern "C" __global__ void load_store(const int* in, int* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = in[i] + 1;
}
extern "C" __global__ void load_syncs_store(const int* in, int* out, int n, int syncs) {
  __shared__ int s[1024];
  int i = threadIdx.x;
  int v = i < n ? in[i] : 0;
  s[i] = v;
  for (int k = 0; k < syncs; ++k) { __syncthreads(); v += s[(i + k + 1) & (blockDim.x - 1)]; }
  if (i < n) out[i] = v;
}
extern "C" __global__ void load_atomic_ret_store(const int* in, int* ctr, int* out, int n) {
  int i = threadIdx.x;
  int v = i < n ? in[i] : 0;
  int o = atomicAdd(ctr + (v & 255), 1);
  if (i < n) out[i] = o;
}
// Every block: load, then the threadfence + ticket; the last block reads everyone's value.
extern "C" __global__ void ticket(const int* in, int* part, unsigned* tk, int* out, int n) {
  __shared__ bool last;
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  int v = i < n ? in[i] : 0;
  if (threadIdx.x == 0) part[blockIdx.x] = v;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(tk, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  int s = 0;
  for (int b = threadIdx.x; b < gridDim.x; b += blockDim.x) s += __ldcg(part + b);
  if (threadIdx.x == 0) { out[0] = s; *tk = 0; }
}
"""

CASES = [  # op ("... det": deterministic=True), T, E, K, B, L
    ("base", 1, 64, 8, 16, None), ("lora", 1, 64, 6, 16, 4), ("base", 256, 256, 8, 16, None),
    ("base", 256, 512, 10, 16, None), ("lora", 16, 64, 6, 16, 16), ("lora", 1, 256, 8, 16, 16),
    ("lora", 256, 256, 8, 16, 16), ("base", 4096, 8, 2, 64, None),
    ("base", 16384, 256, 8, 64, None), ("base", 65536, 256, 8, 64, None),
    ("lora", 4096, 256, 8, 64, 16), ("lora", 16384, 256, 8, 64, 16),
    ("pair", 4096, 256, 8, 64, 16), ("pair", 16384, 256, 8, 64, 16),
    ("base det", 1, 64, 8, 16, None), ("base det", 256, 256, 8, 16, None),
    ("lora det", 16, 64, 6, 16, 16), ("lora det", 1, 256, 8, 16, 16),
    ("lora det", 16, 256, 8, 16, 16), ("base det", 16384, 256, 8, 64, None),
    ("base det", 65536, 256, 8, 64, None), ("lora det", 4096, 256, 8, 64, 16),
    ("base det", 4096, 256, 8, 64, None), ("base det", 1024, 256, 8, 64, None),
    ("lora det", 16384, 256, 8, 64, 16), ("base", 1024, 512, 10, 64, None),
    ("base det", 1024, 512, 10, 64, None), ("base det", 256, 512, 10, 16, None),
    ("base", 16, 64, 8, 16, None), ("base", 16, 256, 8, 16, None),
    ("base", 64, 256, 8, 16, None), ("lora", 16, 256, 8, 16, 16),
    ("lora det", 256, 256, 8, 16, 16),
    # one slot against one base row of the same routes: the anchors' row over 3 % (r51)
    ("lora", 16, 128, 4, 16, 1), ("base", 16, 128, 4, 16, None),
    # the anchors' row nearest 3 % in r53; the skewed deterministic LoRA sort (r53's deals)
    ("lora", 16, 64, 6, 16, 4), ("lora det skewed", 2048, 256, 8, 64, 16),
    ("lora det skewed", 3072, 256, 8, 64, 16), ("lora det skewed", 4096, 256, 8, 64, 16),
    # the same hot segments of 1600 routes (r54: where sorting a block's long ones together lost)
    ("lora det skewed", 16384, 256, 8, 64, 16), ("lora skewed", 16384, 256, 8, 64, 16),
    ("lora skewed", 4096, 256, 8, 64, 16),
    # fill SMs for the sorted deterministic calls (coop_fill_sms_sorted) lost 4.7 us here (r54)
    ("lora det skewed", 1024, 256, 8, 64, 16), ("lora det", 1024, 256, 8, 64, 16),
]
STAGES = {0: ["entry", "rows+fill", "claim", "scan", "stores", "end", "wait from",
              "group walk"],
          1: ["entry", "rows", "claim", "flush", "ticket", "scan", "end", "det prefix"],
          2: ["entry", "expert_ids", "claim", "base", "scan", "staged", "end"],
          3: ["entry", "rows+fill", "claim", "staged", "barrier", "scan+adj", "end",
              "det barrier 1"],
          4: ["entry", "rows", "fill", "claim+barrier", "remote reads", "scan", "stores", "end"],
          5: ["entry", "warps", "scanned", "digits", "bitmap", "end", "loads", "counted"],
          6: ["ranked", "prefix"],
          7: ["entry", "rows", "stores issued", "block issued", "fenced"],
          8: ["entry", "zeroed", "bits set", "bits barrier", "counted", "prefixed",
              "read back", "end"],
          # the bitmap sort's last warp to reach each barrier (MLA_ARRIVE: clock only)
          9: ["entry", "zeroed", "bits set", "counted", "prefixed", "read back"]}
KERNEL = {0: "single", 1: "count", 2: "place", 3: "coop", 4: "cluster", 5: "order",
          6: "cl det", 7: "fill", 8: "bitmap", 9: "arrive"}
# Slots that stamp inside another's kernel, by the slot whose entry their cycles count from:
# the cluster kernel's deterministic ranks, and the block's last bitmap sort (sort_by_bitmaps,
# which a block may run for several groups of long segments: each overwrites the last), and
# its warps' arrivals.
ENTRY_SLOT = {6: 4, 8: 5, 9: 5}
# kernels/align_common.cuh: mla_probe's shape (MLA_PROBE_SLOTS, _BLOCKS, _STAGES)
SLOTS, PROBE_BLOCKS, PROBE_STAGES = len(KERNEL), 160, 8


def floor_ladder(stream):
    mod = cupy.RawModule(code=FLOOR_SRC)
    f = {n: mod.get_function(n) for n in ("empty", "load_store", "load_syncs_store",
                                          "load_atomic_ret_store", "ticket")}
    src = cupy.arange(1 << 20, dtype=np.int32)
    dst = cupy.empty_like(src)
    ctr = cupy.zeros(1024, np.int32)
    tk = cupy.zeros(1, np.uint32)
    n4 = np.int32(4096)
    rows = [
        ("empty 1x128", lambda: f["empty"]((1,), (128,), ())),
        ("empty 1x1024", lambda: f["empty"]((1,), (1024,), ())),
        ("empty 132x1024", lambda: f["empty"]((132,), (1024,), ())),
        ("load+store 1x128", lambda: f["load_store"]((1,), (128,), (src, dst, n4))),
        ("load+store 1x1024", lambda: f["load_store"]((1,), (1024,), (src, dst, n4))),
        ("load+store 132x1024", lambda: f["load_store"]((132,), (1024,), (src, dst, np.int32(1 << 20)))),
        ("load, 1 sync, store 1x1024", lambda: f["load_syncs_store"]((1,), (1024,), (src, dst, n4, np.int32(1)))),
        ("load, 8 syncs, store 1x1024", lambda: f["load_syncs_store"]((1,), (1024,), (src, dst, n4, np.int32(8)))),
        ("load, 32 syncs, store 1x1024", lambda: f["load_syncs_store"]((1,), (1024,), (src, dst, n4, np.int32(32)))),
        ("load, global atomic ret, store 1x128", lambda: f["load_atomic_ret_store"]((1,), (128,), (src, ctr, dst, n4))),
        ("ticket 132x1024", lambda: f["ticket"]((132,), (1024,), (src, ctr, tk, dst, np.int32(1 << 20)))),
        ("2 x load+store 132x1024", lambda: (f["load_store"]((132,), (1024,), (src, dst, np.int32(1 << 20))),
                                             f["load_store"]((132,), (1024,), (dst, src, np.int32(1 << 20))))),
    ]
    out = {}
    for name, fn in rows:
        out[name] = graph_us(fn, stream)
        print(f"  {name:40s} {out[name]:7.2f} us", flush=True)
    return out


POLICY = None  # --policy: the AlignPolicy every case runs under (None: the default)


def make_call(case, stream, policy=None):
    policy = policy or POLICY
    op, T, E, K, B, L = case
    op, *flags = op.split()  # flags: "det" (deterministic), "skewed" (the benchmark's routing)
    det = "det" in flags
    rng = np.random.default_rng(T * 7 + E)
    ids = cupy.asarray(routing(rng, T, K, E, "skewed" if "skewed" in flags else "uniform"))
    if op == "base":
        plan = mla.AlignPlan(T, K, E, B, deterministic=det, policy=policy)
        return lambda: plan(ids, stream=stream)
    mapping, lora_ids, enabled = (cupy.asarray(x) for x in lora_inputs(rng, T, L))
    if op == "pair":  # base and LoRA through a plan (scripts/decode_experiment.py)
        pair = mla.AlignPlan(T, K, E, B, max_loras=L, deterministic=det, policy=policy)
        return lambda: pair(ids, mapping, stream=stream)
    P, M = mla.buffer_sizes(T * K, E, B)
    out = [cupy.full((L, P), T * K, np.int32), cupy.full((L, M), -1, np.int32),
           cupy.zeros(L, np.int32)]
    return lambda: mla.moe_lora_align_block_size(ids, mapping, B, E, L, lora_ids=lora_ids,
                                                 adapter_enabled=enabled, out=out,
                                                 stream=stream, deterministic=det,
                                                 policy=policy)


def time_cases(stream, label):
    res = {}
    for case in CASES:
        fn = make_call(case, stream)
        res[str(case)] = graph_us(fn, stream)
        print(f"  {label:10s} {case!s:40s} {res[str(case)]:7.2f} us", flush=True)
    return res


def reload_kernels(options):
    _kernels.use_build(dataclasses.replace(_kernels.current_build(), options=tuple(options)))


def probe_run(fn, stream, with_sms=False):
    """Run ``fn`` once on ``stream`` (its kernels loaded already) with every probe buffer
    zeroed, and return what the probes hold after it: a [SLOTS, PROBE_BLOCKS, PROBE_STAGES,
    2] int64 array; ``with_sms``: also a [SLOTS, PROBE_BLOCKS] array of each block's SM (-1
    where the block stamped nothing).
    Each kernel is a module of its own with its own copy of the probe globals; entries a
    kernel did not write stay 0 in its copy, so the elementwise max merges them."""
    modules = [module for ks in _kernels.loaded_sets() for module in ks.modules.values()]
    bufs = [cupy.ndarray((SLOTS, PROBE_BLOCKS, PROBE_STAGES, 2), np.uint64,
                         module.get_global("mla_probe")) for module in modules]
    sm_bufs = [cupy.ndarray((SLOTS, PROBE_BLOCKS), np.uint32, module.get_global("mla_probe_sm"))
               for module in modules] if with_sms else []
    for buf in bufs + sm_bufs:
        buf.fill(0)
    with stream:
        fn()
    stream.synchronize()
    merged = np.maximum.reduce([cupy.asnumpy(buf) for buf in bufs]).astype(np.int64)
    if not with_sms:
        return merged
    return merged, np.maximum.reduce([cupy.asnumpy(buf) for buf in sm_bufs]).astype(np.int64) - 1


def block_lines(b, sms, slot, top):
    """Kernel ``slot``'s blocks one by one, the ``top`` that stamped last (global timer)
    first: a line of how many blocks on how many SMs, then a line a block with its SM, its
    entry and last stamp in ns from the slot's first entry, and each stage's SM cycles from
    its entry."""
    blocks = [blk for blk in range(PROBE_BLOCKS) if b[slot, blk, 0, 0]]
    if not blocks:
        return []
    names = STAGES[slot]
    t0 = min(b[slot, blk, 0, 1] for blk in blocks)
    last = {blk: max(b[slot, blk, s, 1] for s in range(len(names))) - t0 for blk in blocks}
    lines = [f"   {KERNEL[slot]} by block, the {min(top, len(blocks))} last of {len(blocks)} "
             f"(on {len({int(sms[slot, blk]) for blk in blocks})} SMs):"]
    for blk in sorted(blocks, key=lambda k: (-last[k], k))[:top]:
        parts = [f"{nm} {int(b[slot, blk, s, 0] - b[slot, blk, 0, 0])}c"
                 for s, nm in enumerate(names) if s > 0 and b[slot, blk, s, 0]]
        lines.append(f"     block {blk:3d} sm {int(sms[slot, blk]):3d} "
                     f"@{int(b[slot, blk, 0, 1] - t0)}-{int(last[blk])}ns: " + "; ".join(parts))
    return lines


def stamps(stream, by_block=(), top=16):
    """One call's stage stamps for every case, as printable lines and raw numbers; for the
    kernel slots named in ``by_block`` (KERNEL's names), also the ``top`` last blocks one by
    one, with their SMs."""
    lines, raw = [], {}
    for case in CASES:
        fn = make_call(case, stream)
        with stream:
            fn()
        stream.synchronize()
        b, sms = probe_run(fn, stream, with_sms=True)
        raw[str(case)] = b.tolist()
        lines.append(f"{case}")
        t0 = min(b[k, blk, 0, 1] for k in range(SLOTS) for blk in range(PROBE_BLOCKS)
                 if b[k, blk, 0, 1])
        for k in range(SLOTS):
            blocks = [blk for blk in range(PROBE_BLOCKS) if b[k, blk, 0, 0]]
            if not blocks:
                continue
            names = STAGES[k]
            # Cycles from the block's entry (ENTRY_SLOT: the kernel's it stamps inside).
            entry = b[ENTRY_SLOT.get(k, k)]
            clk = {s: [b[k, blk, s, 0] - entry[blk, 0, 0] for blk in blocks if b[k, blk, s, 0]]
                   for s in range(len(names))}
            gt = {s: [b[k, blk, s, 1] - t0 for blk in blocks if b[k, blk, s, 1]]
                  for s in range(len(names))}
            parts = []
            for s, nm in enumerate(names):
                if clk[s]:  # arrivals (slot 9) stamp no timer
                    at = f" @{int(min(gt[s]))}-{int(max(gt[s]))}ns" if gt[s] else ""
                    parts.append(f"{nm} {int(statistics.median(clk[s]))}c/"
                                 f"{int(max(clk[s]))}c{at}")
            lines.append(f"   {KERNEL[k]:6s} blocks={len(blocks):3d}: " + "; ".join(parts))
            if KERNEL[k] in by_block:
                lines += block_lines(b, sms, k, top)
    return lines, raw


def eager_profile(stream):
    ids = cupy.asarray(routing(np.random.default_rng(1), 1, 8, 64, "uniform"))
    plan = mla.AlignPlan(1, 8, 64, 16)
    mapping = cupy.zeros(1, np.int32)
    pair = mla.AlignPlan(1, 8, 64, 16, max_loras=4)
    out = {}
    for name, fn in (("plan base", lambda: plan(ids, stream=stream)),
                     ("plan base+lora", lambda: pair(ids, mapping, stream=stream)),
                     ("public base", lambda: mla.moe_align_block_size(ids, 16, 64, stream=stream))):
        for _ in range(200):
            fn()
        stream.synchronize()
        n = 3000
        t = time.perf_counter()
        for _ in range(n):
            fn()
        host = (time.perf_counter() - t) / n * 1e6
        stream.synchronize()
        out[name] = host
        print(f"  host us per call, {name:16s} {host:7.2f}", flush=True)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(3000):
        plan(ids, stream=stream)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
    print("\n".join(s.getvalue().splitlines()[:40]))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("probe-out"))
    ap.add_argument("--stamps-only", action="store_true",
                    help="only the probe build's graph times and stamps (no floor ladder, "
                         "carveout or eager profile)")
    ap.add_argument("--min-tokens", type=int, default=0, help="only cases with T >= this")
    ap.add_argument("--only", default="",
                    help="only cases whose printed tuple contains one of these '|'-separated parts")
    ap.add_argument("--by-block", default="",
                    help="kernel slots (" + ", ".join(KERNEL.values()) + "), ','-separated, "
                         "whose last blocks to print one by one, with their SMs")
    ap.add_argument("--kernels", type=Path, default=None,
                    help="a kernels/ folder to build instead of the package's (another "
                         "commit's, e.g. a branch's `git archive BRANCH kernels` unpacked)")
    ap.add_argument("--policy", default="",
                    help="AlignPolicy fields for every case, as NAME=INT,... (e.g. "
                         "cluster_min_routes=0,cluster_max_routes=65536)")
    args = ap.parse_args()
    global POLICY
    if args.policy:
        POLICY = mla.AlignPolicy(**{k: int(v) for k, v in
                                    (kv.split("=") for kv in args.policy.split(","))})
    args.out.mkdir(parents=True, exist_ok=True)
    if args.kernels:  # reload_kernels keeps the source folder and changes only the options
        _kernels.use_build(dataclasses.replace(_kernels.current_build(),
                                               source_dir=args.kernels.resolve()))
    CASES[:] = [c for c in cases_matching(CASES, args.only) if c[1] >= args.min_tokens]
    stream = cupy.cuda.Stream(non_blocking=True)
    report = {"graph_calls": GRAPH_CALLS}
    base_opts = _kernels.current_build().options
    if not args.stamps_only:
        print("== floor ladder (graph us per call)")
        report["floor"] = floor_ladder(stream)
        print("== kernels as built")
        report["built"] = time_cases(stream, "built")
        print("== carveout 100 %")
        for ks in _kernels.loaded_sets():
            for k in ks.kernels.values():
                k.preferred_shared_memory_carveout = 100
        report["carveout100"] = time_cases(stream, "carve100")
    print("== probe build (-DMLA_PROBE): graph us, then stage stamps: median/max SM cycles "
          "from entry @ global-timer ns window from the call's first entry")
    reload_kernels(base_opts + ("-DMLA_PROBE",))
    report["probe_build"] = time_cases(stream, "probe")
    by_block = [name for name in args.by_block.split(",") if name]
    unknown = sorted(set(by_block) - set(KERNEL.values()))
    if unknown:
        ap.error(f"--by-block: no kernel slot {unknown}; the slots: {list(KERNEL.values())}")
    lines, report["stamps"] = stamps(stream, by_block)
    print("\n".join(lines))
    reload_kernels(base_opts)
    if not args.stamps_only:
        print("== eager host cost")
        report["eager"] = eager_profile(stream)
    (args.out / "probe.json").write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
