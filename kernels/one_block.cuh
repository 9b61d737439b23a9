// One-block kernels (decode sizes): align_single / align_pair, align_tiny / align_tiny_pair.
// Included by align_kernels.cu, after align_common.cuh and the modes, ITEMS_PER_THREAD,
// dynamic_smem and for_routes that file defines.

// ---------------------------------------------------------------------------------------------
// Single block: count, scan, place and fill in one launch (decode sizes).
// After the row region: starts[nb + 1] ints | DET: warp_counts[nwarps * stride] ushort,
// stride = nb rounded up to even (4-byte aligned rows).
// `stamp_as`: the probe's kernel slot for this pass (scripts/decode_experiment.py runs it twice).
template <typename IdT, bool DET>
__device__ void align_in_one_block(const Problem& p, int stamp_as = 0) {
  __shared__ int warp_sums[32];
  const int nb = num_buckets(p), nwarps = blockDim.x >> 5, stride = (nb + 1) & ~1;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  unsigned char* processed = dynamic_smem;
  int* starts = reinterpret_cast<int*>(dynamic_smem + row_region_bytes(p.rows));
  unsigned short* warp_counts = reinterpret_cast<unsigned short*>(starts + nb + 1);
  MLA_STAMP(stamp_as, 0);

  // Non-deterministic: thread t owns routes t, t + blockDim, ...; deterministic: warp w owns
  // a contiguous run, so its counters give ranks in flat-index order.
  const Span span = warp_span(0, p.numel, warp, nwarps);
  const int lo = span.lo, hi = span.hi;
  Route route[ITEMS_PER_THREAD];
  if (!DET) {
#pragma unroll
    for (int j = 0; j < ITEMS_PER_THREAD; ++j)
      route[j] = load_route<IdT>(p, j * blockDim.x + threadIdx.x, p.numel);
  }
  for (int b = threadIdx.x; b < nb; b += blockDim.x) starts[b] = 0;
  if (DET)
    for (int k = threadIdx.x; k < nwarps * stride; k += blockDim.x) warp_counts[k] = 0;
  mark_processed_rows(p, processed);
  fill_rows(p, processed, p.sorted_ids, p.sorted_pitch, p.padded_len, p.numel, threadIdx.x, blockDim.x);
  MLA_STAMP(stamp_as, 1);

  if (!DET) {
    int bucket[ITEMS_PER_THREAD], rank[ITEMS_PER_THREAD];
#pragma unroll
    for (int j = 0; j < ITEMS_PER_THREAD; ++j) {
      const int i = j * blockDim.x + threadIdx.x;
      bucket[j] = bucket_of(p, route[j], processed);
      if (p.scatter_idx != nullptr && i < p.numel) p.scatter_idx[i] = bucket[j] >= 0 ? i : -1;
      rank[j] = claim(starts, bucket[j]);
    }
    __syncthreads();
    MLA_STAMP(stamp_as, 2);
    scan_padded_counts(p, nb, [&](int b) { return starts[b]; }, starts, warp_sums);
    MLA_STAMP(stamp_as, 3);
#pragma unroll
    for (int j = 0; j < ITEMS_PER_THREAD; ++j)
      if (bucket[j] >= 0)
        p.sorted_ids[output_index(p, starts, bucket[j], rank[j])] = j * blockDim.x + threadIdx.x;
    MLA_STAMP(stamp_as, 4);
  } else {
    unsigned short* mine = warp_counts + warp * stride;
    for_routes<IdT>(p, lo + lane, 32, hi, [&](int i, Route r) {
      const int b = bucket_of(p, r, processed);
      if (p.scatter_idx != nullptr && i < hi) p.scatter_idx[i] = b >= 0 ? i : -1;
      claim(mine, b);  // totals only: order does not matter here
    });
    __syncthreads();
    for (int b = threadIdx.x; b < nb; b += blockDim.x)
      starts[b] = prefix_over_warps(warp_counts + b, stride, nwarps);
    __syncthreads();
    scan_padded_counts(p, nb, [&](int b) { return starts[b]; }, starts, warp_sums);
    for_routes<IdT>(p, lo + lane, 32, hi, [&](int i, Route r) {
      const int b = bucket_of(p, r, processed);
      const int rank = claim_in_lane_order(mine, b, bucket_bits(nb));
      if (b >= 0) p.sorted_ids[output_index(p, starts, b, rank)] = i;
    });
  }
  write_expert_ids(p, processed, starts, threadIdx.x, blockDim.x);
  write_totals(p, processed, starts);
#ifdef MLA_PROBE
  __syncthreads();
  MLA_STAMP(stamp_as, 5);
#endif
}

