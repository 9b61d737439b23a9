"""The dispatcher's decisions for a table of cases (pure: no GPU)."""

import dataclasses

import numpy as np
import pytest

from moe_lora_align import _dispatch as d
from moe_lora_align._sizes import buffer_sizes

H200 = d.DeviceLimits.h200()
SMALL = d.DeviceLimits(sm_count=16, smem_optin=48 * 1024)
NO_COOP = d.DeviceLimits(sm_count=132, smem_optin=232448, cooperative=False)
NO_CLUSTERS = d.DeviceLimits(sm_count=132, smem_optin=232448, cooperative=True)
# Deterministic calls through the kernels' own ordered ranks (no align_order after them).
ORDERED = dataclasses.replace(d.DEFAULT_POLICY, sort_for_determinism=False)
SORTED = dataclasses.replace(d.DEFAULT_POLICY, sort_min_buckets=0)
# deterministic align_tiny with a counter a bucket a warp only (no chunks' groups)
COUNTERS = dataclasses.replace(d.DEFAULT_POLICY, tiny_chunk_ranks_from=1 << 62,
                               tiny_chunk_ranks_mid_buckets=1 << 62)
CMIN = d.DEFAULT_POLICY.cluster_min_routes
CMAX = d.DEFAULT_POLICY.cluster_max_routes
# over at most cluster_few_buckets buckets the cluster starts earlier
CFEW = CMIN - d.DEFAULT_POLICY.cluster_few_buckets_routes_earlier
FEW = d.DEFAULT_POLICY.cluster_few_buckets


@pytest.mark.parametrize("numel,buckets,rows,limits,det,variant,expect", [
    # decode sizes: one block, one launch
    (8, 64, 1, H200, False, None, ("shared", "single", 1)),
    (CFEW - 1, 256, 1, H200, False, None, ("shared", "single", 1)),
    (CFEW, FEW, 2, H200, False, None, ("cluster", "cluster", 1)),
    (CMIN - 1, 2 * FEW, 4, H200, False, None, ("shared", "single", 1)),
    (CMIN, 2 * FEW, 4, H200, False, None, ("cluster", "cluster", 1)),
    (2048, 16 * 256, 16, H200, False, None, ("shared", "single", 1)),
    # cluster_min_routes to cluster_max_routes (deterministic: 12K) routes over at most 1024
    # buckets: one cluster, where the device has them
    (CMIN, 256, 1, H200, False, None, ("cluster", "cluster", 1)),
    (CMAX, 512, 1, H200, False, None, ("cluster", "cluster", 1)),
    (CMAX + 1, 512, 1, H200, False, None, ("cooperative", "cooperative", 1)),
    (12288, 512, 1, H200, True, None, ("cluster", "cluster", 1)),
    (4096, 4 * 256, 4, H200, False, None, ("cluster", "cluster", 1)),
    (CMIN, 256, 1, NO_CLUSTERS, False, None, ("shared", "single", 1)),
    (4097, 256, 1, NO_CLUSTERS, False, None, ("cooperative", "cooperative", 1)),
    (4097, 256, 1, H200, True, None, ("cluster", "cluster", 1)),
    (12289, 256, 1, H200, True, None, ("cooperative", "cooperative", 1)),
    (4096, 8192, 1, H200, False, None, ("shared", "single", 1)),
    (CFEW - 1, 256, 1, H200, True, None, ("shared", "single", 1)),
    (CFEW, 256, 1, H200, True, None, ("cluster", "cluster", 1)),
    (CMIN, 256, 1, H200, True, None, ("cluster", "cluster", 1)),
    (CMIN, 256, 1, NO_CLUSTERS, True, None, ("shared", "single", 1)),
    # prefill sizes: one cooperative launch where it can run, else count + place
    (12289, 256, 1, H200, False, None, ("cooperative", "cooperative", 1)),
    (65536 * 8, 256, 1, H200, False, None, ("cooperative", "cooperative", 1)),
    (65536 * 10, 512, 1, H200, False, None, ("cooperative", "cooperative", 1)),
    (16384 * 8, 16 * 256, 16, H200, False, None, ("cooperative", "cooperative", 1)),
    (132 * 8192 + 1, 256, 1, H200, False, None, ("shared", "multi", 2)),
    (16384 * 8, 16 * 4096, 16, H200, False, None, ("global", "multi", 2)),
    (4097, 256, 1, NO_COOP, False, None, ("shared", "multi", 2)),
    (65536 * 8, 256, 1, NO_COOP, False, None, ("shared", "multi", 2)),
    (16384 * 8, 16 * 256, 16, H200, True, None, ("cooperative", "cooperative", 1)),
    (65536 * 8, 256, 1, H200, True, None, ("cooperative", "cooperative", 1)),
    (16384 * 8, 4 * 512, 4, H200, True, None, ("cooperative", "cooperative", 1)),
    (65536 * 8, 256, 1, NO_COOP, True, None, ("shared", "multi", 2)),
    # too many buckets for shared memory: the global variant, whatever the size
    (8, 65536, 16, H200, False, None, ("global", "multi", 2)),
    (65536 * 8, 65536, 16, H200, False, None, ("global", "multi", 2)),
    (65536 * 8, 65536, 16, H200, True, None, ("global", "multi", 3)),
    (2048, 16 * 1024, 16, SMALL, False, None, ("global", "multi", 2)),
    # explicit variants
    (8, 64, 1, H200, False, "global", ("global", "multi", 2)),
    (2048, 256, 1, H200, True, "global", ("global", "multi", 2)),
    (65536, 1024, 1, H200, False, "shared", ("shared", "multi", 2)),
    (8, 64, 1, H200, False, "cooperative", ("cooperative", "cooperative", 1)),
    (0, 64, 1, H200, False, "cooperative", ("cooperative", "cooperative", 1)),
    (65536 * 8, 4096, 1, H200, False, "cooperative", ("cooperative", "cooperative", 1)),
    (8, 64, 1, H200, False, "cluster", ("cluster", "cluster", 1)),
    (0, 64, 1, H200, False, "cluster", ("cluster", "cluster", 1)),
    (65536, 16 * 1024, 16, H200, False, "cluster", ("cluster", "cluster", 1)),
])
def test_decisions(numel, buckets, rows, limits, det, variant, expect):
    launch = d.choose_launch(numel, buckets, rows, limits, deterministic=det, variant=variant)
    assert (launch.variant, launch.kind, launch.launches) == expect
    assert launch.deterministic_output == det
    # Deterministic output: the kernels' own ordered ranks, or align_order after them.
    assert not (launch.deterministic and launch.order_grid)
    assert launch.block % 32 == 0 and launch.block <= 1024
    assert launch.grid >= 1
    for smem in (launch.smem_single, launch.smem_count, launch.smem_place):
        assert 0 <= smem <= limits.smem_optin
    if launch.kind == "multi":
        chunks = launch.grid // launch.ranges
        assert chunks * launch.chunk >= numel
        assert launch.chunk >= 1
        assert launch.grid <= launch.count_grid <= max(launch.grid, limits.sm_count)
        if launch.deterministic:
            assert launch.chunk <= d.WARP_COUNTER_MAX
            assert launch.ranges * launch.range_width >= buckets
            assert launch.range_width % 2 == 0
        elif launch.variant == "shared":
            assert launch.chunk <= d.BLOCK * d.ITEMS_PER_THREAD
    if launch.kind == "cooperative":
        # every block resident: one a SM (with fill blocks: on SMs of their own), or two of
        # half the threads with fill blocks; the counting blocks' chunks cover every route
        counting = launch.grid - launch.fill_grid
        assert counting >= 1 and launch.fill_grid <= limits.sm_count
        assert counting <= limits.sm_count
        if launch.fill_grid and launch.block == d.FILL_SPLIT_BLOCK:
            assert d.two_blocks_an_sm(launch.block, launch.smem_place, limits)
        elif launch.fill_grid:
            assert launch.block == d.BLOCK and launch.grid <= limits.sm_count
            assert not launch.sorted
        assert counting * launch.chunk >= numel
        assert launch.chunk <= launch.block * d.COOP_ITEMS


def test_shared_override_that_cannot_fit_is_a_clear_error():
    with pytest.raises(ValueError, match="variant='shared'.*shared memory"):
        d.choose_launch(1024, 65536, 16, H200, variant="shared")


@pytest.mark.parametrize("numel,buckets,limits,det,why", [
    (1024, 64, NO_COOP, False, "cannot issue cooperative launches"),
    (132 * 8192 + 1, 64, H200, False, "more than its 132 resident blocks"),
    (1024, 65536, H200, False, "shared memory for 65536 buckets"),
    (132 * 8192, 16384, H200, True, "segment sort's scratch or per-warp counters"),
])
def test_cooperative_override_that_cannot_run_is_a_clear_error(numel, buckets, limits, det, why):
    with pytest.raises(ValueError, match=why):
        d.choose_launch(numel, buckets, 1, limits, variant="cooperative", deterministic=det,
                        policy=ORDERED)


@pytest.mark.parametrize("numel,runs", [(4096 * 8, False), (4096 * 8 + 1, True),
                                        (d.ORDER_BITMAP_ALL_MAX, True),
                                        (d.ORDER_BITMAP_ALL_MAX + 8, False)])
def test_sorting_cooperative_launch_reads_runs_past_its_setting(numel, runs):
    """The sorting cooperative kernel's instance whose bitmaps are read back as runs
    (COOP_SORTED_RUNS) runs past sort_runs_above_routes routes, up to ORDER_BITMAP_ALL_MAX
    (past it a warp has more than four rounds); a policy moves the point, and the free-order
    and ordered launches never take it."""
    launch = d.choose_launch(numel, 16 * 256, 16, H200, deterministic=True)
    assert launch.kind == "cooperative" and launch.sorted and launch.sort_runs == runs
    assert d.coop_mode(launch) == (3 if runs else 2)
    assert not d.choose_launch(numel, 16 * 256, 16, H200).sort_runs
    later = dataclasses.replace(d.DEFAULT_POLICY, sort_runs_above_routes=numel)
    assert not d.choose_launch(numel, 16 * 256, 16, H200, deterministic=True,
                               policy=later).sort_runs
    earlier = dataclasses.replace(d.DEFAULT_POLICY, sort_runs_above_routes=0)
    assert d.choose_launch(numel, 16 * 256, 16, H200, deterministic=True,
                           policy=earlier).sort_runs == (numel <= d.ORDER_BITMAP_ALL_MAX)


