"""Helpers of the GPU tests: skip markers, and the shared helpers of ``moe_lora_align.testing``
(random routing, poisoned guarded buffers, the canonical form of a free-order alignment)."""

from __future__ import annotations

import numpy as np
import pytest

import moe_lora_align as mla
from moe_lora_align.testing import (GUARD, POISON, canonical, guarded, make_lora,  # noqa: F401
                                    make_routing, segment_starts)

try:
    import cupy
    HAVE_GPU = mla.gpu_available()
except Exception:  # pragma: no cover - no CuPy at all
    cupy = None
    HAVE_GPU = False

requires_gpu = pytest.mark.skipif(not HAVE_GPU, reason="needs CuPy and a CUDA GPU")


_SPIN = None


def delayed_copy(src, dst, cycles, blocks=64):
    """On the current stream: spin about ``cycles`` clocks, then copy the int32 ``src`` into
    ``dst``: a late producer (or consumer) that a call not ordered on the stream would miss.
    The kernel is compiled on the first use (call it once outside a thread pool first)."""
    global _SPIN
    if _SPIN is None:
        _SPIN = cupy.RawKernel(r'''
        extern "C" __global__ void spin_copy(const int* src, int* dst, int n, long long cycles) {
            long long t0 = clock64();
            while (clock64() - t0 < cycles) { }
            for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
                dst[i] = src[i];
        }''', "spin_copy")
    _SPIN((blocks,), (256,), (src, dst, np.int32(src.size), np.int64(cycles)))
