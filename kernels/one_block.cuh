// One-block kernels (decode sizes): align_single / align_pair, align_tiny / align_tiny_pair,
// and align_tiny_rows / align_tiny_rows_pair (a block for each LoRA row).
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
  fill_rows(p, processed, threadIdx.x, blockDim.x, false);
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
// instead of a binary search per tile, and every fill issued before counting. Large fills
// (LoRA with many slots) go to fill blocks instead (align_tiny_filled): the launch's blocks
// past the first write them, and block 0 waits for their arrivals only before its stores.
// DET: ranks in flat-index order. Warp w owns routes [w * items * 32, (w + 1) * items * 32),
// items = 1, 2 or 4 routes a lane (the fewest that cover the routes); ranks within the warp
// come in lane order (claim_in_lane_order into the warp's own counters), and each bucket's
// thread turns its column of warp counts into a prefix over the warps before the scan.
// After the row region: starts[nb + 1] ints (counts first, then the padded scan in place) |
// DET: warp_counts[route_warps * stride] ushort, stride = nb rounded up to even.
#define TINY_ITEMS 4
#define TINY_BUCKETS 4

// A base alignment: one row, always processed. (A LoRA call without tokens has no token
// slots either, but may list its slots or disable adapters, and has a row per slot.)
__device__ __forceinline__ bool base_problem(const Problem& p) {
  return p.rows == 1 && p.token_slot == nullptr && p.lora_ids == nullptr &&
         p.adapter_enabled == nullptr;
}

// The exclusive start of a thread's share of a block-wide scan: `inclusive` is the warp's
// inclusive sum up to this thread (whose own share is `own`), and sums[w] holds each warp's
// total (published by a barrier before the call). Every warp scans the warp totals itself;
// `total` gets the block's. Every thread calls it.
__device__ __forceinline__ int share_start(const int* sums, int inclusive, int own,
                                           int* total = nullptr) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int w = warp_inclusive_sum(lane < nwarps ? sums[lane] : 0);
  const int before = __shfl_sync(MLA_FULL_MASK, w, (warp + 31) & 31);
  if (total != nullptr) *total = __shfl_sync(MLA_FULL_MASK, w, nwarps - 1);
  return inclusive - own + (warp > 0 ? before : 0);
}

// align_tiny_chunked's flat-order ranks over many buckets (CHUNKED in align_tiny_buckets),
// without a counter a bucket a warp (4096 buckets x 32 warps is 256 KB). A chunk is one item
// of a warp: 32 routes in flat order, and the chunks follow the flat index too. A chunk's
// lanes of one bucket form a group (a multi-split), whose lowest lane adds the group's size
// to the bucket's count in one shared atomic: that gives the group a free-order place in its
// bucket's unpadded segment. After the scan each group leaves a record (chunk << 8 | size) at
// that place, and its leader walks its bucket's records, group to group, summing the sizes
// of earlier chunks' groups: the group's offset in flat order, to which each lane adds its
// rank in the group. A walk visits one record per group of its bucket: about one for spread
// routing, numel / 32 when every route shares a bucket. A bucket of one group has nothing to
// walk, and writes no record.
// Shared memory after the counts: raw[nb] int (unpadded starts) | sums[32] int (the raw
// scan's warp totals) | records[numel] int.
struct ChunkRanks {
  int* raw;
  int* sums;
  int* records;
  __device__ __forceinline__ ChunkRanks(int* after_counts, int nb)
      : raw(after_counts), sums(after_counts + nb), records(after_counts + nb + 32) {}
};

struct ChunkGroup {
  int leader;  // the group's lowest lane
  int size;    // its lanes
  int slot;    // on the leader: the group's free-order place in its bucket
};

// A chunk's claim: the lane's rank in its group; `g` gets the group. Every lane calls it;
// bucket < 0 is inactive (its group is unused).
__device__ __forceinline__ int claim_group(int* counts, int bucket, int nbits, ChunkGroup& g) {
  const unsigned active = __ballot_sync(MLA_FULL_MASK, bucket >= 0);
  const unsigned peers = same_bucket_lanes(active, bucket, nbits);
  g.leader = (__ffs(peers) - 1) & 31;
  g.size = __popc(peers);
  g.slot = 0;
  if (bucket >= 0 && (int)(threadIdx.x & 31) == g.leader)
    g.slot = atomicAdd(counts + bucket, g.size);
  return __popc(peers & lanemask_lt());
}

