"""Where the host time of an eager public call goes: cProfile over 10,000 calls.

    python scripts/profile_calls.py [--calls N] [--path cupy_out|cupy_alloc|torch_out|torch_alloc]
"""

import argparse
import cProfile
import pstats
import time

import numpy as np

import moe_lora_align as mla


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=10000)
    ap.add_argument("--path", default="cupy_out")
    ap.add_argument("--lora", action="store_true", help="LoRA (16 slots) instead of base")
    args = ap.parse_args()
    import cupy

    T, K, E, B, L = 16, 8, 256, 16, 16
    rng = np.random.default_rng(0)
    ids = rng.integers(0, E, size=(T, K)).astype(np.int32)
    mapping = rng.integers(0, L, size=T).astype(np.int32)
    d = [cupy.asarray(ids), cupy.asarray(mapping)]
    P, M = mla.buffer_sizes(T * K, E, B)
    rows = L if args.lora else 1
    if args.path.startswith("torch"):
        import torch

        d = [torch.from_dlpack(x) for x in d]
        out = tuple(torch.empty(n, dtype=torch.int32, device="cuda")
                    for n in (rows * P, rows * M, rows))
    else:
        out = tuple(cupy.empty(n, np.int32) for n in (rows * P, rows * M, rows))
    out = out if args.path.endswith("_out") else None
    if args.lora:
        fn = lambda: mla.moe_lora_align_block_size(d[0], d[1], B, E, L, out=out)  # noqa: E731
    else:
        fn = lambda: mla.moe_align_block_size(d[0], B, E, out=out)  # noqa: E731
    for _ in range(100):
        fn()
    cupy.cuda.Device().synchronize()
    t = time.perf_counter()
    for _ in range(args.calls):
        fn()
    cupy.cuda.Device().synchronize()
    print(f"{args.path} {'lora' if args.lora else 'base'}: "
          f"{(time.perf_counter() - t) / args.calls * 1e6:.2f} µs per call (wall, no profiler)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        fn()
    prof.disable()
    cupy.cuda.Device().synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
