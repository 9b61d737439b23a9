"""The dispatcher: a pure function from sizes, device limits and a tuning policy to a variant
and its geometry.

No GPU is needed to call it, so CI tests its decisions. Two kinds of numbers steer it: the
kernels' compile-time constants (``kernels/align_kernels.cu``, mirrored below and checked
against the source by a test), and the tuning in ``AlignPolicy``, a value passed in (the
measurements behind its defaults are in ``docs/tuning.md``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Tuple

# Constants of the kernels (tests/test_dispatch.py reads them back from the CUDA source).
BLOCK = 1024                  # threads per block of every non-deterministic kernel
ITEMS_PER_THREAD = 4          # ITEMS_PER_THREAD: routes a thread holds in registers
TINY_ITEMS = 4                # TINY_ITEMS: align_tiny's routes a thread
TINY_BUCKETS = 4              # TINY_BUCKETS: align_tiny's buckets a thread when buckets
                              #   outnumber threads
WARP_ROUTES = 32              # WARP_ROUTES: align_tiny places at most this many routes
                              #   (of at most 32 rows) on one warp (align_warp)
COOP_ITEMS = 8                # COOP_ITEMS: the cooperative kernels' routes a thread, at most
FILL_SPLIT_BLOCK = BLOCK // 2  # threads of each block of a cooperative launch with fill blocks
                              #   (two blocks an SM: __launch_bounds__(BLOCK, 1) keeps a
                              #   thread at 64 registers, so both fit the register file)
CLUSTER_BLOCKS = 8            # CLUSTER_BLOCKS: blocks of align_cluster's one cluster
CLUSTER_ITEMS = 8             # CLUSTER_ITEMS: align_cluster's routes a thread, at most
ORDER_ITEMS = 4               # ORDER_ITEMS: entries a lane holds in the segment sort's warps
ORDER_WARP_MAX = 32 * ORDER_ITEMS  # segments up to this long are sorted by a warp
ORDER_DIGITS_MAX = 4096       # ORDER_DIGITS_MAX: segment entries a block sorts by digits
ORDER_BITMAP_ALL_MAX = 131072  # ORDER_BITMAP_ALL_MAX: up to this many routes the bitmap sorts
                              #   every long segment; past it the digits take those of up
                              #   to ORDER_DIGITS_MAX entries
SINGLE_BLOCK_MAX_ROUTES = BLOCK * ITEMS_PER_THREAD
WARP_COUNTER_MAX = 65535      # unsigned short per-warp counters bound a deterministic chunk
SMEM_SLACK = 512              # bytes of a block's shared memory kept for the kernels' static
                              #   shared memory (KernelSet checks each kernel's fits)


@dataclass(frozen=True)
class AlignPolicy:
    """The dispatcher's tuning: every size at which it changes its mind, as one value.

    The defaults are the H200's; ``docs/tuning.md`` has the measurement behind each. An
    experiment makes its own (``dataclasses.replace(AlignPolicy(), use_tiny=False)``) and
    passes it to the public functions or ``AlignPlan`` as ``policy=``.
    """
    # One block at decode sizes: align_tiny where it fits, else align_single.
    use_tiny: bool = True
    tiny_one_bucket_max: int = 1024      # align_tiny: a thread a bucket up to this, then 1 per 4
    single_block_sizes: Tuple[int, ...] = (128, 256, 512, 1024)  # align_single's choices
    one_route_per_thread: int = 512      # up to this many routes, a thread claims one
    entries_per_thread: int = 64         # output entries a thread of one block writes, at most
    buckets_per_thread: int = 4          # buckets a thread of align_single zeroes and scans
    # Above this many output entries the cooperative launch beats one block; with fill
    # blocks beside it (tiny_fill_blocks_from), one block keeps up to the second figure.
    coop_over_single_entries: int = 81920
    coop_over_filled_single_entries: int = 1 << 19
    # One cluster of CLUSTER_BLOCKS blocks (sm_90+) from this many routes
    # up to this many (deterministic calls: up to cluster_max_routes_deterministic), over at
    # most this many buckets; its blocks get cluster_routes_per_thread routes a thread, at
    # least cluster_min_block threads.
    cluster_min_routes: int = 2304
    # Over at most cluster_few_buckets buckets the cluster starts this many routes earlier
    # (LoRA of one or two slots; base rows there are staged instead): r50's A/B, one slot of
    # 256 experts T=256 (2048 routes), 5.14 against align_tiny's 6.08 us (H100); with four
    # slots (1024 buckets) the cluster lost, 6.49 against 6.02.
    cluster_few_buckets: int = 512
    cluster_few_buckets_routes_earlier: int = 256
    cluster_max_routes: int = 9216
    cluster_max_routes_deterministic: int = 12288
    cluster_max_buckets: int = 1024
    cluster_routes_per_thread: int = 2
    cluster_min_block: int = 256
    # Deterministic output from this many buckets (LoRA sizes) by sorting each bucket's
    # segment after the free-order kernels: the cooperative kernel after a second barrier,
    # count + place then align_order. Below (or False) the kernels rank in flat order
    # themselves, with a [chunks, buckets] prefix.
    sort_for_determinism: bool = True
    sort_min_buckets: int = 4096
    # A sorting cooperative launch of more routes than this (up to ORDER_BITMAP_ALL_MAX)
    # runs the kernel instance whose bitmap sort reads each warp's two to four rounds back
    # as runs of a lane's words (COOP_SORTED_RUNS). A separate instance, because the runs'
    # code in the same kernel cost about 1 % at one round a warp even where they were not
    # taken (r62's A/B, H100, skewed LoRA E=256 B=64 16 slots: T=4096 19.28 against 19.10 us,
    # T=16384 22.90 against 23.48).
    sort_runs_above_routes: int = 32768
    # Multi-block launches.
    fill_per_block: int = 8192           # sentinel entries a count block fills, about
    # From this many output entries, and below the second figure, the cooperative launch
    # gets fill blocks: blocks that only write the sentinel fill beside the counting blocks
    # (two blocks of FILL_SPLIT_BLOCK threads an SM) instead of the counting blocks filling
    # before they count. Free-order calls of fewer routes than the third figure keep them
    # below the fourth: there the fill, not the counting, is most of the work.
    coop_fill_blocks_from: int = 0
    coop_fill_blocks_below: int = 1 << 18
    coop_fill_blocks_free_routes: int = 196608
    coop_fill_blocks_free_below: int = 655360
    # From this many output entries the cooperative launch instead keeps blocks of BLOCK
    # threads, one an SM, and gives whole SMs to fill blocks: one per coop_fill_sm_entries
    # entries, as many as the counting blocks leave (COOP_ITEMS routes a thread at most).
    # The counting blocks keep every thread for the work after the barrier, which blocks of
    # FILL_SPLIT_BLOCK threads lacked at large fills (r47, H100: LoRA T=4096 E=256 16 slots
    # 11.39 against 13.05 us; below 2^18 entries the split won: base T=4096 6.76 against 8.06).
    coop_fill_sms_from: int = 1 << 18
    coop_fill_sm_entries: int = 32768
    # ... and only where the output entries are at least this many times the routes: rows
    # of two or more slots, whose fill outweighs their routes. One row's fill is about its
    # routes, and there the counting blocks filling first on every SM won (r51, H100, A/B
    # line 16: base T=65536 E=64 10.27 against 10.32 us, deterministic 13.32 against 13.52;
    # LoRA T=16384 16 slots kept its fill SMs: 14.63 against 15.49 without, line 14).
    coop_fill_sms_min_entries_per_route: int = 2
    # Deterministic calls that sort their segments (sort_min_buckets) take the fill SMs too:
    # the fill blocks write the fill and leave, and the counting blocks (at least one per two
    # buckets, where the SMs allow) sort after the second barrier. Without them every block
    # fills before it counts. Off: r54 (H100) measured it faster at T=1024 to 4096 of LoRA
    # E=256 B=64 16 slots (uniform 0.5 to 0.9 us) but slower at T=16384 (3.8 us, 60 blocks
    # left to sort) and skewed T=1024 (2.8 us); docs/tuning.md has the rows.
    coop_fill_sms_sorted: bool = False
    # From this many output entries align_tiny (past one warp's routes) gets fill blocks:
    # a block per fill_per_block entries writes the fill while block 0 counts. LoRA rows
    # gain at every size since r44's faster fill blocks (r45, H100: T=16 E=64 16 slots 3.90
    # against 4.97 us); one row's fill is short, and below the second figure block 0 writes
    # it sooner than it could wait for a fill block (base T=16 E=64 2.18 against 2.87 us).
    tiny_fill_blocks_from: int = 0
    tiny_fill_blocks_one_row_from: int = 32768
    # From this many routes a base align_tiny call without fill blocks (a thread a bucket)
    # builds its sorted_ids row in shared memory, where it fits, and stores it coalesced
    # after the scan (align_tiny_staged). In the cluster's range such a call keeps one block
    # below the second figure of routes (deterministic: the third) and of fewer output
    # entries than the fourth.
    tiny_stage_from: int = 1024
    # Deterministic align_tiny from this many buckets, and of the second to the third figure
    # of routes, ranks through its chunks' groups (align_tiny_chunked: an atomic a group of a
    # warp's routes of one bucket, a walk over the bucket's groups) instead of a counter a
    # bucket a warp. Those counters fit 4096 buckets only up to 16 warps of routes (the
    # cooperative launch took more), and cost most there. r49, H200, the chunks against the
    # default before (r48's digit sort from 320 routes at 4096 buckets, else the counters or
    # the cooperative launch), LoRA E=256: 16 slots T=16 6.17 against 6.92 us, T=64 6.76
    # against 8.77, T=256 9.85 against 12.96; 8 slots T=16 4.87 against 5.29, T=256 9.53
    # against 10.65. They lost at 1024 buckets and fewer for few routes (E=64 16 slots T=16
    # 5.23 against 4.63; base T=256 E=256 8.59 against 5.04) and tied the cooperative launch
    # at 4096 routes.
    tiny_chunk_ranks_from: int = 2048
    tiny_chunk_ranks_min_routes: int = 33
    tiny_chunk_ranks_max_routes: int = 2048
    # Below that cut, from the first figure of buckets, the chunks take calls of the second
    # figure of routes and more (up to tiny_chunk_ranks_max_routes). r49, 1024 buckets, the
    # chunks against the counters (H200 at 7671437; H100 at 2b977d0): E=256 4 slots T=64
    # 5.50 against 5.68 us (5.41 against 5.67), T=256 8.62 against 9.67 (8.54 against
    # 9.67); E=64 K=6 16 slots T=256 7.77 against 8.16 (7.73 against 8.16); with 96 routes
    # (E=64 K=6 16 slots T=16) they lost, 5.23 against 4.62.
    tiny_chunk_ranks_mid_buckets: int = 1024
    tiny_chunk_ranks_mid_min_routes: int = 512
    # LoRA calls of 2 to tiny_row_blocks_max_rows slots over at most tiny_one_bucket_max
    # experts, from the first figure of routes to the second (at most TINY_ITEMS * BLOCK): a
    # block a slot (align_tiny_rows), each aligning its slot's routes as a base row of E
    # buckets, ahead of one block over every slot's buckets and the launches for more
    # routes. r55 (H100, A/B lines 34 and 38): LoRA E=256 16 slots T=16 2.70 against 4.65
    # us, T=256 4.10 against 7.40, T=512 4.61 against 10.18; T=1 2.54 against 3.48;
    # deterministic T=16 3.10 against 6.06. r56 (line 40), past 32 slots: 64 slots T=16
    # 3.00 against 38.61, 128 slots of 64 T=16 3.48 against 26.58 (docs/tuning.md).
    tiny_row_blocks: bool = True
    tiny_row_blocks_min_routes: int = 1
    tiny_row_blocks_max_routes: int = 4096
    tiny_row_blocks_max_rows: int = 128
    # LoRA calls of 2 to cluster_rows_max_rows slots, of cluster_rows_min_routes to
    # cluster_rows_max_routes routes (deterministic: cluster_rows_max_routes_deterministic)
    # (sm_90+): a cluster a slot (align_cluster_rows), each aligning its slot's routes as one
    # row of E buckets, where the cooperative launch ran every slot's buckets (the cluster
    # over at most cluster_max_buckets keeps its range). H100, A/B lines 41 (r56) and 42
    # (r57), LoRA E=256 16 slots: B=64 T=1024 6.36 against 10.90 us, deterministic 7.50
    # against 15.15; K=8 T=1536 (12288 routes) 10.66 against 11.03, deterministic 12.97
    # against 15.25. From 16384 routes the free call lost (T=2048 11.56 against 11.12), the
    # deterministic one from 24576 (T=3072 15.56 against 15.34).
    # Up to cluster_rows_wide_max_rows slots of at least cluster_rows_wide_min_experts
    # experts, the cut is at least cluster_rows_routes_per_row routes a slot (deterministic:
    # _deterministic): the cooperative launch over that many buckets stays slow with fewer
    # slots, while 16 clusters of 8 blocks are more than an H100 holds at once (r56: E=64 4
    # slots of 24576 routes lost, 7.66 against 6.88 us, where its 256 buckets are cheap). r58
    # (H100, A/B lines 46 and 48), E=256 B=64 K=8: 8 slots 49152 routes 8.51 against 9.98
    # us, deterministic 65536 12.02 against 18.76; 4 slots 24576 7.45 against 7.57 and 32768
    # lost (8.08 against 7.73), deterministic 32768 10.36 against 12.50; 2 slots 16384 lost
    # (E=512: 7.87 against 7.53), deterministic 9.87 against 12.40.
    cluster_rows: bool = True
    cluster_rows_min_routes: int = 4097
    cluster_rows_max_routes: int = 12288
    cluster_rows_max_routes_deterministic: int = 16384
    cluster_rows_routes_per_row: int = 6144
    cluster_rows_routes_per_row_deterministic: int = 8192
    cluster_rows_wide_max_rows: int = 8
    cluster_rows_wide_min_experts: int = 256
    cluster_rows_max_rows: int = 16
    # Base + LoRA pairs whose LoRA side would run a cluster a row alone, of at most
    # cluster_rows_pair_max_routes routes (deterministic: _deterministic) and at least
    # cluster_rows_pair_min_experts experts (the sizes measured): base on a cluster
    # beside the rows' clusters, one launch (align_cluster_rows_pair), where the cooperative
    # pair ran. r58 (H100, A/B lines 47 and 49), E=256 B=64: 8 slots 8192 routes 6.21 against
    # 10.45 us, deterministic 7.27 against 19.48; 16 slots 12288 10.75 against 12.54; 8 slots
    # 16384 8.63 against 10.53; 32768 lost (12.00 against 10.66), deterministic won (14.29
    # against 18.61).
    cluster_rows_pair: bool = True
    cluster_rows_pair_max_routes: int = 16384
    cluster_rows_pair_max_routes_deterministic: int = 32768
    cluster_rows_pair_min_experts: int = 256
    # Base + LoRA pairs of at most this many routes whose LoRA side takes a block a row:
    # base in block 0 and the rows after it (choose_pair) ahead of the cluster pair, which
    # choose_streams otherwise tries first in the cluster's range. r56 (H100, A/B line 39):
    # E=256 4 slots T=288 (2304 routes) 5.26 against 6.65 us, deterministic 6.53 against
    # 7.66; at 4096 routes it lost (7.58 against 7.14; 2 slots 7.58 against 6.47).
    pair_row_blocks_over_cluster_max_routes: int = 2304
    cluster_over_staged_from: int = 4097
    cluster_over_staged_from_deterministic: int = 2304
    cluster_over_staged_entries: int = 16384
    chunk_matrix_budget: int = 1 << 18   # entries of the deterministic [chunks, buckets] matrix


DEFAULT_POLICY = AlignPolicy()

# "shared" / "global": where the counting histogram lives (one block at decode sizes, else a
# count and a place launch); "cooperative": shared histograms, one launch of resident blocks
# with a grid-wide barrier between counting and placing; "cluster": one launch of one
# thread-block cluster (sm_90 and newer), the blocks meeting at the cluster's barrier.
VARIANTS = ("shared", "global", "cooperative", "cluster")


# The kernels' MODE template argument (kernels/align_kernels.cu: MODE_*).
MODE_SHARED, MODE_GLOBAL, MODE_DETERMINISTIC = 0, 1, 2


@dataclass(frozen=True)
class DeviceLimits:
    sm_count: int
    smem_optin: int           # MaxSharedMemoryPerBlockOptin, bytes
    cooperative: bool = False  # the device and the launcher can issue cooperative launches
    clusters: bool = False    # thread-block clusters (compute capability 9.0 and newer)

    @property
    def dynamic_smem(self) -> int:
        """Dynamic shared bytes any kernel may be given: the opt-in limit less SMEM_SLACK."""
        return self.smem_optin - SMEM_SLACK

    @classmethod
    def h200(cls):
        return cls(sm_count=132, smem_optin=232448, cooperative=True, clusters=True)


@dataclass(frozen=True)
class Launch:
    """How one alignment runs: ``single`` (one block, one launch), ``multi`` (count, place),
    ``cooperative`` (one launch of resident blocks, a grid barrier inside) or ``cluster``
    (one launch of one cluster of CLUSTER_BLOCKS blocks; a fused pair: two clusters)."""
    variant: str              # "shared", "global", "cooperative" or "cluster"
    kind: str                 # "single", "multi", "cooperative" or "cluster"
    deterministic: bool
    block: int                # threads per block
    grid: int = 1             # blocks of each launch (multi: of the place kernel)
    count_grid: int = 1       # multi: blocks of the count kernel (>= grid; extra ones fill)
    chunk: int = 0            # routes per chunk (multi, cooperative, cluster: per block)
    range_width: int = 0      # buckets per block (deterministic multi)
    ranges: int = 1           # bucket ranges per chunk (deterministic multi)
    smem_single: int = 0      # dynamic shared bytes of the single-block kernel
    smem_count: int = 0       # dynamic shared bytes of the count kernel
    smem_place: int = 0       # dynamic shared bytes of the place kernel (cooperative and
                              #   cluster: of their one kernel)
    starts_in_smem: bool = False  # place kernel copies the segment starts to shared memory
    stage_output: bool = False    # place kernel stages routes for coalesced stores (shared);
                                  #   align_tiny (base): its row built in shared memory
    tiny: bool = False            # single: align_tiny (a thread per bucket), not align_single
    sorted: bool = False      # cooperative, deterministic: sorts every segment after a
                              #   second barrier (else ranks in flat order)
    sort_runs: bool = False   # sorted: the bitmaps read back as runs (COOP_SORTED_RUNS)
    fill_grid: int = 0        # cooperative: the grid's last blocks, align_tiny: the blocks
                              #   after the first, which only write the sentinel fill (the
                              #   aligning blocks fill when 0)
    order_grid: int = 0       # > 0: then align_order, this many blocks, sorts every segment
                              #   (deterministic output from the free-order count + place)
    smem_order: int = 0       # dynamic shared bytes of align_order (the sort's scratch)
    rank_chunks: bool = False  # single, tiny, deterministic: flat-order ranks from the
                               #   chunks' groups (align_tiny_chunked), not per-warp counters
    row_blocks: bool = False  # single, tiny, LoRA: a block a row (align_tiny_rows; grid = rows)
    row_clusters: bool = False  # cluster, LoRA: a cluster a row (align_cluster_rows; grid =
                                #   rows * CLUSTER_BLOCKS)

    @property
    def mode(self) -> int:
        """The kernels' MODE template argument."""
        if self.deterministic:
            return MODE_DETERMINISTIC
        return MODE_GLOBAL if self.variant == "global" else MODE_SHARED

    @property
    def launches(self) -> int:
        """Kernel launches it issues (``launch_kernels`` lists them)."""
        return len(launch_kernels(self))

    @property
    def deterministic_output(self) -> bool:
        """Routes in flat order: ranked or sorted so by the kernel, or sorted by align_order."""
        return self.deterministic or self.order_grid > 0


