"""``fill_tail=False``: every variant writes exactly the entries up to each row's total, and the
single-block and cooperative kernels nothing past it (GPU only; poisoned, guarded outputs)."""

import numpy as np
import pytest

import moe_lora_align as mla
from gpu_util import (GUARD, POISON, canonical, cupy, guarded, make_lora, make_routing,
                      requires_gpu, segment_starts)

pytestmark = [requires_gpu, pytest.mark.gpu]

CASES = [  # (T, E, K, B, max_loras, routing)
    (1, 64, 8, 16, 4, "uniform"), (3, 7, 8, 1, 1, "invalid"), (255, 256, 8, 16, 16, "hot"),
    (256, 512, 10, 16, 4, "skewed"), (4096, 128, 4, 64, 4, "uniform"),
    (16384, 256, 8, 64, 16, "uniform"), (65536, 64, 8, 64, 4, "skewed"), (0, 64, 8, 16, 4,
                                                                          "uniform")]


def _skips_tail(numel, E, B, rows, det, variant):
    """Whether the launch the dispatcher picks leaves the tail alone (count + place fills it)."""
    P, M = mla.buffer_sizes(numel, E, B)
    entries = mla._launch.entries_written(rows, numel, E, B, P, M, False)
    launch = mla._dispatch.choose_launch(numel, rows * E, rows, mla._launch.device_limits(0),
                                         deterministic=det, variant=variant,
                                         out_entries=entries, fill_tail=False)
    return launch.kind != "multi"


