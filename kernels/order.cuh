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
// Warps sort the segments of at most ORDER_WARP_MAX entries in registers (each entry's rank
// counted against all the others); blocks sort the longer ones through a bitmap of the numel
// route indices in shared memory (set a bit per route, then read the bits back in order),
// which costs the same whatever the segment's length.
// Dynamic shared memory: the bitmap, ceil(numel / 32) words.
#define ORDER_ITEMS 4                     // entries a lane holds in the warps' sort
#define ORDER_WARP_MAX (32 * ORDER_ITEMS)

// Sort seg[0, n) ascending, n <= ORDER_WARP_MAX, by one warp. Ties (sentinels) are broken by
// position, so every rank is distinct. Every lane calls it.
__device__ __forceinline__ void sort_in_warp(int* seg, int n) {
  const int lane = threadIdx.x & 31;
  int v[ORDER_ITEMS], rank[ORDER_ITEMS];
#pragma unroll
  for (int k = 0; k < ORDER_ITEMS; ++k) {
    const int i = k * 32 + lane;
    v[k] = i < n ? seg[i] : 0x7fffffff;  // above every entry: never counted
    rank[k] = 0;
  }
#pragma unroll
  for (int k2 = 0; k2 < ORDER_ITEMS; ++k2) {
    if (k2 * 32 >= n) break;  // n is the same on every lane
#pragma unroll 8
    for (int l = 0; l < 32; ++l) {
      const int x = __shfl_sync(MLA_FULL_MASK, v[k2], l);
      const int j = k2 * 32 + l;
#pragma unroll
      for (int k = 0; k < ORDER_ITEMS; ++k)
        rank[k] += (x < v[k]) | ((x == v[k]) & (j < k * 32 + lane));
    }
  }
#pragma unroll
  for (int k = 0; k < ORDER_ITEMS; ++k)
    if (k * 32 + lane < n) seg[rank[k]] = v[k];
}

// Sort the routes of seg[0, n) (sentinels stay at the back) by the whole block, through the
// bitmap `bits` of ceil(numel / 32) words. Every thread calls it.
__device__ __forceinline__ void sort_in_block(const Problem& p, int* seg, int n, unsigned* bits,
                                              int* warp_sums) {
  const int words = (p.numel + 31) >> 5;
  for (int w = threadIdx.x; w < words; w += blockDim.x) bits[w] = 0u;
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int v = seg[i];
    if (v < p.numel) atomicOr(bits + (v >> 5), 1u << (v & 31));
  }
  __syncthreads();  // every entry read before any is rewritten
  // Thread t reads back a contiguous run of words; a block scan of their bit counts gives
  // where its routes go.
  const int per = (words + blockDim.x - 1) / blockDim.x;
  const int lo = min(words, (int)threadIdx.x * per), hi = min(words, lo + per);
  int count = 0;
  for (int w = lo; w < hi; ++w) count += __popc(bits[w]);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int x = warp_inclusive_sum(count);
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) warp_sums[lane] = warp_inclusive_sum(lane < nwarps ? warp_sums[lane] : 0);
  __syncthreads();
  int at = x - count + (warp > 0 ? warp_sums[warp - 1] : 0);
  for (int w = lo; w < hi; ++w) {
    unsigned m = bits[w];
    while (m != 0u) {
      seg[at++] = (w << 5) + __ffs(m) - 1;
      m &= m - 1u;
    }
  }
  __syncthreads();  // the bitmap and warp_sums are reused for the next segment
}

template <typename IdT>
__global__ void __launch_bounds__(1024) align_order(const Problem p) {
  __shared__ int warp_sums[32];
  const int nb = num_buckets(p);
  const int warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int* starts = p.starts;
  for (int b = blockIdx.x * nwarps + warp; b < nb; b += gridDim.x * nwarps) {
    const int n = __ldcg(starts + b + 1) - __ldcg(starts + b);
    if (n > 1 && n <= ORDER_WARP_MAX) sort_in_warp(p.sorted_ids + output_index(p, starts, b, 0), n);
  }
  unsigned* bits = reinterpret_cast<unsigned*>(dynamic_smem);
  for (int b = blockIdx.x; b < nb; b += gridDim.x) {
    const int n = __ldcg(starts + b + 1) - __ldcg(starts + b);
    if (n > ORDER_WARP_MAX) sort_in_block(p, p.sorted_ids + output_index(p, starts, b, 0), n, bits, warp_sums);
  }
}
