"""Launch each representative alignment once after warm-up, for ncu to profile.

Usage on the GPU machine:
  ncu --clock-control none --section SpeedOfLight --section WarpStateStats \
      -k regex:align --launch-skip-before-match 0 python3 scripts/profile_kernels.py
"""
import cupy
import numpy as np

import moe_lora_align as mla

CASES = [("base", 1, 64, 8, 16, None), ("base", 256, 256, 8, 16, None),
         ("lora", 16, 256, 8, 16, 16), ("lora", 256, 256, 8, 16, 16),
         ("base", 65536, 256, 8, 64, None), ("lora", 16384, 256, 8, 64, 16)]


def main():
    rng = np.random.default_rng(0)
    plans = []
    for op, T, E, K, B, L in CASES:
        ids = cupy.asarray(np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int32))
        mapping = cupy.asarray(rng.integers(L or 1, size=T).astype(np.int32))
        plan = mla.AlignPlan(T, K, E, B, max_loras=L)
        call = (lambda p=plan, i=ids, m=mapping, lo=L: p(i, m)[1] if lo else p(i))
        call()
        plans.append(call)
    cupy.cuda.Device().synchronize()
    cupy.cuda.runtime.profilerStart()
    for call in plans:
        call()
    cupy.cuda.Device().synchronize()
    cupy.cuda.runtime.profilerStop()


if __name__ == "__main__":
    main()