template <typename IdT, bool DET>
__global__ void align_single(const Problem p) {
  align_in_one_block<IdT, DET>(p);
#ifdef MLA_TWICE
  // Probe only: the same alignment again in the same block, on warm caches.
  __syncthreads();
  align_in_one_block<IdT, DET>(p, 1);
#endif
}

// Base and LoRA alignment in one launch: block 0 aligns `first`, block 1 aligns `second`.
template <typename IdT, bool DET>
__global__ void align_pair(const Problem first, const Problem second) {
  align_in_one_block<IdT, DET>(blockIdx.x == 0 ? first : second);
}

// ---------------------------------------------------------------------------------------------
// One block with a bucket per thread, or TINY_BUCKETS consecutive buckets per thread when there
// are more buckets than threads (LoRA with many slots), and up to TINY_ITEMS routes a thread:
// the single block's work with the fewest instructions on its dependent chain. At decode sizes
// the time is that chain, one warp's instructions one after another (about five stages of
// ~1000 cycles in align_single), so this version has no divisions in its loops, a two-barrier
// scan whose result stays in each bucket's thread, tiles written by their bucket's thread
// instead of a binary search per tile, and every fill issued before counting (but a
// free-order spread's, see Slices).
// DET: ranks in flat-index order. Warp w owns routes [w * items * 32, (w + 1) * items * 32),
// items = 1, 2 or 4 routes a lane (the fewest that cover the routes); ranks within the warp
// come in lane order (claim_in_lane_order into the warp's own counters), and each bucket's
// thread turns its column of warp counts into a prefix over the warps before the scan.
// After the row region: starts[nb + 1] ints (counts first, then the padded scan in place) |
// DET: warp_counts[route_warps * stride] ushort, stride = nb rounded up to even.
#define TINY_ITEMS 4
#define TINY_BUCKETS 4

// Slices: the blocks of one align_tiny launch where its output is large (LoRA decode with
// many slots: rows of sentinels). Every block ranks all the routes (a few hundred at most) and
// writes only its part of each row (the sentinel fill, and the routes and tile ids that land
// there), so the fill spreads over SMs and no block waits for another. That needs every block
// to rank every route alike (flat order: DET, or the ballot path). In free order (shared
// atomics, whose order differs between blocks) the counting path writes each position from
// one block instead: a segment's routes from the block whose part holds the segment's start,
// its pads and the row's tail from the block whose part holds them; the fill then waits for
// the scan, and nothing is written twice.
// The part of a row of `len` entries that slice `slice` of `slices` writes: [lo, hi), whole
// groups of `group` entries (4: int4 stores), the last slice taking the rest.
struct RowPart {
  int lo, hi;
  __device__ __forceinline__ bool holds(int k) const { return k >= lo && k < hi; }
};
__device__ __forceinline__ RowPart row_part(int len, int group, int slice, int slices) {
  if (slices == 1) return {0, len};
  const int per = ((len / group + slices - 1) / slices) * group;
  return {min(len, slice * per), slice == slices - 1 ? len : min(len, (slice + 1) * per)};
}

// Sentinels into `part` of row r, threads from `from` by `step`: int4 stores where `vec` (the
// part starts on a 16-byte boundary), then single entries.
__device__ __forceinline__ void fill_row_part(const Problem& p, int r, RowPart part, bool vec,
                                              int from, int step) {
  const int4 sentinel = make_int4(p.numel, p.numel, p.numel, p.numel);
  int* row = p.sorted_ids + (long long)r * p.sorted_pitch + part.lo;
  const int len = part.hi - part.lo, units = vec ? len >> 2 : 0;
#pragma unroll 1
  for (int k = from; k < units; k += step) reinterpret_cast<int4*>(row)[k] = sentinel;
#pragma unroll 1
  for (int k = 4 * units + from; k < len; k += step) row[k] = p.numel;
}

// -1 into `part` of row r's tile ids, threads from `from` by `step`.
__device__ __forceinline__ void fill_tiles_part(const Problem& p, int r, RowPart part, int from,
                                                int step) {
  int* tiles = p.expert_ids + (long long)r * p.expert_pitch;
#pragma unroll 1
  for (int k = part.lo + from; k < part.hi; k += step) tiles[k] = -1;
}

