// Multi-block kernels in one launch of thread-block clusters: align_cluster,
// align_cluster_rows, align_cluster_pair, align_cluster_rows_pair. Included by
// align_kernels.cu, after align_common.cuh and the modes, dynamic_smem and for_routes that
// file defines.

// ---------------------------------------------------------------------------------------------
// One cluster of CLUSTER_BLOCKS blocks (sm_90 and newer), for the sizes between one block and
// the cooperative launch (thousands to tens of thousands of routes). The blocks of a cluster
// run at once on SMs of one GPC, read each other's shared memory and meet at a hardware
// barrier, so the hand-off that the cooperative kernel pays with global atomics, a fence and a
// spinning grid barrier costs one cluster barrier here, and the output leaves through
// CLUSTER_BLOCKS SMs instead of the single block's one.
// Block j of the cluster counts routes [j * chunk, (j + 1) * chunk) into its own histogram
// (shared atomics; the rank of each route among the block's routes of its bucket stays in a
// register) and issues its share of the sentinel fill and of the -1 tile fill. One cluster
// barrier (release / acquire: it also orders every fill store before the stores below). Then
// every block reads all the blocks' histograms (distributed shared memory), so each knows
// every bucket's total and, per bucket, how many routes the blocks before it hold; it scans
// the padded totals itself, and stores its routes, its share of the tile owners, block 0 the
// totals. Nothing is left in global scratch, so no call cleans up after another.
// A block must not exit while another may still read its histogram: each arrives at a
// second cluster barrier once it has read the others (a relaxed arrival: it orders no
// stores), and waits on it just before it exits.
// DET (deterministic output, the flat route order in every segment): warp w of a block holds
// a contiguous run of the block's chunk and ranks its routes in lane order on counters of its
// own; a prefix over the warps of each bucket's counters turns those into ranks in the block.
// The blocks' order among each other already follows the chunks' (`before`).
// After the row region: hist[nb] | starts[nb + 1] | before[nb] ints | DET: warp_counts[nwarps
// * stride] ushort, stride = nb rounded up to even.
#define CLUSTER_BLOCKS 8  // blocks of one cluster: the portable maximum
#define CLUSTER_ITEMS 8   // routes a thread, at most: chunk <= CLUSTER_ITEMS * blockDim.x

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define MLA_CLUSTERS 1
#define MLA_CLUSTER_DIMS __cluster_dims__(CLUSTER_BLOCKS, 1, 1)
#else
#define MLA_CLUSTERS 0
#define MLA_CLUSTER_DIMS
#endif

#if MLA_CLUSTERS
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// Cluster barrier halves (every thread of every block calls both, whole warps at a time).
// arrive has release and wait acquire semantics at cluster scope.
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
}
// An arrival that orders nothing: enough where it only says "done reading your shared
// memory" (loads whose values came back are complete), and it skips the release's wait for
// this thread's outstanding stores.
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}

// `local` (a pointer into this block's shared memory) as a generic pointer to the same
// place in block `rank` of the cluster. Plain loads through it reach that block's shared
// memory, and the compiler issues them together like any other loads.
__device__ __forceinline__ const int* in_block(const int* local, unsigned rank) {
  unsigned long long remote;
  asm("mapa.u64 %0, %1, %2;" : "=l"(remote) : "l"(local), "r"(rank));
  return reinterpret_cast<const int*>(remote);
}

