"""Base + LoRA together: the fused launch, the two-stream fork/join, stream order, AlignPlan and
CUDA graph capture (GPU only)."""

import numpy as np
import pytest

import moe_lora_align as mla
from gpu_util import (CLUSTER_ROWS_PAIR, CLUSTER_ROWS_PAIR_CASES, canonical, cupy,
                      delayed_copy, make_lora, make_routing, requires_gpu, segment_starts)

pytestmark = [requires_gpu, pytest.mark.gpu]

SIZES = [  # (tokens, experts, topk, block, max_loras): decode and prefill
    (1, 64, 8, 16, 4), (255, 256, 8, 16, 16), (4096, 128, 4, 64, 4), (16384, 256, 8, 64, 16)]


def _inputs(T, E, K, max_loras, seed=0, disabled=1):
    rng = np.random.default_rng(seed)
    ids = make_routing(rng, T, K, E, np.int32, "uniform")
    mapping, lora_ids, enabled = make_lora(rng, T, max_loras, disabled=disabled)
    return ids, mapping, lora_ids, enabled


def _expect(ids, mapping, lora_ids, enabled, B, E, max_loras):
    base = mla.moe_align_block_size(ids, B, E)
    lora = mla.moe_lora_align_block_size(ids, mapping, B, E, max_loras, lora_ids=lora_ids,
                                         adapter_enabled=enabled)
    return base, lora


def _check(got_base, got_lora, ids, mapping, lora_ids, enabled, B, E, max_loras, *,
           exact=False):
    """Both sides as the NumPy backend's: segments in any order, or (``exact``, the
    deterministic calls) bit for bit."""
    base, lora = _expect(ids, mapping, lora_ids, enabled, B, E, max_loras)
    if exact:
        for a, b in zip(list(got_base) + list(got_lora), list(base) + list(lora)):
            np.testing.assert_array_equal(cupy.asnumpy(a), b)
        return
    sb = segment_starts(ids, E, B)
    sl = segment_starts(ids, E, B, rows=max_loras, mapping=mapping, lora_ids=lora_ids,
                        enabled=enabled)
    g = [cupy.asnumpy(x) for x in got_base]
    np.testing.assert_array_equal(canonical(g[0][None], sb), canonical(base[0][None], sb))
    np.testing.assert_array_equal(g[1], base[1])
    np.testing.assert_array_equal(g[2], base[2])
    g = [cupy.asnumpy(x) for x in got_lora]
    np.testing.assert_array_equal(canonical(g[0], sl), canonical(lora[0], sl))
    np.testing.assert_array_equal(g[1], lora[1])
    np.testing.assert_array_equal(g[2], lora[2])


@pytest.mark.parametrize("streams", [None, "one", "two", "fused"])
@pytest.mark.parametrize("T,E,K,B,L", SIZES)
def test_together_equals_separate(T, E, K, B, L, streams):
    ids, mapping, lora_ids, enabled = _inputs(T, E, K, L)
    args = dict(lora_ids=cupy.asarray(lora_ids), adapter_enabled=cupy.asarray(enabled))
    base, lora = mla.align_moe_and_lora(cupy.asarray(ids), cupy.asarray(mapping), B, E, L,
                                        streams=streams, **args)
    cupy.cuda.get_current_stream().synchronize()
    _check(base, lora, ids, mapping, lora_ids, enabled, B, E, L)


@pytest.mark.parametrize("streams", ["one", "two", "fused"])
@pytest.mark.parametrize("variant", ["shared", "cooperative"])
@pytest.mark.parametrize("T,E,K,B,L", [(16384, 256, 8, 64, 16), (3, 64, 8, 16, 4),
                                       (65536, 64, 8, 64, 4)])
def test_together_each_variant(T, E, K, B, L, variant, streams):
    """Base + LoRA through count + place (or one block each) and through the cooperative
    kernels: on one stream, forked onto two (two cooperative launches may then run at once)
    and fused (one cooperative launch split between base and LoRA)."""
    if variant == "shared" and streams == "fused" and T * K > 4096:
        with pytest.raises(ValueError, match="fused"):
            mla.align_moe_and_lora(cupy.zeros((T, K), np.int32), cupy.zeros(T, np.int32), B,
                                   E, L, streams=streams, variant=variant)
        return
    ids, mapping, lora_ids, enabled = _inputs(T, E, K, L, seed=9)
    for _ in range(3):  # the cooperative kernel's count buffers alternate between calls
        base, lora = mla.align_moe_and_lora(cupy.asarray(ids), cupy.asarray(mapping), B, E, L,
                                            lora_ids=cupy.asarray(lora_ids),
                                            adapter_enabled=cupy.asarray(enabled),
                                            streams=streams, variant=variant)
        cupy.cuda.get_current_stream().synchronize()
        _check(base, lora, ids, mapping, lora_ids, enabled, B, E, L)