// Sentinels into [lo, hi) of row r (lo anywhere; int4 stores between 16-byte boundaries where
// `vec`), threads from `from` by `step`.
__device__ __forceinline__ void fill_row_span(const Problem& p, int r, int lo, int hi, bool vec,
                                              int from, int step) {
  int* row = p.sorted_ids + (long long)r * p.sorted_pitch;
  const int lo4 = vec ? min(hi, (lo + 3) & ~3) : hi, hi4 = vec ? max(lo4, hi & ~3) : hi;
#pragma unroll 1
  for (int k = lo + from; k < lo4; k += step) row[k] = p.numel;
  const int4 sentinel = make_int4(p.numel, p.numel, p.numel, p.numel);
#pragma unroll 1
  for (int k = (lo4 >> 2) + from; k < (hi4 >> 2); k += step)
    reinterpret_cast<int4*>(row)[k] = sentinel;
#pragma unroll 1
  for (int k = hi4 + from; k < hi; k += step) row[k] = p.numel;
}

// fill(r, from, step) for every written row, the threads from `from` by `step`. Short rows:
// a group of nwarps / rows warps a row (one warp a row when rows >= nwarps); all rows in
// every thread would leave most threads idle on every row.
template <typename Fill>
__device__ __forceinline__ void for_written_rows(const Problem& p, const unsigned char* processed,
                                                 bool short_rows, Fill fill) {
  const int tid = threadIdx.x, warp = tid >> 5, nwarps = blockDim.x >> 5;
  if (short_rows) {
    const int group = p.rows >= nwarps ? 1 : nwarps / p.rows;
    const int row0 = warp / group;  // a last, incomplete group gets row0 >= rows: it idles
#pragma unroll 1
    for (int r = row0; r < p.rows; r += nwarps / group)
      if (row_written(p, processed, r)) fill(r, tid - row0 * group * 32, 32 * group);
  } else {
#pragma unroll 1
    for (int r = 0; r < p.rows; ++r)
      if (row_written(p, processed, r)) fill(r, tid, (int)blockDim.x);
  }
}

// Bucket b's tiles [tile0, tile0 + tiles) of row r that fall in `part` get its expert id
// (mapped when map_mode == 2).
__device__ __forceinline__ void write_tiles_part(const Problem& p, int r, int b, int tile0,
                                                 int tiles, RowPart part) {
  const int t0 = max(tile0, part.lo), t1 = min(tile0 + tiles, part.hi);
  if (t0 >= t1) return;  // (no load of the map for an empty range)
  int value = b - r * p.num_experts;
  if (p.map_mode == 2) value = p.expert_map[value];
  int* tile = p.expert_ids + (long long)r * p.expert_pitch;
#pragma unroll 1
  for (int k = t0; k < t1; ++k) tile[k] = value;
}

