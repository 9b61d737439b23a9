"""Registers, local memory (spills) and static shared memory of every kernel instantiation,
as this machine's NVRTC compiles them (GPU machine).

  python3 scripts/kernel_resources.py [DTYPE ...]     (default: every id dtype)
"""
from __future__ import annotations

import sys

import numpy as np

from moe_lora_align import _kernels, _launch


def main(argv):
    dtypes = [np.dtype(a) for a in argv] or sorted(_kernels.CTYPES, key=str)
    smem = _launch.device_limits(0).smem_optin
    print(f"{'kernel':44s} {'regs':>5s} {'local B':>8s} {'static smem B':>14s}")
    for dtype in dtypes:
        ks = _kernels.kernels_for(dtype, 0, smem)
        ks.load_all()  # side by side
        for key, name in ks.names.items():
            k = ks[key]
            print(f"{name:44s} {k.num_regs:5d} {k.local_size_bytes:8d} {k.shared_size_bytes:14d}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