@pytest.mark.parametrize("T,E,K,B,L", SIZES[:2] + [(3, 7, 2, 1, 16), (64, 1024, 8, 16, 1),
                                       (16, 256, 8, 16, 16)])
def test_fused_decode_with_and_without_tiny(T, E, K, B, L):
    """The fused decode launch as two align_tiny blocks and as two align_single blocks."""
    ids, mapping, lora_ids, enabled = _inputs(T, E, K, L, seed=4)
    for tiny in (True, False):
        base, lora = mla.align_moe_and_lora(cupy.asarray(ids), cupy.asarray(mapping), B, E, L,
                                            lora_ids=cupy.asarray(lora_ids),
                                            adapter_enabled=cupy.asarray(enabled),
                                            streams="fused",
                                            policy=mla.AlignPolicy(use_tiny=tiny))
        cupy.cuda.get_current_stream().synchronize()
        _check(base, lora, ids, mapping, lora_ids, enabled, B, E, L)


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("how", ["fill_blocks", "no_fill_blocks", "row_blocks"])
@pytest.mark.parametrize("T,E,K,B,L", [(16, 256, 8, 16, 16), (5, 64, 8, 16, 16),
                                       (64, 128, 8, 16, 4), (255, 64, 8, 16, 16),
                                       (5, 64, 8, 128, 33)])
def test_fused_tiny_pair_with_and_without_fill_blocks(T, E, K, B, L, how, det):
    """The fused tiny pair with its LoRA side's fill blocks (blocks 2.. of a cooperative
    launch) and without, or with a block a LoRA row after the base block (33 rows too),
    each asked for by its policy, also one block up to any fill size; the result as two
    separate calls', and deterministic bit for bit."""
    fill, rows = how == "fill_blocks", how == "row_blocks"
    policy = mla.AlignPolicy(tiny_fill_blocks_from=0 if fill else 1 << 62,
                             tiny_fill_blocks_one_row_from=0 if fill else 1 << 62,
                             coop_over_single_entries=1 << 30,
                             coop_over_filled_single_entries=1 << 30, tiny_row_blocks=rows,
                             tiny_row_blocks_min_routes=1, tiny_row_blocks_max_rows=64)
    P, M = mla.buffer_sizes(T * K, E, B)
    launch = mla._dispatch.choose_pair(T * K, E, L * E, L, mla._launch.device_limits(0),
                                       deterministic=det, out_entries=L * (P + M),
                                       policy=policy)
    assert launch is not None and launch.tiny and bool(launch.fill_grid) == fill
    assert launch.row_blocks == rows
    ids, mapping, lora_ids, enabled = _inputs(T, E, K, L, seed=5, disabled=2)
    for with_ids in (True, False):
        args = dict(lora_ids=cupy.asarray(lora_ids) if with_ids else None,
                    adapter_enabled=cupy.asarray(enabled))
        base, lora = mla.align_moe_and_lora(cupy.asarray(ids), cupy.asarray(mapping), B, E, L,
                                            streams="fused", deterministic=det,
                                            policy=policy, **args)
        cupy.cuda.get_current_stream().synchronize()
        listed = lora_ids if with_ids else None
        _check(base, lora, ids, mapping, listed, enabled, B, E, L, exact=det)


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("over", [False, True], ids=["cluster_pair", "row_pair"])
@pytest.mark.parametrize("T,L", [(288, 4), (512, 2)])
def test_pair_row_blocks_over_cluster(T, L, over, det):
    """Pairs of 2304 and 4096 routes whose LoRA side takes a block a row: the cluster pair,
    or (pair_row_blocks_over_cluster_max_routes) base in block 0 and a block a row after it."""
    E, K, B = 256, 8, 16
    policy = mla.AlignPolicy(pair_row_blocks_over_cluster_max_routes=(1 << 30) if over else 0)
    ids, mapping, lora_ids, enabled = _inputs(T, E, K, L, seed=7, disabled=1)
    base, lora = mla.align_moe_and_lora(cupy.asarray(ids), cupy.asarray(mapping), B, E, L,
                                        lora_ids=cupy.asarray(lora_ids),
                                        adapter_enabled=cupy.asarray(enabled),
                                        streams="fused", deterministic=det, policy=policy)
    cupy.cuda.get_current_stream().synchronize()
    _check(base, lora, ids, mapping, lora_ids, enabled, B, E, L, exact=det)


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("T,E,K,B,L", CLUSTER_ROWS_PAIR_CASES)
def test_fused_pair_with_row_clusters(T, E, K, B, L, det):
    """Base on cluster 0 and a cluster a LoRA row after it (align_cluster_rows_pair,
    gpu_util.CLUSTER_ROWS_PAIR), fused: both sides as the NumPy backend's (sm_90 and newer)."""
    if not mla._launch.device_limits(0).clusters:
        pytest.skip("clusters need sm_90 or newer")
    ids, mapping, lora_ids, enabled = _inputs(T, E, K, L, seed=11, disabled=1)
    base, lora = mla.align_moe_and_lora(cupy.asarray(ids), cupy.asarray(mapping), B, E, L,
                                        lora_ids=cupy.asarray(lora_ids),
                                        adapter_enabled=cupy.asarray(enabled),
                                        streams="fused", deterministic=det,
                                        policy=CLUSTER_ROWS_PAIR)
    cupy.cuda.get_current_stream().synchronize()
    _check(base, lora, ids, mapping, lora_ids, enabled, B, E, L, exact=det)