def test_deterministic_calls_sort_after_the_fast_kernels():
    """Deterministic, from the policy's sort_min_buckets (LoRA sizes): the cooperative
    kernel sorts each segment inside its launch (its scratch in the staging's place), count
    + place is followed by align_order where the sort's shared memory fits. Below it the
    multi-block kernels rank in flat order; one block always does."""
    SORT = dataclasses.replace(d.DEFAULT_POLICY, sort_min_buckets=0)
    lora = d.choose_launch(16384 * 8, 16 * 256, 16, H200, deterministic=True)
    fast = d.choose_launch(16384 * 8, 16 * 256, 16, H200)
    assert lora.kind == "cooperative" and lora.deterministic and lora.sorted
    assert not lora.order_grid and lora.launches == 1
    assert lora.smem_place == fast.smem_place - 8 * fast.chunk + max(
        8 * fast.chunk, d.order_scratch_bytes(16384 * 8))
    base = d.choose_launch(65536 * 8, 256, 1, H200, deterministic=True)
    assert base.kind == "cooperative" and base.deterministic and not base.sorted
    assert d.choose_launch(65536 * 8, 256, 1, H200, deterministic=True, policy=SORT).sorted
    for numel, nb, rows, limits, variant, policy in (
            (16384 * 8, 16 * 256, 16, NO_COOP, None, d.DEFAULT_POLICY),
            (8192, 256, 1, H200, "shared", SORT), (2048, 256, 1, H200, "global", SORT)):
        fast = d.choose_launch(numel, nb, rows, limits, variant=variant, policy=policy)
        det = d.choose_launch(numel, nb, rows, limits, variant=variant, deterministic=True,
                              policy=policy)
        assert det == dataclasses.replace(fast, order_grid=d.order_grid(nb, limits),
                                          smem_order=d.order_scratch_bytes(numel))
        assert det.launches == fast.launches + 1 and det.deterministic_output
        assert det.order_grid * (d.BLOCK // 32) >= nb  # a warp a bucket
        assert not d.choose_launch(numel, nb, rows, limits, variant=variant,
                                   deterministic=True, policy=ORDERED).order_grid
    # Below sort_min_buckets: count + place rank in order.
    launch = d.choose_launch(65536 * 8, 256, 1, NO_COOP, deterministic=True)
    assert launch.kind == "multi" and launch.deterministic and not launch.order_grid
    # Sorting off, but the ordered ranks' per-warp counters do not fit: the cooperative
    # kernel sorts.
    assert d.choose_launch(16384 * 8, 16 * 256, 16, H200, deterministic=True,
                           policy=ORDERED).sorted
    # Decode: one block ranks in order.
    assert d.choose_launch(64, 256, 1, H200, deterministic=True, policy=SORT).kind == "single"
    # Past the sort's shared memory: count + place rank in order.
    huge = 8 * H200.dynamic_smem + 1
    assert d.order_scratch_bytes(huge) > H200.dynamic_smem
    launch = d.choose_launch(huge, 16 * 256, 16, NO_COOP, deterministic=True)
    assert launch.deterministic and not launch.order_grid


NO_FILL_BLOCKS = d.AlignPolicy(coop_fill_blocks_from=1 << 62)
NO_ROWS = d.AlignPolicy(tiny_row_blocks=False)  # LoRA never a block a row (align_tiny_rows)
ALL_FILL_BLOCKS = d.AlignPolicy(coop_fill_blocks_below=1 << 62, coop_fill_sms_from=1 << 62)
FILL_SMS = d.AlignPolicy(coop_fill_sms_from=0, coop_fill_sms_min_entries_per_route=0)
SPLIT_ONLY = d.AlignPolicy(coop_fill_sms_from=1 << 62)  # the split's own bounds, as before r47


def test_fill_blocks_on_sms_of_their_own():
    # From coop_fill_sms_from output entries: blocks of BLOCK threads, a fill block per
    # coop_fill_sm_entries entries, the routes in chunks of whole warps over the other SMs.
    sms, per_sm = H200.sm_count, d.DEFAULT_POLICY.coop_fill_sm_entries
    assert d.DEFAULT_POLICY.coop_fill_sms_from == d.DEFAULT_POLICY.coop_fill_blocks_below
    P, M = buffer_sizes(16384 * 8, 256, 64)
    entries = 16 * (P + M)
    launch = d.choose_launch(16384 * 8, 16 * 256, 16, H200, out_entries=entries,
                             policy=FILL_SMS)
    fill = -(-entries // per_sm)
    assert launch.kind == "cooperative" and launch.block == d.BLOCK and not launch.sorted
    assert launch.fill_grid == fill and launch.chunk % 32 == 0
    counting = launch.grid - fill
    assert counting == -(-16384 * 8 // launch.chunk) and counting <= sms - fill
    assert launch.chunk == 32 * -(-(-(-16384 * 8 // (sms - fill))) // 32)
    # Base T=16384: 147K entries, five fill SMs; the counting blocks keep the other SMs
    P, M = buffer_sizes(16384 * 8, 256, 64)
    base = d.choose_launch(16384 * 8, 256, 1, H200, out_entries=P + M, policy=FILL_SMS)
    assert base.fill_grid == -(-(P + M) // per_sm) == 5 and base.block == d.BLOCK
    assert base.grid - 5 <= sms - 5
    # At most what the routes leave: COOP_ITEMS routes a thread of the counting blocks
    for numel in (1, 1000, (sms - 1) * d.COOP_ITEMS * d.BLOCK):
        most = d.choose_launch(numel, 256, 1, H200, out_entries=10**9, policy=FILL_SMS,
                               variant="cooperative")
        counting = most.grid - most.fill_grid
        assert most.fill_grid == sms - -(-numel // (d.COOP_ITEMS * d.BLOCK))
        assert counting * most.chunk >= numel and most.chunk <= d.COOP_ITEMS * d.BLOCK
    # None left over: no fill blocks of this kind (the split's where it applies, else none)
    full = d.choose_launch(sms * d.COOP_ITEMS * d.BLOCK, 256, 1, H200, out_entries=10**6,
                           policy=FILL_SMS, variant="cooperative")
    assert full.block == d.BLOCK and not full.fill_grid
    # Below coop_fill_sms_from: as before; deterministic: ordered ranks take them, the
    # segment sort does not (it spreads over every SM)
    at = d.AlignPolicy(coop_fill_sms_from=100000)
    assert d.choose_launch(16384 * 8, 256, 1, H200, out_entries=99999, policy=at) == \
        d.choose_launch(16384 * 8, 256, 1, H200, out_entries=99999)
    ordered = d.choose_launch(16384 * 8, 256, 1, H200, deterministic=True,
                              out_entries=10**6, policy=FILL_SMS)
    assert not ordered.sorted and ordered.fill_grid and ordered.block == d.BLOCK
    sort = d.choose_launch(16384 * 8, 16 * 256, 16, H200, deterministic=True,
                           out_entries=10**6, policy=FILL_SMS)
    assert sort.kind == "cooperative" and sort.sorted and not sort.fill_grid
    # The guard passes each: shared memory, residency, chunks that cover the routes
    for numel, buckets, rows, det in ((1, 7, 1, False), (4096 * 8, 256, 1, True),
                                      (16384 * 8, 16 * 256, 16, False),
                                      (65536 * 8, 256, 1, False), (65536 * 10, 512, 1, True),
                                      (8192 * 8, 4 * 512, 4, True)):
        launch = d.choose_launch(numel, buckets, rows, H200, deterministic=det,
                                 out_entries=10**6, policy=FILL_SMS, variant="cooperative")
        assert launch.fill_grid and launch.block == d.BLOCK, (numel, det)
        d.check_launch(launch, numel, [(buckets, rows)], H200)
    # Not in the cooperative pair
    pair = d.choose_cooperative_pair(16384 * 8, 256, 16 * 256, 16, H200, base_entries=10**5,
                                     lora_entries=10**6, policy=FILL_SMS)
    assert not pair.base.fill_grid and not pair.lora.fill_grid


def test_fill_sms_only_where_the_fill_outweighs_the_routes():
    # From coop_fill_sms_from entries, fill SMs where the entries are at least
    # coop_fill_sms_min_entries_per_route times the routes: LoRA rows of two or more slots.
    # One row (base, or one slot) keeps every SM counting and filling (r51, A/B line 14).
    ratio = d.DEFAULT_POLICY.coop_fill_sms_min_entries_per_route
    assert ratio == 2
    for T, E, K, slots, sms in ((65536, 64, 8, 1, False), (65536, 256, 8, 1, False),
                                (65536, 512, 10, 1, False), (32768, 256, 8, 1, False),
                                (16384, 256, 8, 2, True), (16384, 256, 8, 16, True),
                                (4096, 256, 8, 16, True), (8192, 256, 8, 4, True)):
        P, M = buffer_sizes(T * K, E, 64)
        entries = slots * (P + M)
        assert entries >= d.DEFAULT_POLICY.coop_fill_sms_from
        for det in (False, True):
            launch = d.choose_launch(T * K, slots * E, slots, H200, out_entries=entries,
                                     deterministic=det)
            if launch.sorted:  # the segment sort spreads over every SM itself
                continue
            assert launch.kind == "cooperative", (T, slots, det)
            assert bool(launch.fill_grid) == sms and launch.block == d.BLOCK, (T, slots, det)
    # Both sides of the cut, at the same routes
    numel = 200000  # past coop_fill_blocks_free_routes: no split fill blocks either
    for entries, sms in ((ratio * numel - 1, False), (ratio * numel, True)):
        launch = d.choose_launch(numel, 1024, 4, H200, out_entries=entries,
                                 variant="cooperative")
        assert bool(launch.fill_grid) == sms and launch.block == d.BLOCK, entries
    # Off: every call past coop_fill_sms_from, as r47 to r50
    off = d.AlignPolicy(coop_fill_sms_min_entries_per_route=0)
    P, M = buffer_sizes(65536 * 8, 256, 64)
    assert d.choose_launch(65536 * 8, 256, 1, H200, out_entries=P + M, policy=off).fill_grid


def test_cooperative_fill_spreads_over_the_sms():
    # LoRA T=4096, 16 slots, E=256, B=64: 16 rows of sentinels to write
    entries = 16 * (48896 + 764)
    fill = -(-entries // d.DEFAULT_POLICY.fill_per_block)
    # By default, past coop_fill_sms_from: blocks of 1024, a fill SM per 32K entries.
    # Split fill blocks: 64 counting blocks of 512 routes, then the fill's blocks.
    assert entries >= d.DEFAULT_POLICY.coop_fill_sms_from
    default = d.choose_launch(4096 * 8, 16 * 256, 16, H200, out_entries=entries)
    assert default.block == d.BLOCK and default.fill_grid == -(-entries // 32768)
    assert not d.choose_launch(4096 * 8, 16 * 256, 16, H200, out_entries=entries,
                               policy=SPLIT_ONLY).fill_grid
    launch = d.choose_launch(4096 * 8, 16 * 256, 16, H200, out_entries=entries,
                             policy=ALL_FILL_BLOCKS)
    assert launch.kind == "cooperative" and launch.block == d.FILL_SPLIT_BLOCK
    assert launch.chunk == 512 and launch.fill_grid == fill
    assert launch.grid == 64 + fill
    # Without them: 32 chunks of routes, blocks past them only fill.
    launch = d.choose_launch(4096 * 8, 16 * 256, 16, H200, out_entries=entries,
                             policy=NO_FILL_BLOCKS)
    assert launch.kind == "cooperative" and launch.chunk == 1024 and not launch.fill_grid
    assert launch.grid == fill > 32
    # T=65536: 128 chunks of 4096 routes (8 a thread of 512), then a fill block an SM
    for policy, grid in ((ALL_FILL_BLOCKS, 128 + H200.sm_count),
                         (d.DEFAULT_POLICY, H200.sm_count), (NO_FILL_BLOCKS, H200.sm_count)):
        assert d.choose_launch(65536 * 8, 256, 1, H200, out_entries=10**9, policy=policy,
                               variant="cooperative").grid == grid


def test_fill_blocks_of_free_order_calls_with_few_routes():
    # Past coop_fill_blocks_below, free-order calls of fewer than coop_fill_blocks_free_routes
    # routes keep fill blocks below coop_fill_blocks_free_below entries; ordered calls do not.
    # (Where the fill SMs are off: since r47 they take every call past coop_fill_sms_from.)
    policy = SPLIT_ONLY
    routes, free_below = policy.coop_fill_blocks_free_routes, policy.coop_fill_blocks_free_below
    assert policy.coop_fill_blocks_below < free_below
    for numel, entries, split in ((routes - 1, free_below - 1, True),
                                  (routes - 1, free_below, False),
                                  (routes, policy.coop_fill_blocks_below, False),
                                  (routes, policy.coop_fill_blocks_below - 1, True)):
        for det in (False, True):
            launch = d.choose_launch(numel, 1024, 4, H200, out_entries=entries,
                                     deterministic=det, variant="cooperative", policy=policy)
            want = split and (not det or entries < policy.coop_fill_blocks_below)
            assert bool(launch.fill_grid) == want, (numel, entries, det)
    # The r41 cases of the LoRA A/B line (E=256, K=8, B=64): T=2048 16 slots and T=16384
    # 4 slots take them, T=4096 16 slots (794K entries) and base T=32768 do not; by default
    # (r47) the LoRA rows have fill SMs, and since r51 one row (base T=32768) has none.
    for T, slots, split in ((2048, 16, True), (16384, 4, True), (4096, 16, False),
                            (32768, 1, False)):
        P, M = buffer_sizes(T * 8, 256, 64)
        for pol, want in ((SPLIT_ONLY, split), (d.DEFAULT_POLICY, slots > 1)):
            launch = d.choose_launch(T * 8, slots * 256, slots, H200,
                                     out_entries=slots * (P + M), policy=pol)
            assert launch.kind == "cooperative" and bool(launch.fill_grid) == want, T
            assert launch.block == (d.BLOCK if pol is d.DEFAULT_POLICY or not want
                                    else d.FILL_SPLIT_BLOCK)


def test_fill_blocks_where_they_apply():
    # From coop_fill_blocks_from output entries on, below coop_fill_blocks_below (the free-
    # order bound off)
    at = d.AlignPolicy(coop_fill_blocks_from=100000, coop_fill_blocks_below=200000,
                       coop_fill_blocks_free_below=0)
    for entries, split in ((99999, False), (100000, True), (199999, True), (200000, False)):
        launch = d.choose_launch(16384 * 8, 256, 1, H200, out_entries=entries, policy=at)
        assert launch.kind == "cooperative" and bool(launch.fill_grid) == split
        assert launch.block == (d.FILL_SPLIT_BLOCK if split else d.BLOCK)
    below = d.DEFAULT_POLICY.coop_fill_blocks_below
    for entries, block in ((below - 1, d.FILL_SPLIT_BLOCK), (below, d.BLOCK)):  # then fill SMs
        launch = d.choose_launch(32768 * 8, 256, 1, H200, out_entries=entries,
                                 policy=d.AlignPolicy(coop_fill_sms_min_entries_per_route=0))
        assert launch.fill_grid and launch.block == block
        launch = d.choose_launch(32768 * 8, 256, 1, H200, out_entries=entries,
                                 policy=SPLIT_ONLY)
        assert bool(launch.fill_grid) == (block == d.FILL_SPLIT_BLOCK)
    at = ALL_FILL_BLOCKS
    # Not where the segment sort runs (it holds a segment in a block of BLOCK threads), nor
    # in the cooperative pair, nor where two blocks' shared memory does not fit one SM
    sort = d.choose_launch(16384 * 8, 16 * 256, 16, H200, deterministic=True,
                           out_entries=10**6, policy=at)
    assert sort.kind == "cooperative" and sort.sorted and not sort.fill_grid
    ordered = d.choose_launch(16384 * 8, 256, 1, H200, deterministic=True, out_entries=10**6,
                              policy=at)
    assert ordered.kind == "cooperative" and not ordered.sorted and ordered.fill_grid
    pair = d.choose_cooperative_pair(16384 * 8, 256, 16 * 256, 16, H200,
                                     base_entries=10**5, lora_entries=10**6, policy=at)
    assert not pair.base.fill_grid and not pair.lora.fill_grid
    big = d.choose_launch(16384 * 8, 16 * 1024, 16, H200, out_entries=10**6, policy=at)
    assert big.kind == "cooperative" and not big.fill_grid and big.block == d.BLOCK
    assert not d.two_blocks_an_sm(d.FILL_SPLIT_BLOCK,
                                  d.smem_cooperative(16 * 1024, 16, 1024, False), H200)
    # Routes past what the counting blocks of half the threads hold: one block an SM
    most = H200.sm_count * d.COOP_ITEMS * d.FILL_SPLIT_BLOCK
    for numel, split in ((most, True), (most + 1, False)):
        launch = d.choose_launch(numel, 256, 1, H200, out_entries=10**6, policy=at)
        assert launch.kind == "cooperative" and bool(launch.fill_grid) == split


def test_unknown_variant():
    with pytest.raises(ValueError, match="variant must be one of"):
        d.choose_launch(1024, 64, 1, H200, variant="texture")


def test_work_spreads_over_the_sms():
    for limits in (H200, NO_COOP):
        launch = d.choose_launch(65536 * 8, 256, 1, limits)
        assert launch.grid >= H200.sm_count * 0.9
    det = d.choose_launch(65536 * 8, 256, 1, NO_COOP, deterministic=True, policy=ORDERED)
    assert det.grid >= H200.sm_count


def test_single_block_deterministic_uses_fewer_warps_for_many_buckets():
    few = d.choose_launch(4096, 256, 1, NO_CLUSTERS, deterministic=True)  # one block there
    many = d.choose_launch(4096, 16 * 256, 16, H200, deterministic=True, policy=COUNTERS)
    assert few.kind == "single" and few.block == 1024
    assert many.kind == "single" and many.block < 1024 and not many.tiny


def test_pair_fuses_decode_and_declines_prefill():
    pair = d.choose_pair(2048, 256, 16 * 256, 16, H200, policy=NO_ROWS)
    assert pair is not None and pair.grid == 2 and pair.smem_single <= H200.smem_optin
    assert d.choose_pair(65536, 256, 16 * 256, 16, H200) is None
    assert d.choose_pair(2048, 256, 65536, 16, H200) is None


@pytest.mark.parametrize("numel,entries,buckets,threads", [
    (1, 0, 64, 128), (128, 0, 64, 128), (129, 0, 64, 256), (512, 0, 64, 512),
    (513, 0, 64, 512), (2048, 0, 64, 512), (2049, 0, 64, 1024), (4096, 0, 64, 1024),
    (8, 128 * 64 + 1, 64, 256), (8, 10**6, 64, 1024),
    (8, 0, 512, 128), (8, 0, 1024, 256), (8, 0, 4096, 1024)])
def test_single_block_size_follows_the_work(numel, entries, buckets, threads):
    assert d.single_block_threads(numel, entries, buckets) == threads
    launch = d.choose_launch(numel, buckets, 1, NO_COOP, out_entries=entries,
                             policy=d.AlignPolicy(use_tiny=False))
    assert launch.kind == "single" and launch.block == threads and not launch.tiny


@pytest.mark.parametrize("numel,entries,buckets,threads", [
    (1, 0, 1, 32), (8, 128, 8, 32), (8, 0, 64, 64), (8, 0, 257, 288), (128, 0, 64, 128),
    (512, 0, 64, 512), (2048, 0, 256, 512), (2560, 10240 + 640, 512, 640),
    (4096, 0, 64, 1024), (8, 0, 512, 512), (8, 0, 1024, 1024), (8, 0, 1025, 288),
    (8, 64 * 1024, 64, 1024), (8, 10**6, 64, 1024), (128, 0, 16 * 256, 1024),
    (8, 0, 16 * 64 + 4, 288)])
def test_tiny_block_has_a_thread_per_bucket(numel, entries, buckets, threads):
    """align_tiny: a multiple of 32 threads, one per bucket up to 1024 buckets (then one per
    four), one route each up to 512, at most four, 64 fill entries each up to 1024 threads."""
    assert d.tiny_block_threads(numel, entries, buckets) == threads
    launch = d.choose_launch(numel, buckets, 1, NO_COOP, out_entries=entries)
    assert launch.kind == "single" and launch.tiny and launch.block == threads


@pytest.mark.parametrize("numel,entries,buckets", [
    (8, 0, 4097), (4097, 0, 64)])
def test_tiny_block_declines_what_one_block_cannot_spread(numel, entries, buckets):
    assert d.tiny_block_threads(numel, entries, buckets) is None
    launch = d.choose_launch(numel, buckets, 1, NO_COOP, out_entries=entries)
    assert not launch.tiny


def test_tiny_threshold_of_one_bucket_a_thread():
    """Below tiny_one_bucket_max buckets a thread each; above it four (the kernel tells the
    two apart by buckets > threads, so the block never covers fewer than a quarter)."""
    policy = d.AlignPolicy(tiny_one_bucket_max=256)
    assert d.tiny_block_threads(8, 0, 256, policy) == 256
    assert d.tiny_block_threads(8, 0, 512, policy) == 128
    assert d.tiny_block_threads(2048, 0, 512, policy) == 512  # the routes want more


def test_tiny_pairs_need_both_sides():
    pair = d.choose_pair(8, 64, 4 * 64, 4, H200, policy=NO_ROWS)
    assert pair.tiny and pair.block == 256 and pair.grid == 2 and not pair.deterministic
    # LoRA side: 4 buckets a thread
    pair = d.choose_pair(8, 64, 16 * 256, 16, H200, policy=NO_ROWS)
    assert pair.tiny and pair.block == 1024
    assert not d.choose_pair(8, 64, 16 * 257, 16, H200, policy=NO_ROWS).tiny
    # a block a row needs only a row's buckets a block
    assert d.choose_pair(8, 64, 16 * 257, 16, H200).row_blocks


@pytest.mark.parametrize("numel,block,buckets,nbytes", [
    (8, 64, 64, 2 * 64),              # one warp holds the routes, one a lane
    (33, 64, 63, 2 * 2 * 64),         # two warps; rows rounded up to even
    (1024, 1024, 256, 2 * 32 * 256),  # one route a lane: every warp
    (1025, 1024, 256, 2 * 17 * 256),  # two a lane: 17 warps of 64 routes
    (2049, 1024, 256, 2 * 17 * 256),  # four a lane: 17 warps of 128 routes
    (4096, 1024, 4096, 2 * 32 * 4096)])
def test_tiny_deterministic_counters(numel, block, buckets, nbytes):
    assert d.tiny_warp_counter_bytes(numel, block, buckets) == nbytes


def test_deterministic_decode_runs_tiny_where_its_counters_fit():
    launch = d.choose_launch(8, 64, 1, H200, deterministic=True)
    base = 4 * 65 + d.row_region_bytes(1)
    assert launch.tiny and launch.deterministic and launch.block == 64
    assert launch.smem_single == base + 2 * 64
    # 2048 routes over 16 x 256 buckets: 32 warps of counters need 256 KB, align_single's
    # fewer warps fit (without the chunks' groups, which the default gives these buckets).
    launch = d.choose_launch(2048, 16 * 256, 16, NO_COOP, deterministic=True, policy=COUNTERS)
    assert launch.kind == "single" and launch.deterministic and not launch.tiny
    launch = d.choose_launch(2048, 16 * 256, 16, NO_COOP, deterministic=True)
    assert launch.tiny and launch.rank_chunks
    pair = d.choose_pair(8, 64, 4 * 64, 4, H200, deterministic=True, policy=NO_ROWS)
    assert pair.tiny and pair.deterministic and pair.block == 256
    assert pair.smem_single == (4 * 257 + d.row_region_bytes(4)
                                + d.tiny_warp_counter_bytes(8, 256, 256))
    # A side whose counters do not fit: both sides on align_single, warps for the smaller.
    pair = d.choose_pair(2048, 64, 16 * 256, 16, NO_COOP, deterministic=True, policy=NO_ROWS)
    assert not pair.tiny and pair.deterministic


def test_fill_blocks_join_the_count_kernel():
    # LoRA T=4096, 16 slots, E=256, B=64: 32 chunks but 16 rows of 48896 sentinels to write.
    launch = d.choose_launch(4096 * 8, 16 * 256, 16, H200, out_entries=16 * (48896 + 764),
                             variant="shared")
    assert launch.kind == "multi" and launch.grid == 32
    assert launch.count_grid == -(-16 * (48896 + 764) // d.DEFAULT_POLICY.fill_per_block) > launch.grid
    assert d.choose_launch(65536 * 8, 256, 1, H200, out_entries=10**9,
                           variant="shared").count_grid == H200.sm_count
    det = d.choose_launch(4096 * 8, 16 * 256, 16, NO_COOP, out_entries=16 * 48896,
                          deterministic=True, policy=ORDERED)
    assert det.count_grid == det.grid


def test_packed_argument_and_its_address():
    """The driver gets the packed Problem's address; a repack for new inputs rewrites only the
    input pointers, in place."""
    from types import SimpleNamespace

    from moe_lora_align import _launch

    def dev(ptr):
        return SimpleNamespace(data=SimpleNamespace(ptr=ptr))

    ws = SimpleNamespace(counts=dev(1), starts=dev(2), cursor=dev(3), chunk_hist=dev(4),
                         ticket=dev(5), generation=0)
    job = _launch.Job(topk_ids=dev(0x1000), numel=8, topk=8, num_experts=64, block_size=16,
                      rows=1, padded_len=968, num_tiles=61, sorted_ids=dev(0x2000),
                      expert_ids=dev(0x3000), num_post_pad=dev(0x4000), sorted_pitch=968,
                      expert_pitch=61)
    launch = d.choose_launch(8, 64, 1, H200, out_entries=968 + 61)
    _launch.pack(job, launch, ws)
    fields = np.frombuffer(job.packed, dtype=_launch.PROBLEM_DTYPE)[0]
    assert fields["topk_ids"] == 0x1000 and fields["numel"] == 8 and fields["ticket"] == 5
    assert int(job.params[0]) == job.packed.ctypes.data
    # a prepared call rewrites the array pointers in place (the driver reads them there)
    before = job.packed.ctypes.data
    _launch.POINTERS.pack_into(job.packed, 0, 0x5000, 0, 0, 0, 0, 0x6000, 0x7000, 0x8000, 0)
    assert job.packed.ctypes.data == before
    fields = np.frombuffer(job.packed, dtype=_launch.PROBLEM_DTYPE)[0]
    assert fields["topk_ids"] == 0x5000 and fields["sorted_ids"] == 0x6000
    assert fields["numel"] == 8 and fields["ticket"] == 5


def test_pair_parameter_array_follows_repacks():
    from types import SimpleNamespace

    from moe_lora_align import _launch

    a = SimpleNamespace(params=np.array([11], np.uint64), params_addr=0)
    b = SimpleNamespace(params=np.array([22], np.uint64), params_addr=0, pair_params=None)
    first = _launch._params_address((a, b))
    assert _launch._params_address((a, b)) == first
    assert list(b.pair_params[2]) == [11, 22]
    b.params = np.array([33], np.uint64)  # a repack makes a new parameter array
    _launch._params_address((a, b))
    assert list(b.pair_params[2]) == [11, 33]


def test_cooperative_pack_points_at_its_own_scratch():
    """The cooperative kernel counts in its two buffers (count_stride apart) and keeps its
    control words apart from the count + place kernels' zeroed counters."""
    from types import SimpleNamespace

    from moe_lora_align import _launch

    def dev(ptr):
        return SimpleNamespace(data=SimpleNamespace(ptr=ptr))

    ws = SimpleNamespace(counts=dev(1), starts=dev(2), cursor=dev(3), chunk_hist=dev(4),
                         ticket=dev(5), coop_counts=dev(6), coop_control=dev(7), buckets=300,
                         generation=0)
    job = _launch.Job(topk_ids=dev(0x1000), numel=40000, topk=8, num_experts=256,
                      block_size=64, rows=1, padded_len=56320, num_tiles=880,
                      sorted_ids=dev(0x2000), expert_ids=dev(0x3000), num_post_pad=dev(0x4000),
                      sorted_pitch=56320, expert_pitch=880)
    launch = d.choose_launch(40000, 256, 1, H200, out_entries=56320 + 880)
    assert launch.kind == "cooperative"
    _launch.pack(job, launch, ws)
    f = np.frombuffer(job.packed, dtype=_launch.PROBLEM_DTYPE)[0]
    assert (f["counts"], f["ticket"], f["count_stride"], f["chunk"]) == (6, 7, 300, launch.chunk)


@pytest.mark.parametrize("numel,base_blocks,lora_blocks", [
    (8, 1, 32), (16384 * 8, 32, 100), (4096 * 8, 8, 96), (65536 * 8, 66, 66)])
def test_cooperative_pair_splits_the_sms(numel, base_blocks, lora_blocks):
    """Base gets blocks for about four routes a thread (at most half the SMs), LoRA the rest
    (each side as many as its routes and its share of the fill use); together at most one
    block a SM, so every block of the launch is resident."""
    P = numel + 256 * 63
    pair = d.choose_cooperative_pair(numel, 256, 16 * 256, 16, H200, base_entries=P,
                                     lora_entries=16 * P)
    assert (pair.base.grid, pair.lora.grid) == (base_blocks, lora_blocks)
    assert pair.grid <= H200.sm_count
    for side in (pair.base, pair.lora):
        assert side.kind == "cooperative" and side.grid * side.chunk >= numel
        assert side.chunk <= d.COOP_ITEMS * d.BLOCK and side.smem_place <= pair.smem
    assert pair.smem <= H200.smem_optin


@pytest.mark.parametrize("numel,experts,rows,policy,modes", [
    (4096 * 8, 256, 16, d.DEFAULT_POLICY, (1, 2)),   # base ordered ranks, LoRA sorted
    (16384 * 8, 256, 16, d.DEFAULT_POLICY, (1, 3)),   # LoRA sorted, bitmaps read as runs
    (4096 * 6, 64, 4, d.DEFAULT_POLICY, (1, 1)),     # 256 LoRA buckets: both ordered
    (4096 * 8, 256, 16, ORDERED, (1, 2)),            # LoRA's per-warp counters do not fit
])
def test_deterministic_cooperative_pair_takes_each_sides_way(numel, experts, rows, policy,
                                                             modes):
    """Deterministic base + LoRA in one cooperative launch: each side ranks in order or
    sorts its segments as its own cooperative launch would, on its share of the SMs; the
    kernel has an instance for every pair of ways this gives."""
    sides = [(experts, 1), (rows * experts, rows)]
    pair = d.choose_cooperative_pair(numel, experts, rows * experts, rows, H200,
                                     deterministic=True, policy=policy)
    assert pair.deterministic and pair.modes == modes and modes in d.COOP_PAIR_MODES
    for side, (nb, r) in zip((pair.base, pair.lora), sides):
        alone = d._cooperative(numel, nb, r, d.DeviceLimits(side.grid, H200.smem_optin, True),
                               0, True, policy)
        assert (side.sorted, side.sort_runs, side.deterministic) == (alone.sorted,
                                                                    alone.sort_runs, True)
        assert side.smem_place == d.smem_cooperative(nb, r, side.chunk, True, numel,
                                                     side.sorted)
    d.check_launch(pair, numel, sides, H200)
    free = d.choose_cooperative_pair(numel, experts, rows * experts, rows, H200)
    assert free.modes == (0, 0) and not free.deterministic


def test_cooperative_pair_has_no_instance_with_both_sides_sorted():
    assert d.choose_cooperative_pair(4096 * 8, 256, 16 * 256, 16, H200, deterministic=True,
                                     policy=SORTED) is None


def test_cooperative_pair_declines_what_it_cannot_hold():
    assert d.choose_cooperative_pair(65536 * 10, 512, 16 * 512, 16, H200) is None  # routes
    assert d.choose_cooperative_pair(1024, 256, 65536, 16, H200) is None  # LoRA buckets
    assert d.choose_cooperative_pair(1024, 256, 4096, 16, NO_COOP) is None


def test_decode_with_a_large_fill_prefers_the_cooperative_launch():
    # LoRA T=256 E=256 B=16, 16 slots: 100K output entries through one SM lose to the grid,
    # unless fill blocks write them beside it (up to coop_over_filled_single_entries)
    entries = 16 * (5888 + 368)
    no_tiny_fill = d.AlignPolicy(tiny_fill_blocks_from=1 << 62,
                                 tiny_fill_blocks_one_row_from=1 << 62)
    filled = d.choose_launch(2048, 16 * 256, 16, H200, out_entries=entries)
    assert filled.kind == "single" and filled.tiny and filled.fill_grid
    # deterministic: align_tiny_chunked with its fill blocks, as the free-order call
    chunked_filled = d.choose_launch(2048, 16 * 256, 16, H200, out_entries=entries,
                                    deterministic=True)
    assert chunked_filled.tiny and chunked_filled.rank_chunks
    assert chunked_filled.fill_grid == filled.fill_grid
    for det in (False, True):
        # (deterministic without the chunks' groups: per-warp counters of 4096 buckets do
        # not fit)
        assert d.choose_launch(2048, 16 * 256, 16, H200, out_entries=entries, deterministic=det,
                               policy=COUNTERS if det else no_tiny_fill
                               ).kind == "cooperative"
        assert d.choose_launch(2048, 16 * 256, 16, NO_COOP, out_entries=entries,
                               deterministic=det).kind == "single"
    assert d.choose_launch(2048, 16 * 256, 16, H200, out_entries=entries, policy=no_tiny_fill,
                           variant="shared").kind == "single"
    most = d.DEFAULT_POLICY.coop_over_filled_single_entries
    assert d.choose_launch(2048, 16 * 256, 16, H200, out_entries=most).fill_grid
    assert d.choose_launch(2048, 16 * 256, 16, H200,
                           out_entries=most + 1).kind == "cooperative"
    # T=16: 67K entries, one block still wins, fill blocks or not
    for policy in (d.DEFAULT_POLICY, no_tiny_fill):
        assert d.choose_launch(128, 16 * 256, 16, H200, out_entries=16 * (3968 + 248),
                               policy=policy).kind == "single"
    # The pair likewise: the tiny pair with fill blocks, else the cooperative pair
    pair = d.choose_pair(2048, 256, 16 * 256, 16, H200, out_entries=entries,
                         prefer_cooperative=True, policy=NO_ROWS)
    assert pair.tiny and pair.fill_grid
    for out, policy in ((entries, dataclasses.replace(no_tiny_fill, tiny_row_blocks=False)),
                        (most + 1, NO_ROWS)):
        assert d.choose_pair(2048, 256, 16 * 256, 16, H200, out_entries=out, policy=policy,
                             prefer_cooperative=True) is None
        assert d.choose_pair(2048, 256, 16 * 256, 16, H200, out_entries=out,
                             policy=policy) is not None
    # Fill blocks computed, but no tiny pair (align_single's blocks have none): cooperative
    assert d.choose_pair(2048, 256, 16 * 256, 16, H200, out_entries=entries,
                         policy=d.AlignPolicy(use_tiny=False), prefer_cooperative=True) is None


# ---- every decision passes the launcher's guard, on both sides of every limit ---------------
def _boundaries(limits, rows):
    """Bucket counts on both sides of every limit the dispatcher and the kernels have."""
    region = d.row_region_bytes(rows)
    one_block = (limits.dynamic_smem - region) // 4 - 1     # starts[nb + 1]
    shared_multi = (limits.dynamic_smem - region - 4) // 8  # hist[nb + 1] and base[nb]
    coop = (limits.dynamic_smem - region - 8 - 8 * d.BLOCK) // 12
    edges = [1, 1024, 4096, one_block, shared_multi, coop, 32768, 65536, 131072]
    return sorted({max(rows, n + k) for n in edges for k in (0, 1)})


def _sides_fit(launch, numel, nb, rows, limits):
    d.check_launch(launch, numel, [(nb, rows)], limits)
    assert d.kernel_demands(launch, numel, [(nb, rows)])


@pytest.mark.parametrize("limits", [H200, NO_COOP, SMALL], ids=["h200", "no_coop", "small"])
@pytest.mark.parametrize("rows", [1, 8, 32, 64])
def test_every_choice_passes_the_launch_guard(limits, rows):
    for nb in _boundaries(limits, rows):
        for numel in (0, 1, 512, 4096, 4097, 32768, 131072, 132 * 8192 + 1):
            entries = rows * (numel + nb)
            for det in (False, True):
                for variant in (None, "shared", "global", "cooperative"):
                    try:
                        launch = d.choose_launch(numel, nb, rows, limits, deterministic=det,
                                                 variant=variant, out_entries=entries)
                    except ValueError as e:
                        assert variant in ("shared", "cooperative"), e
                        assert f"variant='{variant}'" in str(e)
                        continue
                    _sides_fit(launch, numel, nb, rows, limits)


def test_the_32768_bucket_crash_is_gone():
    # LoRA 32 slots x 1024 experts at T=4096 K=8 picked the shared count + place launches,
    # whose place kernel needed 262 KB of shared memory (CUDA_ERROR_INVALID_VALUE).
    for experts, slots, tokens in ((1024, 32, 4096), (2048, 16, 16384), (4096, 8, 4096)):
        nb, numel = experts * slots, tokens * 8
        launch = d.choose_launch(numel, nb, slots, H200, out_entries=slots * numel)
        _sides_fit(launch, numel, nb, slots, H200)
        assert launch.variant == "global"
        with pytest.raises(ValueError, match="variant='shared'.*two ints a bucket"):
            d.choose_launch(numel, nb, slots, H200, variant="shared")


def test_shared_multi_limit_is_the_place_kernels():
    rows = 4
    top = (H200.dynamic_smem - d.row_region_bytes(rows) - 4) // 8
    assert d.shared_fits(top, rows, H200) and not d.shared_fits(top + 1, rows, H200)
    assert d.choose_launch(65536, top, rows, NO_COOP).variant == "shared"
    assert d.choose_launch(65536, top + 1, rows, NO_COOP).variant == "global"


@pytest.mark.parametrize("field,value,why", [
    ("smem_place", 131072, "layout needs"),
    ("smem_place", 300000, "more than the"),
    ("block", 1000, "block of 1000"),
    ("chunk", 8, "do not cover"),
])
def test_guard_refuses_what_a_kernel_cannot_run(field, value, why):
    import dataclasses
    nb, numel = 32768, 32768
    launch = d.choose_launch(numel, nb, 32, H200)
    bad = dataclasses.replace(launch, **{field: value})
    with pytest.raises(d.LaunchRefused, match=why):
        d.check_launch(bad, numel, [(nb, 32)], H200)


def test_tiny_fill_blocks():
    """align_tiny gets a block per fill_per_block output entries beside block 0 from
    tiny_fill_blocks_from entries on, and the fused tiny pair beside its two blocks for its
    LoRA side: never on the one-warp path (it fills itself); the aligning block is then
    sized without the fill."""
    policy = d.DEFAULT_POLICY
    entries = 16 * (128 + 256 * 15 + 248)  # LoRA T=16 K=8 E=256 B=16, 16 rows
    launch = d.choose_launch(128, 16 * 256, 16, H200, out_entries=entries)
    assert launch.kind == "single" and launch.tiny
    assert launch.fill_grid == -(-entries // policy.fill_per_block) and launch.grid == 1 + launch.fill_grid
    assert launch.block == d.tiny_block_threads(128, 0, 16 * 256)
    # below the threshold, or one warp's routes: block 0 fills
    cut = d.AlignPolicy(tiny_fill_blocks_from=32768)
    for numel, out, pol in ((128, 32767, cut), (d.WARP_ROUTES, 50000, policy)):
        small = d.choose_launch(numel, 16 * 64, 16, H200, out_entries=out, policy=pol)
        assert small.tiny and small.grid == 1 and not small.fill_grid
    at = d.choose_launch(d.WARP_ROUTES + 1, 16 * 64, 16, H200, out_entries=50000)
    assert at.tiny and at.fill_grid
    # LoRA rows get them at any size by default; one row from tiny_fill_blocks_one_row_from
    assert d.choose_launch(128, 4 * 64, 4, H200, out_entries=4 * (128 + 64 * 15)).fill_grid
    one_row = policy.tiny_fill_blocks_one_row_from
    for out, fills in ((128 + 256 * 15, False), (one_row - 1, False), (one_row, True)):
        base = d.choose_launch(128, 256, 1, H200, out_entries=out)
        assert base.tiny and bool(base.fill_grid) == fills, out
    # never more blocks than SMs
    most = d.choose_launch(4096, 16 * 256, 16, H200, out_entries=10**8,
                           policy=d.AlignPolicy(coop_over_single_entries=10**9,
                                                coop_over_filled_single_entries=10**9))
    assert most.tiny and most.grid == H200.sm_count
    pair = d.choose_pair(128, 256, 16 * 256, 16, H200, out_entries=entries, policy=NO_ROWS)
    assert pair.tiny and pair.fill_grid == launch.fill_grid and pair.grid == 2 + pair.fill_grid
    sides = [(256, 1), (16 * 256, 16)]
    d.check_launch(pair, 128, sides, H200)
    small = d.choose_pair(128, 256, 16 * 64, 16, H200, out_entries=32767,
                          policy=dataclasses.replace(cut, tiny_row_blocks=False))
    assert small.tiny and small.grid == 2 and not small.fill_grid
    with pytest.raises(d.LaunchRefused, match="not 1 and"):
        d.check_launch(dataclasses.replace(launch, grid=1), 128, [(16 * 256, 16)], H200)
    with pytest.raises(d.LaunchRefused, match="not 2 and"):
        d.check_launch(dataclasses.replace(pair, grid=2), 128, sides, H200)
    single = d.choose_pair(128, 256, 16 * 256, 16, H200, out_entries=entries,
                           policy=d.AlignPolicy(use_tiny=False))
    assert not single.tiny and not single.fill_grid
    with pytest.raises(d.LaunchRefused, match="only align_tiny"):
        d.check_launch(dataclasses.replace(single, fill_grid=1), 128, sides, H200)
    d.check_launch(launch, 128, [(16 * 256, 16)], H200)
    # a cooperative launch (block 0 waits for them): none where there is no such launch
    assert d.launch_kernels(launch)[0][4] and d.launch_kernels(pair, fused=True)[0][4]
    assert not d.launch_kernels(small, fused=True)[0][4]
    assert not d.choose_pair(128, 256, 16 * 256, 16, NO_COOP, out_entries=entries).fill_grid
    assert not d.choose_launch(128, 16 * 256, 16, NO_COOP, out_entries=entries).fill_grid
    with pytest.raises(d.LaunchRefused, match="resident"):
        d.check_launch(dataclasses.replace(launch, grid=H200.sm_count + 1,
                                           fill_grid=H200.sm_count), 128, [(16 * 256, 16)], H200)


def test_guard_refuses_a_cooperative_grid_that_cannot_be_resident():
    import dataclasses
    launch = d.choose_launch(8192, 256, 1, H200, variant="cooperative", policy=NO_FILL_BLOCKS)
    with pytest.raises(d.LaunchRefused, match="resident"):
        d.check_launch(dataclasses.replace(launch, grid=133), 8192, [(256, 1)], H200)
    # Fill blocks: two blocks of half the threads an SM, never more
    split = d.choose_launch(8192, 256, 1, H200, variant="cooperative", out_entries=10**5)
    assert split.fill_grid and split.grid <= 2 * H200.sm_count
    d.check_launch(dataclasses.replace(split, grid=2 * H200.sm_count), 8192, [(256, 1)], H200)
    with pytest.raises(d.LaunchRefused, match="resident"):
        d.check_launch(dataclasses.replace(split, grid=2 * H200.sm_count + 1), 8192,
                       [(256, 1)], H200)
    # At least one counting block
    for bad in (dataclasses.replace(launch, fill_grid=launch.grid),
                dataclasses.replace(split, fill_grid=split.grid)):
        with pytest.raises(d.LaunchRefused, match="only filling"):
            d.check_launch(bad, 8192, [(256, 1)], H200)
    # Fill blocks of BLOCK threads: one block an SM, the counting blocks' chunks covering
    # every route
    whole = d.choose_launch(8192, 256, 1, H200, variant="cooperative", out_entries=10**5,
                            policy=FILL_SMS)
    assert whole.fill_grid and whole.block == d.BLOCK
    d.check_launch(dataclasses.replace(whole, grid=H200.sm_count,
                                       fill_grid=H200.sm_count - whole.grid + whole.fill_grid),
                   8192, [(256, 1)], H200)
    with pytest.raises(d.LaunchRefused, match="resident"):
        d.check_launch(dataclasses.replace(whole, grid=H200.sm_count + 1,
                                           fill_grid=H200.sm_count + 1 - whole.grid
                                           + whole.fill_grid), 8192, [(256, 1)], H200)
    with pytest.raises(d.LaunchRefused, match="do not cover"):
        d.check_launch(dataclasses.replace(whole, fill_grid=whole.fill_grid + 1), 8192,
                       [(256, 1)], H200)
    # The segment sort needs blocks of BLOCK threads; at most COOP_ITEMS routes a thread
    with pytest.raises(d.LaunchRefused, match="segment sort"):
        d.check_launch(dataclasses.replace(split, sorted=True, deterministic=True,
                                           smem_place=100000), 8192,
                       [(256, 1)], H200)
    with pytest.raises(d.LaunchRefused, match="a thread of 512"):
        d.check_launch(dataclasses.replace(split, chunk=d.COOP_ITEMS * 512 + 1,
                                           smem_place=100000), 8192,
                       [(256, 1)], H200)


@pytest.mark.parametrize("rows", [1, 4, 16, 64])
@pytest.mark.parametrize("det", [False, True])
def test_every_pair_passes_the_launch_guard(rows, det):
    for experts in (1, 64, 256, 1024, 4096, 8192):
        for numel in (0, 1, 64, 512, 2048, 4096, 8192, 131072):
            sides = [(experts, 1), (rows * experts, rows)]
            pair = d.choose_pair(numel, experts, rows * experts, rows, H200, deterministic=det,
                                 out_entries=rows * (numel + experts))
            if pair is not None:
                d.check_launch(pair, numel, sides, H200)
            if not det:
                coop = d.choose_cooperative_pair(numel, experts, rows * experts, rows, H200)
                if coop is not None:
                    d.check_launch(coop, numel, sides, H200)


def test_kernel_constants_match_the_cuda_source():
    """The constants the dispatcher sizes launches by are those the kernels are built with."""
    import re

    from moe_lora_align import _kernels

    src = _kernels.source()
    defined = dict(re.findall(r"^#define (\w+) (\d+)", src, flags=re.M))
    for name in ("ITEMS_PER_THREAD", "TINY_ITEMS", "TINY_BUCKETS", "WARP_ROUTES", "COOP_ITEMS",
                 "CLUSTER_BLOCKS", "CLUSTER_ITEMS", "ORDER_ITEMS", "ORDER_DIGITS_MAX",
                 "ORDER_BITMAP_ALL_MAX",
                 "MODE_SHARED", "MODE_GLOBAL", "MODE_DETERMINISTIC"):
        assert int(defined[name]) == getattr(d, name), name


def test_policy_is_a_value_the_dispatcher_takes():
    import dataclasses

    default = d.choose_launch(8, 64, 1, H200)
    assert default.tiny
    off = d.choose_launch(8, 64, 1, H200, policy=dataclasses.replace(d.DEFAULT_POLICY,
                                                                     use_tiny=False))
    assert off.kind == "single" and not off.tiny
    assert d.choose_launch(8, 64, 1, H200) == default  # nothing global changed
    hash(d.DEFAULT_POLICY)  # the launch cache keys on it


CLUSTER_CAP = d.CLUSTER_BLOCKS * d.CLUSTER_ITEMS * d.BLOCK


@pytest.mark.parametrize("numel", [0, 1, 2048, 8191, 12288, CLUSTER_CAP])
@pytest.mark.parametrize("buckets", [1, 256, 4096])
def test_cluster_geometry_covers_every_route(numel, buckets):
    launch = d.choose_launch(numel, buckets, 1, H200, variant="cluster")
    assert launch.kind == "cluster" and launch.grid == d.CLUSTER_BLOCKS
    assert launch.chunk * d.CLUSTER_BLOCKS >= numel
    assert launch.chunk <= d.CLUSTER_ITEMS * launch.block
    assert launch.block % 32 == 0 and 32 <= launch.block <= d.BLOCK
    assert launch.block * d.DEFAULT_POLICY.buckets_per_thread >= min(buckets, 4 * d.BLOCK)
    assert launch.smem_place == d.smem_cluster(buckets, 1)
    d.check_launch(launch, numel, [(buckets, 1)], H200)


@pytest.mark.parametrize("numel,buckets,limits,det,why", [
    (CLUSTER_CAP + 1, 64, H200, False, "more than its"),
    (2048, 4096, H200, True, "shared memory"),
    (2048, 64, NO_CLUSTERS, False, "no thread-block clusters"),
    (2048, 20000, H200, False, "shared memory"),
])
def test_forced_cluster_refusals_say_why(numel, buckets, limits, det, why):
    with pytest.raises(ValueError, match=why):
        d.choose_launch(numel, buckets, 1, limits, deterministic=det, variant="cluster")


def test_cluster_range_is_a_policy_value():
    import dataclasses

    assert d.choose_launch(4096, 256, 1, H200).kind == "cluster"
    off = dataclasses.replace(d.DEFAULT_POLICY, cluster_max_routes=0)
    assert d.choose_launch(4096, 256, 1, H200, policy=off).kind != "cluster"
    few = dataclasses.replace(d.DEFAULT_POLICY, cluster_max_buckets=128)
    assert d.choose_launch(4096, 256, 1, H200, policy=few).kind != "cluster"


def test_cluster_pair_shares_one_geometry():
    pair = d.choose_cluster_pair(4096, 256, 4 * 256, 4, H200)
    assert pair.kind == "cluster" and pair.grid == 2 * d.CLUSTER_BLOCKS
    assert pair.smem_place == max(d.smem_cluster(256, 1), d.smem_cluster(1024, 4))
    d.check_launch(pair, 4096, [(256, 1), (1024, 4)], H200)
    assert d.choose_cluster_pair(4096, 256, 1024, 4, NO_CLUSTERS) is None


@pytest.mark.parametrize("numel,buckets,rows", [(2048, 256, 1), (8192, 512, 1), (12288, 1024, 4),
                                                (CLUSTER_CAP, 64, 1)])
def test_deterministic_cluster_holds_its_warp_counters(numel, buckets, rows):
    """Deterministic align_cluster: a 2-byte counter a bucket for each warp of its block
    beside the histograms; the dispatcher picks it in the cluster range."""
    launch = d.choose_launch(numel, buckets, rows, H200, deterministic=True, variant="cluster")
    free = d.choose_launch(numel, buckets, rows, H200, variant="cluster")
    assert launch.deterministic and launch.block == free.block
    counters = 2 * (launch.block // 32) * (buckets + buckets % 2)
    assert launch.smem_place == d.smem_cluster(buckets, rows) + counters
    d.check_launch(launch, numel, [(buckets, rows)], H200)
    if d.in_cluster_range(numel, buckets, d.DEFAULT_POLICY, deterministic=True):
        assert d.choose_launch(numel, buckets, rows, H200, deterministic=True) == launch


def test_deterministic_cluster_pair_sizes_both_sides_at_its_block():
    pair = d.choose_cluster_pair(4096, 256, 1024, 4, H200, deterministic=True)
    assert pair.deterministic and pair.grid == 2 * d.CLUSTER_BLOCKS
    assert pair.smem_place == max(d.smem_cluster(256, 1, True, pair.block),
                                  d.smem_cluster(1024, 4, True, pair.block))
    d.check_launch(pair, 4096, [(256, 1), (1024, 4)], H200)
    # 16 slots of 1024 experts: the LoRA side's counters cannot fit one block
    assert d.choose_cluster_pair(4096, 1024, 16 * 1024, 16, H200, deterministic=True) is None


def test_check_launch_refuses_a_broken_cluster_launch():
    import dataclasses

    good = d.choose_launch(4096, 256, 1, H200, variant="cluster")
    for bad in (dataclasses.replace(good, grid=2 * d.CLUSTER_BLOCKS),
                dataclasses.replace(good, chunk=good.chunk - 1),
                dataclasses.replace(good, block=32),
                dataclasses.replace(good, smem_place=good.smem_place - 4)):
        with pytest.raises(d.LaunchRefused, match="align_cluster"):
            d.check_launch(bad, 4096, [(256, 1)], H200)


def test_every_cooperative_pair_the_dispatcher_gives_has_a_kernel():
    """The launcher looks the pair kernel up by its sides' modes: no size, policy or mode the
    dispatcher can pick may lack an instance (both sides sorting has none, so it is refused)."""
    from moe_lora_align import _kernels

    names = _kernels.kernel_names(np.int32)
    seen = set()
    for numel in (1, 4096 * 8, 16384 * 8, 65536 * 8):
        for experts, rows in ((64, 4), (256, 16), (512, 16), (2048, 4)):
            for det in (False, True):
                for policy in (d.DEFAULT_POLICY, ORDERED, SORTED):
                    pair = d.choose_cooperative_pair(numel, experts, rows * experts, rows, H200,
                                                     deterministic=det, policy=policy)
                    if pair is not None:
                        assert ("cooperative_pair", pair.modes) in names
                        seen.add(pair.modes)
    assert seen == set(d.COOP_PAIR_MODES)


def test_tiny_staged_base_row():
    """A base align_tiny call of more than one warp's routes from tiny_stage_from routes
    builds its row in shared memory (align_tiny_staged, an ordinary launch) where the image
    fits, and keeps it over the cluster below the cluster_over_staged_* figures; never below
    the cut, on LoRA rows, with fill blocks, in a
    fused pair or where the output's size is not given."""
    staged = d.AlignPolicy(tiny_stage_from=0)
    P, M = 2048 + 256 * 15, 368
    cut = d.DEFAULT_POLICY.tiny_stage_from
    assert not d.choose_launch(cut - 1, 256, 1, H200, out_entries=P + M).stage_output
    assert d.choose_launch(cut, 256, 1, H200, out_entries=P + M).stage_output
    assert not d.choose_launch(2048, 256, 1, H200).stage_output
    # a LoRA row of one slot is not a base row: never staged, so the cluster may take it
    one_slot = d.choose_launch(cut, 256, 1, H200, out_entries=P + M, lora=True)
    assert not one_slot.stage_output and one_slot.kind == "single"
    assert d.choose_launch(2560, 256, 1, H200, out_entries=2560 + 256 * 15 + 176,
                           lora=True).kind == "cluster"
    # the mid band's cluster range: staged below cluster_over_staged_from, else the cluster
    for numel, expect in ((2560, "single"), (4096, "single")):
        assert d.choose_launch(numel, 512, 1, H200, out_entries=numel + 512 * 15 + 400).kind \
            == expect
    for numel, at in ((2560, 2560), (2560, 2561), (4096, 4096)):
        launch = d.choose_launch(numel, 512, 1, H200, out_entries=numel + 512 * 15 + 400,
                                 policy=d.AlignPolicy(cluster_over_staged_from=at))
        assert launch.kind == ("cluster" if numel >= at else "single")
    # deterministic calls, and outputs of as many entries as cluster_over_staged_entries
    det_cut = d.DEFAULT_POLICY.cluster_over_staged_from_deterministic
    for numel in (det_cut - 1, det_cut):
        launch = d.choose_launch(numel, 256, 1, H200, deterministic=True,
                                 out_entries=numel + 256 * 15 + 400)
        assert launch.kind == ("cluster" if numel >= det_cut else "single")
    most = d.DEFAULT_POLICY.cluster_over_staged_entries
    for out in (most - 1, most):
        launch = d.choose_launch(4096, 256, 1, H200, out_entries=out)
        assert launch.kind == ("cluster" if out >= most else "single")
    assert d.choose_launch(2560, 512, 1, dataclasses.replace(H200, clusters=False),
                           out_entries=2560 + 512 * 15 + 400).stage_output
    launch = d.choose_launch(2048, 256, 1, H200, out_entries=P + M, policy=staged)
    assert launch.tiny and launch.stage_output and not launch.fill_grid
    assert d.launch_kernels(launch) == [(("tiny_staged", False), 1, launch.block,
                                         launch.smem_single, False)]
    assert d.tiny_stage_entries(launch, 2048, 256) >= P
    d.check_launch(launch, 2048, [(256, 1)], H200)
    det = d.choose_launch(2048, 256, 1, H200, deterministic=True, out_entries=P + M,
                          policy=staged)
    assert det.stage_output and d.tiny_stage_entries(det, 2048, 256) >= P
    at = d.AlignPolicy(tiny_stage_from=2048)
    assert d.choose_launch(2048, 256, 1, H200, out_entries=P + M, policy=at).stage_output
    assert not d.choose_launch(2047, 256, 1, H200, out_entries=P + M, policy=at).stage_output
    for numel, nb, rows, out in ((d.WARP_ROUTES, 64, 1, 2000), (128, 4 * 64, 4, 8000),
                                 (128, 256, 1, H200.dynamic_smem // 4)):
        assert not d.choose_launch(numel, nb, rows, H200, out_entries=out,
                                   policy=staged).stage_output
    filled = d.choose_launch(128, 256, 1, H200, out_entries=40000,
                             policy=d.AlignPolicy(tiny_stage_from=0,
                                                  tiny_fill_blocks_one_row_from=0))
    assert filled.fill_grid and not filled.stage_output
    pair = d.choose_pair(2048, 256, 16 * 256, 16, H200, out_entries=16 * (P + M),
                         policy=staged)
    assert pair is None or not pair.stage_output
    off = d.AlignPolicy(tiny_stage_from=1 << 62)
    assert d.tiny_stage_entries(d.choose_launch(2048, 256, 1, H200, out_entries=P + M,
                                                policy=off), 2048, 256) == 0


# ---- deterministic align_tiny's chunks' groups (align_tiny_chunked) ------------------------
def test_tiny_chunked_ranks_from_its_bucket_cut_for_its_routes():
    pol = dataclasses.replace(d.DEFAULT_POLICY, cluster_min_routes=1 << 30)
    cut, lo, hi = (pol.tiny_chunk_ranks_from, pol.tiny_chunk_ranks_min_routes,
                   pol.tiny_chunk_ranks_max_routes)
    assert d.WARP_ROUTES < lo <= hi <= d.SINGLE_BLOCK_MAX_ROUTES
    for buckets, routes, want in [(cut, lo, True), (cut, hi, True), (cut - 1, lo, False),
                                  (cut, lo - 1, False), (cut, hi + 1, False)]:
        rows = -(-buckets // 256)
        launch = d.choose_launch(routes, buckets, rows, NO_COOP, deterministic=True, policy=pol)
        assert launch.kind == "single" and launch.rank_chunks == want, (buckets, routes)
        assert not d.choose_launch(routes, buckets, rows, NO_COOP, policy=pol).rank_chunks
    # past its routes as before: counters where they fit, else align_single's fewer warps
    # or the cooperative launch
    assert not d.choose_launch(hi + 1, cut, 16, H200, deterministic=True).rank_chunks
    # the fused pair kernels keep per-warp counters
    pair = d.choose_pair(lo, 256, 16 * 256, 16, H200, deterministic=True)
    assert pair is None or not pair.rank_chunks


def test_tiny_chunked_ranks_below_the_cut_from_the_mid_routes():
    """From tiny_chunk_ranks_mid_buckets buckets (below the cut) the chunks take calls of
    tiny_chunk_ranks_mid_min_routes routes and more, up to the same route bound."""
    pol = dataclasses.replace(d.DEFAULT_POLICY, cluster_min_routes=1 << 30)
    mid, lo = pol.tiny_chunk_ranks_mid_buckets, pol.tiny_chunk_ranks_mid_min_routes
    cut, hi = pol.tiny_chunk_ranks_from, pol.tiny_chunk_ranks_max_routes
    assert mid < cut and pol.tiny_chunk_ranks_min_routes < lo <= hi
    for buckets, routes, want in [(mid, lo, True), (mid, hi, True), (cut - 1, lo, True),
                                  (mid, lo - 1, False), (mid - 1, lo, False),
                                  (mid, hi + 1, False), (cut - 1, lo - 1, False)]:
        assert d.tiny_ranks_by_chunks(routes, buckets, pol) == want, (buckets, routes)
        rows = -(-buckets // 256)
        launch = d.choose_launch(routes, buckets, rows, NO_COOP, deterministic=True, policy=pol)
        assert launch.tiny and launch.rank_chunks == want, (buckets, routes)


@pytest.mark.parametrize("numel,buckets", [(33, 1), (40, 2), (100, 4096), (4096, 4096),
                                           (2048, 1000), (500, 33 * 7)])
def test_tiny_chunked_layout(numel, buckets):
    """align_tiny_chunked's shared memory: raw starts, the scan's warp totals, a record a
    route; the launch gives that after the counts."""
    assert d.tiny_chunk_bytes(numel, buckets) == 4 * buckets + 128 + 4 * numel
    rows = -(-buckets // 256) if buckets > 1024 else 1
    launch = d.choose_launch(numel, buckets, rows, NO_COOP, deterministic=True,
                             policy=dataclasses.replace(d.DEFAULT_POLICY, tiny_chunk_ranks_from=0,
                                                        tiny_chunk_ranks_min_routes=0,
                                                        tiny_chunk_ranks_max_routes=1 << 62,
                                                        cluster_min_routes=1 << 30))
    assert launch.rank_chunks
    assert launch.smem_single == d.smem_one_block(buckets, rows) + d.tiny_chunk_bytes(numel, buckets)
    assert d.launch_kernels(launch) == [(("tiny_chunked", True), launch.grid, launch.block,
                                         launch.smem_single, launch.fill_grid > 0)]
    d.check_launch(launch, numel, [(buckets, rows)], NO_COOP)


def test_tiny_chunked_refuses_past_its_block_or_in_free_order():
    every = dataclasses.replace(d.DEFAULT_POLICY, tiny_chunk_ranks_max_routes=1 << 62)
    launch = d.choose_launch(4096, 4096, 16, NO_COOP, deterministic=True, policy=every)
    assert launch.rank_chunks
    roomy = dataclasses.replace(launch, smem_single=launch.smem_single + 64)
    with pytest.raises(d.LaunchRefused, match="more than the 4096"):
        d.check_launch(roomy, 4097, [(4096, 16)], NO_COOP)
    free = dataclasses.replace(launch, deterministic=False)
    with pytest.raises(d.LaunchRefused, match="free-order"):
        d.check_launch(free, 4096, [(4096, 16)], NO_COOP)


# ---- LoRA a block a row (align_tiny_rows, align_tiny_rows_pair) ----------------------------
ROWS = d.AlignPolicy(tiny_row_blocks=True)
FEWER_ROWS = d.AlignPolicy(tiny_row_blocks=True, tiny_row_blocks_max_rows=100)


def test_row_blocks_take_lora_calls_of_their_range():
    """A block a row for LoRA calls of 2 to tiny_row_blocks_max_rows rows and
    tiny_row_blocks_min_routes to _max_routes routes, a thread a bucket of a row (tiny_one_bucket_max experts), each block
    sized as align_tiny's base block of one row; never for base calls or without the policy."""
    lo, hi = ROWS.tiny_row_blocks_min_routes, ROWS.tiny_row_blocks_max_routes
    P, M = 128 + 256 * 15, 248
    launch = d.choose_launch(128, 16 * 256, 16, H200, out_entries=16 * (P + M), policy=ROWS,
                             lora=True)
    assert launch.row_blocks and launch.grid == 16 and not launch.fill_grid
    assert launch.block == d.tiny_block_threads(128, P + M, 256, ROWS)
    assert launch.smem_single == d.smem_one_block(256, 1)
    assert d.launch_kernels(launch) == [(("tiny_rows", False), 16, launch.block,
                                         launch.smem_single, False)]
    det = d.choose_launch(128, 16 * 256, 16, H200, out_entries=16 * (P + M), policy=ROWS,
                          lora=True, deterministic=True)
    assert det.row_blocks and det.deterministic
    assert det.smem_single == d.smem_one_block(256, 1, d.tiny_warp_counter_bytes(128, det.block,
                                                                                 256))
    for numel, nb, rows, lora, policy, want in [
            (lo, 4 * 64, 4, True, ROWS, True), (lo - 1, 4 * 64, 4, True, ROWS, False),
            (hi, 4 * 64, 4, True, ROWS, True), (hi + 1, 4 * 64, 4, True, ROWS, False),
            (128, 2 * 64, 2, True, ROWS, True), (128, 64, 1, True, ROWS, False),
            (128, 128 * 8, 128, True, ROWS, True), (128, 129 * 8, 129, True, ROWS, False),
            (128, 100 * 64, 100, True, FEWER_ROWS, True),
            (128, 101 * 64, 101, True, FEWER_ROWS, False),
            (128, 2 * 1024, 2, True, ROWS, True), (128, 2 * 1025, 2, True, ROWS, False),
            (128, 4 * 64, 4, False, ROWS, False),
            (128, 4 * 64, 4, True, NO_ROWS, False),
            (128, 4 * 64, 4, True, dataclasses.replace(ROWS, use_tiny=False), False)]:
        launch = d.choose_launch(numel, nb, rows, H200, out_entries=rows * 4000, policy=policy,
                                 lora=lora)
        assert launch.row_blocks == want, (numel, nb, rows, lora)
        d.check_launch(launch, numel, [(nb, rows)], H200)
    # ahead of the cluster and of the cooperative launch in its range of routes
    assert d.choose_launch(4096, 2 * 256, 2, H200, out_entries=10**6, policy=ROWS,
                           lora=True).row_blocks


def test_row_blocks_pair_and_its_guard():
    """Base in block 0, then a block a LoRA row: the larger block and shared memory of the
    two sides; the guard refuses a grid that is not 1 + rows (or rows alone), fill blocks,
    and more experts than threads. Past 32 rows the pair is the same."""
    pair = d.choose_pair(128, 256, 16 * 256, 16, H200, out_entries=16 * 4216, policy=ROWS,
                         prefer_cooperative=True)
    assert pair.row_blocks and pair.grid == 17 and not pair.fill_grid
    sides = [(256, 1), (16 * 256, 16)]
    assert d.launch_kernels(pair, fused=True)[0][0] == ("tiny_rows_pair", False)
    d.check_launch(pair, 128, sides, H200)
    det = d.choose_pair(2048, 64, 16 * 256, 16, NO_COOP, deterministic=True, policy=ROWS)
    assert det.row_blocks and det.smem_single == max(
        d.smem_one_block(nb, 1, d.tiny_warp_counter_bytes(2048, det.block, nb))
        for nb in (64, 256))
    d.check_launch(det, 2048, [(64, 1), (16 * 256, 16)], NO_COOP)
    assert not d.choose_pair(128, 256, 16 * 256, 16, H200, policy=NO_ROWS).row_blocks
    assert not d.choose_pair(128, 64, 129 * 64, 129, H200, policy=ROWS).row_blocks
    many = d.choose_pair(128, 256, 64 * 256, 64, H200, out_entries=64 * 4216, policy=ROWS)
    assert many.row_blocks and many.grid == 65
    d.check_launch(many, 128, [(256, 1), (64 * 256, 64)], H200)
    lone = d.choose_launch(128, 16 * 256, 16, H200, policy=ROWS, lora=True)
    for bad, numel, sides_, match in [
            (dataclasses.replace(pair, grid=16), 128, sides, "a grid of 16 blocks"),
            (dataclasses.replace(lone, grid=17), 128, [(16 * 256, 16)], "a grid of 17"),
            (dataclasses.replace(lone, grid=64), 128, [(65 * 256, 65)], "a grid of 64"),
            (dataclasses.replace(lone, fill_grid=2), 128, [(16 * 256, 16)], "no fill blocks"),
            (dataclasses.replace(lone, block=128), 128, [(16 * 256, 16)], "256 experts")]:
        with pytest.raises(d.LaunchRefused, match=match):
            d.check_launch(bad, numel, sides_, H200)


# ---- LoRA a cluster a row (align_cluster_rows) ---------------------------------------------
WIDE_CLUSTER_ROWS = d.AlignPolicy(cluster_rows_max_routes=8 * 8 * 1024,
                                  cluster_rows_max_routes_deterministic=8 * 8 * 1024)


def test_cluster_rows_pair_where_the_lora_side_runs_a_cluster_a_row():
    """Base on cluster 0 and a cluster a LoRA row after it: where the policy asks for it (on
    by default, up to cluster_rows_pair_max_routes) and the LoRA side alone would run a
    cluster a row; one geometry for both sides, the larger side's shared memory; the guard
    wants (1 + rows) clusters."""
    numel, E, rows = 8192, 256, 16
    off = d.AlignPolicy(cluster_rows_pair=False)
    assert d.choose_cluster_rows_pair(numel, E, rows * E, rows, H200, policy=off) is None
    on = d.DEFAULT_POLICY
    assert on.cluster_rows_pair
    pair = d.choose_cluster_rows_pair(numel, E, rows * E, rows, H200, policy=on)
    alone = d.cluster_rows(numel, rows * E, rows, H200, policy=on)
    assert pair.row_clusters and pair.grid == (1 + rows) * 8 and pair.chunk == alone.chunk
    assert pair.smem_place == max(d.smem_cluster(E, 1, False, pair.block), alone.smem_place)
    assert d.launch_kernels(pair, fused=True) == [(("cluster_rows_pair", False), pair.grid,
                                                   pair.block, pair.smem_place, False)]
    sides = [(E, 1), (rows * E, rows)]
    d.check_launch(pair, numel, sides, H200)
    for bad, sides_ in [(dataclasses.replace(pair, grid=rows * 8), sides),
                        (pair, [(E, 1), (E, 1), (rows * E, rows)])]:
        with pytest.raises(d.LaunchRefused, match="not one cluster"):
            d.check_launch(bad, numel, sides_, H200)
    det = d.choose_cluster_rows_pair(numel, E, rows * E, rows, H200, deterministic=True,
                                     policy=on)
    assert det.deterministic and det.row_clusters
    for args, limits in [((16, E, rows * E, rows), H200),  # decode: a block a row
                         ((numel, E, rows * E, 17), H200),  # past cluster_rows_max_rows
                         ((numel, E, rows * E, rows), NO_CLUSTERS)]:
        assert d.choose_cluster_rows_pair(*args, limits, policy=on) is None, args


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
def test_cluster_rows_pair_stops_at_its_route_cut(det):
    """The pair's own cut (cluster_rows_pair_max_routes, deterministic: _deterministic)
    stops it where the LoRA side alone still runs a cluster a row (8 slots), both sides of
    the cut; choose_streams then fuses the pair another way or runs two launches."""
    pol, E, rows = d.DEFAULT_POLICY, 256, 8
    most = (pol.cluster_rows_pair_max_routes_deterministic if det
            else pol.cluster_rows_pair_max_routes)
    assert most < d.cluster_rows_route_cut(rows, E, det, pol)
    for numel, want in [(most, True), (most + 8, False)]:
        assert d.cluster_rows(numel, rows * E, rows, H200, det) is not None
        pair = d.choose_cluster_rows_pair(numel, E, rows * E, rows, H200, deterministic=det)
        assert (pair is not None) == want, numel
    # fewer experts than cluster_rows_pair_min_experts (not measured): no rows pair
    small = pol.cluster_rows_pair_min_experts // 2
    numel = pol.cluster_rows_max_routes
    assert d.cluster_rows(numel, rows * small, rows, H200, det) is not None
    assert d.choose_cluster_rows_pair(numel, small, rows * small, rows, H200,
                                      deterministic=det) is None


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
def test_the_gpu_tests_policy_gives_every_pair_a_base_cluster_and_row_clusters(det):
    """gpu_util.CLUSTER_ROWS_PAIR fuses each case of the GPU test of
    align_cluster_rows_pair into that launch, free and deterministic, on the H200's limits."""
    from gpu_util import CLUSTER_ROWS_PAIR, CLUSTER_ROWS_PAIR_CASES
    for T, E, K, B, rows in CLUSTER_ROWS_PAIR_CASES:
        assert d.pair_in_cluster_range(T * K, rows * E, rows, 0, det, H200,
                                       CLUSTER_ROWS_PAIR) is False
        pair = d.choose_cluster_rows_pair(T * K, E, rows * E, rows, H200, deterministic=det,
                                          policy=CLUSTER_ROWS_PAIR)
        assert pair is not None and pair.grid == (1 + rows) * 8, (T, E, K, B, rows)
        d.check_launch(pair, T * K, [(E, 1), (rows * E, rows)], H200)


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
def test_the_gpu_tests_policy_gives_every_case_a_cluster_a_row(det):
    """gpu_util.CLUSTER_ROWS takes each case of the GPU test of align_cluster_rows, free and
    deterministic, on the H200's limits (as that test asserts on the device)."""
    from gpu_util import CLUSTER_ROWS, CLUSTER_ROWS_CASES
    for E, T, K, rows in CLUSTER_ROWS_CASES:
        P, M = buffer_sizes(T * K, E, 16)
        launch = d.choose_launch(T * K, rows * E, rows, H200, deterministic=det,
                                 out_entries=rows * (P + M), policy=CLUSTER_ROWS, lora=True)
        assert launch.row_clusters and launch.grid == rows * 8, (E, T, K, rows)


def test_cluster_rows_take_lora_calls_of_their_range():
    """A cluster a row for LoRA calls of 2 to cluster_rows_max_rows rows and
    cluster_rows_min_routes to _max_routes routes (at most what one cluster holds), on
    devices with clusters, past the one cluster's buckets; each cluster align_cluster's
    geometry of one row; the guard wants a cluster a row."""
    pol = d.DEFAULT_POLICY
    lo, hi, most = pol.cluster_rows_min_routes, pol.cluster_rows_max_routes, 8 * 8 * 1024
    launch = d.choose_launch(hi, 16 * 256, 16, H200, out_entries=10**6, lora=True)
    one = d._cluster(hi, 256, 1, H200, False, pol)
    assert launch.row_clusters and launch.grid == 16 * 8 and launch.block == one.block
    assert launch.smem_place == one.smem_place and launch.chunk == one.chunk
    assert d.launch_kernels(launch) == [(("cluster_rows", False), 128, launch.block,
                                         launch.smem_place, False)]
    d.check_launch(launch, hi, [(16 * 256, 16)], H200)
    for numel, E, rows, policy, limits, want in [
            (lo, 256, 16, pol, H200, True), (lo - 1, 256, 16, pol, H200, False),
            (hi, 256, 16, pol, H200, True), (hi + 1, 256, 16, pol, H200, False),
            (most, 256, 16, WIDE_CLUSTER_ROWS, H200, True),
            (most + 1, 256, 16, WIDE_CLUSTER_ROWS, H200, False),
            (hi, 1024, 1, pol, H200, False), (hi, 1024, 2, pol, H200, True),
            (hi, 256, 17, pol, H200, False),
            # 1024 buckets: the one cluster's range, and past its routes a cluster a row
            (pol.cluster_max_routes, 256, 4, pol, H200, False),
            (pol.cluster_max_routes + 1, 256, 4, pol, H200, True),
            (hi, 256, 16, d.AlignPolicy(cluster_rows=False), H200, False),
            (hi, 256, 16, pol, dataclasses.replace(H200, clusters=False), False)]:
        got = d.choose_launch(numel, rows * E, rows, limits, out_entries=rows * 20000,
                              policy=policy, lora=True)
        assert got.row_clusters == want, (numel, E, rows, policy.cluster_rows)
    det = d.choose_launch(hi, 16 * 256, 16, H200, deterministic=True, lora=True)
    assert det.row_clusters and det.deterministic and not det.order_grid
    hi_det = pol.cluster_rows_max_routes_deterministic  # past the free calls' cut
    assert hi < hi_det
    for numel, want in [(hi + 1, True), (hi_det, True), (hi_det + 1, False)]:
        got = d.choose_launch(numel, 16 * 256, 16, H200, deterministic=True,
                              out_entries=16 * 20000, lora=True)
        assert got.row_clusters == want and got.deterministic, numel
    for bad, sides_ in [(dataclasses.replace(launch, grid=8), [(16 * 256, 16)]),
                        (launch, [(256, 1), (16 * 256, 16)])]:
        with pytest.raises(d.LaunchRefused, match="not one cluster"):
            d.check_launch(bad, hi, sides_, H200)


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
def test_cluster_rows_cut_grows_with_routes_a_slot_up_to_the_wide_rows(det):
    """Up to cluster_rows_wide_max_rows slots of at least cluster_rows_wide_min_experts
    experts, a cluster a row takes cluster_rows_routes_per_row routes a slot (deterministic:
    _deterministic) where that passes the flat cut; past those slots, or with fewer
    experts, the flat cut holds; both sides of each cut, 2 to 16 slots."""
    pol = d.DEFAULT_POLICY
    flat = pol.cluster_rows_max_routes_deterministic if det else pol.cluster_rows_max_routes
    per_row = (pol.cluster_rows_routes_per_row_deterministic if det
               else pol.cluster_rows_routes_per_row)
    wide, fewest = pol.cluster_rows_wide_max_rows, pol.cluster_rows_wide_min_experts
    for E in (fewest // 4, fewest // 2, fewest, 2 * fewest):
        for rows in (2, 3, 4, wide, wide + 1, 16):
            most = d.cluster_rows_route_cut(rows, E, det, pol)
            widened = rows <= wide and E >= fewest
            assert most == (max(flat, per_row * rows) if widened else flat), (E, rows)
            for numel, want in [(most, True), (most + 8, False)]:
                if numel > 8 * 8 * 1024:  # past what one cluster holds
                    continue
                got = d.choose_launch(numel, rows * E, rows, H200, deterministic=det,
                                      out_entries=rows * 20000, lora=True)
                assert got.row_clusters == want, (E, rows, numel)
    assert d.cluster_rows_route_cut(8, fewest, det, pol) > flat  # it widens 8 slots
    assert d.cluster_rows_route_cut(8, fewest // 2, det, pol) == flat
