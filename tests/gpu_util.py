"""Helpers of the GPU tests: skip markers, and the shared helpers of ``moe_lora_align.testing``
(random routing, poisoned guarded buffers, the canonical form of a free-order alignment)."""

from __future__ import annotations

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