// PER: buckets a thread, a compile-time count so the one-bucket version carries no loop or
// guard for the others. This is slice `slice` of `slices` (see RowPart).
template <typename IdT, int PER, bool DET>
__device__ __forceinline__ void align_tiny_buckets(const Problem& p, int slice, int slices,
                                                   int stamp_as) {
  __shared__ int warp_sums[32];
  const int nb = num_buckets(p), tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  const int first = tid * PER;  // buckets [first, first + PER) are this thread's
  unsigned char* processed = dynamic_smem;
  int* starts = reinterpret_cast<int*>(dynamic_smem + row_region_bytes(p.rows));
  // DET: routes a lane (1, 2 or 4, so log2 is items >> 1), warps holding routes, counters.
  const int bd = blockDim.x;
  const int items = !DET ? TINY_ITEMS : p.numel <= bd ? 1 : p.numel <= 2 * bd ? 2 : 4;
  const int route_warps = DET ? (p.numel + (32 << (items >> 1)) - 1) >> (5 + (items >> 1)) : 0;
  const int stride = (nb + 1) & ~1;
  unsigned short* warp_counts = reinterpret_cast<unsigned short*>(starts + nb + 1);
  const auto route_index = [&](int j) {
    return DET ? (j < items ? (warp * items + j) * 32 + lane : p.numel) : j * bd + tid;
  };
  MLA_STAMP(stamp_as, 0);
  Route route[TINY_ITEMS];
#pragma unroll
  for (int j = 0; j < TINY_ITEMS; ++j) route[j] = load_route<IdT>(p, route_index(j), p.numel);
  if (DET) {  // the counts come from the warp counters, which start at zero
    unsigned* words = reinterpret_cast<unsigned*>(warp_counts);
#pragma unroll 1
    for (int k = tid; k < (route_warps * stride) >> 1; k += bd) words[k] = 0;
  } else {
#pragma unroll
    for (int q = 0; q < PER; ++q)
      if (q * bd + tid < nb) starts[q * bd + tid] = 0;
  }
  mark_processed_rows(p, processed);
  // The sentinel fill of every written row (this slice's part), and -1 in all its tiles:
  // fire-and-forget stores that drain while the block counts (routes and tile owners
  // overwrite them after the barriers below, so nothing is left to write past the totals at
  // the end). A free-order spread fills its rows after the scan instead.
  const bool vec = ((p.sorted_pitch & 3) == 0) &&
                   ((reinterpret_cast<unsigned long long>(p.sorted_ids) & 15) == 0);
  const RowPart part = row_part(p.padded_len, vec ? 4 : 1, slice, slices);
  const RowPart tile_part = row_part(p.num_tiles, 1, slice, slices);
  const int part_len = part.hi - part.lo;
  const bool late = !DET && slices > 1;  // free-order spread: the fill waits for the scan
  const bool short_rows = p.rows > 1 && 2 * (vec ? part_len >> 2 : part_len) <= (int)blockDim.x;
  if (!late)
    for_written_rows(p, processed, short_rows, [&](int r, int from, int step) {
      fill_row_part(p, r, part, vec, from, step);
    });
  if (slices == 1) {
    fill_tile_ids(p, processed, tid, blockDim.x);
  } else {
#pragma unroll 1
    for (int r = 0; r < p.rows; ++r)
      if (row_written(p, processed, r)) fill_tiles_part(p, r, tile_part, tid, blockDim.x);
  }
  MLA_STAMP(stamp_as, 1);

  int bucket[TINY_ITEMS], rank[TINY_ITEMS];
#pragma unroll
  for (int j = 0; j < TINY_ITEMS; ++j) {
    const int i = route_index(j);
    bucket[j] = bucket_of(p, route[j], processed);
    if (p.scatter_idx != nullptr && i < p.numel && slice == 0)
      p.scatter_idx[i] = bucket[j] >= 0 ? i : -1;
    if (!DET) rank[j] = claim(starts, bucket[j]);
    else if (j < items)
      rank[j] = claim_in_lane_order(warp_counts + warp * stride, bucket[j], bucket_bits(nb));
  }
  __syncthreads();
  MLA_STAMP(stamp_as, 2);

  // Padded exclusive scan, this thread's buckets in this thread: warp scan of the threads'
  // sums, then every warp scans the warp totals itself (no serial phase of warp 0).
  int padded[PER], count[PER], sum = 0;
#pragma unroll
  for (int q = 0; q < PER; ++q) {
    const int b = first + q;
    count[q] = b >= nb ? 0
               : DET ? prefix_over_warps(warp_counts + b, stride, route_warps) : starts[b];
    padded[q] = b < nb ? padded_count(p, count[q]) : 0;
    sum += padded[q];
  }
  const int x = warp_inclusive_sum(sum);
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  const int w = warp_inclusive_sum(lane < nwarps ? warp_sums[lane] : 0);
  const int before = __shfl_sync(MLA_FULL_MASK, w, (warp + 31) & 31);  // warps before this one
  const int total = __shfl_sync(MLA_FULL_MASK, w, nwarps - 1);
  int start[PER];
  start[0] = x - sum + (warp > 0 ? before : 0);
#pragma unroll
  for (int q = 1; q < PER; ++q) start[q] = start[q - 1] + padded[q - 1];
#pragma unroll
  for (int q = 0; q < PER; ++q)  // each thread overwrites only the counts it read
    if (first + q < nb) starts[first + q] = start[q];
  if (tid == 0) starts[nb] = total;
  __syncthreads();
  MLA_STAMP(stamp_as, 3);

#pragma unroll
  for (int j = 0; j < TINY_ITEMS; ++j) {
    if (bucket[j] < 0) continue;
    const int b = bucket[j], row = row_of(p, b);
    const int segment = starts[b] - starts[row * p.num_experts];
    const int at = segment + (DET ? rank[j] + warp_counts[warp * stride + b] : rank[j]);
    if (part.holds(late ? segment : at))
      p.sorted_ids[(long long)row * p.sorted_pitch + at] = route_index(j);
  }
  if (late) {  // the pads of this thread's buckets and the rows' tails, where in this part
#pragma unroll
    for (int q = 0; q < PER; ++q) {
      if (padded[q] == count[q]) continue;
      const int row = row_of(p, first + q);
      const int pads = start[q] - starts[row * p.num_experts] + count[q];  // the first pad
      int* out = p.sorted_ids + (long long)row * p.sorted_pitch;
#pragma unroll 1
      for (int k = max(pads, part.lo); k < min(pads + padded[q] - count[q], part.hi); ++k)
        out[k] = p.numel;
    }
    for_written_rows(p, processed, short_rows, [&](int r, int from, int step) {  // the tails
      const int row_total = starts[(r + 1) * p.num_experts] - starts[r * p.num_experts];
      fill_row_span(p, r, max(part.lo, row_total), part.hi, vec, from, step);
    });
  }
  // Tiles of this thread's buckets (only processed rows have counts).
#pragma unroll
  for (int q = 0; q < PER; ++q) {
    if (padded[q] == 0) continue;
    const int b = first + q, row = row_of(p, b);
    write_tiles_part(p, row, b,
                     fast_div(start[q] - starts[row * p.num_experts], p.block_magic, p.block_shift),
                     fast_div(padded[q], p.block_magic, p.block_shift), tile_part);
  }
  if (slice == 0) write_totals(p, processed, starts);
  MLA_STAMP(stamp_as, 4);
#ifdef MLA_PROBE
  __syncthreads();
  MLA_STAMP(stamp_as, 5);
#endif
}