def check_without_tail(dev, host, starts, totals, numel, B, skipped, exact):
    """``dev``/``host``: (sorted [rows, P], experts [rows, M], totals [rows]) as NumPy; the host
    ran on the same poisoned buffers with ``fill_tail=False``, so it left every tail poisoned.
    Rows the call did not process (total still POISON) must be untouched on the device."""
    d_sorted, d_exp = dev[0].copy(), dev[1].copy()
    np.testing.assert_array_equal(dev[2], host[2])
    for r, t in enumerate(totals):
        if t == POISON:
            assert (d_sorted[r] == POISON).all() and (d_exp[r] == POISON).all(), f"row {r}"
            continue
        tail, tiles = d_sorted[r, t:], d_exp[r, t // B:]
        if skipped:
            assert (tail == POISON).all() and (tiles == POISON).all(), f"row {r} tail written"
        else:  # count + place still fill the tail, which the contract allows
            assert np.isin(tail, [POISON, numel]).all() and np.isin(tiles, [POISON, -1]).all()
        d_sorted[r, t:], d_exp[r, t // B:] = POISON, POISON
    if exact:
        np.testing.assert_array_equal(d_sorted, host[0])
    else:
        np.testing.assert_array_equal(canonical(d_sorted, starts), canonical(host[0], starts))
    np.testing.assert_array_equal(d_exp, host[1])


def _buffers(rows, P, M, xp):
    return [guarded([rows, P], xp), guarded([rows, M], xp), guarded([rows], xp)]


def _guards_intact(bufs):
    for whole, _ in bufs:
        w = cupy.asnumpy(whole)
        assert (w[:GUARD] == POISON).all() and (w[-GUARD:] == POISON).all()


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("variant", [None, "shared", "global", "cooperative"])
@pytest.mark.parametrize("T,E,K,B,L,kind", CASES)
@pytest.mark.parametrize("op", ["base", "lora"])
def test_each_variant_without_tail(op, T, E, K, B, L, kind, variant, det):
    rows = L if op == "lora" else 1
    try:
        skipped = _skips_tail(T * K, E, B, rows, det, variant)
    except ValueError as e:
        pytest.skip(f"{variant} cannot run this size: {e}")
    rng = np.random.default_rng(T * 31 + E + K + L)
    ids = make_routing(rng, T, K, E, np.int32, kind)
    mapping, lora_ids, enabled = make_lora(rng, T, L, disabled=1)
    P, M = mla.buffer_sizes(T * K, E, B)
    host, dev = _buffers(rows, P, M, np), _buffers(rows, P, M, cupy)
    kw = dict(fill_tail=False, deterministic=det)
    if op == "base":
        mla.moe_align_block_size(ids, B, E, out=[v[0] for _, v in host[:2]] + [host[2][1]],
                                 fill_tail=False)
        mla.moe_align_block_size(cupy.asarray(ids), B, E, variant=variant,
                                 out=[v[0] for _, v in dev[:2]] + [dev[2][1]], **kw)
        starts = segment_starts(ids, E, B)
    else:
        args = dict(lora_ids=lora_ids, adapter_enabled=enabled)
        mla.moe_lora_align_block_size(ids, mapping, B, E, L, out=[v for _, v in host],
                                      fill_tail=False, **args)
        mla.moe_lora_align_block_size(cupy.asarray(ids), cupy.asarray(mapping), B, E, L,
                                      variant=variant, out=[v for _, v in dev],
                                      **{k: cupy.asarray(v) for k, v in args.items()}, **kw)
        starts = segment_starts(ids, E, B, rows=L, mapping=mapping, lora_ids=lora_ids,
                                enabled=enabled)
    cupy.cuda.get_current_stream().synchronize()
    _guards_intact(dev)
    check_without_tail([cupy.asnumpy(v) for _, v in dev], [v for _, v in host], starts,
                       host[2][1], T * K, B, skipped, exact=det)


@pytest.mark.parametrize("streams", ["one", "two", "fused"])
@pytest.mark.parametrize("T,E,K,B,L,kind", CASES[:-1])
def test_together_without_tail(T, E, K, B, L, kind, streams):
    rng = np.random.default_rng(T + E * 3 + L)
    ids = make_routing(rng, T, K, E, np.int32, kind)
    mapping, lora_ids, enabled = make_lora(rng, T, L, disabled=1)
    P, M = mla.buffer_sizes(T * K, E, B)
    hb, hl = _buffers(1, P, M, np), _buffers(L, P, M, np)
    db, dl = _buffers(1, P, M, cupy), _buffers(L, P, M, cupy)
    flat = lambda bufs: [v[0] for _, v in bufs[:2]] + [bufs[2][1]]  # noqa: E731
    args = dict(lora_ids=lora_ids, adapter_enabled=enabled)
    try:
        mla.align_moe_and_lora(cupy.asarray(ids), cupy.asarray(mapping), B, E, L,
                               out_base=flat(db), out_lora=[v for _, v in dl], streams=streams,
                               fill_tail=False, **{k: cupy.asarray(v) for k, v in args.items()})
    except ValueError as e:
        assert streams == "fused", e
        pytest.skip(f"no fused launch at this size: {e}")
    mla.align_moe_and_lora(ids, mapping, B, E, L, out_base=flat(hb),
                           out_lora=[v for _, v in hl], fill_tail=False, **args)
    cupy.cuda.get_current_stream().synchronize()
    _guards_intact(db + dl)
    numel = T * K
    sides = ((db, hb, 1, segment_starts(ids, E, B)),
             (dl, hl, L, segment_starts(ids, E, B, rows=L, mapping=mapping, lora_ids=lora_ids,
                                        enabled=enabled)))
    for d, h, rows, starts in sides:
        skipped = streams == "fused" or _skips_tail(numel, E, B, rows, False, None)
        check_without_tail([cupy.asnumpy(v) for _, v in d], [v for _, v in h], starts,
                           h[2][1], numel, B, skipped, exact=False)


@pytest.mark.parametrize("T", [1, 255, 16384])
def test_plan_without_tail(T):
    """A plan with fill_tail=False: the head of every row matches the oracle call after call
    (its buffers keep the previous call's values past the totals), unprocessed rows total 0."""
    E, K, B, L = 256, 8, 16, 16
    plan = mla.AlignPlan(16384, K, E, B, max_loras=L, fill_tail=False)
    for seed in range(3):
        rng = np.random.default_rng(seed)
        ids = make_routing(rng, T, K, E, np.int32, "uniform")
        mapping, lora_ids, enabled = make_lora(rng, T, L, disabled=2)
        base, lora = plan(cupy.asarray(ids), cupy.asarray(mapping),
                          lora_ids=cupy.asarray(lora_ids), adapter_enabled=cupy.asarray(enabled))
        rb = mla.moe_align_block_size(ids, B, E)
        rl = mla.moe_lora_align_block_size(ids, mapping, B, E, L, lora_ids=lora_ids,
                                           adapter_enabled=enabled)
        cupy.cuda.get_current_stream().synchronize()
        for got, ref, rows, starts in (
                (base, rb, 1, segment_starts(ids, E, B)),
                (lora, rl, L, segment_starts(ids, E, B, rows=L, mapping=mapping,
                                             lora_ids=lora_ids, enabled=enabled))):
            g = [cupy.asnumpy(x).reshape(rows, -1) for x in got[:2]]
            r = [np.asarray(x).reshape(rows, -1) for x in ref[:2]]
            totals = np.asarray(ref[2]).reshape(-1)
            np.testing.assert_array_equal(cupy.asnumpy(got[2]).reshape(-1), totals)
            for row, t in enumerate(totals):
                head = np.array(g[0][row], dtype=np.int64)
                head[t:] = -1  # unspecified: compare the heads only
                want = np.array(r[0][row], dtype=np.int64)
                want[t:] = -1
                seg = starts[row:row + 1]
                np.testing.assert_array_equal(canonical(head[None], seg),
                                              canonical(want[None], seg))
                np.testing.assert_array_equal(g[1][row, :t // B], r[1][row, :t // B])
