"""moe_lora_align: MoE and multi-LoRA MoE alignment kernels (CUDA via CuPy, NumPy fallback).

Public API: ``moe_align_block_size``, ``moe_lora_align_block_size``, ``align_moe_and_lora``,
``AlignPlan`` (preallocated, CUDA-graph capturable), ``buffer_sizes``, ``scratch_bytes``
(device memory a call keeps beyond its outputs), ``gpu_available``, and the size limits
``MAX_ROUTES`` and ``MAX_BUCKETS``.
"""

from ._dispatch import AlignPolicy
from ._launch import scratch_bytes
from ._sizes import MAX_BUCKETS, MAX_ROUTES, buffer_sizes
from .api import (Alignment, AlignmentWithScatter, LoraAlignment, align_moe_and_lora,
                  moe_align_block_size, moe_lora_align_block_size)
from .plan import AlignPlan

__version__ = "0.1.0"

__all__ = [
    "AlignPlan", "AlignPolicy", "Alignment", "AlignmentWithScatter", "LoraAlignment", "align_moe_and_lora",
    "moe_align_block_size", "moe_lora_align_block_size", "buffer_sizes", "gpu_available",
    "scratch_bytes", "MAX_ROUTES", "MAX_BUCKETS", "__version__",
]


def gpu_available() -> bool:
    """True when CuPy is installed and sees at least one CUDA device."""
    try:
        import cupy
    except Exception:
        return False
    try:
        return bool(cupy.is_available())
    except Exception:
        return False
