// Alignment kernels: one launch for small inputs, two (count, place) for large ones.
// Small inputs: align_single (one block; align_tiny where every bucket has its own thread);
// align_pair (align_tiny_pair) runs a base and a LoRA alignment in one launch of two blocks.
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
  const int per_warp = ((p.numel + nwarps - 1) / nwarps + 31) & ~31;
  const int lo = min(p.numel, warp * per_warp), hi = min(p.numel, lo + per_warp);
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
    for (int b = threadIdx.x; b < nb; b += blockDim.x) {
      int run = 0;
      for (int w = 0; w < nwarps; ++w) {
        const int c = warp_counts[w * stride + b];
        warp_counts[w * stride + b] = (unsigned short)run;
        run += c;
      }
      starts[b] = run;
    }
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
// instead of a binary search per tile, and every fill issued before counting.
// DET: ranks in flat-index order. Warp w owns routes [w * items * 32, (w + 1) * items * 32),
// items = 1, 2 or 4 routes a lane (the fewest that cover the routes); ranks within the warp
// come in lane order (claim_in_lane_order into the warp's own counters), and each bucket's
// thread turns its column of warp counts into a prefix over the warps before the scan.
// After the row region: starts[nb + 1] ints (counts first, then the padded scan in place) |
// DET: warp_counts[route_warps * stride] ushort, stride = nb rounded up to even.
#define TINY_ITEMS 4
#define TINY_BUCKETS 4

// Deterministic counts of one bucket: its column of the warps' counters (stride apart) becomes
// the exclusive prefix over the warps, and the total comes back. Loads are issued eight at a
// time, ahead of the stores, so the column costs a few round trips, not one a warp.
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

// PER: buckets a thread, a compile-time count so the one-bucket version carries no loop or
// guard for the others.
template <typename IdT, int PER, bool DET>
__device__ __forceinline__ void align_tiny_buckets(const Problem& p) {
  __shared__ int warp_sums[32];
  const int nb = num_buckets(p), E = p.num_experts, tid = threadIdx.x;
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
  MLA_STAMP(0, 0);
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
  // The sentinel fill of every written row, and -1 in all its tiles: fire-and-forget stores
  // that drain while the block counts (routes and tile owners overwrite them after the
  // barriers below, so nothing is left to write past the totals at the end).
  const int4 sentinel = make_int4(p.numel, p.numel, p.numel, p.numel);
  const bool vec = ((p.sorted_pitch & 3) == 0) &&
                   ((reinterpret_cast<unsigned long long>(p.sorted_ids) & 15) == 0);
  const int units = vec ? (p.padded_len >> 2) : 0;
  const auto fill_row = [&](int r, int from, int step) {
    if (!row_written(p, processed, r)) return;
    int* row = p.sorted_ids + (long long)r * p.sorted_pitch;
#pragma unroll 1
    for (int k = from; k < units; k += step) reinterpret_cast<int4*>(row)[k] = sentinel;
#pragma unroll 1
    for (int k = 4 * units + from; k < p.padded_len; k += step) row[k] = p.numel;
  };
  if (p.rows > 1 && 2 * (vec ? units : p.padded_len) <= (int)blockDim.x) {
    // Short rows: a group of nwarps / rows warps fills each (one warp a row when rows >=
    // nwarps); all rows in every thread would leave most threads idle on every row.
    const int group = p.rows >= nwarps ? 1 : nwarps / p.rows;
    const int row0 = warp / group;  // a last, incomplete group gets row0 >= rows: it idles
#pragma unroll 1
    for (int r = row0; r < p.rows; r += nwarps / group)
      fill_row(r, tid - row0 * group * 32, 32 * group);
  } else {
#pragma unroll 1
    for (int r = 0; r < p.rows; ++r) fill_row(r, tid, blockDim.x);
  }
  // Tiles as one flat range over the rows (few per row).
#pragma unroll 1
  for (int k = tid; k < p.rows * p.num_tiles; k += blockDim.x) {
    const int r = fast_div(k, p.tiles_magic, p.tiles_shift);
    if (row_written(p, processed, r))
      p.expert_ids[(long long)r * p.expert_pitch + (k - r * p.num_tiles)] = -1;
  }
  MLA_STAMP(0, 1);

  int bucket[TINY_ITEMS], rank[TINY_ITEMS];
#pragma unroll
  for (int j = 0; j < TINY_ITEMS; ++j) {
    const int i = route_index(j);
    bucket[j] = bucket_of(p, route[j], processed);
    if (p.scatter_idx != nullptr && i < p.numel) p.scatter_idx[i] = bucket[j] >= 0 ? i : -1;
    if (!DET) rank[j] = claim(starts, bucket[j]);
    else if (j < items)
      rank[j] = claim_in_lane_order(warp_counts + warp * stride, bucket[j], bucket_bits(nb));
  }
  __syncthreads();
  MLA_STAMP(0, 2);

  // Padded exclusive scan, this thread's buckets in this thread: warp scan of the threads'
  // sums, then every warp scans the warp totals itself (no serial phase of warp 0).
  int padded[PER], sum = 0;
#pragma unroll
  for (int q = 0; q < PER; ++q) {
    const int b = first + q;
    const int count = b >= nb ? 0
                      : DET ? prefix_over_warps(warp_counts + b, stride, route_warps) : starts[b];
    padded[q] = b < nb ? padded_count(p, count) : 0;
    sum += padded[q];
  }
  int x = sum;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int y = __shfl_up_sync(MLA_FULL_MASK, x, d);
    if (lane >= d) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  int w = lane < nwarps ? warp_sums[lane] : 0;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int y = __shfl_up_sync(MLA_FULL_MASK, w, d);
    if (lane >= d) w += y;
  }
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
  MLA_STAMP(0, 3);

