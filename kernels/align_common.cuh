// Device routines shared by every alignment kernel, base and LoRA alike.
//
// The LoRA alignment is the base alignment with a row per adapter slot: a route's bucket is
// `slot * E + expert`, every bucket row is scanned on its own, and row `slot` of each output
// is written. The base alignment is the one-row case (no token slots, row 0 always processed).
// No headers are included so NVRTC compiles this without the CUDA toolkit.
#pragma once

#define MLA_FULL_MASK 0xffffffffu

// Mirrors moe_lora_align/_launch.py: PROBLEM_DTYPE (same fields, same order, same types).
struct Problem {
  const void* topk_ids;         // [numel] route ids (IdT)
  const int* token_slot;        // [T] adapter slot per token, or null for the base alignment
  const int* lora_ids;          // [lora_ids_len] slots to process, or null: every slot
  const int* adapter_enabled;   // [rows + 1] 0 = disabled, or null: all enabled
  const int* expert_map;        // [num_experts] global -> local id (or -1), or null
  int* sorted_ids;              // [rows, sorted_pitch]
  int* expert_ids;              // [rows, expert_pitch]
  int* num_post_pad;            // [rows]
  int* scatter_idx;             // [numel] or null
  int* counts;                  // scratch [num_buckets]: zero on entry, left zero (cooperative
                                //   kernel: [2, count_stride], see align_cooperative)
  int* starts;                  // scratch [num_buckets + 1]: padded exclusive scan, all rows
  int* cursor;                  // scratch [num_buckets]: next free position of each bucket
  int* chunk_hist;              // scratch [chunks, num_buckets]: per-chunk offsets (shared and
                                //   deterministic modes)
  unsigned int* ticket;         // scratch [1]: zero on entry, left zero (cooperative kernel:
                                //   its control words, see align_cooperative)
  int numel;
  int topk;                     // K: routes per token
  int num_experts;              // E: buckets per row
  int block_size;               // B
  int rows;                     // 1 for base, max_loras for LoRA
  int lora_ids_len;
  int padded_len;               // P
  int num_tiles;                // M
  int sorted_pitch;
  int expert_pitch;
  int map_mode;                 // 0: no map, 1: map before counting, 2: map tile ids after
  int fill_unprocessed;         // write the empty alignment into rows that are not processed
  int chunk;                    // routes per chunk (multi-block kernels)
  int range_width;              // buckets per block (deterministic multi-block kernels)
  int ranges;                   // bucket ranges per chunk (deterministic multi-block kernels)
  int starts_in_smem;           // place kernel: copy starts to shared memory for the tile search
  int stage_output;             // place kernel (shared mode): stage routes for coalesced stores;
                                //   align_tiny_staged: ints of its row image
  unsigned int topk_magic;      // n / d == (n * magic) >> shift for 0 <= n < 2^31 (host-made)
  int topk_shift;
  unsigned int block_magic;
  int block_shift;
  unsigned int experts_magic;
  int experts_shift;
  unsigned int tiles_magic;
  int tiles_shift;
  int count_stride;             // cooperative kernel: entries between its two count buffers
  int coop_blocks;              // cooperative kernels: blocks aligning this problem
  int fill_blocks;              // blocks of the launch that only fill (align_cooperative's
                                //   last ones, align_tiny_filled's after the first)
};

