// Multi-block kernels in one cooperative launch: align_cooperative, align_cooperative_pair.
// Included by align_kernels.cu, after align_common.cuh and the modes, ITEMS_PER_THREAD,
// dynamic_smem and for_routes that file defines.

// ---------------------------------------------------------------------------------------------
// Multi-block in one launch (cooperative launch: every block is resident at once). Each block
// counts its chunk, reserves its range in every bucket it touches, stages its routes in output
// order, and writes its share of the sentinel fill (or fill blocks write it: fill_and_arrive,
// align_kernels.cu); then one barrier over the problem's blocks;
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
// align_cooperative's DET argument: free order, ordered ranks, or sorted segments (with the
// sort's bitmaps read back as runs, which the dispatcher takes where a warp has two to four
// rounds: AlignPolicy.sort_runs_above_routes).
#define COOP_FREE 0
#define COOP_ORDERED 1
#define COOP_SORTED 2
#define COOP_SORTED_RUNS 3

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
// Deterministic output (the flat route order in every segment), two ways:
// DET == COOP_ORDERED: warp w of a block owns a contiguous run of the block's chunk; per-warp
//   counters rank its routes in order (as in the single block), and the block's place among
//   blocks comes from a prefix over blocks of every bucket's per-block counts (p.chunk_hist
//   [nb, blocks]: a bucket's column contiguous, so a warp reads it in a few coalesced loads),
//   computed between two barriers, instead of from the order in which the reservation
//   atomics land. The same prefix gives each bucket's total, so this path has no count
//   atomics (the fence of the first barrier would wait for them to drain). Adds after the
//   staging: warp_counts[32 * stride] ushort,
//   stride = nb rounded up to even.
// DET == COOP_SORTED: the free-order kernel, then a second barrier, then the blocks sort every
//   bucket's segment in place (order_segments, order.cuh), the segment starts already in each
//   block's shared memory. The sort's scratch takes the place of value and bucket_of_k where
//   larger (order_scratch_bytes). DET == COOP_SORTED_RUNS: the same, the bitmaps read back as
//   runs (sort_by_bitmaps<true>).
template <typename IdT, int DET>
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
  // Route j of this thread: strided over the block, or (COOP_ORDERED) over the warp's run.
  const Span span = warp_span(c0, c1, warp, nwarps);
  const bool runs = DET == COOP_ORDERED;
  const int first = runs ? span.lo + lane : c0 + threadIdx.x;
  const int step = runs ? 32 : (int)blockDim.x, end = runs ? span.hi : c1;
  MLA_STAMP(3, 0);

  Route route[COOP_ITEMS];  // in flight during the set-up below
