// Multi-block kernels in two launches: align_count, then align_place.
// Included by align_kernels.cu, after align_common.cuh and the modes, ITEMS_PER_THREAD,
// dynamic_smem and for_routes that file defines.

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
  const BlockShare share = block_share<MODE>(p, nb);
  const int chunk = share.chunk, lo_b = share.lo_b, hi_b = share.hi_b;
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
    fill_rows(p, processed, blockIdx.x * blockDim.x + threadIdx.x, gridDim.x * blockDim.x, false);
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
    MLA_STAMP(1, 7);
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

  const BlockShare share = block_share<MODE>(p, nb);
  const int chunk = share.chunk, lo_b = share.lo_b, hi_b = share.hi_b;
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
    const Span span = warp_span(c0, c1, warp, nwarps);
    const int lo = span.lo, hi = span.hi;
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
      prefix_over_warps(warp_counts + lb, p.range_width, nwarps);
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