def test_fused_refuses_a_deterministic_prefill_no_pair_kernel_holds():
    """Deterministic prefill fuses into one cooperative launch (test_gpu_kernels:
    test_cooperative_pair_deterministic), except where both sides would sort their
    segments: no instance of the pair kernel does that, so streams='fused' refuses."""
    with pytest.raises(ValueError, match="fused"):
        mla.align_moe_and_lora(cupy.zeros((8192, 8), np.int32), cupy.zeros(8192, np.int32), 64,
                               256, 16, streams="fused", deterministic=True,
                               policy=mla.AlignPolicy(sort_min_buckets=0))


@pytest.mark.parametrize("tiny", [True, False], ids=["tiny", "single"])
@pytest.mark.parametrize("T,E,K,B,L", [(255, 64, 8, 16, 4), (1, 64, 8, 16, 4),
                                       (16, 256, 8, 16, 16), (3, 7, 2, 1, 16)])
def test_together_deterministic_is_exact(T, E, K, B, L, tiny):
    """Deterministic base + LoRA, fused (two align_tiny or two align_single blocks), on two
    streams and on one: bit-identical to the NumPy backend."""
    policy = mla.AlignPolicy(use_tiny=tiny)
    ids, mapping, lora_ids, enabled = _inputs(T, E, K, L, seed=3)
    for streams in ("fused", "two", "one"):
        base, lora = mla.align_moe_and_lora(cupy.asarray(ids), cupy.asarray(mapping), B, E, L,
                                            lora_ids=cupy.asarray(lora_ids),
                                            adapter_enabled=cupy.asarray(enabled),
                                            streams=streams, deterministic=True,
                                            policy=policy)
        _check(base, lora, ids, mapping, lora_ids, enabled, B, E, L, exact=True)




@pytest.mark.parametrize("streams", ["two", "fused", "one"])
def test_caller_stream_order(streams):
    """Work queued on a non-default caller stream before the call is seen by the alignment,
    and work queued after it sees the results."""
    T, E, K, B, L = 16384, 256, 8, 64, 16
    # every slot processed: the out= rows of unprocessed slots would keep their old zeros
    ids, mapping, lora_ids, enabled = _inputs(T, E, K, L, seed=5, disabled=0)
    caller = cupy.cuda.Stream(non_blocking=True)
    with caller:
        src = cupy.asarray(ids)
        d_ids = cupy.full_like(src, E + 1)  # all invalid until the late producer lands
        d_map, d_lora, d_en = (cupy.asarray(x) for x in (mapping, lora_ids, enabled))
        P, M = mla.buffer_sizes(T * K, E, B)
        out_b = [cupy.zeros(P, np.int32), cupy.zeros(M, np.int32), cupy.zeros(1, np.int32)]
        out_l = [cupy.zeros((L, P), np.int32), cupy.zeros((L, M), np.int32),
                 cupy.zeros(L, np.int32)]
        mla.align_moe_and_lora(d_ids, d_map, B, E, L, lora_ids=d_lora, adapter_enabled=d_en,
                               out_base=out_b, out_lora=out_l)  # warm-up: compile, workspace
        caller.synchronize()
        delayed_copy(src.reshape(-1), d_ids.reshape(-1), 20_000_000)
        mla.align_moe_and_lora(d_ids, d_map, B, E, L, lora_ids=d_lora, adapter_enabled=d_en,
                               out_base=out_b, out_lora=out_l, streams=streams)
        seen_b = [cupy.empty_like(x) for x in out_b]
        seen_l = [cupy.empty_like(x) for x in out_l]
        for s, d in zip(out_b + out_l, seen_b + seen_l):
            delayed_copy(s.reshape(-1), d.reshape(-1), 0)
    caller.synchronize()
    _check(seen_b, seen_l, ids, mapping, lora_ids, enabled, B, E, L)


