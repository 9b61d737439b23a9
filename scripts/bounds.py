"""Where issue 18's target rows stand against their bounds, on the GPU machine, in one process.

  python3 scripts/bounds.py [--out DIR] [--cases PATTERN]

For each case (the rows issue 18 sets a target for, and the deterministic ones beside them):
- **graph**: µs per call as built, in graph replay (`bench.graph_us`, as the benchmark).
- **empty**: the same calls with every kernel's body emptied (`empty_source`: each
  `__global__` function returns at once): the same launches, grids, shared memory,
  cooperative and cluster launches and host path, in the same graph. What the launches cost
  before any work is done.
- **work**: graph less empty, what the kernels' work adds.
- **stamps**: the probe build (-DMLA_PROBE) of one call: its span from the first block's
  entry to the last stamp of any block (global timer, ns), and the slowest block's largest
  stage (SM cycles), as `stage_probe.py` names them.
- **bytes**: what the call must read and write (routes, token slots, every output entry),
  and `fill`: µs per call of one memset of that many bytes (a graph node of its own), timed
  the same way, the traffic's own floor here.
- **target**: issue 18's figure (`bench.graph_target`); a deterministic case's is 1.3 times
  its default case's graph figure.

``--cases`` keeps the cases whose tuple's text contains one of its '|'-separated parts.
Writes bounds.txt and bounds.json into ``--out``.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moe_lora_align import _kernels  # noqa: E402
from moe_lora_align.bench import (DETERMINISTIC_OVER_DEFAULT, cases_matching,  # noqa: E402
                                  graph_target)
from moe_lora_align.bench import traffic_bytes as bench_traffic_bytes  # noqa: E402

CASES = [  # op ("... det": deterministic=True, "... skewed": skewed routing), T, E, K, B, L,
    # as stage_probe.make_call takes
    ("base", 1, 64, 8, 16, None), ("base", 16, 256, 8, 16, None),
    ("base", 64, 256, 8, 16, None), ("base", 64, 512, 8, 16, None),
    ("base", 256, 128, 8, 16, None), ("base", 256, 256, 8, 16, None),
    ("base", 256, 512, 10, 16, None), ("base", 1024, 256, 8, 64, None),
    ("base", 1024, 512, 10, 64, None), ("base", 16384, 256, 8, 64, None),
    ("lora", 1, 64, 6, 16, 4), ("lora", 16, 128, 4, 16, 4),
    ("lora", 1, 256, 8, 16, 16), ("lora", 16, 256, 8, 16, 16),
    ("lora", 256, 256, 8, 16, 16), ("lora", 16384, 256, 8, 64, 16),
    ("base det", 256, 256, 8, 16, None), ("base det", 1024, 512, 10, 64, None),
    ("base det", 16384, 256, 8, 64, None), ("lora det", 16, 256, 8, 16, 16),
    ("lora det", 256, 256, 8, 16, 16), ("lora det", 16384, 256, 8, 64, 16),
    # the benchmark's other deterministic rows (its target: 1.3 times the default beside it),
    # uniform and skewed routing
    ("base", 65536, 256, 8, 64, None), ("base det", 65536, 256, 8, 64, None),
    ("lora", 4096, 256, 8, 64, 16), ("lora det", 4096, 256, 8, 64, 16),
    ("base skewed", 256, 256, 8, 16, None), ("base det skewed", 256, 256, 8, 16, None),
    ("base skewed", 16384, 256, 8, 64, None), ("base det skewed", 16384, 256, 8, 64, None),
    ("base skewed", 65536, 256, 8, 64, None), ("base det skewed", 65536, 256, 8, 64, None),
    ("lora skewed", 256, 256, 8, 16, 16), ("lora det skewed", 256, 256, 8, 16, 16),
    ("lora skewed", 4096, 256, 8, 64, 16), ("lora det skewed", 4096, 256, 8, 64, 16),
    ("lora skewed", 16384, 256, 8, 64, 16), ("lora det skewed", 16384, 256, 8, 64, 16),
]

# A kernel's entry: `__global__ void [attributes] name(params) {` (no braces before the body).
KERNEL_ENTRY = re.compile(r"(__global__\s+void\b[^{};]*\)\s*\{)")


def empty_source(text: str) -> str:
    """The kernels' source with every ``__global__`` function returning at once."""
    return KERNEL_ENTRY.sub(r"\1 return;", text)


def empty_build(tmp: Path) -> _kernels.KernelBuild:
    """A KernelBuild of the package's kernels, emptied, written as one file into ``tmp``."""
    text = empty_source(_kernels.inline_source(_kernels.kernel_dir()))
    (tmp / "align_kernels.cu").write_text(text)
    return _kernels.KernelBuild(source_dir=tmp, options=_kernels.current_build().options)


def traffic_bytes(case) -> int:
    """Bytes a case's call must move (``bench.traffic_bytes``)."""
    op, T, E, K, B, L = case
    return bench_traffic_bytes(op.split()[0], T, K, E, B, L)


def target_of(case, graph: dict) -> float | None:
    """Issue 18's graph µs for the case: its row's target, or for a deterministic case 1.3
    times the default case's measured figure (when that case ran too)."""
    op, T, E, K, B, L = case
    kind, *flags = op.split()
    if "det" in flags:
        default = str((" ".join([kind] + [f for f in flags if f != "det"]), T, E, K, B, L))
        return DETERMINISTIC_OVER_DEFAULT * graph[default] if default in graph else None
    return graph_target({"op": kind, "tokens": T, "num_experts": E, "max_loras": L,
                         "routing": "skewed" if "skewed" in flags else "uniform"})