// Stage timestamps for scripts/stage_probe.py, compiled in only with -DMLA_PROBE: thread 0 of
// each block records (SM clock, global nanosecond timer) at MLA_STAMP(kernel, stage) points,
// and the SM it runs on.
// Kernel slots: 0 single block, 1 count, 2 place, 3 cooperative, 4 cluster, 5 order, 6 the
// deterministic cluster kernel's ranking steps, 7 fill blocks (fill_and_arrive), 8 the bitmap
// sort (sort_by_bitmaps), 9 its warps' last arrivals before its barriers (MLA_ARRIVE).
#ifdef MLA_PROBE
#define MLA_PROBE_SLOTS 10
#define MLA_PROBE_BLOCKS 160
#define MLA_PROBE_STAGES 8
__device__ unsigned long long mla_probe[MLA_PROBE_SLOTS * MLA_PROBE_BLOCKS * MLA_PROBE_STAGES * 2];
__device__ unsigned mla_probe_sm[MLA_PROBE_SLOTS * MLA_PROBE_BLOCKS];  // the block's SM + 1
// This block's (clock, timer) pair of a stage in mla_probe: its clock's index.
__device__ __forceinline__ int mla_probe_at(int kernel, int stage) {
  return ((kernel * MLA_PROBE_BLOCKS + blockIdx.x) * MLA_PROBE_STAGES + stage) * 2;
}
__device__ __forceinline__ void mla_stamp(int kernel, int stage) {
  if (threadIdx.x == 0 && blockIdx.x < MLA_PROBE_BLOCKS) {
    unsigned long long g;
    unsigned sm;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g));
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    const int k = mla_probe_at(kernel, stage);
    mla_probe[k] = clock64();
    mla_probe[k + 1] = g;
    mla_probe_sm[kernel * MLA_PROBE_BLOCKS + blockIdx.x] = sm + 1;
  }
}
// The last warp's arrival before a barrier: each warp's lane 0 raises the stage's clock to
// its own (a block's warps share their SM's clock). Thread 0's stamp after the barrier counts
// the wait for the slowest warp in with the work; this one tells the two apart. Clock only
// (the timer half stays 0); a block that passes twice keeps the later pass.
__device__ __forceinline__ void mla_arrive(int kernel, int stage) {
  if ((threadIdx.x & 31) == 0 && blockIdx.x < MLA_PROBE_BLOCKS) {
    atomicMax(&mla_probe[mla_probe_at(kernel, stage)], (unsigned long long)clock64());
  }
}
#define MLA_STAMP(kernel, stage) mla_stamp(kernel, stage)
#define MLA_ARRIVE(kernel, stage) mla_arrive(kernel, stage)
#else
#define MLA_STAMP(kernel, stage) ((void)0)
#define MLA_ARRIVE(kernel, stage) ((void)0)
#endif

// Division by a divisor fixed per call, as a multiply and a shift (no division instructions).
__device__ __forceinline__ int fast_div(int n, unsigned magic, int shift) {
  return (int)(((unsigned long long)(unsigned)n * magic) >> shift);
}

__device__ __forceinline__ int num_buckets(const Problem& p) { return p.rows * p.num_experts; }

__device__ __forceinline__ unsigned lanemask_lt() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

__device__ __forceinline__ bool adapter_on(const Problem& p, int slot) {
  return p.adapter_enabled == nullptr || p.adapter_enabled[slot] != 0;
}

// Shared bytes of the per-row region at the start of every kernel's dynamic shared memory:
// processed[rows] flags, then the slot list (first rows + 1 entries of lora_ids).
// Mirrors moe_lora_align/_dispatch.py: row_region_bytes.
__device__ __forceinline__ int row_region_bytes(int rows) {
  return ((((rows + 3) & ~3) + 4 * (rows + 1)) + 15) & ~15;
}

__device__ __forceinline__ unsigned warp_or(unsigned v) {
#if __CUDA_ARCH__ >= 800
  return __reduce_or_sync(MLA_FULL_MASK, v);
#else
  for (int d = 16; d > 0; d >>= 1) v |= __shfl_xor_sync(MLA_FULL_MASK, v, d);
  return v;
#endif
}

// The sum over the warp's lanes, on every lane: one reduction instruction from sm_80 (a
// scan's five dependent shuffles where only the total is wanted cost more).
__device__ __forceinline__ int warp_sum(int v) {
#if __CUDA_ARCH__ >= 800
  return __reduce_add_sync(MLA_FULL_MASK, v);
#else
  for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(MLA_FULL_MASK, v, d);
  return v;
#endif
}

// The processed rows of up to 32 rows as bits in a register, read like the shared flags.
struct RowBits {
  unsigned bits;
  __device__ __forceinline__ bool operator[](int r) const { return (bits >> r) & 1u; }
};

// What a lane reads for the RowBits of a call with at most 32 rows: its entries of lora_ids
// (at most 33 listed: two a lane) and its slot's enabled flag. Loaded apart from row_bits so
// a caller can issue the loads early and combine them after a barrier.
struct RowFlagLoads {
  int s0, s1;
  bool on;
};