// The scan over buckets: warp w takes the contiguous run of buckets [w * span, (w + 1) *
// span), 32 at a time, a bucket a lane, so the reads of every block's histogram are
// coalesced and free of bank conflicts, and each lane's loads from all the blocks are in
// flight at once.
// SLOT_ROW (align_cluster_rows): `p` is row `row` of the LoRA call `lora` (its outputs' row,
// rows = 1), and its routes are those of the tokens of slot `row`, as slot 0 of the row.
template <typename IdT, bool DET, bool SLOT_ROW = false>
__device__ __forceinline__ void align_in_cluster(const Problem& p, const Problem* lora = nullptr,
                                                 int row = 0) {
  __shared__ int warp_sums[32];
  const int nb = num_buckets(p), bd = blockDim.x, tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5, nwarps = bd >> 5;
  const int rank = (int)cluster_rank();
  unsigned char* processed = dynamic_smem;
  int* hist = reinterpret_cast<int*>(dynamic_smem + row_region_bytes(p.rows));
  int* starts = hist + nb;
  int* before = starts + nb + 1;
  const int stride = (nb + 1) & ~1;
  unsigned short* warp_counts = reinterpret_cast<unsigned short*>(before + nb);
  const int c0 = min(p.numel, rank * p.chunk), c1 = min(p.numel, c0 + p.chunk);
  const int ctid = rank * bd + tid, cthreads = CLUSTER_BLOCKS * bd;
  // Route j of this thread: strided over the block, or (DET) over the warp's own run.
  const Span run = warp_span(c0, c1, warp, nwarps);
  const int first = DET ? run.lo + lane : c0 + tid, step = DET ? 32 : bd;
  const int end = DET ? run.hi : c1;
  MLA_STAMP(4, 0);

  Route route[CLUSTER_ITEMS];  // in flight during the set-up below
#pragma unroll
  for (int j = 0; j < CLUSTER_ITEMS; ++j) route[j] = load_route<IdT>(p, first + j * step, end);
  RowFlagLoads flag_loads{-1, -1, false};
  if (SLOT_ROW && warp == 0) flag_loads = load_slot_flags(*lora, row);
  for (int b = tid; b < nb; b += bd) hist[b] = 0;
  if (DET)
    for (int k = tid; k < nwarps * stride / 2; k += bd) reinterpret_cast<unsigned*>(warp_counts)[k] = 0;
  if (SLOT_ROW) {  // the row's flag, then its routes as slot 0 and every other route dropped
    if (warp == 0) {
      const bool on = slot_processed(*lora, flag_loads, row);
      if (lane == 0) processed[0] = on;
    }
    __syncthreads();
    // Every block of the cluster reads the same flag: all leave, or none does.
    if (!processed[0] && !p.fill_unprocessed) return;
#pragma unroll
    for (int j = 0; j < CLUSTER_ITEMS; ++j)
      route[j] = route[j].slot == row ? Route{route[j].id, 0} : Route{-1, 0};
  } else {
    mark_processed_rows(p, processed);  // ends in a barrier: the zeros are in place
  }
  MLA_STAMP(4, 1);
  // This block's share of the fills, cut over the cluster's threads; the barrier below
  // orders them before the route and tile-owner stores of every block.
  fill_rows(p, processed, ctid, cthreads, true);
  MLA_STAMP(4, 2);

  int bucket[CLUSTER_ITEMS], rank_in_block[CLUSTER_ITEMS];
  unsigned short* mine = warp_counts + warp * stride;
  bucket_and_rank(p, route, first, step, end, processed, DET, nb, hist, mine, bucket, rank_in_block);
  if (DET) {
    // Each warp's counter := routes of the warps before it; hist := the block's count.
    __syncthreads();
    MLA_STAMP(6, 0);
    for (int k = tid; 2 * k < nb; k += bd) {
      const unsigned both = prefix_over_warps_x2(reinterpret_cast<unsigned*>(warp_counts) + k,
                                                 stride / 2, nwarps);
      hist[2 * k] = (int)(both & 0xffffu);
      if (2 * k + 1 < nb) hist[2 * k + 1] = (int)(both >> 16);
    }
    __syncthreads();
    MLA_STAMP(6, 1);
#pragma unroll
    for (int j = 0; j < CLUSTER_ITEMS; ++j)
      if (bucket[j] >= 0) rank_in_block[j] += mine[bucket[j]];
  }
  cluster_arrive();  // a barrier of every thread of the cluster, this block's too
  cluster_wait();
  MLA_STAMP(4, 3);

  // Every block's count of each of this warp's buckets: the total (kept in starts until the
  // scan), the part of the blocks before this one (before), and the warp's exclusive scan of
  // the padded totals (in starts, the warp's offset added below).
  const int span = ((nb + nwarps - 1) / nwarps + 31) & ~31;
  const int w0 = min(nb, warp * span), w1 = min(nb, w0 + span);
  const int* remote[CLUSTER_BLOCKS];
#pragma unroll
  for (int k = 0; k < CLUSTER_BLOCKS; ++k) remote[k] = in_block(hist, k);
  int carry = 0;
  for (int b0 = w0; b0 < w1; b0 += 32) {
    const int b = b0 + lane;
    int c[CLUSTER_BLOCKS];
#pragma unroll
    for (int k = 0; k < CLUSTER_BLOCKS; ++k) c[k] = b < w1 ? remote[k][b] : 0;
    int total = 0, earlier = 0;
#pragma unroll
    for (int k = 0; k < CLUSTER_BLOCKS; ++k) {
      earlier += k < rank ? c[k] : 0;
      total += c[k];
    }
    const int padded = padded_count(p, total);
    const int x = warp_inclusive_sum(padded);
    if (b < w1) {
      before[b] = earlier;
      starts[b] = carry + x - padded;
    }
    carry += __shfl_sync(MLA_FULL_MASK, x, 31);
  }
  MLA_STAMP(4, 4);
  cluster_arrive_relaxed();  // done reading the other blocks' shared memory
  if (lane == 0) warp_sums[warp] = carry;
  __syncthreads();
  const int w = warp_inclusive_sum(lane < nwarps ? warp_sums[lane] : 0);
  const int offset = warp > 0 ? __shfl_sync(MLA_FULL_MASK, w, warp - 1) : 0;
  for (int b = w0 + lane; b < w1; b += 32) starts[b] += offset;
  const int total = __shfl_sync(MLA_FULL_MASK, w, nwarps - 1);
  if (tid == 0) starts[nb] = total;
  __syncthreads();
  MLA_STAMP(4, 5);

#pragma unroll
  for (int j = 0; j < CLUSTER_ITEMS; ++j) {
    if (bucket[j] < 0) continue;
    const int b = bucket[j];
    p.sorted_ids[output_index(p, starts, b, before[b] + rank_in_block[j])] = first + j * step;
  }
  // Tile owners: bucket b's tiles are written by block b % CLUSTER_BLOCKS, by the thread
  // that takes b among that block's share (only processed rows have counts).
  for (int b = rank + CLUSTER_BLOCKS * tid; b < nb; b += CLUSTER_BLOCKS * bd) {
    const int tiles = fast_div(starts[b + 1] - starts[b], p.block_magic, p.block_shift);
    if (tiles != 0) write_bucket_tiles(p, starts, b, starts[b], tiles);
  }
  if (rank == 0) write_totals(p, processed, starts);
  MLA_STAMP(4, 6);
  cluster_wait();
#ifdef MLA_PROBE
  __syncthreads();
  MLA_STAMP(4, 7);
#endif
}
#endif

