// Deterministic output from a non-deterministic alignment, as a second launch: align_order.
// Included by align_kernels.cu, after align_common.cuh and dynamic_smem; order_segments also
// serves the cooperative kernel's deterministic mode (cooperative.cuh), inside its launch.
//
// The first launch (cooperative or count + place) puts each bucket's routes at the front of
// its padded segment in whatever order its atomics gave them, sentinels (numel) after them,
// and leaves the segment starts in p.starts. Deterministic mode wants each segment's routes
// in ascending flat index: this launch sorts every segment in place. The route indices of a
// segment are distinct and below the sentinel, so an ascending sort of the whole padded
// segment is exactly that. Cheaper than ranking in flat order during the first launch, which
// needs per-block counts of every bucket prefixed across blocks.
//
// Warps sort the segments of at most ORDER_WARP_MAX entries in registers (bitonic networks
// across the lanes, a column of 32 entries each). A block sorts each longer one through a
// bitmap of the numel route indices with a summary bit for every nonzero word of it (reading
// it back costs each warp numel / 32768 rounds and its routes), except where numel is past
// ORDER_BITMAP_ALL_MAX and the segment holds at most ORDER_DIGITS_MAX entries: those take a
// counting sort on digits of the route indices, whose cost follows the segment's length.
// Buckets are dealt to warps and blocks round-robin, so the work spreads over every SM.
// Dynamic shared memory, the larger of: the digit sort's vals[ORDER_DIGITS_MAX] |
// start[ORDER_DIGITS_MAX + 1] | scan sums[32], and the bitmaps (order_bitmaps_fit) of
// 32 * ceil(numel / 1024) words each (whole summary words' worth), then their summaries of
// ceil(numel / 1024) words and a count a warp.
#define ORDER_ITEMS 4                     // entries a lane holds in the warps' sort
#define ORDER_WARP_MAX (32 * ORDER_ITEMS)
#define ORDER_DIGITS_MAX 4096             // entries a block sorts by digits; more: by the bitmap
#define ORDER_BLOCK_ITEMS 4               // entries a thread of a block holds: ORDER_DIGITS_MAX / 1024
// The most route indices for which the bitmap sorts every long segment: each warp of 1024
// threads then reads back at most 4 rounds of it. The digit sort took 4200 cycles a segment
// of 300 to 400 entries and 6000 at 1660 (r54's stamps: about ten barriers and a scan of up
// to 4096 digits); the bitmap has five barriers and a scan of 32 warp counts.
#ifndef ORDER_BITMAP_ALL_MAX
#define ORDER_BITMAP_ALL_MAX 131072
#endif
// The most long segments of a round a block sorts at once, a bitmap each, where their
// bitmaps fit the sort's scratch (order_bitmaps_fit) and they hold ORDER_DIGITS_MAX entries in
// all: one set of barriers for them all (skewed routing deals two or three to some blocks).
#define ORDER_GROUP_MAX 4
// The rounds of a bitmap (1024 route indices each) a warp reads back as one run of a lane's
// own words in sort_by_bitmaps<true>, at most: 4 covers ORDER_BITMAP_ALL_MAX routes with 32
// warps. The run is a template choice, not a branch: its code in the same kernel cost 1 %
// at one round a warp even where it was not taken (r62's A/B, cca7dcb).
#define ORDER_RUN_MAX 4

// x sorted ascending across the warp's lanes (lane l ends with the l-th smallest), by a
// bitonic network of shuffles. Every lane calls it.
__device__ __forceinline__ int sort_over_lanes(int x) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int k = 2; k <= 32; k <<= 1) {
#pragma unroll
    for (int j = k >> 1; j > 0; j >>= 1) {
      const int y = __shfl_xor_sync(MLA_FULL_MASK, x, j);
      x = (((lane & j) == 0) == ((lane & k) == 0)) ? min(x, y) : max(x, y);
    }
  }
  return x;
}

// How many of `col`'s 32 values (one a lane, ascending over the lanes) are below x, which
// may differ from lane to lane: a binary search over the lanes. Every lane calls it.
__device__ __forceinline__ int count_below_over_lanes(int col, int x) {
  int below = 0;
#pragma unroll
  for (int step = 16; step > 0; step >>= 1)
    if (__shfl_sync(MLA_FULL_MASK, col, below + step - 1) < x) below += step;
  // below <= 31 here: the last lane's value is below x too where every one is
  return below + (__shfl_sync(MLA_FULL_MASK, col, 31) < x ? 1 : 0);
}