__device__ __forceinline__ RowFlagLoads load_row_flags(const Problem& p) {
  const int lane = threadIdx.x & 31;
  const int listed = p.lora_ids == nullptr ? 0 : min(p.lora_ids_len, p.rows + 1);
  return {lane < listed ? p.lora_ids[lane] : -1, lane + 32 < listed ? p.lora_ids[lane + 32] : -1,
          lane < p.rows && adapter_on(p, lane)};
}

// The warp's RowBits from its lanes' loads: the same rows as mark_processed_rows, with no
// shared memory and no barrier. Every lane calls it.
__device__ __forceinline__ RowBits row_bits(const Problem& p, const RowFlagLoads& f) {
  const int listed = p.lora_ids == nullptr ? 0 : min(p.lora_ids_len, p.rows + 1);
  const unsigned mine = (f.s0 >= 0 && f.s0 < p.rows ? 1u << f.s0 : 0u) |
                        (f.s1 >= 0 && f.s1 < p.rows ? 1u << f.s1 : 0u);
  const unsigned rows_listed = listed > 0 ? warp_or(mine) : MLA_FULL_MASK;
  const unsigned enabled = __ballot_sync(MLA_FULL_MASK, f.on);
  return {enabled & rows_listed};
}

// What a lane reads to find whether the call processes one row (any number of rows): its
// first two entries of lora_ids (the list's first 64) and the row's enabled flag.
__device__ __forceinline__ RowFlagLoads load_slot_flags(const Problem& p, int row) {
  const int lane = threadIdx.x & 31;
  const int listed = p.lora_ids == nullptr ? 0 : min(p.lora_ids_len, p.rows + 1);
  return {lane < listed ? p.lora_ids[lane] : -1, lane + 32 < listed ? p.lora_ids[lane + 32] : -1,
          adapter_on(p, row)};
}

// Whether the call processes `row` (listed, or no list, and enabled), from load_slot_flags'
// loads; a list of more than 64 entries is searched on, 32 entries a round. Every lane calls it.
__device__ __forceinline__ bool slot_processed(const Problem& p, const RowFlagLoads& f, int row) {
  const int listed = p.lora_ids == nullptr ? 0 : min(p.lora_ids_len, p.rows + 1);
  bool found = f.s0 == row || f.s1 == row;
#pragma unroll 1
  for (int k = (threadIdx.x & 31) + 64; k < listed; k += 32) found |= p.lora_ids[k] == row;
  return f.on && (listed == 0 || __ballot_sync(MLA_FULL_MASK, found) != 0);
}

// Row `r` of a LoRA call as a one-row problem: its outputs' row (the kernels a block or a
// cluster a row keep only the routes of slot r, as that row's slot 0).
__device__ __forceinline__ Problem slot_row_problem(const Problem& p, int r) {
  Problem row = p;
  row.sorted_ids += (long long)r * p.sorted_pitch;
  row.expert_ids += (long long)r * p.expert_pitch;
  row.num_post_pad += r;
  row.rows = 1;
  return row;
}

// RowBits of a call with at most 32 rows, worked out by the calling warp alone (every lane
// calls it).
__device__ __forceinline__ RowBits processed_row_bits(const Problem& p) {
  return row_bits(p, load_row_flags(p));
}

// processed[r] = 1 for every row this call aligns: listed in lora_ids (or no list) and
// enabled. Up to 32 rows one warp does it with one round trip of loads and one barrier: the
// list becomes a bit mask of rows (an OR over the lanes), so no row searches it. More rows:
// both arrays are read in one round trip, and the list is searched in shared memory.
__device__ void mark_processed_rows(const Problem& p, unsigned char* processed) {
  const int listed = p.lora_ids == nullptr ? 0 : min(p.lora_ids_len, p.rows + 1);
  if (p.rows <= 32) {
    if (threadIdx.x < 32) {  // listed <= 33: at most two entries a lane, loaded at once
      const RowBits bits = processed_row_bits(p);
      if (threadIdx.x < p.rows) processed[threadIdx.x] = bits[threadIdx.x];
    }
    __syncthreads();
    return;
  }
  int* slots = reinterpret_cast<int*>(processed + ((p.rows + 3) & ~3));
  for (int k = threadIdx.x; k < max(p.rows, listed); k += blockDim.x) {
    const bool on = k < p.rows && adapter_on(p, k);
    if (k < listed) slots[k] = p.lora_ids[k];
    if (k < p.rows) processed[k] = on;
  }
  __syncthreads();
  if (listed > 0) {
    for (int r = threadIdx.x; r < p.rows; r += blockDim.x) {
      bool found = false;
      for (int j = 0; j < listed; ++j) found |= slots[j] == r;
      processed[r] = processed[r] && found;
    }
    __syncthreads();
  }
}