#pragma unroll
  for (int j = 0; j < TINY_ITEMS; ++j) {
    if (bucket[j] < 0) continue;
    const int r = DET ? rank[j] + warp_counts[warp * stride + bucket[j]] : rank[j];
    p.sorted_ids[output_index(p, starts, bucket[j], r)] = route_index(j);
  }
  // Tiles of this thread's buckets (only processed rows have counts).
#pragma unroll
  for (int q = 0; q < PER; ++q) {
    if (padded[q] == 0) continue;
    const int b = first + q, r = row_of(p, b);
    int value = b - r * E;
    if (p.map_mode == 2) value = p.expert_map[value];
    int* tile = p.expert_ids + (long long)r * p.expert_pitch +
                fast_div(start[q] - starts[r * E], p.block_magic, p.block_shift);
    const int n = fast_div(padded[q], p.block_magic, p.block_shift);
#pragma unroll 1
    for (int k = 0; k < n; ++k) tile[k] = value;
  }
  write_totals(p, processed, starts);
  MLA_STAMP(0, 4);
#ifdef MLA_PROBE
  __syncthreads();
  MLA_STAMP(0, 5);
#endif
}

// The dispatcher keeps nb <= TINY_BUCKETS * blockDim.
template <typename IdT, bool DET>
__device__ __forceinline__ void align_tiny_block(const Problem& p) {
  if (num_buckets(p) > (int)blockDim.x) align_tiny_buckets<IdT, TINY_BUCKETS, DET>(p);
  else align_tiny_buckets<IdT, 1, DET>(p);
}

// (1024, 1): with (1024) alone NVRTC 13.0 gave align_tiny<short> 32 registers on sm_80, and spills.
template <typename IdT, bool DET>
__global__ void __launch_bounds__(1024, 1) align_tiny(const Problem p) {
  align_tiny_block<IdT, DET>(p);
}

// Base and LoRA alignment in one launch of two tiny blocks (block 0: `first`).
template <typename IdT, bool DET>
__global__ void __launch_bounds__(1024, 1) align_tiny_pair(const Problem first, const Problem second) {
  align_tiny_block<IdT, DET>(blockIdx.x == 0 ? first : second);
}