def row_region_bytes(rows: int) -> int:
    """kernels/align_common.cuh: row_region_bytes (processed flags and the slot list)."""
    return ((((rows + 3) & ~3) + 4 * (rows + 1)) + 15) & ~15


def _even(n: int) -> int:
    return n + (n & 1)


# ---- what each kernel needs: the one description that both the choice and the launch read --
# Dynamic shared bytes of each kernel's layout (the layout comments in kernels/align_kernels.cu).
# The dispatcher picks only launches whose needs fit DeviceLimits.dynamic_smem, and
# check_launch refuses, before anything is launched, a launch that would give a kernel less
# than its layout needs, more than the device allows, or a grid the kernel cannot run.
def smem_one_block(num_buckets: int, rows: int, warp_counter_bytes: int = 0) -> int:
    """align_single / align_tiny (and their pair kernels): starts[nb + 1], then the
    deterministic per-warp counters."""
    return row_region_bytes(rows) + 4 * (num_buckets + 1) + warp_counter_bytes


def smem_count(mode: int, num_buckets: int, rows: int, range_width: int = 0) -> int:
    """align_count: hist[nb + 1] (shared), hist[range_width] (deterministic), none (global)."""
    hist = {MODE_SHARED: 4 * (num_buckets + 1), MODE_GLOBAL: 0,
            MODE_DETERMINISTIC: 4 * range_width}[mode]
    return row_region_bytes(rows) + hist