// The groups' records, a barrier, and each leader's walk; rank[j] becomes the route's rank
// in flat order within its bucket. After the scan (raw holds the unpadded starts, `routes`
// their total); every thread calls it.
__device__ __forceinline__ void rank_groups_in_flat_order(const ChunkRanks& s,
                                                          int (&rank)[TINY_ITEMS],
                                                          const int (&bucket)[TINY_ITEMS],
                                                          const ChunkGroup (&group)[TINY_ITEMS],
                                                          int items, int nb, int routes) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int first[TINY_ITEMS], end[TINY_ITEMS];  // on a leader: its bucket's records
#pragma unroll
  for (int j = 0; j < TINY_ITEMS; ++j) {
    first[j] = end[j] = 0;
    if (j < items && bucket[j] >= 0 && lane == group[j].leader) {
      const int b = bucket[j];
      first[j] = s.raw[b];
      end[j] = b + 1 < nb ? s.raw[b + 1] : routes;
      if (end[j] - first[j] == group[j].size) end[j] = first[j];  // the bucket's only group
      else s.records[first[j] + group[j].slot] = ((warp * items + j) << 8) | group[j].size;
    }
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < TINY_ITEMS; ++j) {
    if (j >= items) continue;  // the same on every lane
    const int chunk = warp * items + j;
    int before = 0;
#pragma unroll 1
    for (int at = first[j]; at < end[j];) {
      const int record = s.records[at];
      if ((record >> 8) < chunk) before += record & 255;
      at += record & 255;
    }
    rank[j] += __shfl_sync(MLA_FULL_MASK, before, group[j].leader);
  }
}

// The warp totals of align_tiny_buckets' scans. Declared here, in a function that is no
// template, it is one array for all of a kernel's instantiations (each has its own else).
__device__ __forceinline__ int* tiny_warp_sums() {
  __shared__ int sums[32];
  return sums;
}

// PER: buckets a thread, a compile-time count so the one-bucket version carries no loop or
// guard for the others. BASE: a base_problem (one row, always processed), compiled apart so
// the row arithmetic and the row flags fold away, as in align_warp's base instance.
// FILLED: the kernels whose launches may have fill blocks (align_tiny_filled and its pair);
// the others carry none of their code. STAGED (BASE in align_tiny_staged, p.stage_output
// ints of shared memory after the counters holding the row): the row is built in shared
// memory, the fill included, and stored coalesced after the scan. One SM's scattered route
// stores were the largest stage of base T=256 (r44's stamps: 3324 of 8008 cycles).
// CHUNKED (DET, align_tiny_chunked): flat-order ranks without a counter a bucket a warp,
// which many buckets cannot afford: the counts come from one atomic a chunk's group, and the
// ranks from a walk over the bucket's groups (ChunkRanks).
// ROW_BITS (LoRA calls of at most 32 rows, align_tiny_lora): the processed rows as a RowBits
// in a register that every warp works out itself, with no barrier for shared flags.
// SLOT_ROW (BASE, align_tiny_rows): `p` is row `row` of the LoRA call `lora` (its outputs'
// row, rows = 1), and its routes are those of the tokens of slot `row`. A row that the call
// does not process is left alone, or (fill_unprocessed) gets the empty alignment.
template <typename IdT, int PER, bool DET, bool BASE, bool FILLED, bool STAGED = false,
          bool CHUNKED = false, bool ROW_BITS = false, bool SLOT_ROW = false>