// ---------------------------------------------------------------------------------------------
// Multi-block, stage 1: count every chunk; the last block to finish scans the counts into
// segment starts, writes the totals and leaves the scratch zeroed for next time; every block
// then writes its share of the sentinel fill (after the ticket, so the fill's stores do not
// hold up the threadfence on the way to it). Blocks past the last chunk only fill.
// After the row region: SHARED: hist[nb + 1] | DET: hist[range_width] | GLOBAL: nothing.
template <typename IdT, int MODE>
__global__ void align_count(const Problem p) {
  __shared__ int warp_sums[32];
  __shared__ bool is_last;
  const int nb = num_buckets(p);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int chunk = blockIdx.x, lo_b = 0, hi_b = nb;
  if (MODE == MODE_DETERMINISTIC) {
    chunk = blockIdx.x / p.ranges;
    lo_b = (blockIdx.x - chunk * p.ranges) * p.range_width;
    hi_b = min(nb, lo_b + p.range_width);
  }
  unsigned char* processed = dynamic_smem;
  int* hist = reinterpret_cast<int*>(dynamic_smem + row_region_bytes(p.rows));
  const int hist_len = MODE == MODE_SHARED ? nb : MODE == MODE_DETERMINISTIC ? p.range_width : 0;
  const int c0 = min(p.numel, chunk * p.chunk), c1 = min(p.numel, c0 + p.chunk);
  MLA_STAMP(1, 0);

  Route first[ITEMS_PER_THREAD];  // the first load group, in flight during the set-up below
#pragma unroll
  for (int j = 0; j < ITEMS_PER_THREAD; ++j)
    first[j] = load_route<IdT>(p, c0 + j * blockDim.x + threadIdx.x, c1);
  for (int b = threadIdx.x; b < hist_len; b += blockDim.x) hist[b] = 0;
  mark_processed_rows(p, processed);
  MLA_STAMP(1, 1);

  auto count = [&](int i, Route r) {
    int b = bucket_of(p, r, processed);
    if (p.scatter_idx != nullptr && i < c1 && lo_b == 0) p.scatter_idx[i] = b >= 0 ? i : -1;
    if (MODE == MODE_GLOBAL) {
      claim(p.counts, b);
    } else {
      if (MODE == MODE_DETERMINISTIC) b = (b >= lo_b && b < hi_b) ? b - lo_b : -1;
      claim(hist, b);
    }
  };
#pragma unroll
  for (int j = 0; j < ITEMS_PER_THREAD; ++j) count(c0 + j * blockDim.x + threadIdx.x, first[j]);
  const int rest = c0 + ITEMS_PER_THREAD * blockDim.x;  // only deterministic chunks are longer
  if (rest < c1) for_routes<IdT>(p, rest + warp * 32 + lane, blockDim.x, c1, count);
  __syncthreads();
  MLA_STAMP(1, 2);
  if (MODE == MODE_SHARED) {
    // Reserve the block's range in every bucket it touches: the place kernel reads it back.
    for (int b = threadIdx.x; b < nb; b += blockDim.x)
      if (hist[b] != 0) p.chunk_hist[(long long)blockIdx.x * nb + b] = atomicAdd(p.counts + b, hist[b]);
  } else if (MODE == MODE_DETERMINISTIC) {
    for (int b = threadIdx.x; b < hi_b - lo_b; b += blockDim.x) {
      p.chunk_hist[(long long)chunk * nb + lo_b + b] = hist[b];
      if (hist[b] != 0) atomicAdd(p.counts + lo_b + b, hist[b]);
    }
  }

  // The last block to arrive sees every count (classic threadfence + ticket reduction).
  MLA_STAMP(1, 3);
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(p.ticket, 1u) == gridDim.x - 1;
  __syncthreads();
  MLA_STAMP(1, 4);
  const auto fill_share = [&] {
    fill_rows(p, processed, p.sorted_ids, p.sorted_pitch, p.padded_len, p.numel,
              blockIdx.x * blockDim.x + threadIdx.x, gridDim.x * blockDim.x);
  };
  if (!is_last) {
    fill_share();
    return;
  }
  __threadfence();
  const int E = p.num_experts;
  const int* starts = p.starts;
  if (MODE == MODE_SHARED) {
    // All counts in flight at once into shared memory, then the scan runs there.
    for (int b = threadIdx.x; b < nb; b += blockDim.x) hist[b] = __ldcg(p.counts + b);
    __syncthreads();
    scan_padded_counts(p, nb, [&](int b) { return hist[b]; }, hist, warp_sums);
    for (int b = threadIdx.x; b <= nb; b += blockDim.x) p.starts[b] = hist[b];
    starts = hist;
  } else {
    scan_padded_counts(p, nb, [&](int b) { return __ldcg(p.counts + b); }, p.starts, warp_sums);
  }
  MLA_STAMP(1, 5);
  for (int b = threadIdx.x; b < nb; b += blockDim.x) {
    p.counts[b] = 0;
    if (MODE == MODE_GLOBAL) p.cursor[b] = p.starts[b] - p.starts[row_of(p, b) * E];
  }
  if (MODE == MODE_DETERMINISTIC) {
    // Exclusive prefix over chunks of every bucket: where each chunk's routes start. When
    // buckets are fewer than threads, `parts` neighbouring lanes split a bucket's chunks.
    const int chunks = gridDim.x / p.ranges;
    int parts = 1;
    while (parts < 32 && parts * 2 * nb <= (int)blockDim.x) parts *= 2;
    const int per_part = (chunks + parts - 1) / parts, part = threadIdx.x & (parts - 1);
    const int c_lo = min(chunks, part * per_part), c_hi = min(chunks, c_lo + per_part);
    for (int first = 0; first < nb; first += blockDim.x / parts) {
      const int b = first + threadIdx.x / parts;
      int sum = 0;
      if (b < nb) {
#pragma unroll 8
        for (int c = c_lo; c < c_hi; ++c) sum += __ldcg(p.chunk_hist + (long long)c * nb + b);
      }
      int inclusive = sum;
      for (int d = 1; d < parts; d <<= 1) {
        const int y = __shfl_up_sync(MLA_FULL_MASK, inclusive, d, parts);
        if (part >= d) inclusive += y;
      }
      if (b >= nb) continue;
      int run = inclusive - sum;
      for (int c = c_lo; c < c_hi; ++c) {
        const long long k = (long long)c * nb + b;
        const int v = __ldcg(p.chunk_hist + k);
        p.chunk_hist[k] = run;
        run += v;
      }
    }
  }
  write_totals(p, processed, starts);
  if (threadIdx.x == 0) *p.ticket = 0u;
  fill_share();  // the last block's share, after the scan the place kernel waits for
#ifdef MLA_PROBE
  __syncthreads();
  MLA_STAMP(1, 6);
#endif
}

