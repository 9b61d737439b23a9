"""The documented limits on the GPU: the largest routes and buckets, the scratch formula, the
former 32768-bucket crash, and device-side errors leaving caller buffers untouched."""

import numpy as np
import pytest

import moe_lora_align as mla
from gpu_util import GUARD, POISON, canonical, cupy, guarded, make_lora, requires_gpu, \
    segment_starts

pytestmark = [requires_gpu, pytest.mark.gpu]


def _compare_base(ids, E, B, **kw):
    P, M = mla.buffer_sizes(ids.size, E, B)
    ref = mla.moe_align_block_size(ids, B, E)
    dev = [guarded([n], cupy) for n in (P, M, 1)]
    mla.moe_align_block_size(cupy.asarray(ids), B, E, out=[v for _, v in dev], **kw)
    cupy.cuda.get_current_stream().synchronize()
    for w, _ in dev:
        w = w.get()
        assert (w[:GUARD] == POISON).all() and (w[-GUARD:] == POISON).all()
    starts = segment_starts(ids, E, B)
    got = [v.get() for _, v in dev]
    np.testing.assert_array_equal(canonical(got[0][None], starts),
                                  canonical(np.asarray(ref[0])[None], starts))
    np.testing.assert_array_equal(got[1], ref[1])
    np.testing.assert_array_equal(got[2], ref[2])


def test_largest_routes():
    rng = np.random.default_rng(5)
    K = 8
    ids = rng.integers(-2, 258, size=(mla.MAX_ROUTES // K, K)).astype(np.int32)
    _compare_base(ids, 256, 64)


@pytest.mark.parametrize("variant", [None, "global"])
def test_largest_buckets_base(variant):
    rng = np.random.default_rng(6)
    ids = rng.integers(0, mla.MAX_BUCKETS, size=(4096, 8)).astype(np.int32)
    _compare_base(ids, mla.MAX_BUCKETS, 16, variant=variant)


@pytest.mark.parametrize("experts,slots,tokens", [(1024, 32, 4096), (2048, 16, 16384),
                                                  (4096, 8, 4096), (16384, 64, 64)])
@pytest.mark.parametrize("variant", [None, "global", "shared"])
def test_former_crash_sizes(experts, slots, tokens, variant):
    """max_loras * num_experts = 32768 (and 1M) crashed with CUDA_ERROR_INVALID_VALUE."""
    rng = np.random.default_rng(experts + slots)
    K, B = 8, 64
    ids = rng.integers(0, experts, size=(tokens, K)).astype(np.int32)
    mapping, lora_ids, enabled = make_lora(rng, tokens, slots, disabled=1)
    args = (cupy.asarray(ids), cupy.asarray(mapping), B, experts, slots)
    kw = dict(lora_ids=cupy.asarray(lora_ids), adapter_enabled=cupy.asarray(enabled))
    try:
        got = mla.moe_lora_align_block_size(*args, variant=variant, **kw)
    except ValueError as e:
        assert variant == "shared" and "variant='shared' cannot run" in str(e)
        return
    ref = mla.moe_lora_align_block_size(ids, mapping, B, experts, slots, lora_ids=lora_ids,
                                        adapter_enabled=enabled)
    starts = segment_starts(ids, experts, B, rows=slots, mapping=mapping, lora_ids=lora_ids,
                            enabled=enabled)
    g = [a.get() for a in got]
    np.testing.assert_array_equal(canonical(g[0], starts), canonical(ref[0], starts))
    np.testing.assert_array_equal(g[1], ref[1])
    np.testing.assert_array_equal(g[2], ref[2])


@pytest.mark.parametrize("numel,E,rows,det", [(8, 256, None, False), (32768, 256, None, True),
                                              (131072, 4096, 16, False),
                                              (4096 * 8, 256, 16, True)])
def test_scratch_bytes_is_what_a_fresh_stream_allocates(numel, E, rows, det):
    B = 64
    rng = np.random.default_rng(numel)
    ids = cupy.asarray(rng.integers(0, E, size=(numel // 8, 8)).astype(np.int32))
    P, M = mla.buffer_sizes(numel, E, B)
    r = rows or 1
    out = [cupy.zeros(n, np.int32) for n in (r * P, r * M, r)]
    mapping = cupy.asarray(rng.integers(-1, r, size=numel // 8).astype(np.int32))
    stream = cupy.cuda.Stream(non_blocking=True)
    # A new stream gets a new workspace (one left under a reused handle is dropped first).
    mla._launch._workspaces.pop((0, stream.ptr, "base"), None)
    cupy.cuda.Device().synchronize()
    if rows is None:
        mla.moe_align_block_size(ids, B, E, out=out, deterministic=det, stream=stream)
    else:
        mla.moe_lora_align_block_size(ids, mapping, B, E, rows, out=out, deterministic=det,
                                      stream=stream)
    stream.synchronize()
    used = mla._launch._workspaces[(0, stream.ptr, "base")].buf.nbytes
    assert used == mla.scratch_bytes(numel, E, B, max_loras=rows, deterministic=det)


def test_device_errors_leave_buffers_untouched():
    ids = cupy.asarray(np.arange(64, dtype=np.int32).reshape(8, 8) % 8)
    P, M = mla.buffer_sizes(64, 8, 4)
    whole = cupy.full(P + M + 1, POISON, np.int32)
    for out in ([whole[:P], whole[P - 1:P - 1 + M], whole[-1:]],  # overlapping
                [whole[:P], whole[P:P + M], None]):                 # a None
        with pytest.raises((ValueError, TypeError)):
            mla.moe_align_block_size(ids, 4, 8, out=out)
    mapping = cupy.zeros(8, np.int32)
    with pytest.raises(ValueError, match="variant='shared' cannot run"):
        mla.moe_lora_align_block_size(ids, mapping, 4, 16384, 64, variant="shared",
                                      out=[cupy.full(64 * n, POISON, np.int32)
                                           for n in mla.buffer_sizes(64, 16384, 4)] +
                                      [cupy.full(64, POISON, np.int32)])
    cupy.cuda.Device().synchronize()
    assert (whole == POISON).all()
