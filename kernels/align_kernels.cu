// Alignment kernels, one file a launch shape: one_block.cuh (decode sizes: align_single, and
// align_tiny where every bucket has its own thread; align_pair / align_tiny_pair run a base and
// a LoRA alignment in one launch of two blocks), count_place.cuh (two launches: count, place),
// cooperative.cuh (one launch of resident blocks with a grid-wide barrier), cluster.cuh (one
// launch of one thread-block cluster, sm_90 and newer) and order.cuh (a launch after the
// cooperative or count + place kernels that sorts each bucket's segment: their output made
// deterministic). This file holds what they share beyond align_common.cuh;
// _kernels.source() inlines the includes.
//
// Variants of the counting stage (MODE):
//   MODE_SHARED (0) per-block histograms in shared memory, flushed to global counts;
//   MODE_GLOBAL (1) counts and cursors in global memory (any number of buckets);
//   MODE_DETERMINISTIC (2) chunk x bucket-range blocks with per-warp counters, so ranks follow
//                          the flat route index and the output is bit-identical run to run.
// Every kernel is templated on the route-id type IdT and serves base and LoRA alignment alike.
// Dynamic shared memory starts with the per-row region (row_region_bytes); what follows is
// listed above each kernel and mirrored by moe_lora_align/_dispatch.py.
#include "align_common.cuh"

#define MODE_SHARED 0
#define MODE_GLOBAL 1
#define MODE_DETERMINISTIC 2

// Routes per thread kept in registers by the non-deterministic kernels (one load group).
#define ITEMS_PER_THREAD 4

extern __shared__ __align__(16) unsigned char dynamic_smem[];

// Visit routes first, first + step, ... below `end` in groups of ITEMS_PER_THREAD whose loads
// are all issued before any is visited. `first - lane` is warp-uniform, so every lane of a
// warp takes part in every visit (routes past `end` arrive as dropped ones).
template <typename IdT, typename Visit>
__device__ __forceinline__ void for_routes(const Problem& p, int first, int step, int end,
                                           Visit visit) {
  for (int g = first; g - (int)(threadIdx.x & 31) < end; g += ITEMS_PER_THREAD * step) {
    Route r[ITEMS_PER_THREAD];
#pragma unroll
    for (int j = 0; j < ITEMS_PER_THREAD; ++j) r[j] = load_route<IdT>(p, g + j * step, end);
#pragma unroll
    for (int j = 0; j < ITEMS_PER_THREAD; ++j) visit(g + j * step, r[j]);
  }
}

// Warp w's contiguous run [lo, hi) of the routes [c0, c1), in whole warps of 32: the order
// in which deterministic kernels rank routes (a warp's counters, then the warps in turn).
struct Span {
  int lo, hi;
};
__device__ __forceinline__ Span warp_span(int c0, int c1, int warp, int nwarps) {
  const int per_warp = ((c1 - c0 + nwarps - 1) / nwarps + 31) & ~31;
  const int lo = min(c1, c0 + warp * per_warp);
  return {lo, min(c1, lo + per_warp)};
}

// The (chunk of routes, range of buckets) a block of the count or place kernel takes: every
// bucket of one chunk, or in deterministic mode one bucket range of one chunk.
struct BlockShare {
  int chunk, lo_b, hi_b;
};
template <int MODE>
__device__ __forceinline__ BlockShare block_share(const Problem& p, int nb) {
  if (MODE != MODE_DETERMINISTIC) return {(int)blockIdx.x, 0, nb};
  const int chunk = blockIdx.x / p.ranges;
  const int lo_b = (blockIdx.x - chunk * p.ranges) * p.range_width;
  return {chunk, lo_b, min(nb, lo_b + p.range_width)};
}

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
  unsigned v;
#if __CUDA_ARCH__ >= 700
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
#else
  v = *reinterpret_cast<const volatile unsigned*>(p);
  __threadfence();
#endif
  return v;
}

// A fill block: the sentinel fill of the written rows (and with `tiles`, -1 in their tiles)
// over fill blocks [0, p.fill_blocks) of this launch, then one arrival at `arrivals`. The
// blocks that align wait for every arrival before they store what overwrites the fill (both
// launches with fill blocks are cooperative: every block is resident, so none waits for a
// block that has not started). The fill's stores then drain beside the aligning blocks'
// chain of round trips instead of ahead of it.
__device__ void fill_and_arrive(const Problem& p, int fill_block, bool tiles, unsigned* arrivals) {
  MLA_STAMP(7, 0);
  unsigned char* processed = dynamic_smem;
  mark_processed_rows(p, processed);
  MLA_STAMP(7, 1);
  fill_rows(p, processed, fill_block * blockDim.x + threadIdx.x, p.fill_blocks * blockDim.x,
            tiles);
  MLA_STAMP(7, 2);
  __syncthreads();
  MLA_STAMP(7, 3);
  if (threadIdx.x == 0) {
    __threadfence();
    MLA_STAMP(7, 4);  // the block's stores visible (the waiting block sees the arrival after)
    atomicAdd(arrivals, 1u);
  }
}

// The kernels, by launch shape.
#include "one_block.cuh"
#include "count_place.cuh"
#include "order.cuh"
#include "cooperative.cuh"
#include "cluster.cuh"