// ---------------------------------------------------------------------------------------------
// At most p.warp_max_routes (WARP_ROUTES at most) routes and 32 rows (decode): warp 0 holds
// a route a lane and works out every position with ballots and shuffles (no shared memory,
// no atomics, no scan over the buckets), while the block issues the sentinel fill of the
// written rows (each warp reads the processed rows itself, so the fill waits for no
// barrier). One barrier orders the fill before the stores that overwrite it. align_tiny's
// chain has four barriers, the shared atomics and a scan over every bucket. Ranks follow the
// lane order, which is the flat index, so the result is the deterministic one as well.
#define WARP_ROUTES 32

// A base alignment: one row, always processed. (A LoRA call without tokens has no token
// slots either, but may list its slots or disable adapters, and has a row per slot.)
__device__ __forceinline__ bool base_problem(const Problem& p) {
  return p.rows == 1 && p.token_slot == nullptr && p.lora_ids == nullptr &&
         p.adapter_enabled == nullptr;
}

// BASE: a base_problem, compiled apart so the row arithmetic folds away (the general
// instance cost a base decode call 0.2 to 0.3 us).
template <typename IdT, bool BASE>
__device__ __forceinline__ void align_warp(const Problem& p, int stamp_as) {
  const int tid = threadIdx.x, lane = tid & 31, E = p.num_experts;
  const int rows = BASE ? 1 : p.rows;
  MLA_STAMP(stamp_as, 0);
  Route route{-1, 0};
  if (tid < 32) route = load_route<IdT>(p, lane, p.numel);
  const RowBits processed = BASE ? RowBits{1u} : processed_row_bits(p);
  // The fill of every written row and of its tiles (fire-and-forget; overwritten after the
  // barrier by the routes and the tiles' owners).
  const bool vec = (BASE || (p.sorted_pitch & 3) == 0) &&
                   ((reinterpret_cast<unsigned long long>(p.sorted_ids) & 15) == 0);
#pragma unroll 1
  for (int r = 0; r < rows; ++r) {
    if (!processed[r] && !p.fill_unprocessed) continue;
    fill_row_part(p, r, RowPart{0, p.padded_len}, vec, tid, blockDim.x);
    fill_tiles_part(p, r, RowPart{0, p.num_tiles}, tid, blockDim.x);
  }
  MLA_STAMP(stamp_as, 1);

  int bucket = -1, rank = 0, padded = 0, start = 0, total = 0;
  if (tid < 32) {
    bucket = bucket_of(p, route, processed);
    if (p.scatter_idx != nullptr && lane < p.numel) p.scatter_idx[lane] = bucket >= 0 ? lane : -1;
    const unsigned active = __ballot_sync(MLA_FULL_MASK, bucket >= 0);
    const unsigned peers = same_bucket_lanes(active, bucket, bucket_bits(BASE ? E : num_buckets(p)));
    rank = __popc(peers & lanemask_lt());
    // The first lane of each bucket carries its padded count.
    if (bucket >= 0 && rank == 0) padded = padded_count(p, __popc(peers));
    MLA_STAMP(stamp_as, 2);
    // A segment starts after the padded counts of the buckets below it in its row; lane r
    // sums row r's. Every lane's pair is read, unrolled: the shuffles are independent, so
    // they pipeline (a loop over the first lanes only paid a shuffle round trip per distinct
    // bucket: +0.5 us at 32 routes).
    const int row_first = BASE || bucket < 0 ? 0 : row_of(p, bucket) * E;
    const int mine_lo = lane * E, mine_hi = mine_lo + E;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int bucket_j = __shfl_sync(MLA_FULL_MASK, bucket, j);
      const int padded_j = __shfl_sync(MLA_FULL_MASK, padded, j);
      start += bucket_j < bucket && (BASE || bucket_j >= row_first) ? padded_j : 0;
      total += BASE || (bucket_j >= mine_lo && bucket_j < mine_hi) ? padded_j : 0;
    }
  }
  __syncthreads();
  MLA_STAMP(stamp_as, 3);
  if (tid < 32) {
    if (bucket >= 0) {
      const int r = BASE ? 0 : row_of(p, bucket);
      p.sorted_ids[(long long)r * p.sorted_pitch + start + rank] = lane;
      if (padded != 0) {
        int value = bucket - r * E;
        if (p.map_mode == 2) value = p.expert_map[value];
        int* tile = p.expert_ids + (long long)r * p.expert_pitch +
                    fast_div(start, p.block_magic, p.block_shift);
        const int tiles = fast_div(padded, p.block_magic, p.block_shift);
#pragma unroll 1
        for (int k = 0; k < tiles; ++k) tile[k] = value;
      }
    }
    if (lane < rows) {
      if (processed[lane]) p.num_post_pad[lane] = total;
      else if (p.fill_unprocessed) p.num_post_pad[lane] = 0;
    }
  }
  MLA_STAMP(stamp_as, 4);