// Multi-block, stage 2: expert ids of every tile, then every route to its position.
// After the row region: SHARED: hist[nb + 1], base[nb] ints | DET: warp_counts[nwarps *
// range_width] ushort, offsets[range_width] int | then, with p.starts_in_smem, starts[nb + 1]
// ints copied from global memory so the tile search of expert_ids runs in shared memory |
// then, with p.stage_output (SHARED), value[chunk] and position[chunk] ints of the staging.
template <typename IdT, int MODE>
__global__ void align_place(const Problem p) {
  const int nb = num_buckets(p), E = p.num_experts;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
  unsigned char* processed = dynamic_smem;
  unsigned char* after_rows = dynamic_smem + row_region_bytes(p.rows);
  int* hist = reinterpret_cast<int*>(after_rows);
  unsigned short* warp_counts = reinterpret_cast<unsigned short*>(after_rows);
  int* offsets = reinterpret_cast<int*>(warp_counts + nwarps * p.range_width);
  const int head = MODE == MODE_SHARED ? 4 * (2 * nb + 1)
                   : MODE == MODE_DETERMINISTIC ? (2 * nwarps + 4) * p.range_width : 0;
  // Segment starts for the tile search: a shared copy when the host granted room for it.
  int* starts_copy = reinterpret_cast<int*>(after_rows + head);
  const bool local_starts = p.starts_in_smem != 0;

  int chunk = blockIdx.x, lo_b = 0, hi_b = nb;
  if (MODE == MODE_DETERMINISTIC) {
    chunk = blockIdx.x / p.ranges;
    lo_b = (blockIdx.x - chunk * p.ranges) * p.range_width;
    hi_b = min(nb, lo_b + p.range_width);
  }
  const int c0 = min(p.numel, chunk * p.chunk), c1 = min(p.numel, c0 + p.chunk);
  MLA_STAMP(2, 0);
  Route route[ITEMS_PER_THREAD];
  if (MODE == MODE_SHARED) {
#pragma unroll
    for (int j = 0; j < ITEMS_PER_THREAD; ++j)
      route[j] = load_route<IdT>(p, c0 + j * blockDim.x + threadIdx.x, c1);
  }
  if (local_starts)
    for (int b = threadIdx.x; b <= nb; b += blockDim.x) starts_copy[b] = p.starts[b];
  if (MODE == MODE_SHARED)
    for (int b = threadIdx.x; b < nb; b += blockDim.x) hist[b] = 0;
  if (MODE == MODE_DETERMINISTIC)
    for (int k = threadIdx.x; k < nwarps * p.range_width; k += blockDim.x) warp_counts[k] = 0;
  mark_processed_rows(p, processed);
  write_expert_ids(p, processed, local_starts ? starts_copy : p.starts,
                   blockIdx.x * blockDim.x + threadIdx.x, gridDim.x * blockDim.x);
  MLA_STAMP(2, 1);

  if (MODE == MODE_SHARED) {
    __shared__ int warp_sums[32];
    int bucket[ITEMS_PER_THREAD], rank[ITEMS_PER_THREAD];
#pragma unroll
    for (int j = 0; j < ITEMS_PER_THREAD; ++j) {
      bucket[j] = bucket_of(p, route[j], processed);
      rank[j] = claim(hist, bucket[j]);
    }
    __syncthreads();
    MLA_STAMP(2, 2);
    // Where this block's routes of each bucket start in the output (reserved by align_count).
    int* base = hist + nb + 1;
    const int* st = local_starts ? starts_copy : p.starts;
    for (int b = threadIdx.x; b < nb; b += blockDim.x) {
      if (hist[b] == 0) continue;
      const int r = row_of(p, b);
      base[b] = r * p.sorted_pitch + st[b] - st[r * E] + p.chunk_hist[(long long)blockIdx.x * nb + b];
    }
    if (!p.stage_output) {
      __syncthreads();
#pragma unroll
      for (int j = 0; j < ITEMS_PER_THREAD; ++j)
        if (bucket[j] >= 0) p.sorted_ids[base[bucket[j]] + rank[j]] = c0 + j * blockDim.x + threadIdx.x;
      return;
    }
    // Stage the routes in output order, then store runs of consecutive positions together.
    int* value = reinterpret_cast<int*>(after_rows + head + (local_starts ? 4 * (nb + 1) : 0));
    int* position = value + p.chunk;
    MLA_STAMP(2, 3);
    scan_block(nb, [&](int b) { return hist[b]; }, hist, warp_sums);  // hist := block offsets
    MLA_STAMP(2, 4);
#pragma unroll
    for (int j = 0; j < ITEMS_PER_THREAD; ++j) {
      if (bucket[j] < 0) continue;
      const int k = hist[bucket[j]] + rank[j];
      value[k] = c0 + j * blockDim.x + threadIdx.x;
      position[k] = base[bucket[j]] + rank[j];
    }
    __syncthreads();
    MLA_STAMP(2, 5);
    for (int k = threadIdx.x; k < hist[nb]; k += blockDim.x) p.sorted_ids[position[k]] = value[k];
#ifdef MLA_PROBE
    __syncthreads();
    MLA_STAMP(2, 6);
#endif
  } else if (MODE == MODE_GLOBAL) {
    for_routes<IdT>(p, c0 + warp * 32 + lane, blockDim.x, c1, [&](int i, Route r) {
      const int b = bucket_of(p, r, processed);
      const int pos = claim(p.cursor, b);
      if (b >= 0) p.sorted_ids[(long long)row_of(p, b) * p.sorted_pitch + pos] = i;
    });
  } else {
    const int width = hi_b - lo_b;
    const int per_warp = ((c1 - c0 + nwarps - 1) / nwarps + 31) & ~31;
    const int lo = min(c1, c0 + warp * per_warp), hi = min(c1, lo + per_warp);
    unsigned short* mine = warp_counts + warp * p.range_width;
    auto in_range = [&](Route r) {
      const int b = bucket_of(p, r, processed);
      return (b >= lo_b && b < hi_b) ? b - lo_b : -1;
    };
    for_routes<IdT>(p, lo + lane, 32, hi, [&](int, Route r) {
      claim(mine, in_range(r));  // totals only: order does not matter here
    });
    __syncthreads();
    for (int lb = threadIdx.x; lb < width; lb += blockDim.x) {
      const int b = lo_b + lb;
      offsets[lb] = p.starts[b] - p.starts[row_of(p, b) * E] + p.chunk_hist[(long long)chunk * nb + b];
      int run = 0;
      for (int w = 0; w < nwarps; ++w) {
        const int c = warp_counts[w * p.range_width + lb];
        warp_counts[w * p.range_width + lb] = (unsigned short)run;
        run += c;
      }
    }
    __syncthreads();
    for_routes<IdT>(p, lo + lane, 32, hi, [&](int i, Route r) {
      const int b = in_range(r);
      const int rank = claim_in_lane_order(mine, b, bucket_bits(width));
      if (b >= 0)
        p.sorted_ids[(long long)row_of(p, lo_b + b) * p.sorted_pitch + offsets[b] + rank] = i;
    });
  }
}