# ---- AlignPlan -----------------------------------------------------------------------------
def test_plan_reuse_across_sizes():
    E, K, B, L = 128, 8, 64, 8
    plan = mla.AlignPlan(8192, K, E, B, max_loras=L)
    rng = np.random.default_rng(7)
    for T in (8192, 1, 0, 3, 255, 4096, 17, 8192, 300):
        ids = make_routing(rng, T, K, E, np.int32, "hot" if T % 2 else "uniform")
        mapping, lora_ids, enabled = make_lora(rng, T, L, disabled=2)
        base, lora = plan(cupy.asarray(ids), cupy.asarray(mapping),
                          lora_ids=cupy.asarray(lora_ids), adapter_enabled=cupy.asarray(enabled))
        cupy.cuda.get_current_stream().synchronize()
        _check(base, lora, ids, mapping, lora_ids, enabled, B, E, L)


@pytest.mark.parametrize("streams", [None, "one", "two", "fused"])
@pytest.mark.parametrize("T,E,K,B,L", [(1, 64, 8, 16, 4), (255, 256, 8, 16, 16),
                                       (4096, 128, 4, 64, 4)])
def test_plan_replayed_calls_see_new_inputs(T, E, K, B, L, streams):
    """Calls after the first replay its launches: fresh arrays (new addresses), new values,
    other streams, outputs poisoned in between; every result equals the oracle's."""
    plan = mla.AlignPlan(T, K, E, B, max_loras=L, streams=streams)
    s1, s2 = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    for seed, stream in zip(range(30, 36), (s1, s2, s1, None, s2, s1)):
        ids, mapping, lora_ids, enabled = _inputs(T, E, K, L, seed=seed)
        d = [cupy.asarray(x) for x in (ids, mapping, lora_ids, enabled)]
        cupy.cuda.Device().synchronize()
        base, lora = plan(d[0], d[1], lora_ids=d[2], adapter_enabled=d[3], stream=stream)
        cupy.cuda.Device().synchronize()
        _check(base, lora, ids, mapping, lora_ids, enabled, B, E, L)
        for x in (*base, *lora):
            x.fill(-5)
    assert len(plan._prepared) == 3  # one prepared call a stream (s1, s2, the current one)