#ifdef MLA_PROBE
  __syncthreads();
  MLA_STAMP(stamp_as, 5);
#endif
}

// ---------------------------------------------------------------------------------------------
// Up to p.ballot_max_routes routes (at most BALLOT_WARPS warps of 32) and 32 rows (decode),
// above the one-warp path's p.warp_max_routes: ranks and segment starts from ballots alone,
// no atomics and no scan over the buckets.
// Route i sits in lane i % 32 of warp i / 32. Each warp publishes the ballots of its buckets'
// bits; a lane then compares its bucket against every warp's lanes, bit by bit from the top
// (compare_lanes), which gives the lanes holding the same bucket (the count and the rank, in
// flat order) and those holding a smaller one. The first route of each bucket publishes its
// tile count bit by bit, and a segment starts after the tiles of the smaller buckets: the
// popcounts of the smaller lanes' tile bits. Two barriers, against align_tiny's four and its
// scan over every bucket. Ranks follow the flat index, so the result is the deterministic one
// as well. Meanwhile the block issues the sentinel fill of the written rows, which the
// barriers order before the stores that overwrite it.
// Dynamic shared memory: BALLOT_WORDS unsigned a warp holding routes (the row region is not
// used: rows come from processed_row_bits).
#define BALLOT_WARPS 16
#define BALLOT_BUCKET_BITS 13   // bucket ids below 8192 (align_tiny: at most 4096 buckets)
#define BALLOT_TILE_BITS 10     // a bucket's tiles <= its routes <= 32 * BALLOT_WARPS = 512
#define BALLOT_WORDS 32         // a warp's words: bucket bits [0, 13), active lanes at 13,
#define BALLOT_ACTIVE 13        //   tile bits from BALLOT_TILES
#define BALLOT_TILES 16

// Lanes of one warp's published ballots holding a bucket below x (lt) and equal to x (eq).
struct LaneSplit {
  unsigned lt, eq;
};
__device__ __forceinline__ LaneSplit compare_lanes(const unsigned* words, int nbits, int x) {
  unsigned lt = 0, eq = words[BALLOT_ACTIVE];
#pragma unroll 4
  for (int k = nbits - 1; k >= 0; --k) {
    const unsigned set = words[k], want = (x >> k) & 1 ? MLA_FULL_MASK : 0u;
    lt |= eq & ~set & want;
    eq &= ~(set ^ want);
  }
  return {lt, eq};
}

// Tiles of the first routes of buckets among `lanes` of one warp (its published tile bits).
__device__ __forceinline__ int tiles_of_lanes(const unsigned* words, int tbits, unsigned lanes) {
  int sum = 0;
#pragma unroll 2
  for (int m = 0; m < tbits; ++m) sum += __popc(lanes & words[BALLOT_TILES + m]) << m;
  return sum;
}