// Sort the routes of seg[0, n) (sentinels stay at the back), n <= ORDER_WARP_MAX, by one
// warp: up to 32 routes by a bitonic network across the lanes; more column by column (the
// entries k * 32 + lane of each k sorted across the lanes the same way), a route's place
// then its place in its column and the count of every other column's entries below it.
// Every lane calls it.
__device__ __forceinline__ void sort_in_warp(int* seg, int n, int sentinel) {
  const int lane = threadIdx.x & 31;
  int v[ORDER_ITEMS], routes = 0;
#pragma unroll
  for (int k = 0; k < ORDER_ITEMS; ++k) {
    const int i = k * 32 + lane;
    v[k] = i < n ? __ldcg(seg + i) : 0x7fffffff;  // above every entry
    routes += __popc(__ballot_sync(MLA_FULL_MASK, v[k] < sentinel));
  }
  if (routes <= 1) return;
  if (routes <= 32) {
    const int x = sort_over_lanes(v[0] < sentinel ? v[0] : 0x7fffffff);
    if (lane < routes) seg[lane] = x;
    return;
  }
  // The routes are the first `routes` entries, all distinct; the columns past them hold none.
  const int held = (routes + 31) >> 5;
#pragma unroll
  for (int k = 0; k < ORDER_ITEMS; ++k)
    if (k < held) v[k] = sort_over_lanes(v[k]);  // the same `held` on every lane
#pragma unroll
  for (int k = 0; k < ORDER_ITEMS; ++k) {
    if (k >= held) break;
    int place = lane;
#pragma unroll
    for (int other = 0; other < ORDER_ITEMS; ++other)
      if (other != k && other < held) place += count_below_over_lanes(v[other], v[k]);
    if (v[k] < sentinel) seg[place] = v[k];
  }
}

// Sort the routes at the front of seg[0, n) (ORDER_WARP_MAX < n <= ORDER_DIGITS_MAX; the
// entries at or above `sentinel` stay behind them) by the whole block; thread t holds entry
// t + k * blockDim in v[k]. A counting sort on digits of [0, sentinel), at least a digit an
// entry, then each route's rank among its digit's few (a digit spans sentinel / digits
// values, so however the values cluster it holds at most that many). Shared memory:
// vals[n] | start[digits + 1] | scan sums[32]. Every thread calls it.
__device__ void sort_by_digits(int* seg, const int (&v)[ORDER_BLOCK_ITEMS], int n, int sentinel,
                               int* smem) {
  int digits = 2;
  while (digits < n) digits <<= 1;
  int shift = 0;
  while (((sentinel - 1) >> shift) >= digits) ++shift;
  int* vals = smem;
  int* start = vals + n;
  for (int d = threadIdx.x; d <= digits; d += blockDim.x) start[d] = 0;
  __syncthreads();
#pragma unroll
  for (int k = 0; k < ORDER_BLOCK_ITEMS; ++k)
    if (v[k] < sentinel) atomicAdd(start + (v[k] >> shift), 1);
  __syncthreads();
  MLA_STAMP(5, 7);
  // start[d] := the first place of digit d; the scatter's claims then leave it at the
  // digit's end, which is where digit d + 1 starts.
  scan_block(digits, [&](int d) { return start[d]; }, start, start + digits + 1);
  MLA_STAMP(5, 2);
#pragma unroll
  for (int k = 0; k < ORDER_BLOCK_ITEMS; ++k)
    if (v[k] < sentinel) vals[atomicAdd(start + (v[k] >> shift), 1)] = v[k];
  __syncthreads();
#pragma unroll
  for (int k = 0; k < ORDER_BLOCK_ITEMS; ++k) {
    if (v[k] < sentinel) {
      const int d = v[k] >> shift, end = start[d];
      int rank = d > 0 ? start[d - 1] : 0;
      for (int q = rank; q < end; ++q) rank += vals[q] < v[k];
      seg[rank] = v[k];
    }
  }
}

