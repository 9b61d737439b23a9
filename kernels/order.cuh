// Deterministic output from a non-deterministic alignment, as a second launch: align_order.
// Included by align_kernels.cu, after align_common.cuh and dynamic_smem.
//
// The first launch (cooperative or count + place) puts each bucket's routes at the front of
// its padded segment in whatever order its atomics gave them, sentinels (numel) after them,
// and leaves the segment starts in p.starts. Deterministic mode wants each segment's routes
// in ascending flat index: this launch sorts every segment in place. The route indices of a
// segment are distinct and below the sentinel, so an ascending sort of the whole padded
// segment is exactly that. Cheaper than ranking in flat order during the first launch, which
// needs per-block counts of every bucket prefixed across blocks.
//
// Warps sort the segments of at most ORDER_WARP_MAX entries in registers (a bitonic network,
// or each route's rank counted against the others); a block sorts each longer one through a bitmap of the numel
// route indices in shared memory, with a summary bit for every nonzero word of it, so reading
// the routes back in order costs the segment's length and numel / 1024, not numel / 32.
// Buckets are dealt to warps and blocks round-robin, so the work spreads over every SM.
// Dynamic shared memory: bits[ceil(numel / 32)] | summary[ceil(numel / 1024)], left zeroed.
#define ORDER_ITEMS 4                     // entries a lane holds in the warps' sort
#define ORDER_WARP_MAX (32 * ORDER_ITEMS)

// Sort the routes of seg[0, n) (sentinels stay at the back), n <= ORDER_WARP_MAX, by one
// warp: up to 32 routes by a bitonic network across the lanes, more by counting each one's
// rank against the others. Every lane calls it.
__device__ __forceinline__ void sort_in_warp(int* seg, int n, int sentinel) {
  const int lane = threadIdx.x & 31;
  int v[ORDER_ITEMS], routes = 0;
#pragma unroll
  for (int k = 0; k < ORDER_ITEMS; ++k) {
    const int i = k * 32 + lane;
    v[k] = i < n ? seg[i] : 0x7fffffff;  // above every entry
    routes += __popc(__ballot_sync(MLA_FULL_MASK, v[k] < sentinel));
  }
  if (routes <= 1) return;
  if (routes <= 32) {
    int x = v[0] < sentinel ? v[0] : 0x7fffffff;
#pragma unroll
    for (int k = 2; k <= 32; k <<= 1) {
#pragma unroll
      for (int j = k >> 1; j > 0; j >>= 1) {
        const int y = __shfl_xor_sync(MLA_FULL_MASK, x, j);
        x = (((lane & j) == 0) == ((lane & k) == 0)) ? min(x, y) : max(x, y);
      }
    }
    if (lane < routes) seg[lane] = x;
    return;
  }
  // The routes are the first `routes` entries, all distinct: a rank is the count of smaller ones.
  const int held = (routes + 31) >> 5;  // entries a lane holds
  int rank[ORDER_ITEMS] = {};
#pragma unroll
  for (int k2 = 0; k2 < ORDER_ITEMS; ++k2) {
    if (k2 >= held) break;  // the same on every lane
#pragma unroll 8
    for (int l = 0; l < 32; ++l) {
      const int x = __shfl_sync(MLA_FULL_MASK, v[k2], l);
#pragma unroll
      for (int k = 0; k < ORDER_ITEMS; ++k)
        if (k < held) rank[k] += x < v[k];
    }
  }
#pragma unroll
  for (int k = 0; k < ORDER_ITEMS; ++k)
    if (k * 32 + lane < routes) seg[rank[k]] = v[k];
}

// Sort the routes of seg[0, n) (sentinels stay at the back) by the whole block, through the
// zeroed bitmap `bits` and its `summary`; both are zeroed again on the way out. Every thread
// calls it.
__device__ __forceinline__ void sort_in_block(const Problem& p, int* seg, int n, unsigned* bits,
                                              unsigned* summary, int* warp_sums) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int v = seg[i];
    if (v < p.numel) {
      atomicOr(bits + (v >> 5), 1u << (v & 31));
      atomicOr(summary + (v >> 10), 1u << ((v >> 5) & 31));
    }
  }
  __syncthreads();  // every entry read before any is rewritten
  // Thread t reads back the routes of a contiguous run of summary words: it counts them, a
  // block scan of the counts says where they go, then it writes them in order.
  const int sum_words = (p.numel + 1023) >> 10;
  const int per = (sum_words + blockDim.x - 1) / blockDim.x;
  const int lo = min(sum_words, (int)threadIdx.x * per), hi = min(sum_words, lo + per);
  int count = 0;
  for (int s = lo; s < hi; ++s)
    for (unsigned m = summary[s]; m != 0u; m &= m - 1u) count += __popc(bits[(s << 5) + __ffs(m) - 1]);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int x = warp_inclusive_sum(count);
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) warp_sums[lane] = warp_inclusive_sum(lane < nwarps ? warp_sums[lane] : 0);
  __syncthreads();
  int at = x - count + (warp > 0 ? warp_sums[warp - 1] : 0);
  for (int s = lo; s < hi; ++s) {
    for (unsigned m = summary[s]; m != 0u; m &= m - 1u) {
      const int w = (s << 5) + __ffs(m) - 1;
      for (unsigned b = bits[w]; b != 0u; b &= b - 1u) seg[at++] = (w << 5) + __ffs(b) - 1;
      bits[w] = 0u;
    }
    summary[s] = 0u;
  }
  __syncthreads();  // zeroed, and warp_sums free, before the next segment
}

template <typename IdT>
__global__ void __launch_bounds__(1024) align_order(const Problem p) {
  __shared__ int warp_sums[32];
  const int nb = num_buckets(p);
  const int warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int* starts = p.starts;
  // Short segments: bucket b to warp b / gridDim of block b % gridDim.
  for (int b = warp * gridDim.x + blockIdx.x; b < nb; b += gridDim.x * nwarps) {
    const int n = __ldcg(starts + b + 1) - __ldcg(starts + b);
    if (n > 1 && n <= ORDER_WARP_MAX)
      sort_in_warp(p.sorted_ids + output_index(p, starts, b, 0), n, p.numel);
  }
  // Long segments: bucket b to block b % gridDim.
  unsigned* bits = reinterpret_cast<unsigned*>(dynamic_smem);
  unsigned* summary = bits + ((p.numel + 31) >> 5);
  bool zeroed = false;
  for (int b = blockIdx.x; b < nb; b += gridDim.x) {
    const int n = __ldcg(starts + b + 1) - __ldcg(starts + b);
    if (n <= ORDER_WARP_MAX) continue;  // the same on every thread
    if (!zeroed) {
      const int words = ((p.numel + 31) >> 5) + ((p.numel + 1023) >> 10);
      for (int w = threadIdx.x; w < words; w += blockDim.x) bits[w] = 0u;
      __syncthreads();
      zeroed = true;
    }
    sort_in_block(p, p.sorted_ids + output_index(p, starts, b, 0), n, bits, summary, warp_sums);
  }
}
