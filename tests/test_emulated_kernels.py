"""Every kernel variant on the CPU emulator (tests/emulator) against the NumPy backend, on
poisoned, guarded outputs: no GPU needed. The launch path is the package's (dispatcher,
workspace, packing, launch order); each case runs under a few schedules (seeds), which move
warps and blocks apart as far as their barriers allow. An emulated device has the H200's
shared memory and features on four SMs, so cooperative grids stay small.

What this cannot see: the GPU's memory model, timing, and anything of CuPy's or the driver's.
The GPU tests (test_gpu_*.py) still decide; this catches index, barrier and collective
mistakes before a GPU round, and runs in CI."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import emulator
from gpu_util import (CLUSTER_ROWS, CLUSTER_ROWS_PAIR, ROW_BLOCKS, TINY_RANKS,
                      tiny_ranks_policy)
from moe_lora_align import AlignPolicy, _call, _dispatch, _kernels
from moe_lora_align._sizes import buffer_sizes
from moe_lora_align.testing import (GUARD, POISON, canonical, guarded, make_lora,
                                    make_routing, segment_starts)

pytestmark = [pytest.mark.emulator,
              pytest.mark.skipif(not emulator.compiler_available(),
                                 reason=f"needs a C++ compiler ({emulator.COMPILER})")]

SEEDS = (0, 1, 2)


# MLA_EMU_RACECHECK=1: every emulated test with each shared-memory access checked (slower).
RACECHECK_ALL = os.environ.get("MLA_EMU_RACECHECK") == "1"


@pytest.fixture(scope="module")
def emu():
    return emulator.Emulator(emulator.build(dtypes=(np.int32, np.int64),
                                            racecheck=RACECHECK_ALL))


def _refused(variant, det, numel, buckets, rows, policy):
    try:
        _dispatch.choose_launch(numel, buckets, rows, emulator.LIMITS, deterministic=det,
                                variant=variant, policy=policy)
    except ValueError:
        return True
    return False


class Case:
    """One call's inputs, its NumPy answer, and poisoned guarded buffers for the kernels."""

    def __init__(self, T, K, E, B, *, rows=None, kind="uniform", dtype=np.int32, seed=0,
                 disabled=1, with_ids=True, map_mode=None, scatter=False, allocate=False):
        rng = np.random.default_rng(seed)
        self.allocate = allocate  # rows not processed get the empty alignment (allocated outputs)
        self.E, self.B, self.rows = E, B, rows
        self.ids = make_routing(rng, T, K, E, dtype, kind)
        self.lora = rows is not None
        self.mapping = self.lora_ids = self.enabled = None
        if self.lora:
            self.mapping, self.lora_ids, self.enabled = make_lora(rng, T, rows,
                                                                  disabled=disabled)
            if not with_ids:
                self.lora_ids = None
        self.expert_map = None
        if map_mode is not None:
            self.expert_map = np.full(E, -1, dtype=np.int32)
            local = rng.choice(E, size=max(1, E // 2), replace=False)
            self.expert_map[np.sort(local)] = np.arange(local.size, dtype=np.int32)
        # LoRA maps before counting; base as asked ("before" or "after").
        self.map_before = self.lora or map_mode == "before"
        self.scatter = scatter and not self.lora
        P, M = buffer_sizes(T * K, E, B)
        r = rows or 1
        self.shapes = [(r, P) if self.lora else (P,), (r, M) if self.lora else (M,), (r,)]
        if self.scatter:
            self.shapes.append((T * K,))
        self.answer()
        self.bufs = [guarded(sh, np) for sh in self.shapes]

    def answer(self):
        """NumPy's answer into poisoned buffers (again, after a test rewrites the routes)."""
        self.want = [np.full(sh, POISON, np.int32) for sh in self.shapes]
        _call.run_on_host(self.prepare(self.want, False).job)

    def prepare(self, outs, det):
        map_mode = _call.map_mode(self.expert_map, self.map_before)
        if self.lora:
            return _call.prepare(self.ids, self.B, self.E, rows=self.rows, lora=True,
                                 token_lora_mapping=self.mapping, lora_ids=self.lora_ids,
                                 adapter_enabled=self.enabled, expert_map=self.expert_map,
                                 map_mode=map_mode, deterministic=det, out=outs,
                                 fill_unprocessed=self.allocate)
        return _call.prepare(self.ids, self.B, self.E, rows=1, expert_map=self.expert_map,
                             map_mode=map_mode, scatter=self.scatter, deterministic=det,
                             out=outs)

    def job(self, det):
        for whole, _ in self.bufs:
            whole[:] = POISON
        return self.prepare([view for _, view in self.bufs], det).job

    def check(self, det):
        starts = segment_starts(self.ids, self.E, self.B, rows=self.rows or 1,
                                expert_map=self.expert_map, map_before=self.map_before,
                                mapping=self.mapping, lora_ids=self.lora_ids,
                                enabled=self.enabled)
        names = ("sorted", "experts", "ntpp", "scatter")
        for (whole, got), want, name in zip(self.bufs, self.want, names):
            assert (whole[:GUARD] == POISON).all() and (whole[-GUARD:] == POISON).all(), \
                f"{name}: guard zone written"
            if name == "sorted" and not det:
                got, want = (canonical(np.atleast_2d(x), starts) for x in (got, want))
            np.testing.assert_array_equal(got, want, err_msg=name)


def _run(emu, case, det, variant=None, policy=_dispatch.DEFAULT_POLICY, seeds=SEEDS):
    """The case under each schedule (the largest under one); returns the launch the
    dispatcher chose."""
    if case.ids.size * (case.rows or 1) > 100_000:
        seeds = seeds[:1]
    launch = None
    workspace = emulator.HostWorkspace()  # one for all schedules: what a call leaves, the next sees
    for seed in seeds:
        launch = emulator.run(emu, case.job(det), variant=variant, policy=policy, seed=seed,
                              workspace=workspace)
        case.check(det)
    return launch


# ---- base ---------------------------------------------------------------------------------
# (T, K, E, B): decode (one warp up to 32 routes, align_tiny past it, four buckets a thread
# past the block), the mid band (the cluster), prefill (the cooperative launch, count + place).
BASE = [(0, 8, 64, 16), (1, 8, 64, 16), (4, 8, 8, 16), (4, 8, 33, 1), (5, 8, 64, 16),
        (16, 8, 256, 16), (64, 8, 256, 64), (16, 4, 1024, 64), (3, 8, 4096, 16),
        (255, 1, 7, 128), (256, 8, 256, 16), (1024, 10, 512, 64), (2048, 8, 256, 64)]
VARIANTS = [None, "shared", "global", "cooperative", "cluster"]


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("T,K,E,B", BASE)
def test_base(emu, T, K, E, B, variant, det):
    if _refused(variant, det, T * K, E, 1, _dispatch.DEFAULT_POLICY):
        pytest.skip("the dispatcher refuses this variant at these sizes")
    _run(emu, Case(T, K, E, B, kind=("uniform", "skewed", "invalid")[(T + E) % 3], seed=T),
         det, variant)


@pytest.mark.parametrize("kind", ["skewed", "invalid", "duplicates", "hot"])
@pytest.mark.parametrize("T,E", [(3, 64), (40, 256), (512, 256), (4096, 64)])
def test_base_routing_kinds(emu, T, E, kind):
    for det in (False, True):
        _run(emu, Case(T, 8, E, 16, kind=kind, seed=E), det, seeds=(7,))


@pytest.mark.parametrize("map_mode", ["before", "after"])
@pytest.mark.parametrize("T,E,variant", [(2, 64, None), (100, 256, None), (512, 128, None),
                                         (2048, 256, "cooperative"), (1024, 64, "global")])
def test_base_expert_map_and_scatter(emu, T, E, variant, map_mode):
    for det in (False, True):
        if not _refused(variant, det, T * 8, E, 1, _dispatch.DEFAULT_POLICY):
            _run(emu, Case(T, 8, E, 16, map_mode=map_mode, scatter=True, seed=T), det,
                 variant, seeds=(3,))


ALL_DTYPES = (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
              np.uint64)


@pytest.fixture(scope="module")
def emu_all_dtypes():
    return emulator.Emulator(emulator.build(dtypes=tuple(np.dtype(d) for d in ALL_DTYPES)))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_id_dtype_through_every_launch_shape(emu_all_dtypes, dtype):
    """Route ids of each dtype the API accepts (invalid ones included: negative ids of a
    signed dtype, values past E of an unsigned one), through one warp, align_tiny, the
    cluster, the cooperative launch and count + place, base and LoRA, free and ordered."""
    E = 100 if np.dtype(dtype).itemsize == 1 else 256
    for T, rows, variant in [(3, None, None), (40, None, None), (256, None, "cluster"),
                             (1024, None, "cooperative"), (512, None, "global"),
                             (16, 4, None), (256, 4, "cooperative")]:
        for det in (False, True):
            if not _refused(variant, det, T * 8, (rows or 1) * E, rows or 1, _POL):
                _run(emu_all_dtypes, Case(T, 8, E, 16, rows=rows, dtype=dtype, kind="invalid",
                                          seed=T), det, variant, seeds=(1,))


# ---- LoRA ---------------------------------------------------------------------------------
LORA = [(0, 8, 64, 16, 4), (1, 8, 64, 16, 4), (4, 6, 64, 16, 16), (16, 8, 256, 16, 16),
        (16, 4, 128, 64, 4), (64, 8, 64, 16, 1), (256, 8, 256, 16, 16), (1024, 8, 128, 64, 4),
        (2048, 8, 256, 64, 16)]


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("T,K,E,B,rows", LORA)
def test_lora(emu, T, K, E, B, rows, variant, det):
    if _refused(variant, det, T * K, rows * E, rows, _dispatch.DEFAULT_POLICY):
        pytest.skip("the dispatcher refuses this variant at these sizes")
    # one or two slots disabled; the only slot in turn (disabled, it leaves nothing to align)
    disabled = 1 + T % 2 if rows > 1 else T % 2
    _run(emu, Case(T, K, E, B, rows=rows, seed=T + rows, disabled=disabled,
                   with_ids=T % 3 != 1), det, variant)


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("disabled,with_ids", [(0, True), (0, False), (1, True)])
@pytest.mark.parametrize("T,K,E", [(5, 8, 64), (16, 4, 128), (40, 6, 64), (255, 8, 256)])
def test_lora_one_slot_through_align_tiny(emu, T, K, E, disabled, with_ids, det):
    """A LoRA call of one slot through align_tiny (past one warp's routes), its slot enabled
    and listed, unlisted, or disabled: row 0's places, tiles and total, and an unprocessed
    row left as the caller gave it."""
    case = Case(T, K, E, 16, rows=1, seed=T + E, disabled=disabled, with_ids=with_ids)
    launch = _run(emu, case, det)
    assert launch.tiny


@pytest.mark.parametrize("T,E,rows", [(0, 64, 4), (2, 64, 32), (3, 64, 40), (100, 64, 16)])
def test_lora_map_disabled_and_unlisted(emu, T, E, rows):
    for det in (False, True):
        _run(emu, Case(T, 8, E, 16, rows=rows, seed=rows, disabled=3, map_mode="before",
                       with_ids=bool(T % 2)), det, seeds=(11,))


# ---- paths the policy picks ---------------------------------------------------------------
WITHOUT_TINY = AlignPolicy(use_tiny=False)              # align_single
FOUR_BUCKETS = AlignPolicy(tiny_one_bucket_max=0)       # align_tiny, four buckets a thread
ORDERED = AlignPolicy(sort_for_determinism=False)       # ranks in flat order in the kernels
SORTED = AlignPolicy(sort_min_buckets=0)                # segments sorted after the kernels
POLICIES = {"without_tiny": WITHOUT_TINY, "four_buckets": FOUR_BUCKETS, "ordered": ORDERED,
            "sorted": SORTED}


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("T,E,rows,variant", [(3, 64, None, None), (255, 257, None, None),
                                              (16, 256, 16, None), (60, 128, 4, None),
                                              (2048, 256, None, None),
                                              (1024, 64, None, "global"),
                                              (1024, 64, 4, "shared"),
                                              (2048, 64, 4, "cooperative")])
def test_policy_paths(emu, T, E, rows, variant, policy, det):
    pol = POLICIES[policy]
    if _refused(variant, det, T * 8, (rows or 1) * E, rows or 1, pol):
        pytest.skip("the dispatcher refuses this variant at these sizes")
    _run(emu, Case(T, 8, E, 16, rows=rows, seed=T + E, kind="hot"), det, variant, pol,
         seeds=(0, 1))


@pytest.fixture(scope="module")
def emu_digits(tmp_path_factory):
    """The kernels built with ORDER_BITMAP_ALL_MAX 0: the block sorts a long segment of up to
    ORDER_DIGITS_MAX entries by digits, as past 131072 routes, where the emulator's cases
    would take the bitmap."""
    src = tmp_path_factory.mktemp("digits") / "kernels"
    shutil.copytree(_kernels.kernel_dir(), src)
    main = src / "align_kernels.cu"
    main.write_text("#define ORDER_BITMAP_ALL_MAX 0\n" + main.read_text())
    return emulator.Emulator(emulator.build(src))


SORTED_RUNS = dataclasses.replace(SORTED, sort_runs_above_routes=0)

# The ways a block sorts a long segment, as (emulator, policy): the emulator's default build
# (its cases have far fewer than ORDER_BITMAP_ALL_MAX routes: the bitmap, read back a round
# at a time), the sorting cooperative kernel's instance that reads the bitmap back as runs of
# a lane's words (COOP_SORTED_RUNS; the emulator's cases have one round a warp) and emu_digits
# (the digits).
BLOCK_SORTS = {"bitmap": ("emu", SORTED), "runs": ("emu", SORTED_RUNS),
               "digits": ("emu_digits", SORTED)}


def _block_sort(request, block_sort, variant, numel, buckets, rows):
    """The emulator and policy of ``block_sort``; skips where the dispatcher refuses the
    variant, or where the runs are asked of a launch that does not run them (count + place:
    align_order reads a round at a time)."""
    fixture, policy = BLOCK_SORTS[block_sort]
    if _refused(variant, True, numel, buckets, rows, policy):
        pytest.skip("the dispatcher refuses this variant at these sizes")
    launch = _dispatch.choose_launch(numel, buckets, rows, emulator.LIMITS, deterministic=True,
                                     variant=variant, policy=policy)
    if block_sort == "runs" and not launch.sort_runs:
        pytest.skip("only the sorting cooperative kernel reads runs")
    return request.getfixturevalue(fixture), policy


@pytest.mark.parametrize("block_sort", BLOCK_SORTS)
@pytest.mark.parametrize("variant", [None, "shared", "global", "cooperative"])
@pytest.mark.parametrize("count", [1, 33, 70, _dispatch.ORDER_WARP_MAX - 1,
                                   _dispatch.ORDER_WARP_MAX, _dispatch.ORDER_WARP_MAX + 1, 1000,
                                   _dispatch.ORDER_DIGITS_MAX + 1])
def test_sorted_segments_of_every_length(request, count, variant, block_sort):
    """One expert with ``count`` routes among 8192 (sorted by a warp: one column of lanes,
    or up to four merged; else by the block: ``block_sort``, and past ORDER_DIGITS_MAX by
    the bitmap in every build), exact against NumPy."""
    emu, policy = _block_sort(request, block_sort, variant, 8192, 64, 1)
    case = Case(1024, 8, 64, 16, seed=count)
    rng = np.random.default_rng(count)
    flat = case.ids.reshape(-1)
    flat[flat == 5] = 6
    flat[rng.choice(flat.size, size=count, replace=False)] = 5
    case.answer()
    launch = _run(emu, case, True, variant, policy, seeds=(0,))
    assert launch.deterministic_output


# 16 SMs: the cooperative launch takes up to 131072 routes (COOP_ITEMS * BLOCK a block).
SIXTEEN_SMS = dataclasses.replace(emulator.LIMITS, sm_count=16)


@pytest.mark.parametrize("T", [4096, 4128, 12500, 16384])
def test_bitmap_runs_wider_than_a_word(emu, T):
    """Past 32 rounds of the bitmap (32768 routes) the sorting cooperative kernel's default
    instance past sort_runs_above_routes reads each warp's rounds back as runs of up to four
    words a lane: 33024 routes (33 rounds) give runs of two and one warp's of one, 100000
    runs of four and one of two, 131072 of four; at 32768 the instance without runs. Two
    hot experts, one past ORDER_DIGITS_MAX; exact against NumPy."""
    case = Case(T, 8, 64, 16, seed=T)
    rng = np.random.default_rng(T)
    flat = case.ids.reshape(-1)
    flat[np.isin(flat, (5, 9))] = 6
    places = rng.choice(flat.size, size=1000 + _dispatch.ORDER_DIGITS_MAX + 1, replace=False)
    flat[places[:1000]] = 5
    flat[places[1000:]] = 9
    case.answer()
    launch = emulator.run(emu, case.job(True), variant="cooperative", policy=SORTED,
                          limits=SIXTEEN_SMS)
    case.check(True)
    assert launch.sorted and launch.sort_runs == (T * 8 > 32768)


@pytest.mark.parametrize("variant", [None, "global", "cooperative"])
@pytest.mark.parametrize("E,rows", [(32, None), (8, 4)])
def test_long_segments_dealt_over_few_blocks(emu, E, rows, variant):
    """Every bucket's segment longer than a warp sorts (1024 routes a bucket, or 256): more
    long segments than blocks, several to each block; exact against NumPy."""
    case = Case(4096, 8, E, 16, rows=rows, seed=E)
    if _refused(variant, True, case.ids.size, (rows or 1) * E, rows or 1, SORTED):
        pytest.skip("the dispatcher refuses this variant at these sizes")
    launch = _run(emu, case, True, variant, SORTED, seeds=(0, 1))
    assert launch.deterministic_output


@pytest.mark.parametrize("block_sort", BLOCK_SORTS)
@pytest.mark.parametrize("variant", [None, "global", "cooperative"])
@pytest.mark.parametrize("hot,count", [(2, 1024), (2, 1025), (3, 672), (3, 683)])
def test_long_segments_sharing_a_block_on_both_sides_of_2048(request, hot, count, variant,
                                                            block_sort):
    """``hot`` experts of ``count`` routes each, eight apart, among 2560: however the sort
    deals buckets (up to eight blocks), they share one block's round, so the long segments
    it holds (padded to B=16) total 2048 or 2016 entries, or 2080 or 2064: both sides of the
    2048 up to which a block may sort them together (A/B line 54's candidate); each by
    ``block_sort``. Exact against NumPy."""
    emu, policy = _block_sort(request, block_sort, variant, 2560, 64, 1)
    case = Case(320, 8, 64, 16, seed=count)  # the other segments short: about 8 routes
    rng = np.random.default_rng(count)
    flat = case.ids.reshape(-1)
    experts = np.arange(hot, dtype=flat.dtype) * 8 + 5
    flat[np.isin(flat, experts)] = 6
    flat[rng.choice(flat.size, size=hot * count, replace=False)] = np.repeat(experts, count)
    case.answer()
    launch = _run(emu, case, True, variant, policy, seeds=(0, 1))
    assert launch.deterministic_output


@pytest.mark.parametrize("block_sort", BLOCK_SORTS)
@pytest.mark.parametrize("variant", [None, "global", "cooperative"])
@pytest.mark.parametrize("hot", [(3, 40), (3, 7, 40, 44)])
def test_hot_segments_among_short_ones(request, hot, variant, block_sort):
    """LoRA of 4 slots, E=64: a third of the routes on the hot experts, so every slot has a
    few long segments among short ones, over two rounds of the sort (the emulator's 4 blocks
    take 128 buckets a round), dealt by bucket index: the hot segments of a round pile onto
    two blocks; each by ``block_sort``. Exact against NumPy."""
    emu, policy = _block_sort(request, block_sort, variant, 8192, 4 * 64, 4)
    case = Case(1024, 8, 64, 16, rows=4, seed=len(hot))
    rng = np.random.default_rng(len(hot))
    flat = case.ids.reshape(-1)
    picked = rng.random(flat.size) < 1 / 3
    flat[picked] = rng.choice(np.array(hot, dtype=flat.dtype), size=int(picked.sum()))
    case.answer()
    launch = _run(emu, case, True, variant, policy, seeds=(0, 1))
    assert launch.deterministic_output


@pytest.mark.parametrize("variant", [None, "global", "cooperative"])
def test_digits_and_bitmaps_in_one_block(request, variant):
    """With the digits built in (emu_digits), experts 16 apart share a block of the sort
    however many blocks (up to 16) it deals over: three segments the digits sort and one past
    ORDER_DIGITS_MAX the bitmap sorts, in whatever order the block took them. The digits
    stage theirs in the bitmaps' shared memory, so a bitmap sort after them must not trust
    what it left. Exact against NumPy under three schedules."""
    emu, policy = _block_sort(request, "digits", variant, 8192, 64, 1)
    case = Case(1024, 8, 64, 16, seed=16)
    rng = np.random.default_rng(16)
    flat = case.ids.reshape(-1)
    sizes = {1: 1000, 17: _dispatch.ORDER_DIGITS_MAX + 100, 33: 900, 49: 600}
    experts = np.array(list(sizes), dtype=flat.dtype)
    flat[np.isin(flat, experts)] = 6
    places = rng.choice(flat.size, size=sum(sizes.values()), replace=False)
    flat[places] = np.repeat(experts, list(sizes.values()))
    case.answer()
    launch = _run(emu, case, True, variant, policy, seeds=(0, 1, 2))
    assert launch.deterministic_output


# ---- base and LoRA together ---------------------------------------------------------------
@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("T,E,rows,streams,policy", [
    (1, 64, 4, "fused", None), (16, 64, 4, "fused", None), (16, 64, 4, "fused", "without_tiny"),
    (256, 128, 4, "fused", None), (1024, 256, 4, None, None), (2048, 256, 16, "fused", None),
    (2048, 64, 4, "fused", "sorted"), (512, 64, 4, "one", None)])
def test_pairs(emu, T, E, rows, streams, policy, det):
    pol = POLICIES[policy] if policy else _dispatch.DEFAULT_POLICY
    base = Case(T, 8, E, 64, seed=T)
    lora = Case(T, 8, E, 64, rows=rows, seed=T)
    lora.ids[:] = base.ids  # one routing for both sides, as in a serving step
    lora.want = [np.full(sh, POISON, np.int32) for sh in lora.shapes]
    _call.run_on_host(lora.prepare(lora.want, False).job)
    for seed in (0, 1):
        try:
            emulator.run_pair(emu, base.job(det), lora.job(det), streams=streams, policy=pol,
                              seed=seed)
        except ValueError as e:  # streams="fused" where no fused launch exists
            pytest.skip(str(e))
        base.check(det)
        lora.check(det)


# ---- scratch, limits, the emulator itself -------------------------------------------------
def test_workspace_serves_calls_of_any_size_in_turn(emu):
    """One workspace, calls of every launch shape and mode in turn: each kernel leaves the
    scratch as the next one needs it."""
    ws = emulator.HostWorkspace()
    order = [(2048, 256, True), (16, 64, False), (2048, 64, False), (1024, 256, True),
             (4096, 128, False), (2048, 256, True), (3, 64, True), (2048, 256, False)]
    for i, (T, E, det) in enumerate(order):
        case = Case(T, 8, E, 16, seed=i)
        emulator.run(emu, case.job(det), variant="cooperative" if T >= 2048 else None,
                     workspace=ws, seed=i)
        case.check(det)


@pytest.mark.parametrize("routes", [32, 33])
def test_one_warp_limit(emu, routes):
    case = Case(routes, 1, 64, 16, seed=routes)
    for det in (False, True):
        launch = _run(emu, case, det, seeds=(0,))
        assert launch.tiny


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("T,K,rows", [(1, 8, 4), (4, 8, 32), (4, 7, 2), (16, 2, 16)])
def test_lora_one_warp_path(emu, T, K, rows, det):
    """align_warp's LoRA instance, at most WARP_ROUTES routes of at most 32 rows (a block a
    row off: it takes these sizes by default)."""
    policy = AlignPolicy(tiny_row_blocks=False)
    for salt in range(2):
        launch = _run(emu, Case(T, K, 64, 16, rows=rows, seed=70 + salt, disabled=salt,
                                with_ids=salt == 0), det, None, policy, seeds=(salt,))
        assert launch.tiny and launch.grid == 1


# Sizes on both sides of every limit where the dispatcher changes its mind or a kernel
# changes its shape (on the emulated device: 4 SMs): (routes, experts, rows, variant).
_POL = _dispatch.DEFAULT_POLICY
_COOP_MOST = emulator.LIMITS.sm_count * _dispatch.COOP_ITEMS * _dispatch.BLOCK
_CFEW = _POL.cluster_min_routes - _POL.cluster_few_buckets_routes_earlier
LIMIT_SIZES = [
    (_POL.one_route_per_thread, 64, None, None), (_POL.one_route_per_thread + 1, 64, None, None),
    (_dispatch.SINGLE_BLOCK_MAX_ROUTES, 64, None, "shared"),
    (_dispatch.SINGLE_BLOCK_MAX_ROUTES + 1, 64, None, "shared"),
    (100, _POL.tiny_one_bucket_max, None, None), (100, _POL.tiny_one_bucket_max + 1, None, None),
    (_POL.cluster_min_routes - 1, 256, None, None), (_POL.cluster_min_routes, 256, None, None),
    # over few buckets (LoRA of one slot; four slots of 128: 512 buckets, of 160: 640) the
    # cluster starts earlier
    (_CFEW - 1, 256, 1, None), (_CFEW, 256, 1, None),
    (_CFEW, _POL.cluster_few_buckets // 4, 4, None),
    (_CFEW, _POL.cluster_few_buckets // 4 + 32, 4, None),
    (_POL.tiny_stage_from - 1, 256, None, None), (_POL.tiny_stage_from, 256, None, None),
    (_POL.cluster_over_staged_from - 1, 256, None, None),
    (_POL.cluster_over_staged_from, 256, None, None),
    (_POL.cluster_over_staged_from_deterministic - 1, 256, None, None),
    (_POL.cluster_over_staged_from_deterministic, 256, None, None),
    (_POL.cluster_max_routes, 256, None, None), (_POL.cluster_max_routes + 1, 256, None, None),
    (4096, _POL.cluster_max_buckets, None, None), (4096, _POL.cluster_max_buckets + 1, None, None),
    (_COOP_MOST, 64, None, "cooperative"), (_COOP_MOST + 1, 64, None, None),
    (_dispatch.ORDER_DIGITS_MAX, 256, 16, None), (_dispatch.ORDER_DIGITS_MAX + 1, 256, 16, None),
]


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("numel,E,rows,variant", LIMIT_SIZES)
def test_both_sides_of_every_limit(emu, numel, E, rows, variant, det):
    if _refused(variant, det, numel, (rows or 1) * E, rows or 1, _POL):
        pytest.skip("the dispatcher refuses this variant at these sizes")
    _run(emu, Case(numel, 1, E, 16, rows=rows, seed=numel + E, kind="hot"), det, variant,
         seeds=(0,))


def test_translation_refuses_unknown_ptx():
    with pytest.raises(ValueError, match="does not know this inline PTX"):
        emulator.translate('extern __shared__ unsigned char dynamic_smem[];\n'
                           'void f() { asm volatile("trap;"); }')


def test_shared_declarations_become_arena_references():
    out = emulator.translate("extern __shared__ __align__(16) unsigned char dynamic_smem[];\n"
                             "void f() {\n  __shared__ int a[32], b;\n}\n")
    assert "auto& a = mla_emu::shared_var<int[32]>(0);" in out
    assert "auto& b = mla_emu::shared_var<int>(1);" in out


def _mutant(tmp_path, name, old, new, racecheck=False):
    """The emulator built from the kernels with ``old`` (once in ``name``) made ``new``."""
    shutil.copytree(Path(emulator._kernels.kernel_dir()), tmp_path / "kernels")
    path = tmp_path / "kernels" / name
    text = path.read_text()
    assert text.count(old) == 1
    path.write_text(text.replace(old, new))
    return emulator.Emulator(emulator.build(tmp_path / "kernels", racecheck=racecheck))


def _wrong_answers(broken, T, E, B, det, variant, seeds):
    wrong = 0
    for seed in seeds:
        case = Case(T, 8, E, B, seed=seed)
        emulator.run(broken, case.job(det), variant=variant, seed=seed)
        try:
            case.check(det)
        except AssertionError:
            wrong += 1
    return wrong


def test_a_missing_barrier_is_caught(emu, tmp_path):
    """The emulator has teeth: align_tiny without the barrier between its claims and its
    scan gives a wrong answer under some schedule."""
    claims = "bucket_bits(nb));\n  }\n  __syncthreads();"
    broken = _mutant(tmp_path, "one_block.cuh", claims, "bucket_bits(nb));\n  }")
    assert _wrong_answers(broken, 16, 256, 16, True, None, range(6)) > 0


def test_a_grid_barrier_that_does_not_wait_is_caught(emu, tmp_path):
    """The cooperative kernel whose grid barrier lets every block through at once gives a
    wrong answer under some schedule (held blocks start only once the others are stuck)."""
    wait = "    while (load_acquire(arrivals) < blocks) {\n    }\n"
    broken = _mutant(tmp_path, "cooperative.cuh", wait, "")
    assert _wrong_answers(broken, 1024, 256, 64, False, "cooperative", range(4)) > 0


def test_a_cluster_block_that_leaves_early_is_caught(emu, tmp_path):
    """A cluster block that exits before the others are done reading its shared memory
    (align_cluster's final wait removed): a block that naps after the cluster barrier reads
    a poisoned arena. The garbage may index far outside any buffer, so the run is a process
    of its own, and a crash counts as caught."""
    _mutant(tmp_path, "cluster.cuh", "  MLA_STAMP(4, 6);\n  cluster_wait();\n",
            "  MLA_STAMP(4, 6);\n")
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); import emulator, test_emulated_kernels as t\n"
        "broken = emulator.Emulator(emulator.build(sys.argv[2]))\n"
        "for seed in range(8):\n"
        "    case = t.Case(512, 8, 256, 16, seed=seed)\n"
        "    emulator.run(broken, case.job(False), variant='cluster', seed=seed)\n"
        "    case.check(False)\n")
    tests = Path(__file__).resolve().parent
    proc = subprocess.run([sys.executable, "-c", script, str(tests), str(tmp_path / "kernels")],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MLA_EMULATOR_CACHE": str(emulator.CACHE)})
    assert proc.returncode != 0, "the early exit went unnoticed in 8 schedules"


def test_scratch_left_dirty_is_caught(emu, tmp_path):
    """The count kernel leaving its counts behind (the next call's would start from them)."""
    broken = _mutant(tmp_path, "count_place.cuh", "    p.counts[b] = 0;\n", "")
    with pytest.raises(AssertionError, match="nonzero entries in the workspace's counts"):
        emulator.run(broken, Case(1024, 8, 64, 16).job(False), variant="global")


def test_a_block_that_waits_for_another_needs_a_cooperative_launch(emu, monkeypatch):
    """The cooperative kernel launched as an ordinary one: some schedule runs its blocks one
    at a time, and the first block's wait at the grid barrier never ends."""
    plain = _dispatch.launch_kernels
    monkeypatch.setattr(_dispatch, "launch_kernels",
                        lambda launch, fused=False: [k[:4] + (False,) for k in plain(launch, fused)])
    with pytest.raises(RuntimeError, match="deadlock"):
        for seed in range(6):
            emulator.run(emu, Case(2048, 8, 256, 64, seed=seed).job(False),
                         variant="cooperative", seed=seed)


def test_a_barrier_that_cannot_complete_is_reported(emu, tmp_path):
    # Thread 0 waits for arrivals that never come (more than the fill blocks make); the
    # others wait for it at the barrier.
    scan = "  if (tid == 0) starts[nb] = total;\n"
    never = "  if (tid == 0) while (*(volatile unsigned*)p.ticket < 1000u) __nanosleep(32);\n"
    broken = _mutant(tmp_path, "one_block.cuh", scan, scan + never)
    with pytest.raises(RuntimeError, match="deadlock"):
        emulator.run(broken, Case(16, 8, 256, 16).job(False))


def test_every_kernel_runs_on_the_emulator(emu):
    """One call of each launch shape and mode, both alone and fused, between them launch
    every kernel instance of the dtype: none is left to the GPU alone."""
    _every_kernel(emu)


@pytest.fixture(scope="module")
def emu_racecheck():
    return emulator.Emulator(emulator.build(racecheck=True))


def test_racecheck_finds_no_hazard_in_any_kernel(emu_racecheck):
    """Every kernel instance with each shared-memory access checked: no two threads touch a
    byte in one barrier interval, one of them writing, without a barrier (or, lanes of one
    warp, a full-warp collective) between them."""
    _every_kernel(emu_racecheck)


def test_racecheck_names_a_missing_barrier(tmp_path):
    """The barrier between align_tiny's claims and its scan removed: a hazard, named, in the
    first schedule (where the schedules alone catch it only in some)."""
    claims = "bucket_bits(nb));\n  }\n  __syncthreads();"
    broken = _mutant(tmp_path, "one_block.cuh", claims, "bucket_bits(nb));\n  }",
                     racecheck=True)
    with pytest.raises(RuntimeError, match="racecheck: .* hazard"):
        emulator.run(broken, Case(16, 8, 256, 16).job(True), seed=0)


# align_tiny_chunked (deterministic ranks by the chunks' groups) wherever align_tiny runs.
CHUNKED_TINY_RANKS = AlignPolicy(tiny_chunk_ranks_from=0, tiny_chunk_ranks_min_routes=0,
                                 tiny_chunk_ranks_max_routes=1 << 62, tiny_row_blocks=False)

# Tokens of K=8 routes from which the default policy runs the cluster (its pair included).
CLUSTER_T = -(-_dispatch.DEFAULT_POLICY.cluster_min_routes // 8)
# the cluster pair where a block a LoRA row would also run (the row pair's cut at 0)
CLUSTER_PAIR = AlignPolicy(pair_row_blocks_over_cluster_max_routes=0)
# the cooperative pair where base on a cluster and a cluster a LoRA row would also run
COOPERATIVE_PAIR = AlignPolicy(cluster_rows_pair=False)
# ... its LoRA side's sort reading the bitmaps back as runs (COOP_SORTED_RUNS)
COOPERATIVE_PAIR_RUNS = dataclasses.replace(COOPERATIVE_PAIR, sort_runs_above_routes=0)


def _every_kernel(emu):
    start = len(emu.launched)
    for T, E, rows, variant, policy in [(40, 64, None, None, WITHOUT_TINY),
                                        (40, 64, None, None, _dispatch.DEFAULT_POLICY),
                                        (256, 64, None, None, _dispatch.DEFAULT_POLICY),
                                        (256, 256, None, "cluster", _dispatch.DEFAULT_POLICY),
                                        (2048, 256, None, "cooperative", ORDERED),
                                        (2048, 256, None, "cooperative", SORTED),
                                        (2048, 256, None, "cooperative", SORTED_RUNS),
                                        (1024, 64, None, "shared", ORDERED),
                                        (1024, 64, None, "global", ORDERED),
                                        (1024, 64, None, "shared", SORTED),
                                        (40, 64, 4, None, TINY_FILL["tiny_fill_blocks"]),
                                        (40, 64, 4, None, TINY_FILL["no_tiny_fill_blocks"]),
                                        (40, 64, 4, None, CHUNKED_TINY_RANKS),
                                        (40, 64, 4, None, ROW_BLOCKS),
                                        (40, 64, 4, None, CLUSTER_ROWS)]:
        for det in (False, True):
            if not _refused(variant, det, T * 8, E, 1, policy):
                _run(emu, Case(T, 8, E, 16, rows=rows, seed=T), det, variant, policy,
                     seeds=(0,))
    for T, E, rows, policy in [(16, 64, 4, _dispatch.DEFAULT_POLICY), (16, 64, 4, WITHOUT_TINY),
                               (CLUSTER_T, 64, 4, CLUSTER_PAIR),
                               (2048, 64, 4, _dispatch.DEFAULT_POLICY),
                               (2048, 256, 16, COOPERATIVE_PAIR),
                               (2048, 256, 16, COOPERATIVE_PAIR_RUNS),
                               (40, 64, 4, TINY_FILL["tiny_fill_blocks"]),
                               (40, 64, 4, TINY_FILL["no_tiny_fill_blocks"]),
                               (40, 64, 4, ROW_BLOCKS),
                               (40, 64, 3, CLUSTER_ROWS_PAIR)]:
        for det in (False, True):
            base, lora = Case(T, 8, E, 64, seed=T), Case(T, 8, E, 64, rows=rows, seed=T)
            lora.ids[:] = base.ids
            lora.want = [np.full(sh, POISON, np.int32) for sh in lora.shapes]
            _call.run_on_host(lora.prepare(lora.want, False).job)
            emulator.run_pair(emu, base.job(det), lora.job(det), streams="fused",
                              policy=policy)
            base.check(det)
            lora.check(det)
    ran = {name for name, _, _ in emu.launched[start:]}
    missing = set(_kernels.kernel_names(np.int32).values()) - ran
    assert not missing, f"never launched on the emulator: {sorted(missing)}"


# ---- fill blocks and the ordered path's totals (r38, r39) ---------------------------------
# The cooperative kernel with fill blocks (blocks of FILL_SPLIT_BLOCK threads, two an SM, the
# last ones only filling), with fill blocks on SMs of their own (blocks of BLOCK threads, a
# fill block per 4096 entries here) and without, align_tiny and its pair with fill blocks
# (blocks past the aligning ones fill; block 0 waits for their arrivals) and without; routes
# on both sides of what the split's counting blocks hold on the emulated device (4 x 8 x 512).
COOP_FILL = {"fill_blocks": AlignPolicy(coop_fill_blocks_from=0, coop_fill_sms_from=1 << 62,
                                        coop_fill_blocks_below=1 << 62),
             "fill_sms": AlignPolicy(coop_fill_sms_from=0, coop_fill_sm_entries=4096,
                                     coop_fill_sms_min_entries_per_route=0,
                                     coop_fill_blocks_below=0, coop_fill_blocks_free_below=0),
             # deterministic: the segment sort (every size) on the counting blocks, the fill
             # blocks beside them
             "fill_sms_sorted": AlignPolicy(coop_fill_sms_from=0, coop_fill_sm_entries=4096,
                                            coop_fill_sms_min_entries_per_route=0,
                                            coop_fill_blocks_below=0,
                                            coop_fill_blocks_free_below=0,
                                            coop_fill_sms_sorted=True, sort_min_buckets=0),
             "no_fill_blocks": AlignPolicy(coop_fill_blocks_from=1 << 62)}
SPLIT_MOST = emulator.LIMITS.sm_count * _dispatch.COOP_ITEMS * _dispatch.FILL_SPLIT_BLOCK
WHOLE_MOST = (emulator.LIMITS.sm_count - 1) * _dispatch.COOP_ITEMS * _dispatch.BLOCK


def _coop_fill_launch(numel, buckets, rows, det, how):
    launch = _dispatch.choose_launch(numel, buckets, rows, emulator.LIMITS, deterministic=det,
                                     variant="cooperative", out_entries=numel,
                                     policy=COOP_FILL[how])
    most = WHOLE_MOST if how.startswith("fill_sms") else SPLIT_MOST
    sorts = how == "fill_sms_sorted" and det
    if how == "fill_sms_sorted":  # deterministic calls sort there, beside fill blocks
        assert launch.sorted == det
    filled = how != "no_fill_blocks" and (sorts or not launch.sorted) and numel <= most
    assert bool(launch.fill_grid) == filled
    if filled and how.startswith("fill_sms"):
        assert launch.block == _dispatch.BLOCK and launch.grid <= emulator.LIMITS.sm_count


@pytest.mark.parametrize("how", list(COOP_FILL))
@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("E,T,K", [(7, 1, 8), (64, 255, 8), (256, 1024, 8), (257, 2048, 8),
                                   (64, 2049, 8), (256, 1000, 3)])
def test_base_cooperative_with_and_without_fill_blocks(emu, E, T, K, det, how):
    _coop_fill_launch(T * K, E, 1, det, how)
    for salt in range(2):
        _run(emu, Case(T, K, E, 64, seed=90 + salt, scatter=salt == 1,
                       kind=("uniform", "skewed")[salt]), det, "cooperative", COOP_FILL[how],
             seeds=(salt,))


@pytest.mark.parametrize("how", list(COOP_FILL))
@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("E,T,rows", [(64, 3, 4), (256, 512, 16), (64, 2048, 16),
                                      (128, 2000, 4), (7, 2048, 33)])
def test_lora_cooperative_with_and_without_fill_blocks(emu, E, T, rows, det, how):
    _coop_fill_launch(T * 8, rows * E, rows, det, how)
    for salt in range(2):
        _run(emu, Case(T, 8, E, 64, rows=rows, seed=95 + salt, disabled=1 + salt), det,
             "cooperative", COOP_FILL[how], seeds=(salt,))


BIG_SINGLE = 1 << 30
TINY_FILL = {"tiny_fill_blocks": AlignPolicy(tiny_fill_blocks_from=0,
                                             tiny_fill_blocks_one_row_from=0,
                                             coop_over_single_entries=BIG_SINGLE,
                                             coop_over_filled_single_entries=BIG_SINGLE,
                                             tiny_row_blocks=False),
             "no_tiny_fill_blocks": AlignPolicy(tiny_fill_blocks_from=1 << 62,
                                                tiny_fill_blocks_one_row_from=1 << 62,
                                                coop_over_single_entries=BIG_SINGLE,
                                                coop_over_filled_single_entries=BIG_SINGLE,
                                                tiny_row_blocks=False)}


def _tiny_fill_launch(numel, buckets, rows, det, how):
    launch = _dispatch.choose_launch(numel, buckets, rows, emulator.LIMITS, deterministic=det,
                                     out_entries=numel, policy=TINY_FILL[how])
    if not (launch.kind == "single" and launch.tiny):
        pytest.skip(f"{numel} routes over {buckets} buckets are not align_tiny's")
    assert bool(launch.fill_grid) == (how == "tiny_fill_blocks" and numel > 32)


@pytest.mark.parametrize("how", list(TINY_FILL))
@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("E,T,K", [(64, 33, 1), (1024, 16, 8), (257, 255, 8), (7, 512, 8),
                                   (64, 4, 8)])
def test_base_tiny_with_and_without_fill_blocks(emu, E, T, K, det, how):
    _tiny_fill_launch(T * K, E, 1, det, how)
    for salt in range(2):
        _run(emu, Case(T, K, E, 16, seed=110 + salt, map_mode=(None, "after")[salt],
                       scatter=salt == 1), det, None, TINY_FILL[how], seeds=(salt,))


STAGED = AlignPolicy(tiny_stage_from=0, cluster_min_routes=1 << 30,
                     coop_over_single_entries=BIG_SINGLE,
                     coop_over_filled_single_entries=BIG_SINGLE)


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("E,T,K,B", [(64, 33, 1, 16), (1024, 16, 8, 64), (257, 255, 8, 16),
                                     (7, 512, 8, 128), (256, 256, 8, 16), (512, 100, 10, 1),
                                     (8, 5, 8, 16)])
def test_base_tiny_staged_row(emu, E, T, K, B, det):
    """align_tiny_staged: the base row built in shared memory and stored after the scan: the
    fill, the routes, the tiles, an expert map and scatter indices as the direct path's."""
    P, M = buffer_sizes(T * K, E, B)
    launch = _dispatch.choose_launch(T * K, E, 1, emulator.LIMITS, deterministic=det,
                                     out_entries=P + M, policy=STAGED)
    assert launch.tiny and launch.stage_output and not launch.fill_grid
    assert _dispatch.tiny_stage_entries(launch, T * K, E) >= P
    for salt in range(2):
        _run(emu, Case(T, K, E, B, seed=120 + salt, map_mode=(None, "after")[salt],
                       scatter=salt == 1), det, None, STAGED, seeds=(salt,))


@pytest.mark.parametrize("how", list(TINY_FILL))
@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("E,T,rows", [(64, 5, 16), (256, 16, 16), (64, 16, 16), (256, 255, 16),
                                      (64, 64, 4), (7, 100, 33), (128, 2, 16)])
def test_lora_tiny_with_and_without_fill_blocks(emu, E, T, rows, det, how):
    _tiny_fill_launch(T * 8, rows * E, rows, det, how)
    for salt in range(3):
        _run(emu, Case(T, 8, E, 16, rows=rows, seed=115 + salt, with_ids=salt != 2,
                       disabled=salt, map_mode="before" if salt == 2 else None), det, None,
             TINY_FILL[how], seeds=(salt,))


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("fill", [True, False], ids=["fill_blocks", "no_fill_blocks"])
@pytest.mark.parametrize("T,E,B,L", [(16, 256, 16, 16), (5, 64, 16, 16), (64, 128, 16, 4),
                                     (255, 64, 16, 16), (5, 64, 128, 33)])
def test_fused_tiny_pair_with_and_without_fill_blocks(emu, T, E, B, L, fill, det):
    policy = AlignPolicy(tiny_fill_blocks_from=0 if fill else 1 << 62,
                         tiny_fill_blocks_one_row_from=0 if fill else 1 << 62,
                         coop_over_single_entries=BIG_SINGLE,
                         coop_over_filled_single_entries=BIG_SINGLE, tiny_row_blocks=False)
    base = Case(T, 8, E, B, seed=T)
    lora = Case(T, 8, E, B, rows=L, seed=T, disabled=2)
    lora.ids[:] = base.ids
    lora.want = [np.full(sh, POISON, np.int32) for sh in lora.shapes]
    _call.run_on_host(lora.prepare(lora.want, False).job)
    for seed in (0, 1):
        mode, pair = emulator.run_pair(emu, base.job(det), lora.job(det), streams="fused",
                                       policy=policy, seed=seed)
        assert pair.tiny and bool(pair.fill_grid) == fill
        base.check(det)
        lora.check(det)


# ---- LoRA a block a row (align_tiny_rows, align_tiny_rows_pair) ----------------------------


def _row_launch(numel, E, rows, det, policy=ROW_BLOCKS):
    P, M = buffer_sizes(numel, E, 16)
    return _dispatch.choose_launch(numel, rows * E, rows, emulator.LIMITS, deterministic=det,
                                   out_entries=rows * (P + M), policy=policy, lora=True)


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("T,K,E,rows,kind", [
    (1, 1, 64, 2, "uniform"), (4, 8, 64, 4, "uniform"), (5, 8, 256, 16, "skewed"),
    (16, 8, 256, 16, "uniform"), (16, 8, 256, 32, "hot"), (33, 1, 1024, 2, "invalid"),
    (100, 6, 64, 16, "skewed"), (255, 8, 256, 16, "uniform"), (512, 8, 256, 16, "hot"),
    (512, 8, 7, 3, "duplicates"), (3, 8, 1000, 5, "uniform"), (40, 8, 128, 33, "skewed"),
    (300, 2, 32, 80, "hot"), (512, 4, 64, 100, "uniform")])
def test_lora_row_blocks(emu, T, K, E, rows, kind, det):
    """A block a LoRA row: listed, unlisted, disabled and -1 tokens, an expert map, and rows
    not processed left alone or (allocated outputs) given the empty alignment; past 32 rows
    and past a list of 64 entries (which each block searches for its slot)."""
    launch = _row_launch(T * K, E, rows, det)
    assert launch.row_blocks and launch.grid == rows and not launch.fill_grid
    _run_slot_salts(emu, T, K, E, rows, kind, det, ROW_BLOCKS, seed=150)


def _run_slot_salts(emu, T, K, E, rows, kind, det, policy, seed):
    """Four salts of one LoRA case under ``policy``: listed slots, disabled ones (0 to 3),
    no list with an expert map, then allocated outputs (unprocessed rows filled)."""
    for salt in range(4):
        _run(emu, Case(T, K, E, 16, rows=rows, seed=seed + salt, kind=kind, with_ids=salt != 2,
                       disabled=salt, map_mode="before" if salt == 2 else None,
                       allocate=salt == 3), det, None, policy, seeds=(salt,))


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
def test_lora_row_blocks_limits(emu, det):
    """Both sides of each bound of a block a row: its routes, its rows (2 to 128) and a thread
    a bucket of a row (tiny_one_bucket_max); past them the other launches run as before."""
    pol = AlignPolicy(tiny_row_blocks=True, tiny_row_blocks_min_routes=33,
                      tiny_row_blocks_max_routes=1024)
    for numel, E, rows, want in [(32, 64, 4, False), (33, 64, 4, True), (1024, 64, 4, True),
                                 (1025, 64, 4, False), (64, 64, 1, False), (64, 64, 2, True),
                                 (64, 8, 128, True), (64, 8, 129, False),
                                 (64, 1024, 2, True), (64, 1025, 2, False)]:
        assert _row_launch(numel, E, rows, det, pol).row_blocks == want, (numel, E, rows)
        _run(emu, Case(numel, 1, E, 16, rows=rows, seed=numel + rows), det, None, pol,
             seeds=(0,))
    assert not _row_launch(64, 64, 4, det, AlignPolicy(tiny_row_blocks=False)).row_blocks
    assert not _row_launch(64, 64, 4, det, AlignPolicy(tiny_row_blocks=True,
                                                       use_tiny=False)).row_blocks


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("T,K,E,rows,kind", [
    (1, 1, 64, 2, "uniform"), (100, 6, 64, 4, "skewed"), (33, 1, 1024, 2, "invalid"),
    (130, 8, 256, 6, "hot"), (64, 8, 7, 3, "duplicates"), (10, 8, 128, 5, "uniform"),
    (700, 8, 64, 2, "uniform")])
def test_lora_cluster_rows(emu, T, K, E, rows, kind, det):
    """A cluster a LoRA row: listed, unlisted, disabled and -1 tokens, an expert map, and
    rows not processed left alone or (allocated outputs) given the empty alignment."""
    launch = _row_launch(T * K, E, rows, det, CLUSTER_ROWS)
    assert launch.row_clusters and launch.grid == rows * 8 and launch.kind == "cluster"
    _run_slot_salts(emu, T, K, E, rows, kind, det, CLUSTER_ROWS, seed=170)


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
def test_lora_cluster_rows_limits(emu, det):
    """Both sides of each bound of a cluster a row under the default policy: its routes
    (cluster_rows_min_routes to _max_routes, or _max_routes_deterministic), its rows (2 to
    cluster_rows_max_rows), buckets past the one cluster's (which keeps its range up to its
    routes), and clusters on the device."""
    pol = AlignPolicy()
    lo = pol.cluster_rows_min_routes
    hi = pol.cluster_rows_max_routes_deterministic if det else pol.cluster_rows_max_routes
    one_most = pol.cluster_max_routes_deterministic if det else pol.cluster_max_routes
    for numel, E, rows, want in [(lo - 1, 256, 16, False), (lo, 256, 16, True),
                                 (hi, 256, 16, True), (hi + 1, 256, 16, False),
                                 (hi, 1024, 1, False), (hi, 1024, 2, True),
                                 (hi, 128, 16, True), (hi, 128, 17, False),
                                 # 1024 buckets: the one cluster, then a cluster a row
                                 (one_most, 256, 4, False), (one_most + 1, 256, 4, True)]:
        launch = _row_launch(numel, E, rows, det, pol)
        assert launch.row_clusters == want, (numel, E, rows)
    assert _row_launch(one_most, 256, 4, det, pol).kind == "cluster"
    assert not _row_launch(hi, 256, 16, det, AlignPolicy(cluster_rows=False)).row_clusters
    no_clusters = dataclasses.replace(emulator.LIMITS, clusters=False)
    P, M = buffer_sizes(hi, 256, 16)
    assert not _dispatch.choose_launch(hi, 16 * 256, 16, no_clusters, deterministic=det,
                                       out_entries=16 * (P + M), policy=pol,
                                       lora=True).row_clusters


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("T,E,B,L", [(16, 256, 16, 16), (5, 64, 16, 2), (64, 128, 16, 4),
                                     (255, 64, 16, 32), (3, 1024, 64, 3), (40, 64, 16, 70)])
def test_fused_pair_with_row_blocks(emu, T, E, B, L, det):
    """Base in block 0 (align_tiny's block, its one warp at few routes) and a block a LoRA
    row after it, in one launch: both sides as the NumPy backend's."""
    base = Case(T, 8, E, B, seed=T)
    lora = Case(T, 8, E, B, rows=L, seed=T, disabled=2)
    lora.ids[:] = base.ids
    lora.answer()
    for seed in (0, 1):
        mode, pair = emulator.run_pair(emu, base.job(det), lora.job(det), streams="fused",
                                       policy=ROW_BLOCKS, seed=seed)
        assert pair.row_blocks and pair.grid == 1 + L
        base.check(det)
        lora.check(det)


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("T,E,B,L", [(40, 64, 16, 3), (130, 256, 16, 2), (9, 1024, 64, 2),
                                     (33, 7, 16, 5)])
def test_fused_pair_with_row_clusters(emu, T, E, B, L, det):
    """Base on cluster 0 and a cluster a LoRA row after it, in one launch
    (align_cluster_rows_pair): both sides as the NumPy backend's; unlisted, disabled and -1
    tokens on the LoRA side."""
    base = Case(T, 8, E, B, seed=T + 7)
    lora = Case(T, 8, E, B, rows=L, seed=T + 7, disabled=1)
    lora.ids[:] = base.ids
    lora.answer()
    for seed in (0, 1):
        mode, pair = emulator.run_pair(emu, base.job(det), lora.job(det), streams="fused",
                                       policy=CLUSTER_ROWS_PAIR, seed=seed)
        assert pair.row_clusters and pair.grid == (1 + L) * 8
        assert _dispatch.launch_kernels(pair, fused=True)[0][0] == ("cluster_rows_pair", det)
        base.check(det)
        lora.check(det)


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("T,L", [(288, 4), (512, 2)])
def test_pair_row_blocks_over_cluster(emu, T, L, det):
    """Pairs in the cluster's range whose LoRA side takes a block a row: the row pair up to
    pair_row_blocks_over_cluster_max_routes routes (2304 by default), the cluster pair past
    it; both as the NumPy backend's."""
    base = Case(T, 8, 256, 16, seed=T)
    lora = Case(T, 8, 256, 16, rows=L, seed=T, disabled=1)
    lora.ids[:] = base.ids
    lora.answer()
    for most in (None, 0, 1 << 30):
        policy = (AlignPolicy() if most is None
                  else AlignPolicy(pair_row_blocks_over_cluster_max_routes=most))
        want_rows = T * 8 <= policy.pair_row_blocks_over_cluster_max_routes
        mode, pair = emulator.run_pair(emu, base.job(det), lora.job(det), policy=policy)
        assert mode == "fused" and pair.row_blocks == want_rows
        assert (pair.kind == "cluster") != want_rows
        base.check(det)
        lora.check(det)


def test_ordered_cooperative_totals_leave_the_scratch_clean(emu):
    """The ordered path writes each bucket's total into its count buffer where the other
    paths add to zeroed counts: free calls on either buffer after it, and ordered calls after
    free ones, of more and fewer buckets, stay exact (one workspace throughout)."""
    ws = emulator.HostWorkspace()
    policy = AlignPolicy(sort_for_determinism=False)
    for n, (E, det) in enumerate([(256, True), (256, False), (256, False), (512, True),
                                  (64, False), (1024, False), (512, False), (256, True),
                                  (64, True), (1024, False)]):
        case = Case(2048, 8, E, 64, seed=40 + n)
        emulator.run(emu, case.job(det), variant="cooperative", policy=policy, workspace=ws,
                     seed=n)
        case.check(det)


# ---- the probe build of scripts/decode_experiment.py ----------------------------------------
def test_the_twice_probe_runs_align_tiny_twice_and_keeps_both_passes(tmp_path):
    """-DMLA_PROBE -DMLA_TWICE: align_tiny (its one-warp path and a thread a bucket) and
    align_tiny_staged run their alignment twice in the block; the outputs are one pass's,
    pass 1's stamps end in kernel slot 0 and pass 2's, later, in slot 1."""
    import ctypes
    src = tmp_path / "kernels"
    shutil.copytree(_kernels.kernel_dir(), src)
    main = src / "align_kernels.cu"
    main.write_text("#define MLA_PROBE\n#define MLA_TWICE\n" + main.read_text())
    emu = emulator.Emulator(emulator.build(src))
    probe = np.ctypeslib.as_array(
        (ctypes.c_ulonglong * (8 * 160 * 8 * 2)).in_dll(emu.lib, "mla_probe")).reshape(
            8, 160, 8, 2)
    for case, kernel in ((Case(2, 8, 64, 16, seed=1), "align_tiny"),
                         (Case(64, 8, 256, 16, seed=2), "align_tiny"),
                         (Case(256, 8, 256, 16, seed=3), "align_tiny_staged")):
        for det in (False, True):
            probe[:] = 0
            start = len(emu.launched)
            emulator.run(emu, case.job(det), seed=0)
            assert [name.split("<")[0] for name, _, _ in emu.launched[start:]] == [kernel]
            case.check(det)
            first, second = probe[0, 0, :, 1], probe[1, 0, :, 1]
            assert (first[:5] > 0).all() and (second[:5] > 0).all()
            assert second[0] > first[4]  # pass 2 entered after pass 1's stores


# Deterministic align_tiny's two ways to flat-order ranks (gpu_util.TINY_RANKS).
@pytest.mark.parametrize("how", list(TINY_RANKS))
@pytest.mark.parametrize("fill", [True, False], ids=["fill_blocks", "no_fill_blocks"])
@pytest.mark.parametrize("E,T,K,kind", [(64, 33, 1, "uniform"), (1024, 16, 8, "skewed"),
                                        (257, 255, 8, "uniform"), (7, 512, 8, "skewed"),
                                        (2, 100, 8, "uniform"), (1, 40, 8, "invalid"),
                                        (1000, 300, 8, "hot"), (1, 512, 8, "uniform")])
def test_base_tiny_ranks_by_chunks_and_by_counters(emu, E, T, K, kind, fill, how):
    policy = tiny_ranks_policy(T * K, E, 1, how, fill, emulator.LIMITS)
    for salt in range(2):
        _run(emu, Case(T, K, E, 16, seed=130 + salt, kind=kind,
                       map_mode=(None, "after")[salt], scatter=salt == 1), True, None, policy,
             seeds=(salt,))


@pytest.mark.parametrize("how", list(TINY_RANKS))
@pytest.mark.parametrize("fill", [True, False], ids=["fill_blocks", "no_fill_blocks"])
@pytest.mark.parametrize("E,T,rows,kind", [(256, 255, 16, "uniform"), (256, 512, 16, "skewed"),
                                           (64, 16, 16, "uniform"), (7, 100, 33, "skewed"),
                                           (256, 5, 16, "invalid"), (128, 2, 16, "uniform"),
                                           (256, 130, 16, "hot")])
def test_lora_tiny_ranks_by_chunks_and_by_counters(emu, E, T, rows, kind, fill, how):
    policy = tiny_ranks_policy(T * 8, rows * E, rows, how, fill, emulator.LIMITS)
    for salt in range(3):
        _run(emu, Case(T, 8, E, 16, rows=rows, seed=135 + salt, kind=kind,
                       with_ids=salt != 2, disabled=salt,
                       map_mode="before" if salt == 2 else None), True, None, policy,
             seeds=(salt,))