// The published bits `value`'s lanes hold, nbits of them, stored from word `first` on: lane k
// keeps ballot k and writes it (one store a lane).
__device__ __forceinline__ void publish_bits(unsigned* words, int first, int nbits, int value,
                                             int lane) {
  unsigned kept = 0;
#pragma unroll 4
  for (int k = 0; k < nbits; ++k) {
    const unsigned set = __ballot_sync(MLA_FULL_MASK, (value >> k) & 1);
    if (lane == k) kept = set;
  }
  if (lane < nbits) words[first + lane] = kept;
}

// BASE: a base_problem, compiled apart so the row arithmetic folds away. This is slice
// `slice` of `slices` (see RowPart).
template <typename IdT, bool BASE>
__device__ __forceinline__ void align_ballot(const Problem& p, int slice, int slices,
                                             int stamp_as) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, E = p.num_experts;
  const int rows = BASE ? 1 : p.rows;
  const int warps = max(1, (p.numel + 31) >> 5);  // warps holding routes; warp 0 always
  unsigned* words = reinterpret_cast<unsigned*>(dynamic_smem);
  unsigned* mine = words + warp * BALLOT_WORDS;
  MLA_STAMP(stamp_as, 0);
  Route route{-1, 0};
  if (warp < warps) route = load_route<IdT>(p, tid, p.numel);
  const RowBits processed = BASE ? RowBits{1u} : processed_row_bits(p);
  // The fill of every written row and of its tiles (fire-and-forget; overwritten after a
  // barrier by the routes and the tiles' owners).
  const bool vec = (BASE || (p.sorted_pitch & 3) == 0) &&
                   ((reinterpret_cast<unsigned long long>(p.sorted_ids) & 15) == 0);
  const RowPart part = row_part(p.padded_len, vec ? 4 : 1, slice, slices);
  const RowPart tile_part = row_part(p.num_tiles, 1, slice, slices);
#pragma unroll 1
  for (int r = 0; r < rows; ++r) {
    if (!processed[r] && !p.fill_unprocessed) continue;
    fill_row_part(p, r, part, vec, tid, blockDim.x);
    fill_tiles_part(p, r, tile_part, tid, blockDim.x);
  }
  MLA_STAMP(stamp_as, 1);

  const int nbits = bucket_bits(BASE ? E : num_buckets(p));
  const int max_tiles = fast_div(p.numel + p.block_size - 1, p.block_magic, p.block_shift);
  const int tbits = 32 - __clz(max_tiles);  // a bucket's tile count fits these bits
  int bucket = -1, rank = 0, tiles = 0;
  if (warp < warps) {
    bucket = bucket_of(p, route, processed);
    if (p.scatter_idx != nullptr && tid < p.numel && slice == 0)
      p.scatter_idx[tid] = bucket >= 0 ? tid : -1;
    const unsigned active = __ballot_sync(MLA_FULL_MASK, bucket >= 0);
    publish_bits(mine, 0, nbits, bucket, lane);
    if (lane == 0) mine[BALLOT_ACTIVE] = active;
  }
  __syncthreads();
  MLA_STAMP(stamp_as, 2);
  // Loops over the warps stay rolled: unrolled (cfcdeee) they cost about 0.6 us a warp of
  // routes, most likely each copy's code fetched cold (the kernel's code halved rolled).
  if (warp < warps) {
    int count = 0;
#pragma unroll 1
    for (int w = 0; w < warps; ++w) {
      const unsigned same = compare_lanes(words + w * BALLOT_WORDS, nbits, bucket).eq;
      count += __popc(same);
      if (w < warp) rank += __popc(same);
      else if (w == warp) rank += __popc(same & lanemask_lt());
    }
    // The first route of each bucket carries its tile count.
    if (bucket >= 0 && rank == 0)
      tiles = fast_div(count + p.block_size - 1, p.block_magic, p.block_shift);
    publish_bits(mine, BALLOT_TILES, tbits, tiles, lane);
  }
  __syncthreads();  // also orders the fill before the stores below
  MLA_STAMP(stamp_as, 3);
  int start = 0, row_first = 0, row_tiles = 0;  // in tiles
  if (warp < warps) {
    // Lane r (LoRA): tiles of the rows below row r; a route's row start comes from its row's
    // lane, and row r's tiles are the next row's start less its own.
    int rows_below = 0, all = 0;
#pragma unroll 1
    for (int w = 0; w < warps; ++w) {
      const unsigned* ws = words + w * BALLOT_WORDS;
      start += tiles_of_lanes(ws, tbits, compare_lanes(ws, nbits, bucket).lt);
      if (!BASE) rows_below += tiles_of_lanes(ws, tbits, compare_lanes(ws, nbits, lane * E).lt);
      all += tiles_of_lanes(ws, tbits, MLA_FULL_MASK);
    }
    if (BASE) {
      row_tiles = all;
    } else {
      row_first = __shfl_sync(MLA_FULL_MASK, rows_below, bucket >= 0 ? row_of(p, bucket) : 0);
      const int next = __shfl_sync(MLA_FULL_MASK, rows_below, (lane + 1) & 31);
      row_tiles = (lane + 1 < rows ? next : all) - rows_below;
    }
  }
  if (warp < warps) {
    if (bucket >= 0) {
      const int r = BASE ? 0 : row_of(p, bucket);
      const int tile0 = start - row_first, at = tile0 * p.block_size + rank;
      if (part.holds(at)) p.sorted_ids[(long long)r * p.sorted_pitch + at] = tid;
      write_tiles_part(p, r, bucket, tile0, tiles, tile_part);
    }
    if (warp == 0 && lane < rows && slice == 0) {
      if (processed[lane]) p.num_post_pad[lane] = row_tiles * p.block_size;
      else if (p.fill_unprocessed) p.num_post_pad[lane] = 0;
    }
  }
  MLA_STAMP(stamp_as, 4);