template <typename Rows>
__device__ __forceinline__ bool row_written(const Problem& p, const Rows& processed, int r) {
  return processed[r] || p.fill_unprocessed;
}

// A route as loaded from global memory: its id and its token's slot. Loading every route of
// a thread first and classifying afterwards keeps all the loads in flight at once.
struct Route {
  long long id;
  int slot;
};

template <typename IdT>
__device__ __forceinline__ Route load_route(const Problem& p, int i, int end) {
  Route r{-1, 0};
  if (i < end) {
    r.id = (long long)static_cast<const IdT*>(p.topk_ids)[i];
    if (p.token_slot != nullptr) r.slot = p.token_slot[fast_div(i, p.topk_magic, p.topk_shift)];
  }
  return r;
}

// Bucket of a route, or -1 when it is dropped (invalid id, non-local expert, base-model
// token, slot not processed). Never reads outside the arrays whatever their values.
// `processed[slot]`: the row flags in shared memory, or a RowBits.
template <typename Rows>
__device__ __forceinline__ int bucket_of(const Problem& p, Route r, const Rows& processed) {
  if (r.id < 0 || r.id >= p.num_experts) return -1;
  int e = (int)r.id;
  if (p.map_mode == 1) {
    e = p.expert_map[e];
    if (e < 0 || e >= p.num_experts) return -1;
  }
  if (p.token_slot != nullptr) {
    if (r.slot < 0 || r.slot >= p.rows || !processed[r.slot]) return -1;
    return r.slot * p.num_experts + e;
  }
  return e;
}

template <typename IdT>
__device__ __forceinline__ int route_bucket(const Problem& p, int i, int end,
                                            const unsigned char* processed) {
  return bucket_of(p, load_route<IdT>(p, i, end), processed);
}

// atomicAdd returning the old value, for int counters and for unsigned short counters (added
// through their 4-byte word; counts stay below 65536 so the low half never carries over).
__device__ __forceinline__ int atomic_add_count(int* counter, int idx, int n) {
  return atomicAdd(counter + idx, n);
}
__device__ __forceinline__ int atomic_add_count(unsigned short* counter, int idx, int n) {
  unsigned* word = reinterpret_cast<unsigned*>(counter) + (idx >> 1);
  const int shift = (idx & 1) * 16;
  return (int)((atomicAdd(word, (unsigned)n << shift) >> shift) & 0xffffu);
}

// Counter update that returns each lane its slot: counter[bucket] += 1, old value back.
// Lanes sharing the bucket of the warp's first active lane are folded into one atomic (all
// routes of a skewed batch hit one counter); the others add on their own in the same round,
// so a warp waits for one atomic round trip. The order among lanes of one bucket is whatever
// the hardware picks: use claim_in_lane_order for ranks that must follow the flat index.
// Every lane of the warp must call it; bucket < 0 is inactive.
template <typename CounterT>
__device__ __forceinline__ int claim(CounterT* counter, int bucket) {
  const unsigned active = __ballot_sync(MLA_FULL_MASK, bucket >= 0);
  if (active == 0) return -1;
  const int lane = threadIdx.x & 31, first = __ffs(active) - 1;
  const int lead = __shfl_sync(MLA_FULL_MASK, bucket, first);
  const unsigned same = __ballot_sync(MLA_FULL_MASK, bucket == lead);
  int old = 0;
  if (lane == first || (bucket >= 0 && bucket != lead))
    old = atomic_add_count(counter, bucket, lane == first ? __popc(same) : 1);
  const int base = __shfl_sync(MLA_FULL_MASK, old, first);
  if (bucket == lead) return base + __popc(same & lanemask_lt());
  return bucket >= 0 ? old : -1;
}