#pragma unroll
  for (int j = 0; j < COOP_ITEMS; ++j) route[j] = load_route<IdT>(p, first + j * step, end);
  unsigned* ctrl = p.ticket;
  const uint4 words = __ldcg(reinterpret_cast<const uint4*>(ctrl));
  const int parity = (int)(words.x & 1u);
  int* counts = p.counts + parity * p.count_stride;
  int* stale = p.counts + (1 - parity) * p.count_stride;
  const int stale_len = (int)(parity ? words.y : words.z);
  for (int b = threadIdx.x; b < nb; b += blockDim.x) hist[b] = 0;
  if (DET == COOP_ORDERED)
    for (int k = threadIdx.x; k < nwarps * stride; k += blockDim.x) warp_counts[k] = 0;
  mark_processed_rows(p, processed);
  for (int k = tid; k < stale_len; k += nthreads) stale[k] = 0;
  if (tid == 0) {
    ctrl[1 + parity] = (unsigned)nb;
    ctrl[5 - parity] = 0u;  // the previous call's barrier
  }
  // Routes overwrite the fill after the barrier, which orders every fill store before them.
  // With fill blocks (p.fill_blocks > 0) those write it, beside this chain.
  if (p.fill_blocks == 0)
    fill_rows(p, processed, tid, nthreads, false);
  MLA_STAMP(3, 1);

  int bucket[COOP_ITEMS], rank[COOP_ITEMS];
  // Free order: twice COOP_RESERVE, so that blocks of 512 threads (with fill blocks) keep
  // 4096 buckets' reservations in flight too (the sorted instance spills with it, and never
  // runs in blocks of 512).
  constexpr int RESERVE = DET == COOP_FREE ? 2 * COOP_RESERVE : COOP_RESERVE;
  int reserved[RESERVE];
  unsigned short* mine = warp_counts + warp * stride;
  // COOP_ORDERED: the rank among the warp's routes of the bucket, in flat order.
  bucket_and_rank(p, route, first, step, end, processed, runs, nb, hist, mine, bucket, rank);
  if (DET != COOP_ORDERED) {
    __syncthreads();
    MLA_STAMP(3, 2);
    // Reserve the block's range in each of its buckets. The first RESERVE buckets of
    // each thread go out together and come back while the block scans and stages (their
    // offsets are needed only after the barrier); further ones (more than RESERVE *
    // blockDim buckets) wait here, RESERVE at a time.
#pragma unroll
    for (int u = 0; u < RESERVE; ++u) {
      const int b = threadIdx.x + u * blockDim.x;
      const int c = b < nb ? hist[b] : 0;
      reserved[u] = c != 0 ? atomicAdd(counts + b, c) : 0;
    }
    for (int b0 = threadIdx.x + RESERVE * blockDim.x; b0 < nb;
         b0 += RESERVE * blockDim.x) {
      int more[RESERVE];
#pragma unroll
      for (int u = 0; u < RESERVE; ++u) {
        const int b = b0 + u * blockDim.x;
        const int c = b < nb ? hist[b] : 0;
        more[u] = c != 0 ? atomicAdd(counts + b, c) : 0;
      }
#pragma unroll
      for (int u = 0; u < RESERVE; ++u)
        if (b0 + u * blockDim.x < nb) adj[b0 + u * blockDim.x] = more[u];
    }
  } else {
    __syncthreads();
    MLA_STAMP(3, 2);
    // Per bucket: each warp's counter := routes of the warps before it; hist := block total,
    // published for the prefix over blocks.
    for (int k = threadIdx.x; 2 * k < nb; k += blockDim.x) {
      const unsigned both = prefix_over_warps_x2(reinterpret_cast<unsigned*>(warp_counts) + k,
                                                 stride / 2, nwarps);
      for (int b = 2 * k; b < min(nb, 2 * k + 2); ++b) {
        const int run = (int)((both >> (16 * (b & 1))) & 0xffffu);
        hist[b] = run;
        p.chunk_hist[(long long)b * blocks + block] = run;
      }
    }
    __syncthreads();
  }
  // hist := the block's own offsets of each bucket (exclusive), hist[nb] := its route count.
  scan_block(nb, [&](int b) { return hist[b]; }, hist, warp_sums);
  // Stage the routes in output order: rank in the block (COOP_ORDERED: the warps before this
  // one, then the rank in the warp) after the block's offset of the bucket.