def span(stamps: np.ndarray, stage_names: dict) -> dict:
    """From one call's probe stamps ([slots, blocks, stages, (clock, ns)]): the ns from the
    first entry to the last stamp, and the slowest block's largest stage (cycles)."""
    ns = stamps[..., 1]
    written = ns > 0
    if not written.any():
        return {"span_ns": None}
    t0 = ns[:, :, 0][written[:, :, 0]].min()
    last = np.where(written, ns, 0).max(axis=2)  # each block's last stamp, per slot
    slot, block = np.unravel_index(np.argmax(last), last.shape)
    clk = stamps[slot, block, :, 0]
    # in the order the block passed them (a kernel's stage numbers need not be)
    stages = sorted(((s, int(clk[s])) for s in range(clk.shape[0]) if clk[s]),
                    key=lambda x: x[1])
    names = stage_names.get(int(slot), [])
    steps = [(names[s] if s < len(names) else str(s), c - stages[i - 1][1])
             for i, (s, c) in enumerate(stages) if i]
    worst = max(steps, key=lambda x: x[1]) if steps else ("", 0)
    return {"span_ns": int(last.max() - t0), "slowest_slot": int(slot),
            "slowest_block": int(block), "largest_stage": worst[0],
            "largest_stage_cycles": int(worst[1]),
            "slowest_block_cycles": int(stages[-1][1] - stages[0][1]) if stages else 0}


def fmt(x, spec="6.2f"):
    return "-" if x is None else format(x, spec)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bounds-out"))
    ap.add_argument("--cases", default=None, help="'|'-separated parts of the cases' text")
    args = ap.parse_args(argv)
    cases = cases_matching(CASES, args.cases)
    if not cases:
        ap.error(f"--cases {args.cases!r} matches no case")
    args.out.mkdir(parents=True, exist_ok=True)

    import cupy

    from moe_lora_align.bench import graph_us
    from stage_probe import KERNEL, STAGES, make_call, probe_run, reload_kernels

    stream = cupy.cuda.Stream(non_blocking=True)
    built = _kernels.current_build()
    rows = {str(c): {"case": list(c), "bytes": traffic_bytes(c)} for c in cases}
    print("== as built (graph us)", flush=True)
    for c in cases:
        rows[str(c)]["graph_us"] = graph_us(make_call(c, stream), stream)
    print("== a memset of the same bytes (graph us)", flush=True)
    for c in cases:
        buf = cupy.empty(traffic_bytes(c) // 4, np.int32)
        rows[str(c)]["fill_us"] = graph_us(  # CuPy's fill took 12.9 us for 10 MB on an H100
            lambda: cupy.cuda.runtime.memsetAsync(buf.data.ptr, 7, buf.nbytes, stream.ptr),
            stream)
        del buf
    with tempfile.TemporaryDirectory() as tmp:
        print("== emptied kernels (graph us)", flush=True)
        _kernels.use_build(empty_build(Path(tmp)))
        try:
            for c in cases:
                rows[str(c)]["empty_us"] = graph_us(make_call(c, stream), stream)
        finally:
            _kernels.use_build(built)
    print("== probe build (stamps of one call)", flush=True)
    reload_kernels(built.options + ("-DMLA_PROBE",))
    try:
        for c in cases:
            fn = make_call(c, stream)
            rows[str(c)]["probe_graph_us"] = graph_us(fn, stream)
            runs = [span(probe_run(fn, stream), STAGES) for _ in range(5)]
            good = [r for r in runs if r["span_ns"] is not None]
            pick = sorted(good, key=lambda r: r["span_ns"])[len(good) // 2] if good else {}
            rows[str(c)].update(pick)
    finally:
        _kernels.use_build(built)

    graph = {k: r["graph_us"] for k, r in rows.items()}
    lines = [f"{'case':40s} {'target':>6s} {'graph':>6s} {'empty':>6s} {'work':>6s} "
             f"{'span':>6s} {'fill':>6s} {'MB':>6s}  slowest block's largest stage"]
    for c in cases:
        r = rows[str(c)]
        r["target_us"] = target_of(c, graph)
        r["work_us"] = r["graph_us"] - r["empty_us"]
        span_us = r["span_ns"] / 1e3 if r.get("span_ns") is not None else None
        stage = (f"{KERNEL.get(r['slowest_slot'], '?')} {r['largest_stage']} "
                 f"{r['largest_stage_cycles']}c of {r['slowest_block_cycles']}c"
                 if r.get("largest_stage") else "-")
        met = "" if r["target_us"] is None else (" met" if r["graph_us"] <= r["target_us"]
                                                 else " MISS")
        lines.append(f"{str(c):40s} {fmt(r['target_us'])} {fmt(r['graph_us'])} "
                     f"{fmt(r['empty_us'])} {fmt(r['work_us'])} {fmt(span_us)} "
                     f"{fmt(r['fill_us'])} {r['bytes'] / 1e6:6.2f}  {stage}{met}")
    lines.append("graph/empty/work/fill: us per call, graph replay of one process; span: the "
                 "probe build's first entry to last stamp of one call (us, median of 5); "
                 "empty: the same launches with emptied kernels; fill: one memset of the "
                 "call's bytes (MB: routes and slots read, every output entry written)")
    text = "\n".join(lines)
    print(text)
    (args.out / "bounds.txt").write_text(text + "\n")
    (args.out / "bounds.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