// Bits that hold every bucket id below n.
__device__ __forceinline__ int bucket_bits(int n) { return n <= 1 ? 0 : 32 - __clz(n - 1); }

// The lanes of `active` whose bucket equals this lane's (buckets below 1 << nbits): a ballot a
// bit of the id (a warp multi-split), the same few instructions whatever the buckets, where
// __match_any_sync takes longer the more distinct values a warp holds. Every lane calls it.
__device__ __forceinline__ unsigned same_bucket_lanes(unsigned active, int bucket, int nbits) {
  unsigned peers = active;
#pragma unroll 4
  for (int bit = 0; bit < nbits; ++bit) {
    const bool set = (bucket >> bit) & 1;
    const unsigned with = __ballot_sync(MLA_FULL_MASK, set);
    peers &= set ? with : ~with;
  }
  return peers;
}

// Ranks in lane order for counters only this warp touches (deterministic mode): lanes with
// the same bucket (below 1 << nbits) elect the lowest as leader, which reads the counter and
// adds their number. Every lane of the warp must call it; bucket < 0 is inactive.
// The leaders' values travel in one full-warp shuffle: a shuffle under each group's own mask
// ran once a group, one after another.
__device__ __forceinline__ int claim_in_lane_order(unsigned short* counter, int bucket, int nbits) {
  __syncwarp();  // orders the previous step's leader writes before these reads
  const unsigned active = __ballot_sync(MLA_FULL_MASK, bucket >= 0);
  if (active == 0) return -1;
  const unsigned peers = same_bucket_lanes(active, bucket, nbits);  // inactive lanes: unused
  const int leader = __ffs(peers) - 1;
  int base = 0;
  if (bucket >= 0 && (int)(threadIdx.x & 31) == leader) {
    base = counter[bucket];
    counter[bucket] = (unsigned short)(base + __popc(peers));
  }
  base = __shfl_sync(MLA_FULL_MASK, base, leader & 31);
  return bucket >= 0 ? base + __popc(peers & lanemask_lt()) : -1;
}

// The sentinel (p.numel) into row[0, p.padded_len) over threads `from`, `from + step`, ...:
// `units` 16-byte stores of `four` (p.numel four times; units 0 unless row is 16-byte
// aligned), then the rest one by one. align_tiny's base row and align_warp keep loops of
// their own: through this helper their machine code changed, where fill_rows' and the
// staged image's did not.
template <typename Step>
__device__ __forceinline__ void fill_span(const Problem& p, int* row, int units, int4 four,
                                          int from, Step step) {
#pragma unroll 1
  for (int k = from; k < units; k += step) reinterpret_cast<int4*>(row)[k] = four;
#pragma unroll 1
  for (int k = 4 * units + from; k < p.padded_len; k += step) row[k] = p.numel;
}

// The sentinel fill of every written row of sorted_ids, and with `tiles` -1 in all its tile
// owners, over threads [0, nthreads) from `tid`; 16-byte stores where alignment allows, never
// past padded_len. Each row goes to a group of nthreads / rows threads, whole warps where a
// group has 32 or more (past as many rows as groups, a group a row in turn): a loop over
// every row in every thread cost each thread every row's setup, which at LoRA sizes (16
// rows, 32 warps an SM) was the fill's time (r44's stamps: 5700 cycles for a fill block to
// issue 28 KB).
template <typename Rows>
__device__ void fill_rows(const Problem& p, const Rows& processed, int tid, int nthreads,
                          bool tiles) {
  const bool vec = ((p.sorted_pitch & 3) == 0) &&
                   ((reinterpret_cast<unsigned long long>(p.sorted_ids) & 15) == 0);
  const int units = vec ? p.padded_len >> 2 : 0;
  // One row (base calls): every thread on it, without the divisions on the way to the
  // first store.
  const bool one_row = p.rows == 1;
  int group = one_row ? nthreads : p.rows >= nthreads ? 1 : nthreads / p.rows;  // threads a row
  if (!one_row && group >= 32) group &= ~31;
  const int row0 = one_row ? 0 : tid / group, from = tid - row0 * group;
  const int groups = one_row ? 1 : nthreads / group;
  const int4 sentinel = make_int4(p.numel, p.numel, p.numel, p.numel);
#pragma unroll 1
  for (int r = row0; r < p.rows; r += groups) {  // a last, partial group idles
    if (!row_written(p, processed, r)) continue;
    fill_span(p, p.sorted_ids + (long long)r * p.sorted_pitch, units, sentinel, from, group);
    if (tiles) {
#pragma unroll 1
      for (int k = from; k < p.num_tiles; k += group)
        p.expert_ids[(long long)r * p.expert_pitch + k] = -1;
    }
  }
}