#pragma unroll
  for (int j = 0; j < COOP_ITEMS; ++j) {
    if (bucket[j] < 0) continue;
    const int k = hist[bucket[j]] + rank[j] + (runs ? (int)mine[bucket[j]] : 0);
    value[k] = first + j * step;
    bucket_of_k[k] = bucket[j];
  }
  if (DET != COOP_ORDERED) {
#pragma unroll
    for (int u = 0; u < RESERVE; ++u)
      if (threadIdx.x + u * blockDim.x < nb) adj[threadIdx.x + u * blockDim.x] = reserved[u];
  }
  MLA_STAMP(3, 3);
  // Every block arrives once at the first barrier, fill blocks included; only the counting
  // blocks arrive at a second one.
  const unsigned arrivals = (unsigned)(blocks + p.fill_blocks);
  blocks_barrier(ctrl + 4 + parity, arrivals);
  if (DET == COOP_ORDERED) {
    MLA_STAMP(3, 7);
    // Each warp of the grid turns one bucket's column of per-block counts into exclusive
    // prefixes (in block order) and the bucket's total (into `counts`, which this path
    // overwrites rather than adds to), then a second barrier publishes them. Buckets go to the
    // blocks in turn (warp w of block j: bucket w * blocks + j), and a warp's loads of 128
    // blocks' counts are in flight together.
    for (int b = warp * blocks + block; b < nb; b += blocks * nwarps) {
      int* column = p.chunk_hist + (long long)b * blocks;
      int carry = 0;
      for (int j0 = 0; j0 < blocks; j0 += 128) {
        int v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int j = j0 + 32 * u + lane;
          v[u] = j < blocks ? __ldcg(column + j) : 0;
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int j = j0 + 32 * u + lane;
          const int x = warp_inclusive_sum(v[u]);
          if (j < blocks) column[j] = carry + x - v[u];
          carry += __shfl_sync(MLA_FULL_MASK, x, 31);
        }
      }
      if (lane == 0) counts[b] = carry;
    }
    blocks_barrier(ctrl + 4 + parity, arrivals + (unsigned)blocks);
  }
  MLA_STAMP(3, 4);

  for (int b = threadIdx.x; b < nb; b += blockDim.x) {
    starts[b] = __ldcg(counts + b);
    if (DET == COOP_ORDERED && hist[b + 1] != hist[b]) adj[b] = __ldcg(p.chunk_hist + (long long)b * blocks + block);
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
  if (DET >= COOP_SORTED) {
    MLA_STAMP(3, 6);
    blocks_barrier(ctrl + 4 + parity, arrivals + (unsigned)blocks);
    order_segments<DET == COOP_SORTED_RUNS>(p, starts, block, blocks, value);
#ifdef MLA_PROBE
    __syncthreads();
    MLA_STAMP(5, 5);
#endif
  }
#ifdef MLA_PROBE
  __syncthreads();
  if (DET < COOP_SORTED) MLA_STAMP(3, 6);
#endif
}

// (1024, 1): one block a SM by design, or two of 512 threads with fill blocks (64 registers
// a thread at most either way); without the minimum, NVRTC 13.0 gave an instance 32
// registers and spilled. The last p.fill_blocks blocks only fill: their arrival counts at
// the counting blocks' first barrier, which orders the fill before the routes. (The parity
// is read before arriving: block 0 flips it only once every block has arrived.)
template <typename IdT, int DET>
__global__ void __launch_bounds__(1024, 1) align_cooperative(const Problem p) {
  const int counting = (int)gridDim.x - p.fill_blocks;
  if ((int)blockIdx.x >= counting)
    fill_and_arrive(p, (int)blockIdx.x - counting, false, p.ticket + 4 + (__ldcg(p.ticket) & 1u));
  else
    align_cooperatively<IdT, DET>(p, blockIdx.x, counting);
}

// Base and LoRA alignment in one cooperative launch: the first `first.coop_blocks` blocks
// align `first`, the rest `second` (neither has fill blocks); each side has its own scratch
// and barriers, and its own DET argument (deterministic: ordered ranks or sorted segments, as
// its own launch would).
template <typename IdT, int DET_FIRST, int DET_SECOND>
__global__ void __launch_bounds__(1024, 1) align_cooperative_pair(const Problem first,
                                                               const Problem second) {
  const int split = first.coop_blocks;
  if ((int)blockIdx.x < split) align_cooperatively<IdT, DET_FIRST>(first, blockIdx.x, split);
  else align_cooperatively<IdT, DET_SECOND>(second, blockIdx.x - split, gridDim.x - split);
}
