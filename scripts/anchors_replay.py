"""Graph replay of every anchors row through the public functions, for one checkout.

    python3 scripts/anchors_replay.py [--tree DIR] [--cases PATTERN] --json PATH

The anchors (``../shared/ANCHORS.md``) timed this project's public functions with ``out=``
buffers at one commit, on an H200. Those figures hold for that card only. To hold today's
code to them on whatever card comes, run this script once with ``--tree`` set to a copy of
the anchors' commit (``git archive 53c4e4e moe_lora_align kernels | tar -x -C DIR``) and
once on the checkout, on the same warm machine, and compare the two JSON files
(``scripts/anchors_compare.py --against``).

It uses only what both commits have: ``moe_align_block_size``, ``moe_lora_align_block_size``
and ``buffer_sizes``, with the anchors' inputs (K distinct experts per token drawn uniformly;
LoRA: tokens uniform over the slots, ``lora_ids`` the used slots padded with -1, every
adapter enabled; ``pad_sorted_ids=True``). Each call's expert ids and padded counts are
checked against the same package's NumPy backend before it is timed, and timed by this
checkout's benchmark (``bench.graph_us``) whichever package runs.
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def inputs(row):
    """The anchors' inputs for one row, from a seed of its own."""
    T, E, K, L = row["tokens"], row["num_experts"], row["topk"], row.get("max_loras")
    rng = np.random.default_rng(T * 31 + E * 7 + K)
    keys = rng.random((T, E), dtype=np.float32)
    ids = np.argpartition(keys, K - 1, axis=1)[:, :K].astype(np.int32)
    if not L:
        return ids, None, None, None
    mapping = rng.integers(L, size=T).astype(np.int32)
    used = np.unique(mapping)
    lora_ids = np.full(L + 1, -1, np.int32)
    lora_ids[:used.size] = used
    return ids, mapping, lora_ids, np.ones(L + 1, np.int32)


def time_row(mla, row, stream, graph_us):
    import cupy

    T, E, K, B, L = (row["tokens"], row["num_experts"], row["topk"], row["block_size"],
                     row.get("max_loras"))
    ids, mapping, lora_ids, enabled = inputs(row)
    P, M = mla.buffer_sizes(T * K, E, B, pad_sorted_ids=True)
    shape = lambda n: (L, n) if L else (n,)  # noqa: E731
    with stream:
        out = [cupy.full(shape(P), T * K, np.int32), cupy.full(shape(M), -1, np.int32),
               cupy.zeros(L or 1, np.int32)]
        d_ids = cupy.asarray(ids)
        if L:
            dm, dl, de = (cupy.asarray(x) for x in (mapping, lora_ids, enabled))
    if L:
        fn = lambda: mla.moe_lora_align_block_size(  # noqa: E731
            d_ids, dm, B, E, L, lora_ids=dl, adapter_enabled=de, pad_sorted_ids=True,
            out=out, stream=stream)
        want = mla.moe_lora_align_block_size(ids, mapping, B, E, L, lora_ids=lora_ids,
                                                adapter_enabled=enabled, pad_sorted_ids=True)
    else:
        fn = lambda: mla.moe_align_block_size(d_ids, B, E, pad_sorted_ids=True,  # noqa: E731
                                              out=out, stream=stream)
        want = mla.moe_align_block_size(ids, B, E, pad_sorted_ids=True)
    with stream:
        fn()
    stream.synchronize()
    got_experts, got_counts = cupy.asnumpy(out[1]), cupy.asnumpy(out[2])
    want_experts, want_counts = np.asarray(want[1]), np.asarray(want[2]).reshape(-1)
    if not (np.array_equal(got_counts.reshape(-1)[:want_counts.size], want_counts)
            and np.array_equal(got_experts.reshape(want_experts.shape), want_experts)):
        raise AssertionError(f"{row}: expert ids or padded counts differ from the NumPy backend")
    return graph_us(fn, stream)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", type=Path, help="a checkout whose package to time (default: this one)")
    ap.add_argument("--cases", default="", help="'|'-separated parts of a row's printed tuple")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()

    rows = json.loads((ROOT / "moe_lora_align" / "data" / "anchors_h200.json").read_text())["rows"]
    # This checkout's timing and case filter time both trees alike.
    sys.path.insert(0, str(ROOT))
    from moe_lora_align.bench import cases_matching, graph_us
    tree = (args.tree or ROOT).resolve()
    if tree != ROOT:  # the package under test, imported afresh from the other tree
        for name in [m for m in sys.modules if m.split(".")[0] == "moe_lora_align"]:
            del sys.modules[name]
        sys.path.insert(0, str(tree))
    import moe_lora_align as mla
    if Path(mla.__file__).resolve().parent.parent != tree:
        raise SystemExit(f"imported {mla.__file__}, not the package under {tree}")
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    results = []
    by_key = {(r["op"], r["tokens"], r["num_experts"], r["topk"], r["block_size"],
               r.get("max_loras")): r for r in rows}
    for key in cases_matching(list(by_key), args.cases):
        us = time_row(mla, by_key[key], stream, graph_us)
        print(f"{str(key):42} {us:8.2f}", flush=True)
        results.append(dict(zip(("op", "tokens", "num_experts", "topk", "block_size",
                                 "max_loras"), key), graph_us=us))
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    args.json.write_text(json.dumps({
        "versions": {"device": name, "tree": str(tree), "package": mla.__file__},
        "results": results}, indent=1))


if __name__ == "__main__":
    main()