def smem_place(mode: int, num_buckets: int, rows: int, *, range_width: int = 0,
               starts_in_smem: bool = False, stage_chunk: int = 0) -> int:
    """align_place: hist[nb + 1] and base[nb] (shared) or warp_counts[32 * range_width] ushort
    and offsets[range_width] (deterministic), then starts[nb + 1] when copied, then the
    staging's value[chunk] and position[chunk] (shared, when staged)."""
    head = {MODE_SHARED: 4 * (2 * num_buckets + 1), MODE_GLOBAL: 0,
            MODE_DETERMINISTIC: (2 * (BLOCK // 32) + 4) * range_width}[mode]
    starts = 4 * (num_buckets + 1) if starts_in_smem else 0
    return row_region_bytes(rows) + head + starts + 8 * stage_chunk


def smem_cooperative(num_buckets: int, rows: int, chunk: int, deterministic: bool,
                     numel: int = 0, sort: bool = False, block: int = BLOCK) -> int:
    """align_cooperative: hist[nb + 1], adj[nb], starts[nb + 1], then value[chunk] and
    bucket_of_k[chunk]; deterministic: with ``sort`` the segment sort's scratch in their
    place where larger, else warp_counts[block / 32 * even(nb)] ushort after them."""
    staging = 8 * chunk
    if deterministic and sort:
        staging = max(staging, order_scratch_bytes(numel))
    elif deterministic:
        staging += 2 * (block // 32) * _even(num_buckets)
    return row_region_bytes(rows) + 4 * (3 * num_buckets + 2) + staging


def smem_cluster(num_buckets: int, rows: int, deterministic: bool = False,
                 block: int = BLOCK) -> int:
    """align_cluster: hist[nb], starts[nb + 1], before[nb]; deterministic: then
    warp_counts[block / 32 * even(nb)] ushort."""
    counters = 2 * (block // 32) * _even(num_buckets) if deterministic else 0
    return row_region_bytes(rows) + 4 * (3 * num_buckets + 1) + counters


def order_scratch_bytes(numel: int) -> int:
    """The segment sort's shared memory (order.cuh: align_order, and the cooperative kernel's
    deterministic mode): the largest of its digit sort's staging (routes, digit starts, scan
    sums), and the bitmap of the route indices (a bit a route, in whole 32-word rounds) with
    its summary (a bit a word of it) and a count a warp, two of them up to
    ORDER_BITMAP_ALL_MAX routes, which the block sorts at once (order_bitmaps_fit)."""
    bitmap = 4 * (33 * max(1, _ceil_div(numel, 1024)) + 32)
    digits = 4 * (2 * ORDER_DIGITS_MAX + 1 + 32)
    return max(digits, 2 * bitmap if numel <= ORDER_BITMAP_ALL_MAX else bitmap)


def order_grid(num_buckets: int, limits: DeviceLimits) -> int:
    """align_order's blocks: a warp for each bucket (else the warps take them in rounds), and
    at least two blocks an SM where buckets are that many (a block sorts each long segment of
    its warps' buckets)."""
    return max(_ceil_div(num_buckets, BLOCK // 32), min(num_buckets, 2 * limits.sm_count))


def _sorted_after(launch: Launch, numel: int, num_buckets: int, limits: DeviceLimits):
    """The count + place ``launch`` (non-deterministic) followed by align_order, or None
    where that does not apply: another kind of launch (the cooperative kernel sorts inside
    its own launch; one block and one cluster rank in order) or a sort whose shared memory
    does not fit."""
    if launch.kind != "multi" or order_scratch_bytes(numel) > limits.dynamic_smem:
        return None
    return replace(launch, order_grid=order_grid(num_buckets, limits),
                   smem_order=order_scratch_bytes(numel))


def shared_fits(num_buckets: int, rows: int, limits: DeviceLimits) -> bool:
    """The shared-histogram count + place launches fit: the place kernel, which holds two
    ints a bucket, is the larger (unstaged, starts read from global memory)."""
    return smem_place(MODE_SHARED, num_buckets, rows) <= limits.dynamic_smem


def single_block_threads(numel: int, out_entries: int, num_buckets: int = 0,
                         policy: AlignPolicy = DEFAULT_POLICY) -> int:
    """The smallest block that spreads align_single's serial loops: its claims (one route a
    thread up to ``one_route_per_thread`` routes, then up to ITEMS_PER_THREAD), the output
    fill and the bucket scan (docs/tuning.md: align_single's block)."""
    for block in policy.single_block_sizes:
        if (block * ITEMS_PER_THREAD >= numel
                and block >= min(numel, policy.one_route_per_thread)
                and block * policy.entries_per_thread >= out_entries
                and block * policy.buckets_per_thread >= num_buckets):
            return block
    return BLOCK


def tiny_block_threads(numel: int, out_entries: int, num_buckets: int,
                       policy: AlignPolicy = DEFAULT_POLICY):
    """Threads of align_tiny (a multiple of 32): one per bucket up to ``tiny_one_bucket_max``
    buckets, else one per TINY_BUCKETS buckets; one route each up to ``one_route_per_thread``
    routes, at most TINY_ITEMS; ``entries_per_thread`` entries of the fill each, or all BLOCK
    threads for larger fills. None where one block cannot hold the routes or the buckets.
    The kernel gives each thread TINY_BUCKETS buckets exactly when there are more buckets
    than threads."""
    bucket_threads = (num_buckets if num_buckets <= policy.tiny_one_bucket_max
                      else _ceil_div(num_buckets, TINY_BUCKETS))
    need = max(32, bucket_threads, min(numel, policy.one_route_per_thread),
               _ceil_div(numel, TINY_ITEMS),
               min(_ceil_div(out_entries, policy.entries_per_thread), BLOCK))
    block = _ceil_div(need, 32) * 32
    return block if block <= BLOCK else None


def tiny_warp_counter_bytes(numel: int, block: int, num_buckets: int) -> int:
    """Deterministic align_tiny's per-warp counters: a row of ``unsigned short`` (rounded up
    to even) for each warp holding routes, at 1, 2 or 4 routes a lane (the fewest that cover
    them; kernels/align_kernels.cu: align_tiny_buckets)."""
    items = 1 if numel <= block else 2 if numel <= 2 * block else 4
    return 2 * _ceil_div(numel, 32 * items) * (num_buckets + (num_buckets & 1))


def tiny_chunk_bytes(numel: int, num_buckets: int) -> int:
    """align_tiny_chunked's shared memory past the counts (kernels/one_block.cuh: ChunkRanks):
    the unpadded starts, the scan's warp totals, and a record a route (at most; one a group
    of a warp's routes of one bucket)."""
    return 4 * num_buckets + 4 * 32 + 4 * numel


def tiny_ranks_by_chunks(numel: int, num_buckets: int,
                         policy: AlignPolicy = DEFAULT_POLICY) -> bool:
    """Deterministic align_tiny ranks through its chunks' groups (align_tiny_chunked): from
    ``policy.tiny_chunk_ranks_from`` buckets for the policy's range of routes, and from
    ``tiny_chunk_ranks_mid_buckets`` for ``tiny_chunk_ranks_mid_min_routes`` routes and more
    (never one warp's, which rank in lane order on one warp)."""
    if numel <= WARP_ROUTES or numel > policy.tiny_chunk_ranks_max_routes:
        return False
    if num_buckets >= policy.tiny_chunk_ranks_from:
        return numel >= policy.tiny_chunk_ranks_min_routes
    return (num_buckets >= policy.tiny_chunk_ranks_mid_buckets
            and numel >= policy.tiny_chunk_ranks_mid_min_routes)


def tiny_fill_blocks(numel: int, out_entries: int, rows: int, limits: DeviceLimits,
                     policy: AlignPolicy = DEFAULT_POLICY, aligning: int = 1) -> int:
    """Fill blocks of an align_tiny launch of ``rows`` rows (or of the LoRA side of the fused
    tiny pair) beside its ``aligning`` blocks: one per ``fill_per_block`` output entries from
    ``tiny_fill_blocks_from`` on (one row: ``tiny_fill_blocks_one_row_from``), the launch
    within the SMs; none on the one-warp path (which fills itself) or where the launch cannot
    be cooperative (the aligning blocks wait for the fill blocks, so all must be resident).
    The aligning blocks are then sized without the fill."""
    cut = policy.tiny_fill_blocks_from if rows > 1 else policy.tiny_fill_blocks_one_row_from
    if not limits.cooperative or numel <= WARP_ROUTES or out_entries < cut:
        return 0
    return max(0, min(limits.sm_count - aligning, _ceil_div(out_entries, policy.fill_per_block)))


def tiny_row_blocks(numel: int, num_buckets: int, rows: int, out_entries: int,
                    deterministic: bool, limits: DeviceLimits,
                    policy: AlignPolicy = DEFAULT_POLICY):
    """A LoRA alignment of 2 to ``policy.tiny_row_blocks_max_rows`` rows as a block a row
    (align_tiny_rows), where the policy takes its routes and its experts fit a thread a
    bucket; else None. Each block is align_tiny's base block over one row's E buckets and
    one row's output entries."""
    if not (policy.tiny_row_blocks and policy.use_tiny
            and 2 <= rows <= policy.tiny_row_blocks_max_rows
            and policy.tiny_row_blocks_min_routes <= numel
            <= min(policy.tiny_row_blocks_max_routes, TINY_ITEMS * BLOCK)):
        return None
    experts = num_buckets // rows
    if experts > policy.tiny_one_bucket_max:
        return None
    block = tiny_block_threads(numel, out_entries // rows, experts, policy)
    if block is None:
        return None
    counters = tiny_warp_counter_bytes(numel, block, experts) if deterministic else 0
    smem = smem_one_block(experts, 1, counters)
    if smem > limits.dynamic_smem:
        return None
    return Launch("shared", "single", deterministic, block, grid=rows, smem_single=smem,
                  tiny=True, row_blocks=True)


def _single_block(numel, num_buckets, rows, deterministic, limits, out_entries=0,
                  use_tiny=True, policy: AlignPolicy = DEFAULT_POLICY, fill_blocks=True,
                  rank_chunks=True, lora=False):
    """``rank_chunks``: a deterministic align_tiny may rank through its chunks' groups (not
    in the fused pair kernels, which keep per-warp counters). ``lora``: a LoRA alignment,
    whose one row align_tiny_staged does not stage (it stages base rows only); with
    ``fill_blocks`` (not in the fused pair kernels) its rows may take a block each."""
    if numel > SINGLE_BLOCK_MAX_ROUTES:
        return None
    if lora and use_tiny and fill_blocks:
        rows_launch = tiny_row_blocks(numel, num_buckets, rows, out_entries, deterministic,
                                      limits, policy)
        if rows_launch is not None:
            return rows_launch
    base = smem_one_block(num_buckets, rows)
    block = single_block_threads(numel, out_entries, num_buckets, policy)
    fill = tiny_fill_blocks(numel, out_entries, rows, limits, policy) if fill_blocks else 0
    tiny = (tiny_block_threads(numel, 0 if fill else out_entries, num_buckets, policy)
            if policy.use_tiny and use_tiny else None)
    if tiny is not None and deterministic and rank_chunks and tiny_ranks_by_chunks(
            numel, num_buckets, policy):
        smem = base + tiny_chunk_bytes(numel, num_buckets)
        if smem <= limits.dynamic_smem:
            return Launch("shared", "single", True, tiny, grid=1 + fill, smem_single=smem,
                          tiny=True, fill_grid=fill, rank_chunks=True)
    if tiny is not None:
        smem = base + (tiny_warp_counter_bytes(numel, tiny, num_buckets) if deterministic else 0)
        # the staged base row (a bound: out_entries holds the row and its tiles; 0, unknown)
        staged = _align16(smem) + 4 * out_entries
        if (fill_blocks and not fill and rows == 1 and not lora and out_entries > 0
                and numel >= policy.tiny_stage_from
                and numel > WARP_ROUTES and num_buckets <= tiny
                and staged <= limits.dynamic_smem):
            return Launch("shared", "single", deterministic, tiny, smem_single=staged,
                          tiny=True, stage_output=True)
        if smem <= limits.dynamic_smem:
            return Launch("shared", "single", deterministic, tiny, grid=1 + fill,
                          smem_single=smem, tiny=True, fill_grid=fill)
    if not deterministic:
        if base > limits.dynamic_smem:
            return None
        return Launch("shared", "single", False, block, smem_single=base)
    # Deterministic: one unsigned short counter per (warp, bucket); fewer warps if they don't fit.
    for warps in (32, 16, 8, 4):
        if 32 * warps > block:
            continue
        smem = smem_one_block(num_buckets, rows, 2 * warps * _even(num_buckets))
        if smem <= limits.dynamic_smem:
            return Launch("shared", "single", True, 32 * warps, smem_single=smem)
    return None


def _ceil_div(a, b):
    return -(-a // b)


def _align16(n: int) -> int:
    return (n + 15) & ~15


def tiny_stage_entries(launch: "Launch", numel: int, num_buckets: int) -> int:
    """Ints of a staged align_tiny launch's row image: its shared memory past the counters,
    16-byte aligned (kernels/one_block.cuh: align_tiny_buckets' ``image``); 0 unstaged."""
    if not (launch.kind == "single" and launch.tiny and launch.stage_output):
        return 0
    layout = smem_one_block(num_buckets, 1, _one_block_counters(launch, numel, num_buckets))
    return max(0, (launch.smem_single - _align16(layout)) // 4)


def sorts_segments(num_buckets: int, policy: AlignPolicy) -> bool:
    """The policy's way to deterministic output for multi-block launches: sort every
    segment after the free-order kernels (True), or rank in flat order (False)."""
    return policy.sort_for_determinism and num_buckets >= policy.sort_min_buckets


def two_blocks_an_sm(block: int, smem: int, limits: DeviceLimits) -> bool:
    """Two blocks of align_cooperative fit on one SM: at most FILL_SPLIT_BLOCK threads each
    (registers) and both blocks' shared memory, with the kernel's static part and the
    driver's reserve, within one block's opt-in limit (below the SM's capacity)."""
    return block <= FILL_SPLIT_BLOCK and 2 * (smem + SMEM_SLACK + 1024) <= limits.smem_optin


def coop_fill_blocks(numel: int, out_entries: int, deterministic: bool,
                     policy: AlignPolicy = DEFAULT_POLICY) -> bool:
    """The policy gives the cooperative launch of ``numel`` routes writing ``out_entries``
    output entries fill blocks: from ``coop_fill_blocks_from`` entries, below
    ``coop_fill_blocks_below``, or for free-order calls of fewer than
    ``coop_fill_blocks_free_routes`` routes below ``coop_fill_blocks_free_below``."""
    if out_entries < policy.coop_fill_blocks_from:
        return False
    if out_entries < policy.coop_fill_blocks_below:
        return True
    return (not deterministic and numel < policy.coop_fill_blocks_free_routes
            and out_entries < policy.coop_fill_blocks_free_below)


def _cooperative(numel, num_buckets, rows, limits, out_entries, deterministic=False,
                 policy: AlignPolicy = DEFAULT_POLICY, fill_blocks: bool = True):
    """The one-launch multi-block kernel's geometry, or None where it cannot run: no
    cooperative launch, more routes than the resident blocks hold, or its shared memory
    (histogram, reserved offsets, starts: 12 bytes a bucket; 8 bytes a staged route; in
    deterministic mode the segment sort's scratch where larger, or 2 bytes a bucket a warp
    of per-warp counters for ordered ranks) does not fit. Deterministic: the way the policy
    prefers (``sorts_segments``), else the other where only it fits.

    Where ``fill_blocks``, ``coop_fill_sms_from``, ``coop_fill_blocks_from`` and
    ``coop_fill_sms_min_entries_per_route`` allow, one block of BLOCK threads an SM:
    counting blocks, then fill blocks that only write the sentinel fill, on SMs of their
    own. Else, where ``coop_fill_blocks`` allows, blocks of FILL_SPLIT_BLOCK threads, two
    an SM: counting blocks, then fill blocks. Else (or where neither fits) one block of
    BLOCK threads an SM, the counting blocks filling too. Every block is resident whatever
    the occupancy."""
    if not limits.cooperative:
        return None
    if (fill_blocks and out_entries >= max(policy.coop_fill_sms_from,
                                           policy.coop_fill_blocks_from)
            and out_entries >= policy.coop_fill_sms_min_entries_per_route * numel):
        whole = _cooperative_blocks(numel, num_buckets, rows, limits, out_entries,
                                    deterministic, policy, BLOCK, fill_sms=True)
        if whole is not None:
            return whole
    if fill_blocks and coop_fill_blocks(numel, out_entries, deterministic, policy):
        split = _cooperative_blocks(numel, num_buckets, rows, limits, out_entries,
                                    deterministic, policy, FILL_SPLIT_BLOCK)
        if split is not None:
            return split
    return _cooperative_blocks(numel, num_buckets, rows, limits, out_entries, deterministic,
                               policy, BLOCK)


def _cooperative_blocks(numel, num_buckets, rows, limits, out_entries, deterministic, policy,
                        block, fill_sms=False):
    """``fill_sms``: blocks of BLOCK threads, the fill blocks on SMs of their own
    (``coop_fill_sm_entries``), the routes in chunks of whole warps over the other SMs; None
    where no SM is left over, or the launch sorts and ``coop_fill_sms_sorted`` is off."""
    if fill_sms:
        wanted = _ceil_div(out_entries, policy.coop_fill_sm_entries)
        fill = min(wanted, limits.sm_count - _ceil_div(max(numel, 1), COOP_ITEMS * block))
        if fill < 1:
            return None
        per_sm = _ceil_div(max(numel, 1), limits.sm_count - fill)
        chunk = _ceil_div(per_sm, 32) * 32
    else:
        per_sm = _ceil_div(max(numel, 1), limits.sm_count)
        chunk = max(block, _ceil_div(per_sm, block) * block)
    if chunk > COOP_ITEMS * block:
        return None
    ways = [False]
    if deterministic:
        prefer = sorts_segments(num_buckets, policy)
        ways = [prefer, not prefer]
    for sort in ways:
        # The segment sort holds a segment of up to ORDER_DIGITS_MAX in a block of BLOCK.
        if sort and block != BLOCK:
            return None
        smem = smem_cooperative(num_buckets, rows, chunk, deterministic, numel, sort, block)
        if smem <= limits.dynamic_smem:
            break
    else:
        return None
    runs = sort and policy.sort_runs_above_routes < numel <= ORDER_BITMAP_ALL_MAX
    # Blocks past the last chunk (of the SMs the fill SMs leave) only sort, about two
    # segments a block, or fill.
    sort_blocks = _ceil_div(num_buckets, 2) if sort else 1
    if fill_sms:
        if sort and not policy.coop_fill_sms_sorted:
            return None
        counting = max(1, _ceil_div(numel, chunk), min(limits.sm_count - fill, sort_blocks))
        return Launch("cooperative", "cooperative", deterministic, block,
                      grid=counting + fill, chunk=chunk, smem_place=smem, sorted=sort,
                      sort_runs=runs, fill_grid=fill)
    fill = min(limits.sm_count, _ceil_div(out_entries, policy.fill_per_block))
    counting = max(1, _ceil_div(numel, chunk), min(limits.sm_count, sort_blocks))
    if block == BLOCK:
        # Blocks past the last chunk only take their share of the sentinel fill (and of the
        # segments to sort: about two a block).
        return Launch("cooperative", "cooperative", deterministic, block,
                      grid=max(counting, fill), chunk=chunk, smem_place=smem, sorted=sort,
                      sort_runs=runs)
    if not two_blocks_an_sm(block, smem, limits):
        return None
    fill = max(1, fill)
    return Launch("cooperative", "cooperative", deterministic, block, grid=counting + fill,
                  chunk=chunk, smem_place=smem, sorted=sort, sort_runs=runs, fill_grid=fill)


def cluster_block_threads(chunk: int, num_buckets: int,
                          policy: AlignPolicy = DEFAULT_POLICY) -> int:
    """Threads of each align_cluster block: ``cluster_routes_per_thread`` routes a thread of
    the block's ``chunk`` of routes and ``buckets_per_thread`` buckets a thread of the scan,
    at least ``cluster_min_block`` (the fill spreads over them), at most BLOCK; whole warps."""
    want = max(policy.cluster_min_block, _ceil_div(num_buckets, policy.buckets_per_thread),
               _ceil_div(chunk, max(1, policy.cluster_routes_per_thread)),
               _ceil_div(chunk, CLUSTER_ITEMS))
    return min(BLOCK, _ceil_div(want, 32) * 32)


def _cluster(numel, num_buckets, rows, limits, deterministic=False,
             policy: AlignPolicy = DEFAULT_POLICY, clusters: int = 1,
             row_clusters: bool = False):
    """align_cluster's geometry over ``clusters`` clusters (``row_clusters``: a cluster a
    LoRA row, each of ``num_buckets`` buckets), or None where it cannot run: no clusters on
    the device, more routes than the cluster's threads hold (CLUSTER_ITEMS each) or a
    histogram that does not fit (12 bytes a bucket, and deterministic: a 2-byte counter a
    bucket a warp)."""
    if not limits.clusters or numel > CLUSTER_BLOCKS * CLUSTER_ITEMS * BLOCK:
        return None
    chunk = _ceil_div(max(numel, 1), CLUSTER_BLOCKS)
    block = cluster_block_threads(chunk, num_buckets, policy)
    smem = smem_cluster(num_buckets, rows, deterministic, block)
    if smem > limits.dynamic_smem:
        return None
    return Launch("cluster", "cluster", deterministic, block, grid=clusters * CLUSTER_BLOCKS,
                  chunk=chunk, smem_place=smem, row_clusters=row_clusters)


def cluster_rows_route_cut(rows: int, num_experts: int, deterministic: bool,
                           policy: AlignPolicy) -> int:
    """The most routes a cluster a row takes for ``rows`` slots of ``num_experts`` experts:
    ``cluster_rows_max_routes`` (deterministic: ``_deterministic``), and up to
    ``cluster_rows_wide_max_rows`` slots of at least ``cluster_rows_wide_min_experts``
    experts at least ``cluster_rows_routes_per_row`` (``_deterministic``) routes a slot."""
    if deterministic:
        flat, per_row = (policy.cluster_rows_max_routes_deterministic,
                         policy.cluster_rows_routes_per_row_deterministic)
    else:
        flat, per_row = policy.cluster_rows_max_routes, policy.cluster_rows_routes_per_row
    wide = (rows <= policy.cluster_rows_wide_max_rows
            and num_experts >= policy.cluster_rows_wide_min_experts)
    return max(flat, per_row * rows) if wide else flat


def cluster_rows(numel: int, num_buckets: int, rows: int, limits: DeviceLimits,
                 deterministic: bool = False, policy: AlignPolicy = DEFAULT_POLICY):
    """A LoRA alignment of 2 to ``policy.cluster_rows_max_rows`` rows of
    ``cluster_rows_min_routes`` to ``cluster_rows_route_cut(...)`` routes as a cluster
    a row (align_cluster_rows), each cluster align_cluster's geometry for one row of E
    buckets over every route; else None."""
    if not (policy.cluster_rows and 2 <= rows <= policy.cluster_rows_max_rows
            and numel >= policy.cluster_rows_min_routes):
        return None
    experts = num_buckets // rows
    if numel > cluster_rows_route_cut(rows, experts, deterministic, policy):
        return None
    return _cluster(numel, experts, 1, limits, deterministic, policy, clusters=rows,
                    row_clusters=True)


def coop_over_single(out_entries: int, filled: bool, policy: AlignPolicy) -> bool:
    """The cooperative launch beats one block writing ``out_entries`` output entries
    (``filled``: that block has fill blocks beside it)."""
    return out_entries > (policy.coop_over_filled_single_entries if filled
                          else policy.coop_over_single_entries)


def in_cluster_range(numel: int, num_buckets: int, policy: AlignPolicy,
                     deterministic: bool = False) -> bool:
    """The policy hands alignments of ``numel`` routes over ``num_buckets`` buckets to one
    cluster (where it can run)."""
    most = (policy.cluster_max_routes_deterministic if deterministic
            else policy.cluster_max_routes)
    least = policy.cluster_min_routes - (policy.cluster_few_buckets_routes_earlier
                                         if num_buckets <= policy.cluster_few_buckets else 0)
    return least <= numel <= most and num_buckets <= policy.cluster_max_buckets


def choose_launch(numel: int, num_buckets: int, rows: int, limits: DeviceLimits, *,
                  deterministic: bool = False, variant: str | None = None,
                  out_entries: int = 0, policy: AlignPolicy = DEFAULT_POLICY,
                  lora: bool = False) -> Launch:
    """Pick the variant and launch geometry of one alignment.

    ``num_buckets`` is ``rows * num_experts``; ``out_entries`` the output entries written
    (``rows * (P + M)``), which sizes the single block and the fill's share of blocks;
    ``lora``: a LoRA alignment (even of one slot: only base rows are staged).
    ``variant`` forces a kernel family: "shared" (one block, else count + place with shared
    histograms), "global" (count + place, global counters) or "cooperative" (one launch of
    resident blocks) or "cluster" (one cluster of blocks, sm_90 and newer); forcing one that
    cannot run these sizes raises ``ValueError``. Left to itself the dispatcher picks one
    cluster between the policy's ``cluster_min_routes`` and ``cluster_max_routes`` where the
    device has clusters (unless align_tiny stages the row, below the
    ``cluster_over_staged_*`` figures), else one block at decode sizes, else the cooperative
    launch where it fits, else count + place. Deterministic calls: one block ranks in flat
    order; from ``policy.sort_min_buckets`` buckets (``sorts_segments``) the cooperative
    kernel sorts each segment inside its launch after a second barrier and count + place is
    followed by ``align_order``, which sorts each segment (where its shared memory fits);
    below that the multi-block kernels rank in flat order themselves.
    """
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS} or None, got {variant!r}")
    if deterministic and sorts_segments(num_buckets, policy) and variant != "cluster":
        # Where the non-deterministic pick (clusters aside) is count + place: it, then
        # align_order.
        try:
            fast = choose_launch(numel, num_buckets, rows, replace(limits, clusters=False),
                                 variant=variant, out_entries=out_entries, policy=policy,
                                 lora=lora)
        except ValueError:
            fast = None  # the forced variant refuses these sizes: its ordered kernels decide
        sorted_launch = fast and _sorted_after(fast, numel, num_buckets, limits)
        if sorted_launch is not None:
            return sorted_launch
    if variant == "cooperative":
        return _forced_cooperative(numel, num_buckets, rows, limits, deterministic, out_entries,
                                   policy)
    if variant == "cluster":
        return _forced_cluster(numel, num_buckets, rows, limits, deterministic, policy)
    coop = single = None
    if variant in (None, "shared"):
        single = _single_block(numel, num_buckets, rows, deterministic, limits, out_entries,
                               policy=policy, lora=lora)
    if single is not None and single.row_blocks:
        return single  # the policy's range of routes for a block a row
    staged = (single is not None and single.stage_output
              and numel < (policy.cluster_over_staged_from_deterministic if deterministic
                           else policy.cluster_over_staged_from)
              and out_entries < policy.cluster_over_staged_entries)
    if variant is None and not staged and in_cluster_range(numel, num_buckets, policy,
                                                           deterministic):
        cluster = _cluster(numel, num_buckets, rows, limits, deterministic, policy)
        if cluster is not None:
            return cluster
    if variant is None and lora:  # the policy's range for a cluster a row, ahead of coop
        row_clusters = cluster_rows(numel, num_buckets, rows, limits, deterministic, policy)
        if row_clusters is not None:
            return row_clusters
    if variant is None:
        coop = _cooperative(numel, num_buckets, rows, limits, out_entries, deterministic,
                            policy)
    if coop is not None and coop_over_single(out_entries, single is not None and
                                             single.fill_grid > 0, policy):
        return coop
    if single is not None:
        return single
    if coop is not None:
        return coop
    fits = shared_fits(num_buckets, rows, limits)
    if variant == "shared" and not fits and not deterministic:
        need = smem_place(MODE_SHARED, num_buckets, rows)
        raise ValueError(
            f"variant='shared' cannot run {numel} routes over {num_buckets} buckets: its place "
            f"kernel needs {need} bytes of shared memory (two ints a bucket) but the device "
            f"allows {limits.dynamic_smem} per block; use variant='global' or leave variant unset"
        )
    chosen = variant or ("shared" if fits else "global")

    if not deterministic:
        # Enough chunks to spread over the SMs, at most ITEMS_PER_THREAD routes a thread.
        per_sm = _ceil_div(max(numel, 1), limits.sm_count)
        chunk = min(SINGLE_BLOCK_MAX_ROUTES, max(BLOCK, _ceil_div(per_sm, BLOCK) * BLOCK))
        grid = max(1, _ceil_div(numel, chunk))
        # Blocks past the last chunk only write sentinels: the fill then spreads over the SMs.
        count_grid = max(grid, min(limits.sm_count,
                                   _ceil_div(out_entries, policy.fill_per_block)))
        if chosen == "global":
            copy = _room(smem_place(MODE_GLOBAL, num_buckets, rows, starts_in_smem=True),
                         limits)
            return Launch(chosen, "multi", False, BLOCK, grid=grid, count_grid=count_grid,
                          chunk=chunk, smem_count=smem_count(MODE_GLOBAL, num_buckets, rows),
                          smem_place=smem_place(MODE_GLOBAL, num_buckets, rows,
                                                starts_in_smem=copy),
                          starts_in_smem=copy)
        # Shared: counts and block bases, then staging, then the starts copy, as room allows.
        stage = _room(smem_place(MODE_SHARED, num_buckets, rows, stage_chunk=chunk), limits)
        staged = chunk if stage else 0
        copy = _room(smem_place(MODE_SHARED, num_buckets, rows, starts_in_smem=True,
                                stage_chunk=staged), limits)
        return Launch(chosen, "multi", False, BLOCK, grid=grid, count_grid=count_grid,
                      chunk=chunk, smem_count=smem_count(MODE_SHARED, num_buckets, rows),
                      smem_place=smem_place(MODE_SHARED, num_buckets, rows,
                                            starts_in_smem=copy, stage_chunk=staged),
                      starts_in_smem=copy, stage_output=stage)

    # Deterministic: blocks tile (chunk, bucket range); per-warp counters cover one range.
    warps = BLOCK // 32
    avail = limits.dynamic_smem - row_region_bytes(rows)
    width = min(num_buckets, avail // (2 * warps + 4))
    width = max(2, width - width % 32 if width >= 32 else width + (width & 1))
    ranges = _ceil_div(num_buckets, width)
    min_chunks = max(1, _ceil_div(numel, WARP_COUNTER_MAX))
    want = max(1, _ceil_div(limits.sm_count, ranges))
    budget = max(1, policy.chunk_matrix_budget // num_buckets)
    chunks = max(min_chunks, min(want, budget, max(1, _ceil_div(numel, BLOCK))))
    chunk = max(1, _ceil_div(numel, chunks))
    chunks = max(1, _ceil_div(numel, chunk))
    copy = _room(smem_place(MODE_DETERMINISTIC, num_buckets, rows, range_width=width,
                            starts_in_smem=True), limits)
    return Launch(chosen, "multi", True, BLOCK, grid=chunks * ranges,
                  count_grid=chunks * ranges, chunk=chunk,
                  range_width=width, ranges=ranges,
                  smem_count=smem_count(MODE_DETERMINISTIC, num_buckets, rows, width),
                  smem_place=smem_place(MODE_DETERMINISTIC, num_buckets, rows,
                                        range_width=width, starts_in_smem=copy),
                  starts_in_smem=copy)


def _forced_cooperative(numel, num_buckets, rows, limits, deterministic, out_entries, policy):
    coop = _cooperative(numel, num_buckets, rows, limits, out_entries, deterministic, policy)
    if coop is None:
        if not limits.cooperative:
            why = "this device or CuPy cannot issue cooperative launches"
        elif numel > limits.sm_count * COOP_ITEMS * BLOCK:
            why = (f"{numel} routes are more than its {limits.sm_count} resident blocks "
                   f"hold ({COOP_ITEMS * BLOCK} each)")
        else:
            why = (f"its shared memory for {num_buckets} buckets"
                   + (" (deterministic: with the segment sort's scratch or per-warp "
                      "counters)" if deterministic else "")
                   + f" exceeds the {limits.dynamic_smem} bytes a block may have")
        raise ValueError(f"variant='cooperative' cannot run this alignment: {why}; use "
                         "variant='shared' or 'global', or leave variant unset")
    return coop


def _forced_cluster(numel, num_buckets, rows, limits, deterministic, policy):
    cluster = _cluster(numel, num_buckets, rows, limits, deterministic, policy)
    if cluster is None:
        if not limits.clusters:
            why = "this device has no thread-block clusters (compute capability 9.0 or newer)"
        elif numel > CLUSTER_BLOCKS * CLUSTER_ITEMS * BLOCK:
            why = (f"{numel} routes are more than its {CLUSTER_BLOCKS} blocks hold "
                   f"({CLUSTER_ITEMS * BLOCK} each)")
        else:
            why = (f"its shared memory for {num_buckets} buckets exceeds the "
                   f"{limits.dynamic_smem} bytes a block may have")
        raise ValueError(f"variant='cluster' cannot run this alignment: {why}; use another "
                         "variant or leave variant unset")
    return cluster


def pair_in_cluster_range(numel: int, lora_buckets: int, rows: int, out_entries: int,
                          deterministic: bool, limits: DeviceLimits,
                          policy: AlignPolicy = DEFAULT_POLICY) -> bool:
    """The policy hands a base + LoRA pair to the cluster pair: its LoRA side is in the
    cluster's range, unless up to ``pair_row_blocks_over_cluster_max_routes`` routes that
    side runs a block a row (then base in block 0 and the rows after it win)."""
    if not in_cluster_range(numel, lora_buckets, policy, deterministic):
        return False
    return not (numel <= policy.pair_row_blocks_over_cluster_max_routes
                and tiny_row_blocks(numel, lora_buckets, rows, out_entries, deterministic,
                                    limits, policy) is not None)


def _fused_clusters(base, lora, sides, grid: int, deterministic: bool,
                    limits: DeviceLimits):
    """One cluster launch of ``grid`` blocks serving base and LoRA, each side's align_cluster
    geometry for the same routes: the larger block, and the larger of the ``sides``' layouts
    (``(num_buckets, rows)`` a cluster holds) at it; None where a side has no geometry or
    the layout exceeds the device."""
    if base is None or lora is None:
        return None
    block = max(base.block, lora.block)
    smem = max(smem_cluster(nb, r, deterministic, block) for nb, r in sides)
    if smem > limits.dynamic_smem:
        return None
    return replace(lora, block=block, grid=grid, smem_place=smem)


def choose_cluster_pair(numel: int, base_buckets: int, lora_buckets: int, rows: int,
                        limits: DeviceLimits, *, deterministic: bool = False,
                        policy: AlignPolicy = DEFAULT_POLICY):
    """Base and LoRA in one launch of two clusters (cluster 0 base, cluster 1 LoRA): both
    sides have the same routes, so one geometry serves both, with the larger side's shared
    memory; None where align_cluster cannot run either side."""
    return _fused_clusters(_cluster(numel, base_buckets, 1, limits, deterministic, policy),
                           _cluster(numel, lora_buckets, rows, limits, deterministic, policy),
                           [(base_buckets, 1), (lora_buckets, rows)], 2 * CLUSTER_BLOCKS,
                           deterministic, limits)


def choose_cluster_rows_pair(numel: int, base_buckets: int, lora_buckets: int, rows: int,
                             limits: DeviceLimits, *, deterministic: bool = False,
                             policy: AlignPolicy = DEFAULT_POLICY):
    """Base on cluster 0 and a cluster a LoRA row after it, in one launch, where the policy
    takes pairs so (``cluster_rows_pair``, up to ``cluster_rows_pair_max_routes`` routes)
    and the LoRA side alone would run a cluster a row; both sides in align_cluster's
    geometry for these routes; else None."""
    most = (policy.cluster_rows_pair_max_routes_deterministic if deterministic
            else policy.cluster_rows_pair_max_routes)
    takes = (policy.cluster_rows_pair and numel <= most
             and base_buckets >= policy.cluster_rows_pair_min_experts)
    lora = (cluster_rows(numel, lora_buckets, rows, limits, deterministic, policy)
            if takes else None)
    if lora is None:  # (before the base side's geometry is worked out)
        return None
    return _fused_clusters(_cluster(numel, base_buckets, 1, limits, deterministic, policy),
                           lora, [(base_buckets, 1), (lora_buckets // rows, 1)],
                           (1 + rows) * CLUSTER_BLOCKS, deterministic, limits)


def _room(smem: int, limits: DeviceLimits) -> bool:
    """An optional part of a layout (staging, a starts copy) is used when it fits."""
    return smem <= limits.dynamic_smem


@dataclass(frozen=True)
class CooperativePair:
    """Base and LoRA in one cooperative launch: ``base.grid`` blocks, then ``lora.grid``;
    deterministic, each side its own way (ordered ranks or sorted segments)."""
    base: Launch
    lora: Launch
    smem: int                 # dynamic shared bytes: the larger side's

    @property
    def grid(self) -> int:
        return self.base.grid + self.lora.grid

    @property
    def deterministic(self) -> bool:
        return self.base.deterministic

    @property
    def modes(self) -> Tuple[int, int]:
        """The kernel's DET arguments of the two sides (COOP_FREE, _ORDERED, _SORTED or
        _SORTED_RUNS)."""
        return coop_mode(self.base), coop_mode(self.lora)


def coop_mode(launch: Launch) -> int:
    """align_cooperative's DET argument: 0 free order, 1 ordered ranks, 2 sorted segments,
    3 sorted with the bitmaps read back as runs."""
    if launch.sorted:
        return 3 if launch.sort_runs else 2
    return int(launch.deterministic)


# The cooperative pair kernel's instances, (base, LoRA) DET arguments: base has the fewer
# buckets, so it never sorts where LoRA ranks in order (kernels/cooperative.cuh). Both sides
# sorting (a policy that sorts base too) has none: the device's NVRTC (CUDA 13.2) spilled
# that instance (24 bytes), so such a pair runs on two streams.
COOP_PAIR_MODES = ((0, 0), (1, 1), (1, 2), (1, 3))


def choose_cooperative_pair(numel: int, base_buckets: int, lora_buckets: int, rows: int,
                            limits: DeviceLimits, *, base_entries: int = 0,
                            lora_entries: int = 0, deterministic: bool = False,
                            policy: AlignPolicy = DEFAULT_POLICY):
    """Both alignments in one cooperative launch, the SMs split between them, or ``None``
    where either side cannot run in its share. The base side gets enough blocks for about
    four routes a thread (it has little to fill), at most half the SMs; LoRA the rest (its
    rows' sentinel fill is most of the bytes). Deterministic: each side the way its own
    launch would take (``_cooperative``)."""
    if not limits.cooperative or limits.sm_count < 2:
        return None
    fewest = max(1, _ceil_div(numel, COOP_ITEMS * BLOCK))
    base_blocks = min(limits.sm_count // 2, max(fewest, _ceil_div(numel, 4 * BLOCK)))
    sides = []
    for blocks, nb, r, entries in ((base_blocks, base_buckets, 1, base_entries),
                                   (limits.sm_count - base_blocks, lora_buckets, rows,
                                    lora_entries)):
        side = _cooperative(numel, nb, r, DeviceLimits(blocks, limits.smem_optin, True),
                            entries, deterministic, policy=policy, fill_blocks=False)
        if side is None:
            return None
        sides.append(side)
    pair = CooperativePair(sides[0], sides[1], max(s.smem_place for s in sides))
    return pair if pair.modes in COOP_PAIR_MODES else None


def choose_pair(numel: int, base_buckets: int, lora_buckets: int, rows: int,
                limits: DeviceLimits, *, deterministic: bool = False, out_entries: int = 0,
                prefer_cooperative: bool = False, policy: AlignPolicy = DEFAULT_POLICY):
    """The fused single launch for base + LoRA, or ``None`` when either side needs more
    (or, with ``prefer_cooperative``, the LoRA side writes so much that one block for it
    loses to the cooperative pair). ``out_entries``: output entries of the LoRA side."""
    # The base side's block writes its own fill; the LoRA side's may have fill blocks (the
    # tiny pair only: blocks 2.. of its launch), and its block is then sized without it.
    fill = tiny_fill_blocks(numel, out_entries, rows, limits, policy, aligning=2)

    def cooperative_wins(filled: bool) -> bool:
        return (prefer_cooperative and not deterministic and limits.cooperative
                and coop_over_single(out_entries, filled, policy))

    base = _single_block(numel, base_buckets, 1, deterministic, limits,
                         out_entries // max(rows, 1), policy=policy, fill_blocks=False,
                         rank_chunks=False)
    # With a tiny base block, the LoRA side may take a block a row (blocks 1..rows).
    lora = (tiny_row_blocks(numel, lora_buckets, rows, out_entries, deterministic, limits,
                            policy) if base is not None and base.tiny else None)
    if lora is None:
        if cooperative_wins(fill > 0):
            return None
        lora = _single_block(numel, lora_buckets, rows, deterministic, limits,
                             0 if fill else out_entries, policy=policy, fill_blocks=False,
                             rank_chunks=False)
    if base is None or lora is None:
        return None
    if base.tiny and lora.tiny:
        block = max(base.block, lora.block)
        smem = max(base.smem_single, lora.smem_single)
        lora_side = (lora_buckets // rows, 1) if lora.row_blocks else (lora_buckets, rows)
        if deterministic:  # the counters follow the block: both sides at the larger one
            smem = max(smem_one_block(nb, r, tiny_warp_counter_bytes(numel, block, nb))
                       for nb, r in ((base_buckets, 1), lora_side))
        if smem <= limits.dynamic_smem:
            if lora.row_blocks:
                return Launch("shared", "single", deterministic, block, grid=1 + rows,
                              smem_single=smem, tiny=True, row_blocks=True)
            return Launch("shared", "single", deterministic, block, grid=2 + fill,
                          smem_single=smem, tiny=True, fill_grid=fill)
    if fill and cooperative_wins(False):
        return None  # the blocks below have no fill blocks
    if base.tiny or lora.tiny:  # two align_single blocks, each side sized for that kernel
        base, lora = (_single_block(numel, nb, r, deterministic, limits, e, use_tiny=False,
                                    policy=policy)
                      for nb, r, e in ((base_buckets, 1, out_entries // max(rows, 1)),
                                       (lora_buckets, rows, out_entries)))
        if base is None or lora is None:
            return None
    block = lora.block if not deterministic else min(base.block, lora.block)
    warps = block // 32
    smem = max(smem_one_block(nb, r, 2 * warps * _even(nb) if deterministic else 0)
               for nb, r in ((base_buckets, 1), (lora_buckets, rows)))
    if smem > limits.dynamic_smem:
        return None
    return Launch("shared", "single", deterministic, block, grid=2, smem_single=smem)


# ---- the launcher's guard ----------------------------------------------------------------
class LaunchRefused(ValueError):
    """A launch that a kernel cannot run (raised before anything is launched)."""


def _one_block_counters(launch: Launch, numel: int, num_buckets: int) -> int:
    if not launch.deterministic:
        return 0
    if launch.tiny and launch.rank_chunks:
        return tiny_chunk_bytes(numel, num_buckets)
    if launch.tiny:
        return tiny_warp_counter_bytes(numel, launch.block, num_buckets)
    return 2 * (launch.block // 32) * _even(num_buckets)


def launch_kernels(launch, fused: bool = False) -> list:
    """``(kernel key, grid, block, dynamic shared bytes, cooperative)`` of every kernel that
    ``launch`` issues, in order. The key names the instance in ``_kernels.kernel_names``;
    ``fused``: the launch serves base and LoRA (a one-block or cluster ``Launch`` from
    ``choose_pair`` or ``choose_cluster_pair`` then runs the pair kernel, a block or a
    cluster a side)."""
    if isinstance(launch, CooperativePair):
        return [(("cooperative_pair", launch.modes), launch.grid, BLOCK, launch.smem, True)]
    det = launch.deterministic
    if launch.kind == "single":
        name = ("tiny" if launch.tiny else "single") if not fused else (
            "tiny_pair" if launch.tiny else "pair")
        if launch.row_blocks:
            name = "tiny_rows_pair" if fused else "tiny_rows"  # a block a LoRA row
        elif launch.tiny and launch.rank_chunks and not fused:
            name += "_chunked"  # deterministic ranks from the chunks' groups; may have fill blocks
        elif launch.tiny and launch.fill_grid:
            name += "_filled"  # a kernel apart; align_tiny and align_tiny_pair have none
        elif launch.tiny and launch.stage_output and not fused:
            name += "_staged"  # the base row built in shared memory: a kernel apart
        # align_tiny with fill blocks: cooperative, so that block 0's wait for them returns
        kernels = [((name, det), launch.grid, launch.block, launch.smem_single,
                    launch.fill_grid > 0)]
    elif launch.kind == "cluster":
        name = ("cluster_rows_pair" if fused else "cluster_rows") if launch.row_clusters else (
            "cluster_pair" if fused else "cluster")
        kernels = [((name, det), launch.grid, launch.block, launch.smem_place, False)]
    elif launch.kind == "cooperative":
        kernels = [(("cooperative", coop_mode(launch)), launch.grid, launch.block,
                    launch.smem_place, True)]
    else:
        kernels = [(("count", launch.mode), launch.count_grid, launch.block,
                    launch.smem_count, False),
                   (("place", launch.mode), launch.grid, launch.block, launch.smem_place,
                    False)]
    if launch.order_grid:  # then align_order sorts every segment
        kernels.append((("order", False), launch.order_grid, BLOCK, launch.smem_order, False))
    return kernels


def _layout_bytes(kind: str, launch, numel: int, sides) -> int:
    """Dynamic shared bytes that kernel ``kind`` of ``launch`` lays out (``kernel_demands``)."""
    if kind == "order":
        return order_scratch_bytes(numel)
    if isinstance(launch, CooperativePair):
        return max(smem_cooperative(nb, r, side.chunk, side.deterministic, numel, side.sorted,
                                    side.block)
                   for (nb, r), side in zip(sides, (launch.base, launch.lora)))
    if launch.kind == "single":
        if launch.row_blocks:  # a LoRA row's buckets in each of its blocks
            (nb, rows), sides = sides[-1], sides[:-1]
            sides = [*sides, (nb // max(rows, 1), 1)]
        return max(smem_one_block(nb, r, _one_block_counters(launch, numel, nb))
                   for nb, r in sides)
    if launch.kind == "cluster":
        if launch.row_clusters:  # a LoRA row's buckets in each of its clusters (base: one)
            sides = [(nb // max(rows, 1), 1) for nb, rows in sides]
        return max(smem_cluster(nb, r, launch.deterministic, launch.block) for nb, r in sides)
    (nb, rows), = sides
    if kind == "cooperative":
        return smem_cooperative(nb, rows, launch.chunk, launch.deterministic, numel,
                                launch.sorted, launch.block)
    if kind == "count":
        return smem_count(launch.mode, nb, rows, launch.range_width)
    staged = launch.chunk if launch.stage_output else 0
    return smem_place(launch.mode, nb, rows, range_width=launch.range_width,
                      starts_in_smem=launch.starts_in_smem, stage_chunk=staged)


# Kernel keys of align_tiny and its pair (``_kernels.kernel_names``); the ``_filled`` ones
# are the instances whose launches have fill blocks.
TINY_KERNELS = ("tiny", "tiny_pair", "tiny_filled", "tiny_pair_filled", "tiny_staged",
                "tiny_chunked", "tiny_rows", "tiny_rows_pair")
ROW_KERNELS = ("tiny_rows", "tiny_rows_pair")  # a block a LoRA row (after the pair's base)


def kernel_demands(launch, numel: int, sides) -> list:
    """``(kernel, grid, block, dynamic bytes given, dynamic bytes its layout needs)`` of every
    kernel that ``launch`` issues; ``sides`` lists ``(num_buckets, rows)`` of each alignment
    the launch serves (one, or base and LoRA for a fused pair)."""
    return [(kind, grid, block, given, _layout_bytes(kind, launch, numel, sides))
            for (kind, _), grid, block, given, _ in launch_kernels(launch, len(sides) == 2)]


def check_launch(launch, numel: int, sides, limits: DeviceLimits) -> None:
    """Raise ``LaunchRefused`` unless every kernel of ``launch`` gets the shared memory its
    layout needs, no more than the device allows, a block of 32 to BLOCK threads in whole
    warps, and a grid it can run (every block resident for the cooperative kernels; chunks
    that cover every route)."""
    for kernel, grid, block, given, need in kernel_demands(launch, numel, sides):
        why = None
        if given < need:
            why = f"its layout needs {need} bytes of shared memory, the launch gives {given}"
        elif given > limits.dynamic_smem:
            why = (f"it needs {given} bytes of shared memory, more than the "
                   f"{limits.dynamic_smem} a block may have on this device")
        elif not (32 <= block <= BLOCK and block % 32 == 0):
            why = f"a block of {block} threads"
        elif not 1 <= grid <= 2**31 - 1:
            why = f"a grid of {grid} blocks"
        elif kernel.startswith("cooperative") and grid > limits.sm_count * (
                2 if two_blocks_an_sm(block, given, limits) else 1):
            why = f"{grid} blocks of {block} threads cannot all be resident on {limits.sm_count} SMs"
        elif kernel in ("single", "pair") and launch.fill_grid:
            why = (f"{launch.fill_grid} fill blocks (only align_tiny_filled, its pair and "
                   "align_cooperative have them)")
        elif kernel in ROW_KERNELS and (launch.fill_grid or sides[-1][1] < 1
                                        or grid != len(sides) - 1 + sides[-1][1]):
            why = (f"a grid of {grid} blocks for {sides[-1][1]} LoRA rows (a block a row "
                   "after the pair's base block, no fill blocks)")
        elif kernel in ROW_KERNELS and sides[-1][0] // sides[-1][1] > block:
            why = (f"{sides[-1][0] // sides[-1][1]} experts, more than its {block} threads "
                   "(a thread a bucket of a row)")
        elif kernel in TINY_KERNELS and kernel not in ROW_KERNELS and \
                grid != len(sides) + launch.fill_grid:
            why = (f"a grid of {grid} blocks, not {len(sides)} and {launch.fill_grid} fill "
                   "blocks")
        elif kernel in TINY_KERNELS and launch.fill_grid and grid > limits.sm_count:
            why = f"{grid} blocks cannot all be resident on {limits.sm_count} SMs"
        elif kernel in TINY_KERNELS and numel > TINY_ITEMS * block:
            why = (f"{numel} routes, more than the {TINY_ITEMS * block} one block of {block} "
                   f"threads holds ({TINY_ITEMS} a thread)")
        elif kernel == "tiny_chunked" and not launch.deterministic:
            why = "a free-order call (its ranks are the deterministic ones)"
        elif kernel == "cooperative" and launch.chunk > COOP_ITEMS * block:
            why = f"chunks of {launch.chunk} routes, more than {COOP_ITEMS} a thread of {block}"
        elif kernel == "cooperative" and launch.sorted and block != BLOCK:
            why = f"the segment sort in blocks of {block} threads (it needs {BLOCK})"
        elif kernel == "cooperative" and launch.fill_grid >= grid > 0:
            why = (f"{launch.fill_grid} of {grid} blocks of {block} threads only filling "
                   "(at least one block counts)")
        if why is None and kernel in ("count", "cooperative"):
            per_block = launch.chunk
            blocks = grid // launch.ranges if kernel == "count" else grid - launch.fill_grid
            if per_block * blocks < numel or (kernel == "count" and grid < launch.grid):
                why = f"{blocks} chunks of {per_block} routes do not cover {numel} routes"
        if why is None and kernel.startswith("cluster"):
            # a cluster a side, or (align_cluster_rows, and its pair after the base cluster)
            # a cluster a LoRA row
            per_row = kernel in ("cluster_rows", "cluster_rows_pair")
            clusters = len(sides) - 1 + sides[-1][1] if per_row else len(sides)
            if grid != CLUSTER_BLOCKS * clusters or (kernel == "cluster_rows"
                                                     and len(sides) != 1):
                why = (f"a grid of {grid} blocks, not one cluster of {CLUSTER_BLOCKS} a "
                       f"{'LoRA row' if per_row else 'side'}")
            elif (launch.chunk * CLUSTER_BLOCKS < numel
                  or launch.chunk > CLUSTER_ITEMS * block):
                why = (f"{CLUSTER_BLOCKS} chunks of {launch.chunk} routes, at most "
                       f"{CLUSTER_ITEMS} a thread of {block}, do not cover {numel} routes")
        if why is not None:
            raise LaunchRefused(f"refusing to launch align_{kernel} for {numel} routes over "
                                f"{', '.join(str(nb) for nb, _ in sides)} buckets: {why}")