def test_plan_replays_keep_each_call_kind_apart():
    """Base-only plan: sizes and expert-map use interleaved, each replaying its own launches."""
    E, K, B = 32, 4, 16
    plan = mla.AlignPlan(256, K, E, B, ignore_invalid_experts=True)
    rng = np.random.default_rng(41)
    emap = np.full(E, -1, np.int32)
    local = rng.choice(E, size=E // 2, replace=False)
    emap[local] = np.arange(local.size, dtype=np.int32)
    for T, use_map in [(64, False), (64, True), (64, False), (17, True), (64, True),
                       (17, False), (64, False), (17, True), (256, False), (64, True)]:
        ids = make_routing(rng, T, K, E, np.int32, "invalid")
        m = emap if use_map else None
        got = plan(cupy.asarray(ids), expert_map=None if m is None else cupy.asarray(m))
        cupy.cuda.Device().synchronize()
        ref = mla.moe_align_block_size(ids, B, E, expert_map=m, ignore_invalid_experts=True)
        st = segment_starts(ids, E, B, expert_map=m, map_before=True)
        g = [cupy.asnumpy(x) for x in got]
        np.testing.assert_array_equal(canonical(g[0][None], st), canonical(ref[0][None], st))
        np.testing.assert_array_equal(g[1], ref[1])
        np.testing.assert_array_equal(g[2], ref[2])
        for x in got:
            x.fill(-5)
    assert len(plan._prepared) == 5  # (64 | 17 | 256) x (map | none), 256 with a map unseen


def test_plan_rejects_inputs_beyond_it():
    plan = mla.AlignPlan(64, 8, 32, 16)
    with pytest.raises(ValueError, match="max_tokens"):
        plan(cupy.zeros((65, 8), np.int32))
    with pytest.raises(ValueError, match="topk"):
        plan(cupy.zeros((4, 4), np.int32))
    with pytest.raises(TypeError, match="int32"):
        plan(cupy.zeros((4, 8), np.int64))
    with pytest.raises(ValueError, match="GPU"):
        plan(np.zeros((4, 8), np.int32))


@pytest.mark.parametrize("streams", [None, "two", "one"])
@pytest.mark.parametrize("T,E,K,B,L", [(64, 128, 8, 16, 4), (8192, 256, 8, 64, 16)])
def test_plan_graph_capture_replays_new_inputs(T, E, K, B, L, streams):
    plan = mla.AlignPlan(T, K, E, B, max_loras=L, streams=streams)
    ids, mapping, lora_ids, enabled = _inputs(T, E, K, L, seed=9)
    d = [cupy.asarray(x) for x in (ids, mapping, lora_ids, enabled)]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        plan(d[0], d[1], lora_ids=d[2], adapter_enabled=d[3], stream=stream)  # warm-up
        stream.synchronize()
        stream.begin_capture()
        base, lora = plan(d[0], d[1], lora_ids=d[2], adapter_enabled=d[3], stream=stream)
        graph = stream.end_capture()
        for seed in (10, 11, 12):
            ids, mapping, lora_ids, enabled = _inputs(T, E, K, L, seed=seed)
            for dst, src in zip(d, (ids, mapping, lora_ids, enabled)):
                dst.set(src, stream=stream)
            base[0].fill(-5)  # poison between replays
            lora[0].fill(-5)
            graph.launch(stream)
            stream.synchronize()
            _check(base, lora, ids, mapping, lora_ids, enabled, B, E, L)


def _capture_and_replay(stream, call, refill):
    """Warm ``call`` up, capture it on ``stream``, run ``refill`` (new input values in the
    same buffers), replay the graph; returns what the captured call returned."""
    with stream:
        call()
        stream.synchronize()
        stream.begin_capture()
        res = call()
        graph = stream.end_capture()
        refill()
        graph.launch(stream)
        stream.synchronize()
    return res


def test_plan_base_only_graph_capture():
    T, E, K, B = 256, 256, 8, 16
    plan = mla.AlignPlan(T, K, E, B, deterministic=True)
    rng = np.random.default_rng(21)
    d_ids = cupy.asarray(make_routing(rng, T, K, E))
    stream = cupy.cuda.Stream(non_blocking=True)
    ids = make_routing(rng, T, K, E)
    res = _capture_and_replay(stream, lambda: plan(d_ids, stream=stream),
                              lambda: d_ids.set(ids, stream=stream))
    ref = mla.moe_align_block_size(ids, B, E)
    for a, b in zip(res, ref):
        np.testing.assert_array_equal(cupy.asnumpy(a), b)


def test_public_function_under_capture_points_to_the_plan():
    ids = cupy.zeros((16, 8), np.int32)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        mla.moe_align_block_size(ids, 16, 64)
        stream.synchronize()
        stream.begin_capture()
        try:
            with pytest.raises(RuntimeError, match="AlignPlan"):
                mla.moe_align_block_size(ids, 16, 64)
        finally:
            stream.end_capture()


def test_public_function_with_out_buffers_captures():
    T, E, K, B = 4096, 64, 8, 64
    rng = np.random.default_rng(31)
    d_ids = cupy.asarray(make_routing(rng, T, K, E))
    P, M = mla.buffer_sizes(T * K, E, B)
    out = [cupy.empty(P, np.int32), cupy.empty(M, np.int32), cupy.empty(1, np.int32)]
    stream = cupy.cuda.Stream(non_blocking=True)
    ids = make_routing(rng, T, K, E)
    _capture_and_replay(stream,
                        lambda: mla.moe_align_block_size(d_ids, B, E, out=out,
                                                         deterministic=True),
                        lambda: d_ids.set(ids, stream=stream))
    ref = mla.moe_align_block_size(ids, B, E)
    for a, b in zip(out, ref):
        np.testing.assert_array_equal(cupy.asnumpy(a), b)