// ---------------------------------------------------------------------------------------------
// Multi-block in one launch (cooperative launch: every block is resident at once). Each block
// counts its chunk, reserves its range in every bucket it touches, stages its routes in output
// order, and writes its share of the sentinel fill; then one barrier over the problem's blocks;
// then every block scans all the counts itself (no second launch, no re-read of the routes) and
// stores its staged routes, its share of the tile ids, and block 0 the totals.
//
// Scratch that needs no clean-up pass: p.counts holds two count buffers (p.count_stride apart)
// used in turn. A call counts in buffer `parity` and zeroes the other, which the previous call
// left dirty, while it waits anyway. p.ticket (16-byte aligned) holds the control words:
//   [0] parity of the next call, [1 + q] dirty extent of buffer q, [4 + q] barrier arrivals
// (the first four are read in one load).
// After the row region: hist[nb + 1] | adj[nb] | starts[nb + 1] | value[chunk] | bucket_of_k[chunk]
#define COOP_ITEMS 8    // routes per thread, at most: chunk <= COOP_ITEMS * blockDim.x
#define COOP_RESERVE 4  // bucket reservations a thread has in flight at once

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Every one of `blocks` blocks waits here for all the others. The fence publishes the
// block's writes (its fill, its count atomics) before its arrival is counted.
__device__ __forceinline__ void blocks_barrier(unsigned* arrivals, unsigned blocks) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(arrivals, 1u);
    while (load_acquire(arrivals) < blocks) {
    }
  }
  __syncthreads();
}

