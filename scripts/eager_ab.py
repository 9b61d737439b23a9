"""The benchmark's eager table for a few sizes, in one process, as JSON: an A/B of the
package's host paths is this script run from two trees in alternating processes
(``gpu_round.sh eager``). Each path's result is checked against the NumPy backend first.

    python scripts/eager_ab.py [--passes N] [--label NAME] [--json PATH]
"""

import argparse
import json
import sys

import numpy as np

from moe_lora_align.bench import _check_call, eager_paths, keep_best, lora_inputs, routing

# (op, T, E, L): decode and a short prefill, base, LoRA and the pair (K=8, B=16 as the table)
CASES = (("base", 16, 256, None), ("base", 1024, 256, None), ("lora", 16, 256, 16),
         ("pair", 16, 256, 16), ("pair", 1024, 256, 16))
K, B = 8, 16


def measure_case(op, T, E, L, stream):
    """The benchmark's eager measurement of one case (its paths checked against NumPy)."""
    import cupy

    rng = np.random.default_rng(T + E)
    ids = routing(rng, T, K, E, "uniform")
    mapping, lora_ids, enabled = lora_inputs(rng, T, L or 1)
    d = [cupy.asarray(x) for x in (ids, mapping, lora_ids, enabled)]
    return eager_paths(op, ids, d, T, K, E, B, L, stream,
                       lambda res: _check_call(op, res, ids, mapping, lora_ids, E, B, L))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--label", default=".")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    rows = []
    for op, T, E, L in CASES:
        measure = measure_case(op, T, E, L, stream)
        row = {"op": op, "tokens": T, "num_experts": E, "max_loras": L}
        row["eager"], row["host"] = measure()
        rows.append((row, measure))
    for _ in range(args.passes - 1):  # passes over every case, as the benchmark's
        for row, measure in rows:
            keep_best(row, *measure())
    out = []
    for row, _ in rows:
        cells = "  ".join(f"{p} {v:7.2f}" for p, v in row["host"].items())
        print(f"{args.label:12} {row['op']:4} T={row['tokens']:5} host µs: {cells}")
        out.append({k: row[k] for k in ("op", "tokens", "num_experts", "max_loras", "eager",
                                        "host")})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"label": args.label, "rows": out}, f, indent=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