__device__ __forceinline__ int padded_count(const Problem& p, int c) {
  return fast_div(c + p.block_size - 1, p.block_magic, p.block_shift) * p.block_size;
}

// Inclusive sum over the lanes of a warp: lane l gets the sum of lanes 0..l. Every lane calls it.
__device__ __forceinline__ int warp_inclusive_sum(int x) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int y = __shfl_up_sync(MLA_FULL_MASK, x, d);
    if (lane >= d) x += y;
  }
  return x;
}

// One bucket's column of per-warp counters (stride apart) becomes the exclusive prefix over
// the warps (each warp's rank offset), and the bucket's total comes back. Loads are issued
// eight at a time, ahead of the stores, so a column costs a few round trips, not one a warp.
__device__ __forceinline__ int prefix_over_warps(unsigned short* column, int stride, int warps) {
  int run = 0;
#pragma unroll 1
  for (int w0 = 0; w0 < warps; w0 += 8) {
    int c[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) c[u] = w0 + u < warps ? column[(w0 + u) * stride] : 0;
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      if (w0 + u < warps) column[(w0 + u) * stride] = (unsigned short)run;
      run += c[u];
    }
  }
  return run;
}

// prefix_over_warps for two buckets at once: the counters of buckets 2k and 2k + 1 share the
// 32-bit word k of each warp's row (`stride_words` apart), and one 32-bit add advances both
// halves, since no bucket's prefix reaches 65536 (WARP_COUNTER_MAX bounds a chunk). Column k
// becomes the exclusive prefixes; the two totals come back packed the same way.
__device__ __forceinline__ unsigned prefix_over_warps_x2(unsigned* column, int stride_words,
                                                         int warps) {
  unsigned run = 0;
#pragma unroll 1
  for (int w0 = 0; w0 < warps; w0 += 8) {
    unsigned c[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) c[u] = w0 + u < warps ? column[(w0 + u) * stride_words] : 0u;
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      if (w0 + u < warps) column[(w0 + u) * stride_words] = run;
      run += c[u];
    }
  }
  return run;
}

// Bucket and rank of each route a thread holds (route j at index first + j * step, up to
// end), and its scatter_idx entry: ranks from `counts` in the order the hardware picks, or
// (in_lane_order, the route runs of a warp) from the warp's own counters `mine`, in flat
// order among `nb` buckets. Every lane of the warp calls it.
template <int N>
__device__ __forceinline__ void bucket_and_rank(const Problem& p, const Route (&route)[N],
                                                int first, int step, int end,
                                                const unsigned char* processed,
                                                bool in_lane_order, int nb, int* counts,
                                                unsigned short* mine, int (&bucket)[N],
                                                int (&rank)[N]) {
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const int i = first + j * step;
    bucket[j] = bucket_of(p, route[j], processed);
    if (p.scatter_idx != nullptr && i < end) p.scatter_idx[i] = bucket[j] >= 0 ? i : -1;
    rank[j] = in_lane_order ? claim_in_lane_order(mine, bucket[j], bucket_bits(nb))
                            : claim(counts, bucket[j]);
  }
}

// Block-wide exclusive prefix of one value a thread: the sum of the values of the threads
// before this one. warp_sums (32 ints) is read until the caller's next barrier. Every thread
// calls it.
__device__ __forceinline__ int thread_prefix(int value, int* warp_sums) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int x = warp_inclusive_sum(value);
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) warp_sums[lane] = warp_inclusive_sum(lane < nwarps ? warp_sums[lane] : 0);
  __syncthreads();
  return x - value + (warp > 0 ? warp_sums[warp - 1] : 0);
}