__device__ __forceinline__ void align_tiny_buckets(const Problem& p, const Problem* lora = nullptr,
                                                   int row = 0) {
  static_assert(!(BASE && ROW_BITS), "a base row has no row flags");
  static_assert(BASE || !SLOT_ROW, "a slot's row is aligned as a base row");
  static_assert(DET || !CHUNKED, "the chunks' ranks are deterministic mode's");
  int* const warp_sums = tiny_warp_sums();
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
  // STAGED: the row, 16-byte aligned after the counters (_dispatch.tiny_stage_entries).
  int* image = reinterpret_cast<int*>(
      dynamic_smem + ((row_region_bytes(p.rows) + 4 * (nb + 1) +
                       (DET ? 2 * route_warps * stride : 0) + 15) & ~15));
  const auto route_index = [&](int j) {
    return DET ? (j < items ? (warp * items + j) * 32 + lane : p.numel) : j * bd + tid;
  };
  // CHUNKED, after the counts: raw[nb] (unpadded starts) | sums[32] | records[numel]
  // (ChunkRanks).
  const ChunkRanks chunks(starts + nb + 1, nb);
  MLA_STAMP(0, 0);
  Route route[TINY_ITEMS];
#pragma unroll
  for (int j = 0; j < TINY_ITEMS; ++j) route[j] = load_route<IdT>(p, route_index(j), p.numel);
  // ROW_BITS: every warp works out the processed rows itself, from loads issued here and
  // combined after the barrier below, so no warp waits there for warp 0's round trip (r51's
  // stamps: one slot of T=16 reached its claims 1266 cycles after one base row).
  RowFlagLoads flag_loads{-1, -1, false};
  if (ROW_BITS) flag_loads = load_row_flags(p);
  if (SLOT_ROW) flag_loads = load_slot_flags(*lora, row);
  if (CHUNKED) {  // counts from the groups' claims
#pragma unroll
    for (int q = 0; q < PER; ++q)
      if (q * bd + tid < nb) starts[q * bd + tid] = 0;
  } else if (DET) {  // the counts come from the warp counters, which start at zero
    unsigned* words = reinterpret_cast<unsigned*>(warp_counts);
#pragma unroll 1
    for (int k = tid; k < (route_warps * stride) >> 1; k += bd) words[k] = 0;
  } else {
#pragma unroll
    for (int q = 0; q < PER; ++q)
      if (q * bd + tid < nb) starts[q * bd + tid] = 0;
  }
  if (BASE || ROW_BITS) __syncthreads();  // the counts zeroed before any claim
  else mark_processed_rows(p, processed);  // and its barrier
  bool slot_on = false;  // SLOT_ROW: the call processes this row
  if (SLOT_ROW) {
    slot_on = slot_processed(*lora, flag_loads, row);
    if (!slot_on && !p.fill_unprocessed) return;  // the whole block: nothing to write
  }
  RowBits processed_bits{1u};
  // The totals read the bits, or (deterministic instances) the shared flags they are stored
  // to here: deterministic LoRA was 1 to 4 % slower with the bits (A/B line 21).
  constexpr bool TOTALS_FROM_BITS = ROW_BITS && !DET;
  if (ROW_BITS) {
    processed_bits = row_bits(p, flag_loads);
    if (!TOTALS_FROM_BITS && tid < p.rows) processed[tid] = processed_bits[tid];
  }
  // The sentinel fill of every written row, and -1 in all its tiles: fire-and-forget stores
  // that drain while the block counts (routes and tile owners overwrite them after the
  // barriers below, so nothing is left to write past the totals at the end). With fill
  // blocks (FILLED) the launch's other blocks write it.
  const bool fills = !FILLED || p.fill_blocks == 0;
  if (STAGED) {  // the fill into the row's image; the tiles as below
    const int4 sentinel = make_int4(p.numel, p.numel, p.numel, p.numel);
    const int units = p.padded_len >> 2;
    fill_span(p, image, units, sentinel, tid, bd);
#pragma unroll 1
    for (int k = tid; k < p.num_tiles; k += bd) p.expert_ids[k] = -1;
  } else if (!fills) {
  } else if (BASE) {  // one row, always written: no row flags (not marked on this path)
    const int4 sentinel = make_int4(p.numel, p.numel, p.numel, p.numel);
    const bool vec = ((p.sorted_pitch & 3) == 0) &&
                     ((reinterpret_cast<unsigned long long>(p.sorted_ids) & 15) == 0);
    const int units = vec ? (p.padded_len >> 2) : 0;
#pragma unroll 1
    for (int k = tid; k < units; k += bd) reinterpret_cast<int4*>(p.sorted_ids)[k] = sentinel;
#pragma unroll 1
    for (int k = 4 * units + tid; k < p.padded_len; k += bd) p.sorted_ids[k] = p.numel;
#pragma unroll 1
    for (int k = tid; k < p.num_tiles; k += bd) p.expert_ids[k] = -1;
  } else {
    if (ROW_BITS) fill_rows(p, processed_bits, tid, bd, true);
    else fill_rows(p, processed, tid, bd, true);
  }
  MLA_STAMP(0, 1);

  int bucket[TINY_ITEMS], rank[TINY_ITEMS];
  ChunkGroup group[TINY_ITEMS];  // CHUNKED: each item's group
#pragma unroll
  for (int j = 0; j < TINY_ITEMS; ++j) {
    const int i = route_index(j);
    // SLOT_ROW: a route of this row's slot as slot 0 of the one-row problem
    bucket[j] = SLOT_ROW ? (slot_on && route[j].slot == row
                                ? bucket_of(p, Route{route[j].id, 0}, RowBits{1u}) : -1)
              : BASE || ROW_BITS ? bucket_of(p, route[j], processed_bits)
                                 : bucket_of(p, route[j], processed);
    if (p.scatter_idx != nullptr && i < p.numel) p.scatter_idx[i] = bucket[j] >= 0 ? i : -1;
    if (!DET) rank[j] = claim(starts, bucket[j]);
    else if (CHUNKED) {
      if (j < items) rank[j] = claim_group(starts, bucket[j], bucket_bits(nb), group[j]);
    } else if (j < items)
      rank[j] = claim_in_lane_order(warp_counts + warp * stride, bucket[j], bucket_bits(nb));
  }
  __syncthreads();
  MLA_STAMP(0, 2);

  // Padded exclusive scan, this thread's buckets in this thread: warp scan of the threads'
  // sums, then every warp scans the warp totals itself (no serial phase of warp 0).
  int padded[PER], sum = 0, count[PER], count_sum = 0;  // count: CHUNKED's unpadded scan
#pragma unroll
  for (int q = 0; q < PER; ++q) {
    const int b = first + q;
    const int c = b >= nb ? 0
                      : DET && !CHUNKED ? prefix_over_warps(warp_counts + b, stride, route_warps) : starts[b];
    padded[q] = b < nb ? padded_count(p, c) : 0;
    sum += padded[q];
    if (CHUNKED) { count[q] = c; count_sum += c; }
  }
  const int x = warp_inclusive_sum(sum);
  if (lane == 31) warp_sums[warp] = x;
  // CHUNKED: the unpadded starts share the scan's barriers.
  int x_count = 0;
  if (CHUNKED) {
    x_count = warp_inclusive_sum(count_sum);
    if (lane == 31) chunks.sums[warp] = x_count;
  }
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
  int routes = 0;  // CHUNKED: the routes that have a bucket
  if (CHUNKED) {
    int run = share_start(chunks.sums, x_count, count_sum, &routes);
#pragma unroll
    for (int q = 0; q < PER; ++q) {
      if (first + q < nb) chunks.raw[first + q] = run;
      run += count[q];
    }
  }
  if (!fills && tid == 0) {
    MLA_STAMP(0, 6);  // scanned: block 0 starts to wait for the fill blocks
    // Every fill block's stores before the ones below that overwrite them; then the count
    // goes back to zero for the next call (all fill blocks have arrived).
    while (load_acquire(p.ticket) < (unsigned)p.fill_blocks) {
    }
    *p.ticket = 0u;
  }
  __syncthreads();
  MLA_STAMP(0, 3);

  if (CHUNKED) {  // each group's offset among its bucket's earlier groups, into rank
    rank_groups_in_flat_order(chunks, rank, bucket, group, items, nb, routes);
    MLA_STAMP(0, 7);
  }
#pragma unroll
  for (int j = 0; j < TINY_ITEMS; ++j) {
    if (bucket[j] < 0) continue;  // (DET: so are the items past `items`)
    const int r = DET && !CHUNKED ? rank[j] + warp_counts[warp * stride + bucket[j]] : rank[j];
    if (STAGED) image[starts[bucket[j]] + r] = route_index(j);
    else p.sorted_ids[BASE ? starts[bucket[j]] + r : output_index(p, starts, bucket[j], r)] =
        route_index(j);
  }
  // Tiles of this thread's buckets (only processed rows have counts).
#pragma unroll
  for (int q = 0; q < PER; ++q) {
    if (padded[q] == 0) continue;
    const int tiles = fast_div(padded[q], p.block_magic, p.block_shift);
    if (BASE) {
      const int value = p.map_mode == 2 ? p.expert_map[first + q] : first + q;
      int* tile = p.expert_ids + fast_div(start[q], p.block_magic, p.block_shift);
#pragma unroll 1
      for (int k = 0; k < tiles; ++k) tile[k] = value;
    } else {
      write_bucket_tiles(p, starts, first + q, start[q], tiles);
    }
  }
  if (TOTALS_FROM_BITS) write_totals(p, processed_bits, starts);
  else if (!BASE) write_totals(p, processed, starts);
  else if (tid == 0) p.num_post_pad[0] = total;
  if (STAGED) {  // every route in the image: the whole row out, 16 bytes a store
    __syncthreads();
    const bool vec = (reinterpret_cast<unsigned long long>(p.sorted_ids) & 15) == 0;
    const int units = vec ? p.padded_len >> 2 : 0;
#pragma unroll 1
    for (int k = tid; k < units; k += bd)
      reinterpret_cast<int4*>(p.sorted_ids)[k] = reinterpret_cast<const int4*>(image)[k];
#pragma unroll 1
    for (int k = 4 * units + tid; k < p.padded_len; k += bd) p.sorted_ids[k] = image[k];
  }
  MLA_STAMP(0, 4);
#ifdef MLA_PROBE
  __syncthreads();
  MLA_STAMP(0, 5);
#endif
}