// One alignment over blocks [0, blocks) of a cooperative launch; this is block `block`.
// DET: ranks follow the flat route index. Warp w of a block owns a contiguous run of the
// block's chunk; per-warp counters rank its routes in order (as in the single block), and the
// block's place among blocks comes from a prefix over blocks of every bucket's per-block
// counts (p.chunk_hist [blocks, nb]), computed between two barriers, instead of from the
// order in which the reservation atomics land.
// DET adds after the staging: warp_counts[32 * stride] ushort, stride = nb rounded up to even.
template <typename IdT, bool DET>
__device__ __forceinline__ void align_cooperatively(const Problem& p, int block, int blocks) {
  __shared__ int warp_sums[32];
  const int nb = num_buckets(p), E = p.num_experts;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
  const int tid = block * blockDim.x + threadIdx.x, nthreads = blocks * blockDim.x;
  unsigned char* processed = dynamic_smem;
  int* hist = reinterpret_cast<int*>(dynamic_smem + row_region_bytes(p.rows));
  int* adj = hist + nb + 1;
  int* starts = adj + nb;
  int* value = starts + nb + 1;
  int* bucket_of_k = value + p.chunk;
  const int stride = (nb + 1) & ~1;
  unsigned short* warp_counts = reinterpret_cast<unsigned short*>(bucket_of_k + p.chunk);
  const int c0 = min(p.numel, block * p.chunk), c1 = min(p.numel, c0 + p.chunk);
  MLA_STAMP(3, 0);

  Route route[COOP_ITEMS];  // in flight during the set-up below
  if (!DET) {
#pragma unroll
    for (int j = 0; j < COOP_ITEMS; ++j)
      route[j] = load_route<IdT>(p, c0 + j * blockDim.x + threadIdx.x, c1);
  }
  unsigned* ctrl = p.ticket;
  const uint4 words = __ldcg(reinterpret_cast<const uint4*>(ctrl));
  const int parity = (int)(words.x & 1u);
  int* counts = p.counts + parity * p.count_stride;
  int* stale = p.counts + (1 - parity) * p.count_stride;
  const int stale_len = (int)(parity ? words.y : words.z);
  for (int b = threadIdx.x; b < nb; b += blockDim.x) hist[b] = 0;
  if (DET)
    for (int k = threadIdx.x; k < nwarps * stride; k += blockDim.x) warp_counts[k] = 0;
  mark_processed_rows(p, processed);
  for (int k = tid; k < stale_len; k += nthreads) stale[k] = 0;
  if (tid == 0) {
    ctrl[1 + parity] = (unsigned)nb;
    ctrl[5 - parity] = 0u;  // the previous call's barrier
  }
  // Routes overwrite the fill after the barrier, which orders every fill store before them.
  fill_rows(p, processed, p.sorted_ids, p.sorted_pitch, p.padded_len, p.numel, tid, nthreads);
  MLA_STAMP(3, 1);

  int bucket[COOP_ITEMS], rank[COOP_ITEMS];
  int reserved[COOP_RESERVE];
  // DET: warp w's run of the chunk.
  const int per_warp = ((c1 - c0 + nwarps - 1) / nwarps + 31) & ~31;
  const int lo = min(c1, c0 + warp * per_warp), hi = min(c1, lo + per_warp);
  unsigned short* mine = warp_counts + warp * stride;
  if (!DET) {
#pragma unroll
    for (int j = 0; j < COOP_ITEMS; ++j) {
      const int i = c0 + j * blockDim.x + threadIdx.x;
      bucket[j] = bucket_of(p, route[j], processed);
      if (p.scatter_idx != nullptr && i < c1) p.scatter_idx[i] = bucket[j] >= 0 ? i : -1;
      rank[j] = claim(hist, bucket[j]);
    }
    __syncthreads();
    MLA_STAMP(3, 2);
    // Reserve the block's range in each of its buckets. The first COOP_RESERVE buckets of
    // each thread go out together and come back while the block scans and stages (their
    // offsets are needed only after the barrier); further ones (more than COOP_RESERVE *
    // blockDim buckets) wait here, COOP_RESERVE at a time.
#pragma unroll
    for (int u = 0; u < COOP_RESERVE; ++u) {
      const int b = threadIdx.x + u * blockDim.x;
      const int c = b < nb ? hist[b] : 0;
      reserved[u] = c != 0 ? atomicAdd(counts + b, c) : 0;
    }
    for (int b0 = threadIdx.x + COOP_RESERVE * blockDim.x; b0 < nb;
         b0 += COOP_RESERVE * blockDim.x) {
      int more[COOP_RESERVE];
#pragma unroll
      for (int u = 0; u < COOP_RESERVE; ++u) {
        const int b = b0 + u * blockDim.x;
        const int c = b < nb ? hist[b] : 0;
        more[u] = c != 0 ? atomicAdd(counts + b, c) : 0;
      }
#pragma unroll
      for (int u = 0; u < COOP_RESERVE; ++u)
        if (b0 + u * blockDim.x < nb) adj[b0 + u * blockDim.x] = more[u];
    }
  } else {
    for_routes<IdT>(p, lo + lane, 32, hi, [&](int i, Route r) {
      const int b = bucket_of(p, r, processed);
      if (p.scatter_idx != nullptr && i < hi) p.scatter_idx[i] = b >= 0 ? i : -1;
      claim(mine, b);  // totals only: order does not matter here
    });
    __syncthreads();
    MLA_STAMP(3, 2);
    // Per bucket: each warp's counter := routes of the warps before it; hist := block total,
    // published for the prefix over blocks, and added to the bucket's total.
    for (int b = threadIdx.x; b < nb; b += blockDim.x) {
      int run = 0;
      for (int w = 0; w < nwarps; ++w) {
        const int c = warp_counts[w * stride + b];
        warp_counts[w * stride + b] = (unsigned short)run;
        run += c;
      }
      hist[b] = run;
      p.chunk_hist[(long long)block * nb + b] = run;
      if (run != 0) atomicAdd(counts + b, run);
    }
    __syncthreads();
  }
  // hist := the block's own offsets of each bucket (exclusive), hist[nb] := its route count.
  scan_block(nb, [&](int b) { return hist[b]; }, hist, warp_sums);
  if (!DET) {
#pragma unroll
    for (int j = 0; j < COOP_ITEMS; ++j) {
      if (bucket[j] < 0) continue;
      const int k = hist[bucket[j]] + rank[j];
      value[k] = c0 + j * blockDim.x + threadIdx.x;
      bucket_of_k[k] = bucket[j];
    }
#pragma unroll
    for (int u = 0; u < COOP_RESERVE; ++u)
      if (threadIdx.x + u * blockDim.x < nb) adj[threadIdx.x + u * blockDim.x] = reserved[u];
  } else {
    for_routes<IdT>(p, lo + lane, 32, hi, [&](int i, Route r) {
      const int b = bucket_of(p, r, processed);
      const int k = claim_in_lane_order(mine, b, bucket_bits(nb));  // rank in the block, flat order
      if (b >= 0) {
        value[hist[b] + k] = i;
        bucket_of_k[hist[b] + k] = b;
      }
    });
  }
  MLA_STAMP(3, 3);
  blocks_barrier(ctrl + 4 + parity, (unsigned)blocks);
  if (DET) {
    // Each warp of the grid turns one bucket's column of per-block counts into exclusive
    // prefixes (in block order), then a second barrier publishes them.
    for (int b = block * nwarps + warp; b < nb; b += blocks * nwarps) {
      int carry = 0;
      for (int j0 = 0; j0 < blocks; j0 += 32) {
        const int j = j0 + lane;
        const long long at = (long long)j * nb + b;
        const int v = j < blocks ? __ldcg(p.chunk_hist + at) : 0;
        int x = v;
        for (int d = 1; d < 32; d <<= 1) {
          const int y = __shfl_up_sync(MLA_FULL_MASK, x, d);
          if (lane >= d) x += y;
        }
        if (j < blocks) p.chunk_hist[at] = carry + x - v;
        carry += __shfl_sync(MLA_FULL_MASK, x, 31);
      }
    }
    blocks_barrier(ctrl + 4 + parity, 2u * (unsigned)blocks);
  }
  MLA_STAMP(3, 4);

  for (int b = threadIdx.x; b < nb; b += blockDim.x) {
    starts[b] = __ldcg(counts + b);
    if (DET && hist[b + 1] != hist[b]) adj[b] = __ldcg(p.chunk_hist + (long long)block * nb + b);
  }
  __syncthreads();
  scan_padded_counts(p, nb, [&](int b) { return starts[b]; }, starts, warp_sums);
  if (block == 0) {
    write_totals(p, processed, starts);
    if (threadIdx.x == 0) ctrl[0] = (unsigned)(parity ^ 1);  // every block read it before the barrier
  }
  // adj[b] := where the block's route k of bucket b goes, minus k.
  for (int b = threadIdx.x; b < nb; b += blockDim.x) {
    if (hist[b + 1] == hist[b]) continue;
    const int r = row_of(p, b);
    adj[b] += r * p.sorted_pitch + starts[b] - starts[r * E] - hist[b];
  }
  __syncthreads();
  MLA_STAMP(3, 5);
  for (int k = threadIdx.x; k < hist[nb]; k += blockDim.x)
    p.sorted_ids[adj[bucket_of_k[k]] + k] = value[k];
  write_expert_ids(p, processed, starts, tid, nthreads);
#ifdef MLA_PROBE
  __syncthreads();
  MLA_STAMP(3, 6);
#endif
}

// (1024, 1): one block a SM by design; without the minimum, NVRTC 13.0 gave the deterministic
// instance 32 registers and spilled.
template <typename IdT, bool DET>
__global__ void __launch_bounds__(1024, 1) align_cooperative(const Problem p) {
  align_cooperatively<IdT, DET>(p, blockIdx.x, gridDim.x);
}

// Base and LoRA alignment in one cooperative launch: the first `first.coop_blocks` blocks
// align `first`, the rest `second`; each side has its own scratch and barrier.
template <typename IdT>
__global__ void __launch_bounds__(1024, 1) align_cooperative_pair(const Problem first,
                                                               const Problem second) {
  const int split = first.coop_blocks;
  if ((int)blockIdx.x < split) align_cooperatively<IdT, false>(first, blockIdx.x, split);
  else align_cooperatively<IdT, false>(second, blockIdx.x - split, gridDim.x - split);
}