// Block-wide exclusive scan: out[b] = sum_{b' < b} value(b'), out[n] = total. Each thread
// scans a contiguous run; `out` may alias what `value` reads (in place on a thread's run).
template <typename ValueFn>
__device__ void scan_block(int n, ValueFn value, int* out, int* warp_sums) {
  const int per = (n + blockDim.x - 1) / blockDim.x;
  const int lo = min(n, (int)threadIdx.x * per), hi = min(n, lo + per);
  int sum = 0;
  for (int b = lo; b < hi; ++b) sum += value(b);
  int run = thread_prefix(sum, warp_sums);
  for (int b = lo; b < hi; ++b) {
    const int c = value(b);
    out[b] = run;
    run += c;
  }
  if (threadIdx.x == blockDim.x - 1) out[n] = run;
  __syncthreads();
}

// Segment starts: exclusive scan of padded counts over all buckets of all rows.
template <typename CountFn>
__device__ __forceinline__ void scan_padded_counts(const Problem& p, int n, CountFn count, int* out,
                                                   int* warp_sums) {
  scan_block(n, [&](int b) { return padded_count(p, count(b)); }, out, warp_sums);
}

// Last bucket b in [lo, hi) with starts[b] <= target: the owner of the tile at `target`
// (empty buckets share their start with the next one, so the last wins).
__device__ __forceinline__ int owning_bucket(const int* starts, int lo, int hi, int target) {
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (starts[mid] <= target) lo = mid; else hi = mid;
  }
  return lo;
}

// expert_ids of every written row, from the padded scan `starts` (all rows concatenated;
// shared memory where it fits, else global).
__device__ void write_expert_ids(const Problem& p, const unsigned char* processed, const int* starts,
                                 int tid, int nthreads) {
  const int E = p.num_experts, M = p.num_tiles;
  const int total_tiles = p.rows * M;
  for (int k = tid; k < total_tiles; k += nthreads) {
    const int r = fast_div(k, p.tiles_magic, p.tiles_shift), t = k - r * M;
    if (!row_written(p, processed, r)) continue;
    int value = -1;
    if (processed[r]) {
      const int row_base = starts[r * E];
      const long long pos = (long long)t * p.block_size;
      if (pos < (long long)(starts[r * E + E] - row_base)) {
        value = owning_bucket(starts, r * E, r * E + E, row_base + (int)pos) - r * E;
        if (p.map_mode == 2) value = p.expert_map[value];
      }
    }
    p.expert_ids[(long long)r * p.expert_pitch + t] = value;
  }
}

template <typename Rows>
__device__ void write_totals(const Problem& p, const Rows& processed, const int* starts) {
  const int E = p.num_experts;
  for (int r = threadIdx.x; r < p.rows; r += blockDim.x) {
    if (processed[r]) p.num_post_pad[r] = starts[r * E + E] - starts[r * E];
    else if (p.fill_unprocessed) p.num_post_pad[r] = 0;
  }
}

__device__ __forceinline__ int row_of(const Problem& p, int bucket) {
  return fast_div(bucket, p.experts_magic, p.experts_shift);
}

// Bucket b's tiles, `tiles` of them from its segment start `start` (all rows' scan: `starts`
// holds the row's first start at r * E), get its expert id (mapped when map_mode == 2).
__device__ __forceinline__ void write_bucket_tiles(const Problem& p, const int* starts, int b,
                                                   int start, int tiles) {
  const int E = p.num_experts, r = row_of(p, b);
  int value = b - r * E;
  if (p.map_mode == 2) value = p.expert_map[value];
  int* tile = p.expert_ids + (long long)r * p.expert_pitch +
              fast_div(start - starts[r * E], p.block_magic, p.block_shift);
#pragma unroll 1
  for (int k = 0; k < tiles; ++k) tile[k] = value;
}

// Position of a route inside its row: segment start + rank.
__device__ __forceinline__ long long output_index(const Problem& p, const int* starts, int bucket, int rank) {
  const int r = row_of(p, bucket);
  return (long long)r * p.sorted_pitch + (starts[bucket] - starts[r * p.num_experts]) + rank;
}