// How many bitmaps of the numel route indices, with their summaries and a count a warp of
// each, the sort's scratch holds (order_scratch_bytes: the digit sort's 2 * ORDER_DIGITS_MAX
// + 33 words, or one such bitmap, or up to ORDER_BITMAP_ALL_MAX routes two, where larger); at
// most ORDER_GROUP_MAX, and one past ORDER_BITMAP_ALL_MAX (where only segments past
// ORDER_DIGITS_MAX take the bitmap, one at a time).
__device__ __forceinline__ int order_bitmaps_fit(int numel) {
  const int rounds = max(1, (numel + 1023) >> 10), each = 33 * rounds + 32;
  if (numel > ORDER_BITMAP_ALL_MAX) return 1;
  return min(ORDER_GROUP_MAX, max(2 * ORDER_DIGITS_MAX + 33, 2 * each) / each);
}

// Sort the routes at the front of the `count` segments seg[g][0, n[g]) (count <=
// ORDER_GROUP_MAX; the sentinels stay behind the routes) at once by the whole block, each
// through a bitmap of its route indices, so that the barriers are paid once. Each warp reads
// back a contiguous stretch of a bitmap: with RUNS, up to ORDER_RUN_MAX rounds a warp as one
// run of words a lane; else 32 words (one summary word) at a time, skipping empty ones. `scratch`
// holds `capacity` (order_bitmaps_fit) bitmaps of 32 * rounds words, the first `zeroed` of
// them zero (the first `count` are zero again on the way out), then at fixed places past them
// a summary of rounds words and a count a warp (32 words) for each. Every thread calls it.
template <bool RUNS>
__device__ void sort_by_bitmaps(const Problem& p, int* const (&seg)[ORDER_GROUP_MAX],
                                const int (&n)[ORDER_GROUP_MAX], int count, int capacity,
                                int zeroed, unsigned* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int rounds = max(1, (p.numel + 1023) >> 10), words = 32 * rounds;
  unsigned* summaries = scratch + capacity * words;
  int* warp_counts = reinterpret_cast<int*>(summaries + capacity * rounds);
  MLA_STAMP(8, 0);
  MLA_STAMP(9, 0);
  for (int w = zeroed * words + threadIdx.x; w < count * words; w += blockDim.x) scratch[w] = 0u;
  // Every segment's first entries are loaded before any bit is set, so their round trips
  // overlap; the rest (segments longer than the block) after.
  int v[ORDER_GROUP_MAX];
#pragma unroll
  for (int g = 0; g < ORDER_GROUP_MAX; ++g)
    v[g] = g < count && (int)threadIdx.x < n[g] ? __ldcg(seg[g] + threadIdx.x) : p.numel;
  MLA_ARRIVE(9, 1);
  if (zeroed < count) __syncthreads();  // the zeroes stored before any bit is set
  MLA_STAMP(8, 1);
#pragma unroll
  for (int g = 0; g < ORDER_GROUP_MAX; ++g) {
    if (g >= count) break;
    unsigned* bits = scratch + g * words;
    if (v[g] < p.numel) atomicOr(bits + (v[g] >> 5), 1u << (v[g] & 31));
    for (int i = threadIdx.x + blockDim.x; i < n[g]; i += blockDim.x) {
      const int u = __ldcg(seg[g] + i);
      if (u < p.numel) atomicOr(bits + (u >> 5), 1u << (u & 31));
    }
  }
  MLA_STAMP(8, 2);
  MLA_ARRIVE(9, 2);
  __syncthreads();  // every route read before any is rewritten
  MLA_STAMP(8, 3);
  const int per = (rounds + nwarps - 1) / nwarps;
  const int r0 = min(rounds, warp * per), r1 = min(rounds, r0 + per);
  // RUNS, up to ORDER_RUN_MAX rounds a warp: each lane takes a run of the warp's words,
  // r1 - r0 of them in a row from `run`, and reads them back after one scan of the lanes'
  // counts (a scan a round took a chain of shuffles each); else a round at a time, the empty
  // ones skipped by their summary.
  const bool runs = RUNS && per <= ORDER_RUN_MAX;
  const int run_words = r1 - r0, run = (r0 << 5) + lane * run_words;
  // A warp counts each bitmap's routes in its rounds and notes which words hold any (a
  // summary word a round, written by the warp that reads it; built here, not by an atomic a
  // route: a segment's routes crowd a few summary words, and those atomics serialised).
#pragma unroll
  for (int g = 0; g < ORDER_GROUP_MAX; ++g) {
    if (g >= count) break;
    int c = 0;
    if (runs) {
#pragma unroll
      for (int i = 0; i < ORDER_RUN_MAX; ++i)
        if (i < run_words) c += __popc(scratch[g * words + run + i]);
    } else {
      for (int r = r0; r < r1; ++r) {
        const unsigned word = scratch[g * words + (r << 5) + lane];
        c += __popc(word);
        const unsigned nonzero = __ballot_sync(MLA_FULL_MASK, word != 0u);
        if (lane == 0) summaries[g * rounds + r] = nonzero;
      }
    }
    c = warp_sum(c);
    if (lane == 0) warp_counts[g * 32 + warp] = c;
  }
  MLA_STAMP(8, 4);
  MLA_ARRIVE(9, 3);
  __syncthreads();
  if (warp < count) {  // warp g: bitmap g's exclusive prefix over the warps
    const int c = lane < nwarps ? warp_counts[warp * 32 + lane] : 0;
    const int x = warp_inclusive_sum(c);
    warp_counts[warp * 32 + lane] = x - c;
  }
  MLA_ARRIVE(9, 4);
  __syncthreads();
  MLA_STAMP(8, 5);
  // Two bitmaps at a time: their counts packed in the halves of one word, so one scan (and
  // one total) serves both; a round's prefix over the lanes is at most 1024, a run's 4096.
#pragma unroll
  for (int g = 0; g < ORDER_GROUP_MAX; g += 2) {
    if (g >= count) break;
    const bool pair = g + 1 < count;  // the same on every lane
    unsigned* bits0 = scratch + g * words;
    unsigned* bits1 = bits0 + words;  // read and written only with `pair`
    int at0 = warp_counts[g * 32 + warp], at1 = pair ? warp_counts[(g + 1) * 32 + warp] : 0;
    if (runs) {
      unsigned word0[ORDER_RUN_MAX], word1[ORDER_RUN_MAX];
      int mine0 = 0, mine1 = 0;
#pragma unroll
      for (int i = 0; i < ORDER_RUN_MAX; ++i) {
        word0[i] = i < run_words ? bits0[run + i] : 0u;
        word1[i] = pair && i < run_words ? bits1[run + i] : 0u;
        mine0 += __popc(word0[i]);
        mine1 += __popc(word1[i]);
      }
      const int x = warp_inclusive_sum(mine0 | mine1 << 16);
      int k0 = at0 + (x & 0xffff) - mine0, k1 = at1 + (x >> 16) - mine1;
#pragma unroll
      for (int i = 0; i < ORDER_RUN_MAX; ++i) {
        if (i >= run_words) break;
        for (unsigned w = word0[i]; w != 0u; w &= w - 1u)
          seg[g][k0++] = ((run + i) << 5) + __ffs(w) - 1;
        bits0[run + i] = 0u;
        if (!pair) continue;
        for (unsigned w = word1[i]; w != 0u; w &= w - 1u)
          seg[g + 1][k1++] = ((run + i) << 5) + __ffs(w) - 1;
        bits1[run + i] = 0u;
      }
      continue;
    }
    for (int r = r0; r < r1; ++r) {
      // the same on every lane
      const bool any0 = summaries[g * rounds + r] != 0u;
      const bool any1 = pair && summaries[(g + 1) * rounds + r] != 0u;
      if (!any0 && !any1) continue;
      const int w = (r << 5) + lane;
      unsigned word0 = any0 ? bits0[w] : 0u, word1 = any1 ? bits1[w] : 0u;
      const int mine0 = __popc(word0), mine1 = __popc(word1), mine = mine0 | mine1 << 16;
      const int x = warp_inclusive_sum(mine);
      const int round_total = warp_sum(mine);  // beside the scan, not after it
      int k0 = at0 + (x & 0xffff) - mine0, k1 = at1 + (x >> 16) - mine1;
      for (; word0 != 0u; word0 &= word0 - 1u) seg[g][k0++] = (w << 5) + __ffs(word0) - 1;
      for (; word1 != 0u; word1 &= word1 - 1u) seg[g + 1][k1++] = (w << 5) + __ffs(word1) - 1;
      if (any0) bits0[w] = 0u;
      if (any1) bits1[w] = 0u;
      at0 += round_total & 0xffff;
      at1 += round_total >> 16;
    }
  }
  MLA_STAMP(8, 6);
  MLA_ARRIVE(9, 5);
  __syncthreads();  // the bitmaps zeroed again, and the counts read, before the next segments
  MLA_STAMP(8, 7);
}