// Launched as one cluster (grid = CLUSTER_BLOCKS); the dispatcher picks it only on sm_90 and
// newer, so older architectures compile an empty body.
template <typename IdT, bool DET>
__global__ void __launch_bounds__(1024, 1) MLA_CLUSTER_DIMS align_cluster(const Problem p) {
#if MLA_CLUSTERS
  align_in_cluster<IdT, DET>(p);
#endif
}

// LoRA alignment, a cluster a row (grid = rows * CLUSTER_BLOCKS): cluster r aligns the
// routes of slot r as a one-row problem of E buckets, each row's count, scan, fill and stores
// on CLUSTER_BLOCKS SMs of their own, where one cluster or the cooperative launch runs every
// row's buckets through one scan. Every cluster reads every route.
template <typename IdT, bool DET>
__global__ void __launch_bounds__(1024, 1) MLA_CLUSTER_DIMS align_cluster_rows(const Problem p) {
#if MLA_CLUSTERS
  const int r = blockIdx.x / CLUSTER_BLOCKS;
  align_in_cluster<IdT, DET, true>(slot_row_problem(p, r), &p, r);
#endif
}

// Base and LoRA alignment in one launch of two clusters (cluster 0: `first`).
template <typename IdT, bool DET>
__global__ void __launch_bounds__(1024, 1) MLA_CLUSTER_DIMS
    align_cluster_pair(const Problem first, const Problem second) {
#if MLA_CLUSTERS
  align_in_cluster<IdT, DET>(blockIdx.x < CLUSTER_BLOCKS ? first : second);
#endif
}

// Base and LoRA alignment in one launch, base on cluster 0 and a cluster a LoRA row after it
// (grid = (1 + rows) * CLUSTER_BLOCKS): align_cluster_rows with the base row beside it, for
// pairs whose LoRA side would run a cluster a row alone.
template <typename IdT, bool DET>
__global__ void __launch_bounds__(1024, 1) MLA_CLUSTER_DIMS
    align_cluster_rows_pair(const Problem first, const Problem second) {
#if MLA_CLUSTERS
  const int c = blockIdx.x / CLUSTER_BLOCKS;
  if (c == 0) align_in_cluster<IdT, DET>(first);
  else align_in_cluster<IdT, DET, true>(slot_row_problem(second, c - 1), &second, c - 1);
#endif
}