#ifdef MLA_PROBE
  __syncthreads();
  MLA_STAMP(stamp_as, 5);
#endif
}

// The dispatcher keeps nb <= TINY_BUCKETS * blockDim, and gives the launch more than one
// block (slices, see RowPart) only where its output is large and the one-warp path does not
// take it.
template <typename IdT, bool DET>
__device__ __forceinline__ void align_tiny_block(const Problem& p, int slice, int slices,
                                                 int stamp_as = 0) {
  // A limit of 0 turns its path off (for no routes too).
  const bool warp_path = p.warp_max_routes > 0 && p.numel <= p.warp_max_routes && p.rows <= 32;
  if (warp_path) {
    if (slice > 0) return;  // (the dispatcher gives the one-warp path one block)
    if (base_problem(p)) align_warp<IdT, true>(p, stamp_as);
    else align_warp<IdT, false>(p, stamp_as);
  } else if (p.ballot_max_routes > 0 && p.numel <= p.ballot_max_routes &&
             p.numel <= (int)blockDim.x && p.rows <= 32 &&
             bucket_bits(num_buckets(p)) <= BALLOT_BUCKET_BITS) {
    if (base_problem(p)) align_ballot<IdT, true>(p, slice, slices, stamp_as);
    else align_ballot<IdT, false>(p, slice, slices, stamp_as);
  } else if (num_buckets(p) > (int)blockDim.x) {
    align_tiny_buckets<IdT, TINY_BUCKETS, DET>(p, slice, slices, stamp_as);
  } else {
    align_tiny_buckets<IdT, 1, DET>(p, slice, slices, stamp_as);
  }
}

// (1024, 1): with (1024) alone NVRTC 13.0 gave align_tiny<short> 32 registers on sm_80, and spills.
template <typename IdT, bool DET>
__global__ void __launch_bounds__(1024, 1) align_tiny(const Problem p) {
#ifdef MLA_TWICE
  // Probe only: the same alignment twice in each block through the same instructions (a
  // rolled loop; the stamps of the second pass in kernel slot 1), so what the first pass
  // loses to cold instruction caches shows as a faster second pass.
#pragma unroll 1
  for (int pass = 0; pass < 2; ++pass) {
    __syncthreads();
    align_tiny_block<IdT, DET>(p, blockIdx.x, gridDim.x, pass);
  }
#else
  align_tiny_block<IdT, DET>(p, blockIdx.x, gridDim.x);
#endif
}

// Base and LoRA alignment in one launch: block 0 aligns `first` (base), the others `second`
// (LoRA), its writes spread over them as an align_tiny launch of its own would spread them.
template <typename IdT, bool DET>
__global__ void __launch_bounds__(1024, 1) align_tiny_pair(const Problem first, const Problem second) {
  const bool base = blockIdx.x == 0;
  align_tiny_block<IdT, DET>(base ? first : second, base ? 0 : blockIdx.x - 1,
                             base ? 1 : gridDim.x - 1);
}
