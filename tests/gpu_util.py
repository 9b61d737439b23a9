"""Helpers of the GPU tests: skip markers, and the shared helpers of ``moe_lora_align.testing``
(random routing, poisoned guarded buffers, the canonical form of a free-order alignment)."""

from __future__ import annotations

import dataclasses

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


# Deterministic align_tiny's two ways to flat-order ranks, each asked for by its policy (the
# GPU tests and the CPU-emulator tests): the chunks' groups (align_tiny_chunked) at every
# size, or a counter a bucket a warp; with fill blocks or without; one block up to any fill size and no cluster, so that the
# calls stay on align_tiny.
TINY_RANKS = {
    how: {fill: mla.AlignPolicy(tiny_chunk_ranks_from=0 if how == "chunk_groups" else 1 << 62,
                                tiny_chunk_ranks_mid_buckets=1 << 62,
                                tiny_chunk_ranks_min_routes=0,
                                tiny_chunk_ranks_max_routes=1 << 62,
                                tiny_fill_blocks_from=0 if fill else 1 << 62,
                                tiny_fill_blocks_one_row_from=0 if fill else 1 << 62,
                                coop_over_single_entries=1 << 30,
                                coop_over_filled_single_entries=1 << 30,
                                cluster_min_routes=1 << 30, tiny_row_blocks=False)
          for fill in (True, False)}
    for how in ("chunk_groups", "warp_counters")}


# LoRA a block a row (align_tiny_rows, align_tiny_rows_pair) at every size it takes (the GPU
# tests and the CPU-emulator tests).
ROW_BLOCKS = mla.AlignPolicy(tiny_row_blocks=True, tiny_row_blocks_min_routes=1,
                             tiny_row_blocks_max_routes=1 << 30,
                             tiny_row_blocks_max_rows=1 << 30)


# LoRA a cluster a row (align_cluster_rows, sm_90+) at every size it takes: a block a row and
# the one cluster over few buckets off.
CLUSTER_ROWS = mla.AlignPolicy(cluster_rows=True, cluster_rows_min_routes=1,
                               cluster_rows_max_routes=1 << 30,
                               cluster_rows_max_routes_deterministic=1 << 30,
                               cluster_rows_max_rows=1 << 30,
                               tiny_row_blocks=False, cluster_min_routes=1 << 30)
# ... and base + LoRA in one launch, base on a cluster before the rows' clusters, at every
# size and expert count it takes
CLUSTER_ROWS_PAIR = dataclasses.replace(CLUSTER_ROWS, cluster_rows_pair=True,
                                        cluster_rows_pair_max_routes=1 << 30,
                                        cluster_rows_pair_max_routes_deterministic=1 << 30,
                                        cluster_rows_pair_min_experts=1)
# test_gpu_streams.test_fused_pair_with_row_clusters' cases (T, E, K, B, rows)
CLUSTER_ROWS_PAIR_CASES = [(40, 64, 8, 16, 3), (1024, 256, 8, 64, 8), (1536, 256, 8, 64, 15),
                           (33, 1024, 1, 16, 2), (4096, 128, 4, 64, 4)]
# test_gpu_kernels.test_lora_cluster_rows' cases (E, T, K, rows), free and deterministic,
# each a cluster a row under CLUSTER_ROWS (test_dispatch checks that on the host).
CLUSTER_ROWS_CASES = [(64, 1, 1, 2), (256, 130, 8, 16), (1024, 33, 1, 2), (7, 512, 8, 3),
                      (128, 40, 8, 33), (32, 300, 2, 80), (256, 1024, 8, 16),
                      (256, 4096, 8, 16), (64, 8192, 8, 4)]


def tiny_ranks_policy(numel, buckets, rows, how, fill, limits):
    """TINY_RANKS' policy for one case, after checking that the dispatcher gives the call
    align_tiny with that way of ranking (skipped where the counters do not fit)."""
    policy = TINY_RANKS[how][fill]
    launch = mla._dispatch.choose_launch(numel, buckets, rows, limits, deterministic=True,
                                         out_entries=numel, policy=policy)
    if how == "warp_counters" and not launch.tiny:
        pytest.skip(f"a counter a bucket a warp does not fit {buckets} buckets")
    assert launch.kind == "single" and launch.tiny
    # one warp's routes rank in lane order on align_warp
    assert launch.rank_chunks == (how == "chunk_groups" and numel > mla._dispatch.WARP_ROUTES)
    return policy