// ---------------------------------------------------------------------------------------------
// At most WARP_ROUTES routes and 32 rows (decode): warp 0 holds a route a lane and works out
// every position with ballots and shuffles (no shared memory, no atomics, no scan over the
// buckets), while the block issues the sentinel fill of the written rows (each warp reads the
// processed rows itself, so the fill waits for no barrier). One barrier orders the fill
// before the stores that overwrite it. align_tiny's chain has four barriers, the shared
// atomics and a scan over every bucket. Ranks follow the lane order, which is the flat
// index, so the result is the deterministic one as well.
#define WARP_ROUTES 32

// BASE: a base_problem, compiled apart so the row arithmetic folds away (the general
// instance cost a base decode call 0.2 to 0.3 us).
template <typename IdT, bool BASE>
__device__ __forceinline__ void align_warp(const Problem& p) {
  const int tid = threadIdx.x, lane = tid & 31, E = p.num_experts;
  const int rows = BASE ? 1 : p.rows;
  MLA_STAMP(0, 0);
  Route route{-1, 0};
  if (tid < 32) route = load_route<IdT>(p, lane, p.numel);
  const RowBits processed = BASE ? RowBits{1u} : processed_row_bits(p);
  // The fill of every written row and of its tiles (fire-and-forget; overwritten after the
  // barrier by the routes and the tiles' owners).
  const int4 sentinel = make_int4(p.numel, p.numel, p.numel, p.numel);
  const bool vec = (BASE || (p.sorted_pitch & 3) == 0) &&
                   ((reinterpret_cast<unsigned long long>(p.sorted_ids) & 15) == 0);
  const int units = vec ? (p.padded_len >> 2) : 0;
#pragma unroll 1
  for (int r = 0; r < rows; ++r) {
    if (!processed[r] && !p.fill_unprocessed) continue;
    int* row = p.sorted_ids + (long long)r * p.sorted_pitch;
#pragma unroll 1
    for (int k = tid; k < units; k += blockDim.x) reinterpret_cast<int4*>(row)[k] = sentinel;
#pragma unroll 1
    for (int k = 4 * units + tid; k < p.padded_len; k += blockDim.x) row[k] = p.numel;
    int* tiles = p.expert_ids + (long long)r * p.expert_pitch;
#pragma unroll 1
    for (int k = tid; k < p.num_tiles; k += blockDim.x) tiles[k] = -1;
  }
  MLA_STAMP(0, 1);

  int bucket = -1, rank = 0, padded = 0, start = 0, total = 0;
  if (tid < 32) {
    bucket = bucket_of(p, route, processed);
    if (p.scatter_idx != nullptr && lane < p.numel) p.scatter_idx[lane] = bucket >= 0 ? lane : -1;
    const unsigned active = __ballot_sync(MLA_FULL_MASK, bucket >= 0);
    const unsigned peers = same_bucket_lanes(active, bucket, bucket_bits(BASE ? E : num_buckets(p)));
    rank = __popc(peers & lanemask_lt());
    // The first lane of each bucket carries its padded count.
    if (bucket >= 0 && rank == 0) padded = padded_count(p, __popc(peers));
    MLA_STAMP(0, 2);
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
  MLA_STAMP(0, 3);
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
  MLA_STAMP(0, 4);
#ifdef MLA_PROBE
  __syncthreads();
  MLA_STAMP(0, 5);
#endif
}

// align_tiny_buckets for a LoRA call: its processed rows in a register up to 32 rows.
template <typename IdT, int PER, bool DET, bool FILLED, bool CHUNKED = false>
__device__ __forceinline__ void align_tiny_lora(const Problem& p) {
  if (p.rows <= 32) align_tiny_buckets<IdT, PER, DET, false, FILLED, false, CHUNKED, true>(p);
  else align_tiny_buckets<IdT, PER, DET, false, FILLED, false, CHUNKED>(p);
}

// The dispatcher keeps nb <= TINY_BUCKETS * blockDim.
template <typename IdT, bool DET, bool FILLED>
__device__ __forceinline__ void align_tiny_block(const Problem& p) {
  // (the one-warp path fills itself: the dispatcher gives it no fill blocks)
  const bool one_warp = p.numel <= WARP_ROUTES && (!FILLED || p.fill_blocks == 0);
  if (one_warp && base_problem(p)) align_warp<IdT, true>(p);
  else if (one_warp && p.rows <= 32) align_warp<IdT, false>(p);
  else if (num_buckets(p) > (int)blockDim.x) align_tiny_lora<IdT, TINY_BUCKETS, DET, FILLED>(p);
  else if (base_problem(p)) align_tiny_buckets<IdT, 1, DET, true, FILLED>(p);
  else align_tiny_lora<IdT, 1, DET, FILLED>(p);
}

// Probe only (-DMLA_PROBE -DMLA_TWICE, scripts/decode_experiment.py): `body` twice in the
// block through one rolled loop, so both passes run the same instructions and a faster
// second pass shows cold caches, the instruction cache among them. Each pass stamps kernel
// slot 0; swapping slots 0 and 1 after each leaves pass 1's stamps in slot 0, pass 2's in 1.
#ifdef MLA_TWICE
template <typename Body>
__device__ __forceinline__ void mla_twice(Body body) {
#pragma unroll 1
  for (int pass = 0; pass < 2; ++pass) {
    body();
    __syncthreads();
    if (threadIdx.x == 0 && blockIdx.x < MLA_PROBE_BLOCKS)
      for (int k = 0; k < 2 * MLA_PROBE_STAGES; ++k) {
        unsigned long long* slot0 = mla_probe + blockIdx.x * MLA_PROBE_STAGES * 2 + k;
        unsigned long long* slot1 = slot0 + MLA_PROBE_BLOCKS * MLA_PROBE_STAGES * 2;
        const unsigned long long t = *slot0;
        *slot0 = *slot1;
        *slot1 = t;
      }
    __syncthreads();
  }
}
#define MLA_ONE_OR_TWO_PASSES(...) mla_twice([&] { __VA_ARGS__; })
#else
#define MLA_ONE_OR_TWO_PASSES(...) __VA_ARGS__
#endif

// (1024, 1): with (1024) alone NVRTC 13.0 gave align_tiny<short> 32 registers on sm_80, and spills.
template <typename IdT, bool DET>
__global__ void __launch_bounds__(1024, 1) align_tiny(const Problem p) {
  MLA_ONE_OR_TWO_PASSES(align_tiny_block<IdT, DET, false>(p));
}

// align_tiny whose blocks past the first are fill blocks (p.fill_blocks of them, large LoRA
// fills; the launch is cooperative): block 0 waits for their arrivals at p.ticket before its
// stores. A kernel apart, so that decode calls' align_tiny has none of this.
template <typename IdT, bool DET>
__global__ void __launch_bounds__(1024, 1) align_tiny_filled(const Problem p) {
  if (blockIdx.x > 0) fill_and_arrive(p, blockIdx.x - 1, true, p.ticket);
  else align_tiny_block<IdT, DET, true>(p);
}

// align_tiny's base row built in shared memory and stored coalesced after the scan (one
// block; p.stage_output ints of the image). A kernel apart, so that the other align_tiny
// kernels keep their machine code. Sizes it cannot stage (the dispatcher sends none) run as
// align_tiny.
template <typename IdT, bool DET>
__global__ void __launch_bounds__(1024, 1) align_tiny_staged(const Problem p) {
  if (base_problem(p) && p.numel > WARP_ROUTES && num_buckets(p) <= (int)blockDim.x &&
      p.stage_output >= p.padded_len)
    MLA_ONE_OR_TWO_PASSES(align_tiny_buckets<IdT, 1, DET, true, false, true>(p));
  else
    MLA_ONE_OR_TWO_PASSES(align_tiny_block<IdT, DET, false>(p));
}

// Deterministic align_tiny whose ranks come from its chunks' groups (ChunkRanks) instead of
// per-warp counters a bucket: many buckets (LoRA with many slots). Blocks past the first are
// fill blocks where the launch has them (p.fill_blocks; the launch is then cooperative), as
// align_tiny_filled's are.
template <typename IdT>
__global__ void __launch_bounds__(1024, 1) align_tiny_chunked(const Problem p) {
  if (blockIdx.x > 0) fill_and_arrive(p, blockIdx.x - 1, true, p.ticket);
  else if (num_buckets(p) > (int)blockDim.x) align_tiny_lora<IdT, TINY_BUCKETS, true, true, true>(p);
  else if (base_problem(p)) align_tiny_buckets<IdT, 1, true, true, true, false, true>(p);
  else align_tiny_lora<IdT, 1, true, true, true>(p);
}

// LoRA alignment, a block a row (any number of rows, a thread a bucket of a row): block r
// aligns the routes of slot r as a base row of E buckets (align_tiny_buckets' SLOT_ROW).
// align_tiny aligns every row in one block, all rows' buckets through one scan, and its
// fill blocks write the rows' fills; here each row's count, scan, fill and stores run on an
// SM of their own, and no block waits for another. Every block reads every route.
template <typename IdT, bool DET>
__device__ __forceinline__ void align_slot_row(const Problem& p, int r) {
  align_tiny_buckets<IdT, 1, DET, true, false, false, false, false, true>(slot_row_problem(p, r),
                                                                           &p, r);
}

template <typename IdT, bool DET>
__global__ void __launch_bounds__(1024, 1) align_tiny_rows(const Problem p) {
  align_slot_row<IdT, DET>(p, blockIdx.x);
}

// Base (block 0, align_tiny's block) and LoRA a block a row (blocks 1..rows) in one launch.
template <typename IdT, bool DET>
__global__ void __launch_bounds__(1024, 1) align_tiny_rows_pair(const Problem first,
                                                                const Problem second) {
  if (blockIdx.x == 0) align_tiny_block<IdT, DET, false>(first);
  else align_slot_row<IdT, DET>(second, blockIdx.x - 1);
}

// Base and LoRA alignment in one launch of two tiny blocks (block 0: `first`).
template <typename IdT, bool DET>
__global__ void __launch_bounds__(1024, 1) align_tiny_pair(const Problem first, const Problem second) {
  align_tiny_block<IdT, DET, false>(blockIdx.x == 0 ? first : second);
}

// The same, then the fill blocks of `second` (second.fill_blocks of them; the launch is
// cooperative).
template <typename IdT, bool DET>
__global__ void __launch_bounds__(1024, 1) align_tiny_pair_filled(const Problem first,
                                                                  const Problem second) {
  if (blockIdx.x >= 2) fill_and_arrive(second, blockIdx.x - 2, true, second.ticket);
  else align_tiny_block<IdT, DET, true>(blockIdx.x == 0 ? first : second);
}