// Sort the segment of every bucket dealt to `block` of `blocks`: in rounds, warp w takes
// bucket (round * 32 + w) * blocks + block and sorts it if it is short; the block then sorts
// the round's long ones. `starts`: the segment starts (shared or global memory); `scratch`:
// the sort's shared memory (order_scratch_bytes); RUNS: sort_by_bitmaps reads back runs.
// Every thread calls it.
template <bool RUNS>
__device__ void order_segments(const Problem& p, const int* starts, int block, int blocks,
                               int* scratch) {
  // The round's long segments, by bucket; their count in turn in num_long[round & 1]: a round
  // without long segments has no barrier after the count is read, so the next round's reset
  // must not hit the word a slow thread may still read.
  __shared__ int long_bucket[32], num_long[2];
  const int nb = num_buckets(p), E = p.num_experts;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
  auto segment = [&](int b, int* n) {  // the loads of a segment's bounds go out together
    const int r = row_of(p, b);
    const int s0 = starts[b], s1 = starts[b + 1], row_start = starts[r * E];
    *n = s1 - s0;
    return p.sorted_ids + (long long)r * p.sorted_pitch + (s0 - row_start);
  };
  unsigned* bits = reinterpret_cast<unsigned*>(scratch);
  const int group_max = order_bitmaps_fit(p.numel);
  int zeroed = 0;  // how many of the scratch's first bitmaps are zero
  int turn = 0;
  MLA_STAMP(5, 0);
  for (int first = 0; first < nb; first += blocks * nwarps, turn ^= 1) {
    if (threadIdx.x == 0) num_long[turn] = 0;
    __syncthreads();  // also: the previous round done with the shared memory
    const int b = first + warp * blocks + block;
    if (b < nb) {
      int n;
      int* seg = segment(b, &n);
      if (n > ORDER_WARP_MAX) {
        if (lane == 0) long_bucket[atomicAdd(&num_long[turn], 1)] = b;  // any order: independent
      } else if (n > 1) {
        sort_in_warp(seg, n, p.numel);
      }
    }
    __syncthreads();
    MLA_STAMP(5, 1);
    const int longs = num_long[turn];
    for (int j = 0; j < longs; ++j) {
      int n;
      int* seg = segment(long_bucket[j], &n);
      if (n <= ORDER_DIGITS_MAX && p.numel > ORDER_BITMAP_ALL_MAX) {
        int v[ORDER_BLOCK_ITEMS];
#pragma unroll
        for (int k = 0; k < ORDER_BLOCK_ITEMS; ++k) {
          const int i = k * blockDim.x + threadIdx.x;
          v[k] = i < n ? __ldcg(seg + i) : p.numel;
        }
        MLA_STAMP(5, 6);
        __syncthreads();  // the previous segment done with the shared memory
        sort_by_digits(seg, v, n, p.numel, scratch);
        MLA_STAMP(5, 3);
        zeroed = 0;  // the bitmaps' memory was the staging area
      } else {
        // this segment and the next ones that fit, each through a bitmap, at once (one past
        // ORDER_DIGITS_MAX entries goes alone)
        int* group[ORDER_GROUP_MAX];
        int sizes[ORDER_GROUP_MAX], count = 1, total = n;
        group[0] = seg;
        sizes[0] = n;
#pragma unroll
        for (int g = 1; g < ORDER_GROUP_MAX; ++g) {
          group[g] = seg;
          sizes[g] = 0;
          if (g < group_max && count == g && j + g < longs) {
            int m;
            int* next = segment(long_bucket[j + g], &m);
            if (total + m <= ORDER_DIGITS_MAX) {
              group[g] = next;
              sizes[g] = m;
              total += m;
              ++count;
            }
          }
        }
        __syncthreads();  // the previous segment done with the shared memory
        sort_by_bitmaps<RUNS>(p, group, sizes, count, group_max, zeroed, bits);
        MLA_STAMP(5, 4);
        zeroed = max(zeroed, count);
        j += count - 1;
      }
    }
  }
}

// The launch after the count + place kernels in deterministic mode: the segment starts they
// left in p.starts, a bucket a warp (gridDim * 32 >= nb by the dispatcher, else rounds).
template <typename IdT>
__global__ void __launch_bounds__(1024) align_order(const Problem p) {
  order_segments<false>(p, p.starts, blockIdx.x, gridDim.x,
                        reinterpret_cast<int*>(dynamic_smem));
#ifdef MLA_PROBE
  __syncthreads();
  MLA_STAMP(5, 5);
#endif
}
