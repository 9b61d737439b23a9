"""Every kernel variant against the NumPy oracle, on poisoned, guarded outputs (GPU only)."""

import dataclasses
import itertools

import numpy as np
import pytest

import moe_lora_align as mla
from moe_lora_align.bench import routing as bench_routing
from gpu_util import (CLUSTER_ROWS, CLUSTER_ROWS_CASES, GUARD, POISON, ROW_BLOCKS, TINY_RANKS,
                      canonical, cupy, guarded, make_lora, make_routing, requires_gpu,
                      segment_starts, tiny_ranks_policy)

pytestmark = [requires_gpu, pytest.mark.gpu]

EXPERTS = (1, 7, 64, 257, 1024, 4096, 8192)
TOKENS = (0, 1, 3, 255, 4096, 65536)
KINDS = ("uniform", "skewed", "invalid", "duplicates", "hot")


def _case_params(E, T, salt):
    """Deterministic pick of K, B, dtype, routing for one (E, T) cell: covers the grid's other
    axes without its full product."""
    rng = np.random.default_rng(E * 1_000_003 + T * 7 + salt)
    K = (1, 8)[(E + T + salt) % 2]
    B = (1, 16, 64, 128)[(E // 7 + T + salt) % 4]
    dtype = (np.int32, np.int64)[(E + salt) % 2]
    kind = KINDS[(E + T // 3 + salt) % len(KINDS)]
    return rng, K, B, dtype, kind


def _base_case(E, T, variant, deterministic, salt, *, expert_map_mode=None, scatter=False,
               topk=None, policy=None, block_size=None):
    rng, K, B, dtype, kind = _case_params(E, T, salt)
    K, B = topk or K, block_size or B
    ids = make_routing(rng, T, K, E, dtype, kind)
    emap = None
    if expert_map_mode is not None:
        emap = np.full(E, -1, dtype=np.int32)
        local = rng.choice(E, size=max(1, E // 2), replace=False)
        emap[np.sort(local)] = np.arange(local.size, dtype=np.int32)
    ignore = expert_map_mode == "before"
    P, M = mla.buffer_sizes(T * K, E, B)
    host = [guarded([P], np), guarded([M], np), guarded([1], np)]
    dev = [guarded([P], cupy), guarded([M], cupy), guarded([1], cupy)]
    if scatter:
        host.append(guarded([T * K], np))
        dev.append(guarded([T * K], cupy))
    mla.moe_align_block_size(ids, B, E, emap, ignore_invalid_experts=ignore,
                             return_scatter_idx=scatter, out=[v for _, v in host])
    got = mla.moe_align_block_size(cupy.asarray(ids), B, E,
                                   None if emap is None else cupy.asarray(emap),
                                   ignore_invalid_experts=ignore, return_scatter_idx=scatter,
                                   deterministic=deterministic, variant=variant,
                                   out=[v for _, v in dev], policy=policy)
    assert got.sorted_token_ids is dev[0][1]
    cupy.cuda.get_current_stream().synchronize()
    starts = segment_starts(ids, E, B, expert_map=emap, map_before=ignore)
    for (hw, hv), (dw, dv), name in zip(host, dev, ("sorted", "experts", "ntpp", "scatter")):
        dw, dvh = dw.get(), dv.get()
        assert (dw[:GUARD] == POISON).all() and (dw[-GUARD:] == POISON).all(), f"{name} guard"
        if name == "sorted" and not deterministic:
            np.testing.assert_array_equal(canonical(dvh[None], starts), canonical(hv[None], starts))
        else:
            np.testing.assert_array_equal(dvh, hv, err_msg=name)


def _lora_case(E, T, variant, deterministic, salt, *, max_loras=None, with_ids=True,
               disabled=None, allocate=False, use_map=False, topk=None, policy=None,
               block_size=None, routing=None):
    """``routing``: a function (rng, T, K, E) -> ids in place of the case's own kind."""
    rng, K, B, dtype, kind = _case_params(E, T, salt)
    K, B = topk or K, block_size or B
    if max_loras is None:
        max_loras = (1, 4, 16)[(E + T + salt) % 3]
    if disabled is None:  # one slot disabled, unless it is the only one (nothing to align)
        disabled = 1 if max_loras > 1 else 0
    ids = make_routing(rng, T, K, E, dtype, kind) if routing is None else routing(rng, T, K, E)
    mapping, lora_ids, enabled = make_lora(rng, T, max_loras, disabled=disabled)
    if not with_ids:
        lora_ids = None
    emap = None
    if use_map:
        emap = np.full(E, -1, dtype=np.int32)
        local = rng.choice(E, size=max(1, E // 2), replace=False)
        emap[np.sort(local)] = np.arange(local.size, dtype=np.int32)
    P, M = mla.buffer_sizes(T * K, E, B)
    kwargs = dict(lora_ids=lora_ids, adapter_enabled=enabled, expert_map=emap)
    dev_kwargs = {k: None if v is None else cupy.asarray(v) for k, v in kwargs.items()}
    if allocate:
        ref = mla.moe_lora_align_block_size(ids, mapping, B, E, max_loras, **kwargs)
        got = mla.moe_lora_align_block_size(cupy.asarray(ids), cupy.asarray(mapping), B, E,
                                            max_loras, deterministic=deterministic,
                                            variant=variant, policy=policy, **dev_kwargs)
        host_views = [np.asarray(a) for a in ref]
        dev_views = [a.get() for a in got]
        guards = []
    else:
        host = [guarded([max_loras, P], np), guarded([max_loras, M], np),
                guarded([max_loras], np)]
        dev = [guarded([max_loras, P], cupy), guarded([max_loras, M], cupy),
               guarded([max_loras], cupy)]
        mla.moe_lora_align_block_size(ids, mapping, B, E, max_loras, out=[v for _, v in host],
                                      **kwargs)
        mla.moe_lora_align_block_size(cupy.asarray(ids), cupy.asarray(mapping), B, E,
                                      max_loras, deterministic=deterministic, variant=variant,
                                      out=[v for _, v in dev], policy=policy, **dev_kwargs)
        host_views = [v for _, v in host]
        dev_views = [v.get() for _, v in dev]
        guards = [w.get() for w, _ in dev]
    cupy.cuda.get_current_stream().synchronize()
    for g in guards:
        assert (g[:GUARD] == POISON).all() and (g[-GUARD:] == POISON).all()
    starts = segment_starts(ids, E, B, rows=max_loras, expert_map=emap, map_before=True,
                            mapping=mapping, lora_ids=lora_ids, enabled=enabled)
    if deterministic:
        np.testing.assert_array_equal(dev_views[0], host_views[0])
    else:
        np.testing.assert_array_equal(canonical(dev_views[0], starts),
                                      canonical(host_views[0], starts))
    np.testing.assert_array_equal(dev_views[1], host_views[1])
    np.testing.assert_array_equal(dev_views[2], host_views[2])


GRID = list(itertools.product(EXPERTS, TOKENS))
VARIANTS = ["shared", "global", "cooperative", "cluster"]


def _skip_unless_runs(variant, det, numel, buckets, rows, policy=None):
    """Skip the (variant, sizes) cells the dispatcher refuses (its own tests cover that)."""
    try:
        mla._dispatch.choose_launch(numel, buckets, rows, mla._launch.device_limits(0),
                                    deterministic=det, variant=variant,
                                    policy=policy or mla.AlignPolicy())
    except ValueError as e:
        pytest.skip(f"{variant} cannot run this size: {e}")


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("E,T", GRID)
def test_base(E, T, variant, det):
    _skip_unless_runs(variant, det, T * 8, E, 1)
    _base_case(E, T, variant, det, salt=1 + det)


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("E,T", GRID)
def test_lora(E, T, variant, det):
    salt = 3 + det
    rows = (1, 4, 16)[(E + T + salt) % 3]
    _skip_unless_runs(variant, det, T * 8, rows * E, rows)
    _lora_case(E, T, variant, det, salt=salt)


SINGLE_GRID = [(E, T) for E in (1, 7, 64, 257, 1024) for T in (0, 1, 3, 255)]


@pytest.fixture
def without_tiny():
    """The one-block cases through align_single, which align_tiny replaces where it fits."""
    return mla.AlignPolicy(use_tiny=False)


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("variant", [None, "shared"])
@pytest.mark.parametrize("E,T", SINGLE_GRID)
def test_base_single_block_without_tiny(E, T, variant, det, without_tiny):
    _base_case(E, T, variant, det, salt=31, policy=without_tiny)


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("variant", [None, "shared"])
@pytest.mark.parametrize("E,T", SINGLE_GRID)
def test_lora_single_block_without_tiny(E, T, variant, det, without_tiny):
    _lora_case(E, T, variant, det, salt=32, policy=without_tiny)


@pytest.fixture
def tiny_four_buckets():
    """align_tiny with four buckets a thread wherever its block has fewer threads than
    buckets (otherwise only above 1024 buckets), and its row-group sentinel fill."""
    return mla.AlignPolicy(tiny_one_bucket_max=0)


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("E,T", SINGLE_GRID + [(256, 16), (256, 255)])
def test_base_tiny_four_buckets_a_thread(E, T, det, tiny_four_buckets):
    _base_case(E, T, None, det, salt=33, policy=tiny_four_buckets)


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("rows", [4, 16])
@pytest.mark.parametrize("E,T", SINGLE_GRID + [(256, 16), (256, 255)])
def test_lora_tiny_four_buckets_a_thread(E, T, rows, det, tiny_four_buckets):
    _lora_case(E, T, None, det, salt=34 + det, max_loras=rows, policy=tiny_four_buckets)


# Deterministic align_tiny at 1, 2 and 4 routes a lane (its block: 512 threads for these
# E=64 rows), one warp to every warp holding routes, and four buckets a thread (16 x 256).
DET_TINY = [(64, 1, 1), (64, 64, 1), (64, 100, 1), (64, 255, 1), (7, 3, 1), (1024, 255, 1),
            (64, 100, 4), (64, 255, 4), (256, 1, 16), (256, 16, 16), (128, 60, 16)]


@pytest.mark.parametrize("salt", [0, 1, 2])
@pytest.mark.parametrize("E,T,rows", DET_TINY)
def test_tiny_deterministic_is_exact(E, T, rows, salt):
    launch = mla._dispatch.choose_launch(T * 8, rows * E, rows, mla._launch.device_limits(0),
                                         deterministic=True)
    assert launch.kind == "single" and launch.tiny and launch.deterministic
    if rows == 1:
        _base_case(E, T, None, True, salt=40 + salt, topk=8, scatter=salt == 1)
    else:
        _lora_case(E, T, None, True, salt=43 + salt, max_loras=rows, topk=8)


# align_tiny's one-warp path (kernels/one_block.cuh: align_warp, its base instance and its
# general one): at most WARP_ROUTES (32) routes and 32 rows, on both sides of both limits; E
# from one bucket to 1024; every routing kind (skewed, invalid ids, -1 tokens) and id width;
# an expert map applied before or after; scatter indices; listed, disabled and unlisted
# slots, allocated outputs (unprocessed rows filled); free order and deterministic.
WARP_ROUTES = mla._dispatch.WARP_ROUTES
WARP_CASES = [(E, T, K) for E in (1, 7, 64, 512, 1024)
              for T, K in ((1, 1), (1, 8), (3, 10), (4, 8), (32, 1), (33, 1), (5, 7))]
WARP_LORA_CASES = [(E, T, K, rows) for E in (1, 64, 128) for T, K in ((1, 8), (4, 8), (5, 7),
                                                                       (16, 2))
                   for rows in (1, 4, 32, 33)]
assert {T * K for _, T, K in WARP_CASES} >= {WARP_ROUTES, WARP_ROUTES + 1}
assert {T * K for _, T, K, _ in WARP_LORA_CASES} >= {WARP_ROUTES, WARP_ROUTES + 3}


@pytest.mark.parametrize("salt", [0, 1])
@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("E,T,K", WARP_CASES)
def test_base_one_warp_path(E, T, K, det, salt):
    launch = mla._dispatch.choose_launch(T * K, E, 1, mla._launch.device_limits(0),
                                         deterministic=det)
    assert launch.kind == "single" and launch.tiny  # the warp path is inside align_tiny
    mode = (None, "before", "after")[(E + T + K + salt) % 3]
    _base_case(E, T, None, det, salt=60 + salt, topk=K, expert_map_mode=mode,
               scatter=(T + salt) % 2 == 1)


# align_tiny's base instance (kernels/one_block.cuh: align_tiny_buckets<IdT, 1, DET, true>),
# which takes base calls past the one warp's routes with a thread a bucket: routes from 33 to
# 4096, E from one bucket to 1024, an expert map before or after, scatter indices, every
# routing kind and id width; LoRA calls of one row take the general instance.
TINY_BASE_CASES = [(E, T, K) for E in (1, 7, 64, 257, 1024)
                   for T, K in ((33, 1), (5, 8), (16, 8), (64, 8), (100, 10), (255, 8),
                                (512, 8))]


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("E,T,K", TINY_BASE_CASES)
def test_base_tiny_instance(E, T, K, det):
    launch = mla._dispatch.choose_launch(T * K, E, 1, mla._launch.device_limits(0),
                                         deterministic=det)
    if not (launch.kind == "single" and launch.tiny):
        pytest.skip(f"{T * K} routes over {E} buckets are not align_tiny's")
    assert T * K > WARP_ROUTES and E <= launch.block  # a thread a bucket, past one warp
    for salt in range(3):
        mode = (None, "before", "after")[(E + T + K + salt) % 3]
        _base_case(E, T, None, det, salt=100 + salt, topk=K, expert_map_mode=mode,
                   scatter=salt == 1)


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("E,T,K,rows", WARP_LORA_CASES)
def test_lora_one_warp_path(E, T, K, rows, det):
    """align_warp's LoRA instance (a block a row off: it takes these sizes by default)."""
    mix = E + T + K + rows
    _lora_case(E, T, None, det, salt=80 + mix % 7, max_loras=rows, topk=K,
               with_ids=mix % 3 != 0, disabled=mix % 2, allocate=mix % 5 == 0,
               use_map=mix % 4 == 1, policy=mla.AlignPolicy(tiny_row_blocks=False))


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("rows,with_ids,disabled", [(1, False, 0), (1, True, 0), (1, False, 1),
                                                    (1, True, 1), (4, True, 1)])
def test_lora_without_tokens_keeps_its_rows(rows, with_ids, disabled, det):
    """A LoRA call with no tokens has no token slots, like a base alignment, but its listed
    and enabled slots decide which rows are written: never the one-warp base path's row."""
    for E in (1, 64):
        _lora_case(E, 0, None, det, salt=70 + rows + disabled, max_loras=rows,
                   with_ids=with_ids, disabled=disabled)


@pytest.mark.parametrize("E,T,rows", [(64, 1, 1), (257, 255, 1), (64, 255, 16), (1024, 3, 1),
                                      (7, 3, 4), (256, 255, 4), (256, 1, 16), (256, 16, 16),
                                      (1024, 3, 4)])
def test_decode_sizes_run_the_tiny_kernel(E, T, rows):
    """The dispatcher's one-block choice at these sizes is align_tiny (its correctness is
    covered by the grids above, which run it wherever it fits)."""
    launch = mla._dispatch.choose_launch(T * 8, rows * E, rows, mla._launch.device_limits(0))
    assert launch.kind == "single" and launch.tiny


def test_cooperative_scratch_serves_calls_of_any_size_in_turn():
    """The cooperative kernel keeps two count buffers and cleans the previous call's: calls
    of growing and shrinking bucket counts and sizes, free and deterministic, one after
    another on one workspace."""
    for n, (E, T, lora) in enumerate([(256, 5000, True), (64, 300, False), (1024, 65536, False),
                                      (64, 0, True), (64, 4096, True), (8192, 1, False),
                                      (7, 40000, False), (256, 16384, True), (64, 3, False)]):
        det = n % 3 == 1 and E * (16 if lora else 1) <= 2048  # deterministic mode too
        if lora:
            _lora_case(E, T, "cooperative", det, salt=20 + n, max_loras=16)
        else:
            _base_case(E, T, "cooperative", det, salt=20 + n)


def test_ordered_cooperative_totals_leave_the_scratch_clean():
    """The ordered path writes each bucket's total into its count buffer where the other
    paths add to zeroed counts: free calls on either buffer after it, and ordered calls after
    free ones, of more and fewer buckets, stay exact."""
    for n, (E, det) in enumerate([(256, True), (256, False), (256, False), (512, True),
                                  (64, False), (1024, False), (512, False), (256, True),
                                  (64, True), (1024, False)]):
        _base_case(E, 16384, "cooperative", det, salt=40 + n,
                   policy=mla.AlignPolicy(sort_for_determinism=False))


# align_cooperative with fill blocks (blocks of FILL_SPLIT_BLOCK threads, two an SM, the last
# ones only writing the sentinel fill), with fill blocks on SMs of their own (blocks of 1024,
# one an SM; a fill block per 8192 entries here) and without (a block of 1024 an SM, the
# counting blocks filling first), each asked for by its policy: base and LoRA, free order
# and ordered ranks, every routing kind, and routes on both sides of what the split's
# counting blocks hold (132 x 8 x 512 on an H200).
COOP_FILL = {"fill_blocks": mla.AlignPolicy(coop_fill_blocks_from=0,
                                            coop_fill_sms_from=1 << 62,
                                            coop_fill_blocks_below=1 << 62),
             "fill_sms": mla.AlignPolicy(coop_fill_sms_from=0, coop_fill_sm_entries=8192,
                                         coop_fill_sms_min_entries_per_route=0,
                                         coop_fill_blocks_below=0,
                                         coop_fill_blocks_free_below=0),
             # deterministic: the segment sort (every size) on the counting blocks, the fill
             # blocks beside them
             "fill_sms_sorted": mla.AlignPolicy(coop_fill_sms_from=0, coop_fill_sm_entries=8192,
                                                coop_fill_sms_min_entries_per_route=0,
                                                coop_fill_blocks_below=0,
                                                coop_fill_blocks_free_below=0,
                                                coop_fill_sms_sorted=True, sort_min_buckets=0),
             "no_fill_blocks": mla.AlignPolicy(coop_fill_blocks_from=1 << 62)}


def _coop_fill_launch(numel, buckets, rows, det, how):
    limits = mla._launch.device_limits(0)
    launch = mla._dispatch.choose_launch(numel, buckets, rows, limits, deterministic=det,
                                         variant="cooperative", out_entries=numel,
                                         policy=COOP_FILL[how])
    whole = how.startswith("fill_sms")
    block = mla._dispatch.BLOCK if whole else mla._dispatch.FILL_SPLIT_BLOCK
    most = (limits.sm_count - whole) * mla._dispatch.COOP_ITEMS * block
    sorts = how == "fill_sms_sorted" and det
    if how == "fill_sms_sorted":  # deterministic calls sort there, beside fill blocks
        assert launch.sorted == det
    filled = how != "no_fill_blocks" and (sorts or not launch.sorted) and numel <= most
    assert bool(launch.fill_grid) == filled
    if filled and whole:
        assert launch.block == mla._dispatch.BLOCK and launch.grid <= limits.sm_count
    return launch


@pytest.mark.parametrize("how", list(COOP_FILL))
@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("E,T,K", [(7, 1, 8), (64, 255, 8), (256, 4096, 8), (257, 16384, 8),
                                   (1024, 65536, 8), (64, 67584, 8), (64, 67585, 8),
                                   (256, 1000, 3)])
def test_base_cooperative_with_and_without_fill_blocks(E, T, K, det, how):
    _coop_fill_launch(T * K, E, 1, det, how)
    for salt in range(2):
        _base_case(E, T, "cooperative", det, salt=90 + salt, topk=K, policy=COOP_FILL[how],
                   scatter=salt == 1)


@pytest.mark.parametrize("how", list(COOP_FILL))
@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("E,T,rows", [(64, 3, 4), (256, 4096, 16), (64, 16384, 16),
                                      (128, 20000, 4), (7, 65536, 33)])
def test_lora_cooperative_with_and_without_fill_blocks(E, T, rows, det, how):
    _coop_fill_launch(T * 8, rows * E, rows, det, how)
    for salt in range(2):
        _lora_case(E, T, "cooperative", det, salt=95 + salt, topk=8, max_loras=rows,
                   policy=COOP_FILL[how], allocate=salt == 1, disabled=1 + salt)


# align_tiny with fill blocks (blocks past the first write the sentinel fill and the tiles'
# -1; block 0 waits for them before its stores) and without, each asked for by its policy
# (one block up to any fill size): base and LoRA, free order and deterministic, a thread a
# bucket and four, just past one warp's routes, more than 32 rows, listed, disabled and
# unprocessed rows (allocated outputs fill them), an expert map.
BIG_SINGLE = 1 << 30
TINY_FILL = {"tiny_fill_blocks": mla.AlignPolicy(tiny_fill_blocks_from=0,
                                                 tiny_fill_blocks_one_row_from=0,
                                                 coop_over_single_entries=BIG_SINGLE,
                                                 coop_over_filled_single_entries=BIG_SINGLE,
                                                 tiny_row_blocks=False),
             "no_tiny_fill_blocks": mla.AlignPolicy(tiny_fill_blocks_from=1 << 62,
                                                    tiny_fill_blocks_one_row_from=1 << 62,
                                                    coop_over_single_entries=BIG_SINGLE,
                                                    coop_over_filled_single_entries=BIG_SINGLE,
                                                    tiny_row_blocks=False)}


def _tiny_fill_launch(numel, buckets, rows, det, how):
    launch = mla._dispatch.choose_launch(numel, buckets, rows, mla._launch.device_limits(0),
                                         deterministic=det, out_entries=numel,
                                         policy=TINY_FILL[how])
    if not (launch.kind == "single" and launch.tiny):
        pytest.skip(f"{numel} routes over {buckets} buckets are not align_tiny's")
    assert bool(launch.fill_grid) == (how == "tiny_fill_blocks" and numel > WARP_ROUTES)


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("at", ["below_stage", "stage", "below_cluster", "cluster"])
def test_base_staged_cuts(at, det):
    """The default dispatcher on both sides of tiny_stage_from and cluster_over_staged_from
    (deterministic: its own figure; K=1, so routes are tokens)."""
    pol = mla._dispatch.DEFAULT_POLICY
    cut = pol.cluster_over_staged_from_deterministic if det else pol.cluster_over_staged_from
    numel = {"below_stage": pol.tiny_stage_from - 1, "stage": pol.tiny_stage_from,
             "below_cluster": cut - 1, "cluster": cut}[at]
    E, B = 256, 16
    P, M = mla.buffer_sizes(numel, E, B)
    launch = mla._dispatch.choose_launch(numel, E, 1, mla._launch.device_limits(0),
                                         deterministic=det, out_entries=P + M)
    assert launch.stage_output == (at in ("stage", "below_cluster"))
    _base_case(E, numel, None, det, salt=130, topk=1, block_size=B)


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("rows,numel,cluster", [(1, 2047, False), (1, 2048, True),
                                                (2, 2048, True), (4, 2048, False),
                                                (4, 2304, True)])
def test_lora_cluster_cut_over_few_buckets(rows, numel, cluster, det):
    """The default dispatcher on both sides of the cluster's lower bound for LoRA calls of
    few slots (cluster_few_buckets: over at most 512 buckets it starts at 2048 routes, over
    more at cluster_min_routes; K=1, so routes are tokens)."""
    E, B = 256, 16
    P, M = mla.buffer_sizes(numel, E, B)
    policy = mla.AlignPolicy(tiny_row_blocks=False)  # (2 to 32 slots: a block a row by default)
    launch = mla._dispatch.choose_launch(numel, rows * E, rows, mla._launch.device_limits(0),
                                         deterministic=det, out_entries=rows * (P + M),
                                         lora=True, policy=policy)
    assert (launch.kind == "cluster") == cluster, launch
    _lora_case(E, numel, None, det, salt=140 + rows, max_loras=rows, topk=1, block_size=B,
               policy=policy)


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("op", ["base", "lora"])
def test_fill_sms_by_entries_per_route(op, det):
    """The default dispatcher past coop_fill_sms_from: one row (base) without fill SMs, its
    entries about its routes; two slots (twice the entries a route) with them."""
    E, K, B, T = 64, 8, 64, 32768
    rows = 1 if op == "base" else 2
    P, M = mla.buffer_sizes(T * K, E, B)
    launch = mla._dispatch.choose_launch(T * K, rows * E, rows, mla._launch.device_limits(0),
                                         deterministic=det, out_entries=rows * (P + M),
                                         lora=op == "lora")
    assert launch.kind == "cooperative" and launch.block == mla._dispatch.BLOCK
    assert bool(launch.fill_grid) == (rows > 1 and not launch.sorted), launch
    if op == "base":
        _base_case(E, T, None, det, salt=150, topk=K, block_size=B)
    else:
        _lora_case(E, T, None, det, salt=151, max_loras=rows, topk=K, block_size=B)


@pytest.mark.parametrize("how", list(TINY_FILL))
@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("E,T,K", [(64, 33, 1), (1024, 16, 8), (257, 255, 8), (7, 512, 8),
                                   (64, 4, 8)])
def test_base_tiny_with_and_without_fill_blocks(E, T, K, det, how):
    _tiny_fill_launch(T * K, E, 1, det, how)
    for salt in range(2):
        _base_case(E, T, None, det, salt=110 + salt, topk=K, policy=TINY_FILL[how],
                   expert_map_mode=(None, "after")[salt], scatter=salt == 1)


# align_tiny_staged: the base row built in shared memory and stored after the scan (asked for
# by its policy; the cluster off so that 4096 routes stay in one block).
STAGED = mla.AlignPolicy(tiny_stage_from=0, cluster_min_routes=1 << 30,
                         coop_over_single_entries=BIG_SINGLE,
                         coop_over_filled_single_entries=BIG_SINGLE)


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("E,T,K,B", [(64, 33, 1, 16), (1024, 16, 8, 64), (257, 255, 8, 16),
                                     (7, 512, 8, 128), (256, 256, 8, 16), (512, 100, 10, 1),
                                     (128, 256, 8, 16), (8, 5, 8, 16)])
def test_base_tiny_staged_row(E, T, K, B, det):
    P, M = mla.buffer_sizes(T * K, E, B)
    launch = mla._dispatch.choose_launch(T * K, E, 1, mla._launch.device_limits(0),
                                         deterministic=det, out_entries=P + M, policy=STAGED)
    assert launch.tiny and launch.stage_output and not launch.fill_grid
    for salt in range(2):
        _base_case(E, T, None, det, salt=120 + salt, topk=K, block_size=B, policy=STAGED,
                   expert_map_mode=(None, "after")[salt], scatter=salt == 1)


@pytest.mark.parametrize("how", list(TINY_FILL))
@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("E,T,rows", [(64, 5, 16), (256, 16, 16), (64, 16, 16), (256, 255, 16),
                                      (64, 64, 4), (7, 100, 33), (128, 2, 16)])
def test_lora_tiny_with_and_without_fill_blocks(E, T, rows, det, how):
    _tiny_fill_launch(T * 8, rows * E, rows, det, how)
    for salt in range(3):
        _lora_case(E, T, None, det, salt=115 + salt, topk=8, max_loras=rows,
                   policy=TINY_FILL[how], allocate=salt == 1, with_ids=salt != 2,
                   disabled=salt, use_map=salt == 2)


# LoRA a block a row (align_tiny_rows), asked for at every size it takes: 2 to 100 rows (a
# list past 64 entries, which each block searches for its slot), just past one warp's routes
# and 4096 routes, a thread a bucket up to 1024 experts; listed,
# disabled and unprocessed rows (allocated outputs fill them), an expert map, every routing
# kind over the salts.
@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("E,T,K,rows", [(64, 1, 1, 2), (64, 4, 8, 4), (256, 5, 8, 16),
                                        (256, 16, 8, 16), (128, 16, 4, 4), (64, 16, 6, 16),
                                        (256, 64, 8, 32), (1024, 33, 1, 2), (256, 255, 8, 16),
                                        (256, 512, 8, 16), (7, 512, 8, 3), (1000, 3, 8, 5),
                                        (128, 40, 8, 33), (32, 300, 2, 80), (64, 512, 4, 100)])
def test_lora_row_blocks(E, T, K, rows, det):
    P, M = mla.buffer_sizes(T * K, E, 16)
    launch = mla._dispatch.choose_launch(T * K, rows * E, rows, mla._launch.device_limits(0),
                                         deterministic=det, out_entries=rows * (P + M),
                                         policy=ROW_BLOCKS, lora=True)
    assert launch.row_blocks and launch.grid == rows
    for salt in range(5):
        _lora_case(E, T, None, det, salt=160 + salt, topk=K, max_loras=rows, block_size=16,
                   policy=ROW_BLOCKS, allocate=salt == 1, with_ids=salt != 2,
                   disabled=salt % 3, use_map=salt == 2)


# LoRA a cluster a row (align_cluster_rows, sm_90+), asked for at every size it takes: 2 to
# 80 rows, one route to what one cluster holds (65536), a list past 64 entries; listed,
# disabled and unprocessed rows (allocated outputs fill them), an expert map, every routing
# kind over the salts.
@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("E,T,K,rows", CLUSTER_ROWS_CASES)
def test_lora_cluster_rows(E, T, K, rows, det):
    limits = mla._launch.device_limits(0)
    if not limits.clusters:
        pytest.skip("clusters need sm_90 or newer")
    P, M = mla.buffer_sizes(T * K, E, 16)
    launch = mla._dispatch.choose_launch(T * K, rows * E, rows, limits, deterministic=det,
                                         out_entries=rows * (P + M), policy=CLUSTER_ROWS,
                                         lora=True)
    assert launch.row_clusters and launch.grid == rows * 8
    for salt in range(5):
        _lora_case(E, T, None, det, salt=180 + salt, topk=K, max_loras=rows, block_size=16,
                   policy=CLUSTER_ROWS, allocate=salt == 1, with_ids=salt != 2,
                   disabled=salt % 3, use_map=salt == 2)


# Deterministic align_tiny's two ways to flat-order ranks (gpu_util.TINY_RANKS): a thread a
# bucket and four, one and two bucket bits, just past one warp's routes and 4096 routes; five
# salts a case, so every routing kind (skewed, hot, invalid, duplicates) comes up; listed,
# disabled and unprocessed rows.
@pytest.mark.parametrize("how", list(TINY_RANKS))
@pytest.mark.parametrize("fill", [True, False], ids=["fill_blocks", "no_fill_blocks"])
@pytest.mark.parametrize("E,T,K", [(64, 33, 1), (1024, 16, 8), (257, 255, 8), (7, 512, 8),
                                   (2, 100, 8), (1, 40, 8), (1000, 300, 8), (1, 512, 8)])
def test_base_tiny_ranks_by_chunks_and_by_counters(E, T, K, fill, how):
    policy = tiny_ranks_policy(T * K, E, 1, how, fill, mla._launch.device_limits(0))
    for salt in range(5):
        _base_case(E, T, None, True, salt=140 + salt, topk=K, policy=policy,
                   expert_map_mode=(None, "after")[salt % 2], scatter=salt % 2 == 1)


@pytest.mark.parametrize("how", list(TINY_RANKS))
@pytest.mark.parametrize("fill", [True, False], ids=["fill_blocks", "no_fill_blocks"])
@pytest.mark.parametrize("E,T,rows", [(256, 255, 16), (256, 512, 16), (64, 16, 16),
                                      (7, 100, 33), (256, 5, 16), (128, 2, 16), (256, 130, 16),
                                      (256, 256, 8)])
def test_lora_tiny_ranks_by_chunks_and_by_counters(E, T, rows, fill, how):
    policy = tiny_ranks_policy(T * 8, rows * E, rows, how, fill, mla._launch.device_limits(0))
    for salt in range(5):
        _lora_case(E, T, None, True, salt=145 + salt, topk=8, max_loras=rows, policy=policy,
                   allocate=salt == 1, with_ids=salt != 2, disabled=salt % 3,
                   use_map=salt == 2)


@pytest.mark.parametrize("mode", ["before", "after"])
@pytest.mark.parametrize("variant", [None, "shared", "global", "cooperative", "cluster"])
@pytest.mark.parametrize("E,T", [(64, 3), (257, 255), (256, 4096), (64, 65536)])
@pytest.mark.parametrize("det", [False, True])
def test_base_expert_map_and_scatter(E, T, variant, mode, det):
    _skip_unless_runs(variant, det, T * 8, E, 1)
    _base_case(E, T, variant, det, salt=5, expert_map_mode=mode, scatter=True)


@pytest.mark.parametrize("variant", [None, "shared", "global", "cooperative", "cluster"])
@pytest.mark.parametrize("E,T", [(64, 1), (128, 255), (256, 4096), (64, 65536)])
@pytest.mark.parametrize("det", [False, True])
def test_lora_allocated_map_and_no_ids(E, T, variant, det):
    _skip_unless_runs(variant, det, T * 8, 4 * E, 4)
    _lora_case(E, T, variant, det, salt=6, allocate=True, use_map=True, with_ids=False,
               disabled=2, max_loras=4)


@pytest.mark.parametrize("E,T,max_loras", [(256, 16, 16), (4096, 4096, 16), (1024, 255, 64)])
def test_lora_many_buckets_go_global(E, T, max_loras):
    """max_loras * E >= 65536 buckets: only the global variant can count them."""
    _lora_case(E, T, None, False, salt=7, max_loras=max_loras)
    _lora_case(E, T, None, True, salt=8, max_loras=max_loras)


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.uint8, np.uint16, np.uint32, np.uint64])
def test_other_dtypes(dtype):
    rng = np.random.default_rng(11)
    E = 7 if np.dtype(dtype).itemsize == 1 else 300
    ids = make_routing(rng, 300, 4, E, dtype, "invalid")
    ref = mla.moe_align_block_size(ids, 16, E, deterministic=True)
    got = mla.moe_align_block_size(cupy.asarray(ids), 16, E, deterministic=True)
    for a, b in zip(got, ref):
        np.testing.assert_array_equal(a.get(), b)


@pytest.mark.parametrize("T", [255, 65536])
@pytest.mark.parametrize("variant", [None, "shared", "global", "cooperative"])
def test_deterministic_is_bit_identical(T, variant):
    rng = np.random.default_rng(12)
    ids = cupy.asarray(make_routing(rng, T, 8, 64, np.int32, "hot"))
    first = mla.moe_align_block_size(ids, 64, 64, deterministic=True, variant=variant)
    for _ in range(3):
        again = mla.moe_align_block_size(ids, 64, 64, deterministic=True, variant=variant)
        for a, b in zip(first, again):
            assert bool((a == b).all())


def test_zero_tokens_allocated():
    ids = cupy.zeros((0, 8), dtype=cupy.int32)
    base = mla.moe_align_block_size(ids, 16, 64)
    assert base.sorted_token_ids.size == 0 and int(base.num_tokens_post_pad[0]) == 0
    lora = mla.moe_lora_align_block_size(ids, cupy.zeros(0, dtype=cupy.int32), 16, 64, 4)
    assert lora.num_tokens_post_pad.get().tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("variant", [None, "shared", "cooperative"])
def test_all_routes_to_one_expert_large(variant):
    ids = cupy.full((65536, 8), 3, dtype=cupy.int32)
    got = mla.moe_align_block_size(ids, 64, 256, variant=variant)
    assert int(got.num_tokens_post_pad[0]) == 65536 * 8
    s = got.sorted_token_ids.get()
    assert np.array_equal(np.sort(s[: 65536 * 8]), np.arange(65536 * 8))
    assert (got.expert_ids.get()[: 65536 * 8 // 64] == 3).all()


def test_torch_interop():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(13)
    ids = make_routing(rng, 100, 8, 64, np.int64)
    t = torch.as_tensor(ids, device="cuda")
    got = mla.moe_align_block_size(t, 16, 64, deterministic=True)
    assert isinstance(got.sorted_token_ids, torch.Tensor) and got.sorted_token_ids.is_cuda
    ref = mla.moe_align_block_size(ids, 16, 64)
    torch.cuda.synchronize()
    for a, b in zip(got, ref):
        np.testing.assert_array_equal(a.cpu().numpy(), b)


@pytest.mark.parametrize("case", ["empty", "int64", "transposed", "expanded", "offset"])
def test_torch_tensors_of_every_layout(case):
    # Torch tensors enter as CuPy views made from their pointers: shapes, strides (a zero
    # stride too), a storage offset and dtypes must come through as DLPack would bring them.
    torch = pytest.importorskip("torch")
    E, B, K = 16, 4, 3
    ids = make_routing(np.random.default_rng(21), 0 if case == "empty" else 9, K, E,
                       np.int64 if case == "int64" else np.int32)
    t = torch.as_tensor(ids, device="cuda")
    if case == "transposed":
        t = torch.as_tensor(np.ascontiguousarray(ids.T), device="cuda").T
    elif case == "expanded":
        ids = np.repeat(ids[:1], 9, axis=0)
        t = torch.as_tensor(ids[:1], device="cuda").expand(9, K)
    elif case == "offset":
        t = torch.as_tensor(np.concatenate([ids, ids[::-1]]), device="cuda")[9:]
        ids = ids[::-1].copy()
    assert t.stride() != (K, 1) or case in ("empty", "int64", "offset")
    got = mla.moe_align_block_size(t, B, E)
    want = mla.moe_align_block_size(ids, B, E)
    torch.cuda.synchronize()
    starts = segment_starts(ids, E, B)
    np.testing.assert_array_equal(canonical(got[0].cpu().numpy()[None], starts),
                                  canonical(want[0][None], starts))
    np.testing.assert_array_equal(got[1].cpu().numpy(), want[1])
    np.testing.assert_array_equal(got[2].cpu().numpy(), want[2])


def test_mixed_host_and_device_is_an_error():
    ids = cupy.zeros((4, 2), dtype=cupy.int32)
    with pytest.raises(ValueError, match="host"):
        mla.moe_lora_align_block_size(ids, np.zeros(4, np.int32), 16, 8, 2)


def test_device_value_validation_on_request():
    ids = cupy.zeros((4, 2), dtype=cupy.int32)
    bad = cupy.asarray(np.array([0, 5, 0, 0], np.int32))
    with pytest.raises(ValueError, match="token_lora_mapping"):
        mla.moe_lora_align_block_size(ids, bad, 16, 8, 2, validate=True)
    # Without validation the out-of-range slot is dropped, nothing is written out of bounds.
    got = mla.moe_lora_align_block_size(ids, bad, 16, 8, 2)
    ref = mla.moe_lora_align_block_size(np.zeros((4, 2), np.int32),
                                        np.array([0, -1, 0, 0], np.int32), 16, 8, 2)
    for a, b in zip(got, ref):
        np.testing.assert_array_equal(a.get(), b)


@pytest.mark.parametrize("dtype", sorted(mla._kernels.CTYPES, key=str))
def test_device_compiler_leaves_no_kernel_spilled(dtype):
    """tests/test_compile.py's spill check, on the kernels as this machine's NVRTC built
    them (its cuda.core may return no ptxas log): no local memory in any kernel."""
    ks = mla._kernels.kernels_for(dtype, 0, mla._launch.device_limits(0).smem_optin)
    ks.load_all()
    local = {name: ks[key].local_size_bytes for key, name in ks.names.items()}
    assert not any(local.values()), {n: b for n, b in local.items() if b}


# align_cluster: one cluster of CLUSTER_BLOCKS blocks, free order and deterministic. Sizes on
# both sides of its limits (the routes its blocks hold, chunks of one thread each and of
# several), one bucket taking every route (one thread writes all tile owners), LoRA rows past
# one warp's marking, and the fused pair of two clusters.
CLUSTER_CAP = mla._dispatch.CLUSTER_BLOCKS * mla._dispatch.CLUSTER_ITEMS * mla._dispatch.BLOCK


def _needs_clusters():
    if not mla._launch.device_limits(0).clusters:
        pytest.skip("no thread-block clusters on this device")


@pytest.mark.parametrize("numel", [0, 1, 7, 8 * 256, 8 * 256 + 1, 8 * 1024 - 1, 8 * 1024,
                                   8 * 1024 + 33, CLUSTER_CAP - 1, CLUSTER_CAP])
@pytest.mark.parametrize("E", [1, 64, 257, 4096])
@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
def test_cluster_base_sizes(numel, E, det):
    _needs_clusters()
    _skip_unless_runs("cluster", det, numel, E, 1)
    _base_case(E, numel, "cluster", det, salt=50 + det, topk=1, scatter=numel % 2 == 1)


def test_cluster_refuses_past_its_routes():
    _needs_clusters()
    with pytest.raises(ValueError, match="cluster"):
        mla._dispatch.choose_launch(CLUSTER_CAP + 1, 64, 1, mla._launch.device_limits(0),
                                    variant="cluster")


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("E,T", [(256, 256), (64, 4095), (512, 1024)])
def test_cluster_one_expert_takes_every_route(E, T, det):
    _needs_clusters()
    ids = cupy.full((T, 8), 3, dtype=cupy.int32)
    got = mla.moe_align_block_size(ids, 16, E, variant="cluster", deterministic=det)
    padded = -(-T * 8 // 16) * 16
    assert int(got.num_tokens_post_pad[0]) == padded
    s = got.sorted_token_ids.get()
    assert np.array_equal(s[: T * 8] if det else np.sort(s[: T * 8]), np.arange(T * 8))
    assert (s[T * 8:] == T * 8).all()
    assert (got.expert_ids.get()[: padded // 16] == 3).all()
    assert (got.expert_ids.get()[padded // 16:] == -1).all()


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("rows", [1, 4, 16, 40])
@pytest.mark.parametrize("E,T", [(64, 1), (256, 256), (128, 1024), (64, 4096)])
def test_cluster_lora(E, T, rows, det):
    _needs_clusters()
    _skip_unless_runs("cluster", det, T * 8, rows * E, rows)
    _lora_case(E, T, "cluster", det, salt=51, max_loras=rows, topk=8)
    _lora_case(E, T, "cluster", det, salt=52, max_loras=rows, topk=8, allocate=True,
               use_map=True, with_ids=False, disabled=2)


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("E,T,L", [(64, 1, 4), (256, 256, 16), (512, 1024, 4), (64, 4096, 16),
                                   (256, 1024, 4)])
def test_cluster_pair_is_fused(E, T, L, det):
    """Base and LoRA in one launch of two clusters, against the NumPy backend (exactly when
    deterministic)."""
    _needs_clusters()
    if det and mla._dispatch.choose_cluster_pair(T * 8, E, L * E, L,
                                                 mla._launch.device_limits(0),
                                                 deterministic=True) is None:
        pytest.skip("the deterministic cluster pair's counters do not fit")
    rng = np.random.default_rng(E + T + L)
    ids = make_routing(rng, T, 8, E, np.int32, "skewed" if det else "uniform")
    mapping, lora_ids, enabled = make_lora(rng, T, L, disabled=1)
    kw = dict(lora_ids=lora_ids, adapter_enabled=enabled)
    ref = mla.align_moe_and_lora(ids, mapping, 16, E, L, **kw)
    got = mla.align_moe_and_lora(cupy.asarray(ids), cupy.asarray(mapping), 16, E, L,
                                 variant="cluster", streams="fused", deterministic=det,
                                 **{k: cupy.asarray(v) for k, v in kw.items()})
    cupy.cuda.get_current_stream().synchronize()
    for side, rows, extra in ((0, 1, {}), (1, L, dict(mapping=mapping, lora_ids=lora_ids,
                                                       enabled=enabled, map_before=True))):
        starts = segment_starts(ids, E, 16, rows=rows, **extra)
        g, r = got[side], ref[side]
        sorted_g = g[0].get().reshape(rows, -1)
        sorted_r = np.asarray(r[0]).reshape(rows, -1)
        if det:
            np.testing.assert_array_equal(sorted_g, sorted_r)
        else:
            np.testing.assert_array_equal(canonical(sorted_g, starts),
                                          canonical(sorted_r, starts))
        np.testing.assert_array_equal(g[1].get(), np.asarray(r[1]))
        np.testing.assert_array_equal(g[2].get(), np.asarray(r[2]))


# Deterministic output by sorting each segment after the fast kernels: inside the
# cooperative launch, or align_order after count + place. Segment lengths on both sides of the warps' limit
# (ORDER_WARP_MAX, with and without padding inside the segment) and of the blocks' digit
# sort (the bitmap below ORDER_BITMAP_ALL_MAX routes, else ORDER_DIGITS_MAX by digits, then
# the bitmap), after each kernel it follows; values clustered
# in one digit; route counts on both sides of
# the largest bitmap a block holds (past it the kernels rank in order themselves); LoRA rows
# with disabled slots and an expert map; and the same cases with sorting off (the kernels'
# own ordered ranks).
ORDER_MAX = mla._dispatch.ORDER_WARP_MAX
DIGITS_MAX = mla._dispatch.ORDER_DIGITS_MAX
ORDERED = mla.AlignPolicy(sort_for_determinism=False)
SORTED = mla.AlignPolicy(sort_min_buckets=0)  # sorted at every size


def _one_hot_expert(count, numel, E, hot, seed):
    """``numel`` routes (K = 8), ``count`` of them on expert ``hot`` at random places, the
    rest uniform over the others."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(E - 1, size=numel).astype(np.int32)
    ids[ids >= hot] += 1
    ids[rng.choice(numel, size=count, replace=False)] = hot
    return ids.reshape(-1, 8)


def _exact(ids, B, E, variant, policy):
    """GPU (deterministic, poisoned guarded out=) against the NumPy backend, exactly; returns
    the dispatcher's launch."""
    P, M = mla.buffer_sizes(ids.size, E, B)
    launch = mla._dispatch.choose_launch(ids.size, E, 1, mla._launch.device_limits(0),
                                         deterministic=True, variant=variant,
                                         out_entries=P + M,
                                         policy=policy or mla.AlignPolicy())
    assert launch.deterministic_output
    ref = mla.moe_align_block_size(ids, B, E, return_scatter_idx=True)
    dev = [guarded([n], cupy) for n in (P, M, 1, ids.size)]
    mla.moe_align_block_size(cupy.asarray(ids), B, E, return_scatter_idx=True,
                             deterministic=True, variant=variant, policy=policy,
                             out=[v for _, v in dev])
    cupy.cuda.get_current_stream().synchronize()
    for (whole, view), want, name in zip(dev, ref, ("sorted", "experts", "ntpp", "scatter")):
        w = whole.get()
        assert (w[:GUARD] == POISON).all() and (w[-GUARD:] == POISON).all(), f"{name} guard"
        np.testing.assert_array_equal(view.get(), np.asarray(want), err_msg=name)
    return launch


@pytest.mark.parametrize("how", ["sorted", "ordered"])
@pytest.mark.parametrize("B", [1, 16])
@pytest.mark.parametrize("count", [1, 2, 31, 32, 33, ORDER_MAX - 1, ORDER_MAX, ORDER_MAX + 1,
                                   1000, DIGITS_MAX, DIGITS_MAX + 1, 30000])
@pytest.mark.parametrize("variant", [None, "shared", "global", "cooperative"])
def test_order_segment_lengths(variant, count, B, how):
    ids = _one_hot_expert(count, 32768, 256, hot=5, seed=count + B)
    launch = _exact(ids, B, 256, variant, ORDERED if how == "ordered" else SORTED)
    # the cooperative kernel sorts in its launch; count + place sort after, unless ordered
    assert launch.kind == ("multi" if variant in ("shared", "global") else "cooperative")
    assert bool(launch.order_grid) == (launch.kind == "multi" and how == "sorted")
    assert launch.sorted == (launch.kind == "cooperative" and how == "sorted")


@pytest.mark.parametrize("count", [ORDER_MAX + 1, 1000, DIGITS_MAX, DIGITS_MAX + 1])
@pytest.mark.parametrize("variant", [None, "global", "cooperative"])
def test_order_segment_lengths_past_the_bitmap_for_all(variant, count):
    """Past ORDER_BITMAP_ALL_MAX routes a long segment of up to ORDER_DIGITS_MAX entries is
    sorted by digits (below it, as in test_order_segment_lengths, by the bitmap)."""
    numel = mla._dispatch.ORDER_BITMAP_ALL_MAX + 8
    _exact(_one_hot_expert(count, numel, 256, hot=7, seed=count), 16, 256, variant, SORTED)


SORTED_RUNS = mla.AlignPolicy(sort_min_buckets=0, sort_runs_above_routes=0)


@pytest.mark.parametrize("numel", [8192, 32768, 33000, 65536, 100000, 131072])
@pytest.mark.parametrize("count", [ORDER_MAX + 1, 1000, DIGITS_MAX + 1])
@pytest.mark.parametrize("variant,policy", [(None, SORTED), ("global", SORTED),
                                            ("cooperative", SORTED),
                                            ("cooperative", SORTED_RUNS)],
                         ids=["default", "global", "cooperative", "cooperative_runs"])
def test_order_bitmap_runs_of_every_width(variant, policy, count, numel):
    """Past sort_runs_above_routes (32768) routes, up to ORDER_BITMAP_ALL_MAX, the sorting
    cooperative kernel runs its instance that reads each warp's rounds of a block's bitmap
    back as a run of its words a lane, up to four (SORTED_RUNS: at every size). With 32
    warps a block: 8192 routes give runs of a word in 8 warps, 32768 of a word in every
    warp, 33000 (33 rounds) of two words, one warp's of one and the rest none; 65536 of two;
    100000 of four, one warp's of two; 131072 of four. Count + place (align_order) reads a
    round at a time."""
    ids = _one_hot_expert(count, numel, 256, hot=3, seed=count + numel)
    launch = _exact(ids, 16, 256, variant, policy)
    runs = launch.kind == "cooperative" and (policy is SORTED_RUNS or numel > 32768)
    assert launch.sorted == (launch.kind == "cooperative") and launch.sort_runs == runs


@pytest.mark.parametrize("dense,spread", [(2048, 1000), (4096, 0), (DIGITS_MAX, 1),
                                          (300, 60000)])
def test_order_clustered_values(dense, spread):
    """One bucket's routes: a run of consecutive flat indices (one digit holds many) plus
    some spread over the rest; K = 1."""
    rng = np.random.default_rng(dense + spread)
    numel = 1 << 17
    ids = rng.integers(1, 64, size=numel).astype(np.int32)
    ids[1000:1000 + dense] = 0
    ids[rng.choice(np.arange(1000 + dense, numel), size=spread, replace=False)] = 0
    assert _exact(ids.reshape(-1, 1), 16, 64, None, SORTED).sorted
    assert _exact(ids.reshape(-1, 1), 16, 64, "shared", SORTED).order_grid


@pytest.mark.parametrize("extra", [0, 1])
def test_order_both_sides_of_the_largest_bitmap(extra):
    limits = mla._launch.device_limits(0)
    # the most routes (a multiple of 8) whose bitmap fits a block's shared memory
    largest = max(n for n in range(0, 8 * limits.dynamic_smem, 8)
                  if mla._dispatch.order_scratch_bytes(n) <= limits.dynamic_smem)
    numel = largest + 8 * extra
    ids = np.random.default_rng(extra).integers(64, size=(numel // 8, 8)).astype(np.int32)
    ids[::3, 0] = 7  # one long segment among the uniform ones
    launch = _exact(ids, 64, 64, None, SORTED)
    assert launch.kind == "multi" and bool(launch.order_grid) == (extra == 0)


@pytest.mark.parametrize("how", ["sorted", "ordered"])
@pytest.mark.parametrize("variant", [None, "shared", "global", "cooperative"])
@pytest.mark.parametrize("E,T,rows", [(256, 4096, 16), (64, 16384, 4), (8, 2048, 40)])
def test_order_lora(E, T, rows, variant, how):
    policy = ORDERED if how == "ordered" else SORTED
    if variant is not None:
        _skip_unless_runs(variant, True, T * 8, rows * E, rows, policy)
    _lora_case(E, T, variant, True, salt=60, max_loras=rows, topk=8, policy=policy)
    _lora_case(E, T, variant, True, salt=61, max_loras=rows, topk=8, allocate=True,
               use_map=True, with_ids=False, disabled=2, policy=policy)


@pytest.mark.parametrize("variant,fill_sms", [(None, False), ("cooperative", False),
                                              ("shared", False), (None, True),
                                              ("cooperative", True)])
@pytest.mark.parametrize("T,E,L", [(2048, 256, 16), (3072, 256, 16), (4096, 256, 16),
                                   (16384, 256, 16), (16384, 64, 4), (4096, 8, 40)])
def test_order_lora_hot_experts(T, E, L, variant, fill_sms):
    """The benchmark's skewed routing (most routes on 4 hot experts): in every slot a few long
    segments among short ones, more of them than blocks at E=64 and E=8, in the cooperative
    kernel's sort (``fill_sms``: beside fill blocks, where its fill SMs apply) and
    align_order's; exact against the NumPy backend, guards intact."""
    policy = dataclasses.replace(SORTED, coop_fill_sms_sorted=fill_sms)
    _skip_unless_runs(variant, True, T * 8, L * E, L, policy)
    _lora_case(E, T, variant, True, salt=63, max_loras=L, topk=8, block_size=64, disabled=1,
               policy=policy, routing=lambda rng, T, K, E: bench_routing(rng, T, K, E, "skewed"))


@pytest.mark.parametrize("streams", [None, "one", "two"])
def test_order_pair(streams):
    """Base and LoRA together, deterministic at prefill: each side sorted after its kernel."""
    T, E, L, B = 4096, 256, 16, 64
    rng = np.random.default_rng(62)
    ids = make_routing(rng, T, 8, E, np.int32, "skewed")
    mapping, lora_ids, enabled = make_lora(rng, T, L, disabled=1)
    kw = dict(lora_ids=lora_ids, adapter_enabled=enabled)
    ref = mla.align_moe_and_lora(ids, mapping, B, E, L, **kw)
    got = mla.align_moe_and_lora(cupy.asarray(ids), cupy.asarray(mapping), B, E, L,
                                 deterministic=True, streams=streams,
                                 **{k: cupy.asarray(v) for k, v in kw.items()})
    cupy.cuda.get_current_stream().synchronize()
    for g_side, r_side in zip(got, ref):
        for g, r in zip(g_side, r_side):
            np.testing.assert_array_equal(g.get(), np.asarray(r))


# Deterministic base + LoRA in one cooperative launch, each side ranking in order or sorting
# its segments (the pair kernel's instances (1, 1) and (1, 2)), against the NumPy backend
# exactly; skewed routing, disabled slots, sizes from one block's routes to the most the
# launch holds.
@pytest.mark.parametrize("T,E,K,L", [(4096, 256, 8, 16), (16384, 256, 8, 16), (4096, 64, 6, 4),
                                     (1537, 128, 8, 4), (65536, 256, 8, 2)])
@pytest.mark.parametrize("kind", ["uniform", "skewed"])
def test_cooperative_pair_deterministic(T, E, K, L, kind):
    pol = mla.AlignPolicy()
    limits = mla._launch.device_limits(0)
    pair = mla._dispatch.choose_cooperative_pair(T * K, E, L * E, L, limits,
                                                 deterministic=True, policy=pol)
    if pair is None:
        pytest.skip("no deterministic cooperative pair for these sizes")
    rng = np.random.default_rng(T + E + L)
    ids = make_routing(rng, T, K, E, np.int32, kind)
    mapping, lora_ids, enabled = make_lora(rng, T, L, disabled=1)
    kw = dict(lora_ids=lora_ids, adapter_enabled=enabled)
    P, M = mla.buffer_sizes(T * K, E, 64)
    ref = ([np.full(n, POISON, np.int32) for n in (P, M, 1)],  # rows not processed: unwritten
           [np.full(sh, POISON, np.int32) for sh in ((L, P), (L, M), (L,))])
    mla.align_moe_and_lora(ids, mapping, 64, E, L, out_base=ref[0], out_lora=ref[1], **kw)
    base = [guarded([P], cupy), guarded([M], cupy), guarded([1], cupy)]
    lora = [guarded([L, P], cupy), guarded([L, M], cupy), guarded([L], cupy)]
    mla.align_moe_and_lora(cupy.asarray(ids), cupy.asarray(mapping), 64, E, L,
                           deterministic=True, variant="cooperative", streams="fused",
                           out_base=[v for _, v in base], out_lora=[v for _, v in lora],
                           policy=pol, **{k: cupy.asarray(v) for k, v in kw.items()})
    cupy.cuda.get_current_stream().synchronize()
    for (w, v), r in zip(base + lora, list(ref[0]) + list(ref[1])):
        w = w.get()
        assert (w[:GUARD] == POISON).all() and (w[-GUARD:] == POISON).all()
        np.testing.assert_array_equal(v.get(), np.asarray(r))
