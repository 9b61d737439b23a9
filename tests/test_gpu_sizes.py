"""Size sweep: bucket counts on both sides of every limit of the kernels, every variant, base
and LoRA, against the NumPy backend on poisoned, guarded out= buffers (GPU only).

The limits that depend on the device (shared memory, SM count) are found at run time from
``moe_lora_align._dispatch`` with the device's own limits: the largest expert count ``n``
that a kernel family accepts, then ``n`` and ``n + 1`` are both run. A forced variant that
the dispatcher refuses is skipped with its message. Cells whose id holds ``slow`` (large T
with many buckets) can be left out with ``-k "not slow"``; ``huge`` is the 8M-route case.
"""

import functools
import zlib

import numpy as np
import pytest

import fuzz_cases as fc
import moe_lora_align as mla
from gpu_util import cupy, make_lora, requires_gpu

pytestmark = [requires_gpu, pytest.mark.gpu]

VARIANTS = [None, "shared", "global", "cooperative", "cluster"]


# ---- limits of the device, from the dispatcher ---------------------------------------------
def _limits():
    return mla._launch.device_limits(0)


def _entries(numel, E, B, rows):
    P, M = mla.buffer_sizes(numel, E, B)
    return rows * (P + M)


def _launch(numel, E, rows, det, variant, B):
    """The dispatcher's launch for these sizes, or None where it refuses them."""
    try:
        return mla._dispatch.choose_launch(numel, rows * E, rows, _limits(), deterministic=det,
                                           variant=variant, out_entries=_entries(numel, E, B, rows))
    except ValueError:
        return None


def _largest(pred, lo, hi):
    """Largest x in [lo, hi] with pred(x), for pred true up to a point and false after."""
    if not pred(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if pred(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _top(rows):
    return mla.MAX_BUCKETS // rows


def _shared_max_experts(numel, rows, det, B):
    """Shared-histogram count + place (free order; deterministic mode tiles bucket ranges and
    has no such limit)."""
    helper = getattr(mla._dispatch, "shared_multi_max_buckets", None)
    if helper is not None:
        try:
            return int(helper(rows, _limits())) // rows
        except TypeError:
            pass
    return _largest(lambda E: _launch(numel, E, rows, False, "shared", B) is not None, 1,
                    _top(rows))


def _coop_max_experts(numel, rows, det, B):
    return _largest(lambda E: _launch(numel, E, rows, det, "cooperative", B) is not None,
                    1, _top(rows))


def _single_max_experts(numel, rows, det, B):
    helper = getattr(mla._dispatch, "single_max_buckets", None)
    if helper is not None:
        try:
            return int(helper(numel, rows, _limits(), deterministic=det)) // rows
        except TypeError:
            pass

    def single(E):
        launch = _launch(numel, E, rows, det, "shared", B)
        return launch is not None and launch.kind == "single"
    return _largest(single, 1, _top(rows))


def _tiny_max_experts(numel, rows, det, B):
    def tiny(E):
        launch = _launch(numel, E, rows, det, None, B)
        return launch is not None and launch.kind == "single" and launch.tiny
    return _largest(tiny, 1, min(2**16, _top(rows)))


def _default_single_max_experts(numel, rows, det, B):
    """The dispatcher's own switch from one block to the cooperative launch (at
    COOP_OVER_SINGLE_ENTRIES output entries), searched below the cooperative limit."""
    top = _coop_max_experts(numel, rows, det, B)
    if top is None:
        return None

    def single(E):
        launch = _launch(numel, E, rows, det, None, B)
        return launch is not None and launch.kind == "single"
    return _largest(single, 1, top)


BOUNDS = {"shared": _shared_max_experts, "coop": _coop_max_experts,
          "single": _single_max_experts, "tiny": _tiny_max_experts,
          "default-single": _default_single_max_experts}


# ---- the cells -----------------------------------------------------------------------------
# (name, T, K, B, rows (0: base), experts: an int or (bound, 0 | 1) for n | n + 1, det)
BASE = [
    # align_tiny: a thread per bucket up to 1024 buckets, four a thread up to 4096
    ("tiny", 64, 8, 16, 0, 1024, False), ("tiny", 64, 8, 16, 0, 1025, True),
    ("tiny", 1, 8, 16, 0, 1024, True), ("tiny", 1, 8, 16, 0, 1025, False),
    ("tiny", 64, 8, 32, 0, 4096, False), ("tiny", 64, 8, 32, 0, 4097, True),
    ("tiny", 1, 8, 32, 0, 4096, True), ("tiny", 1, 8, 32, 0, 4097, False),
    ("tiny-det", 255, 8, 16, 0, ("tiny", 0), True), ("tiny-det", 255, 8, 16, 0, ("tiny", 1), True),
    # one block: the largest histogram in shared memory (deterministic: with its counters)
    ("single", 64, 8, 64, 0, ("single", 0), False), ("single", 64, 8, 64, 0, ("single", 1), False),
    ("single-det", 64, 8, 64, 0, ("single", 0), True),
    ("single-det", 64, 8, 64, 0, ("single", 1), True),
    # the dispatcher's switch from one block to the cooperative launch
    ("default", 256, 8, 64, 0, ("default-single", 0), False),
    ("default", 256, 8, 64, 0, ("default-single", 1), False),
    # count + place: shared histograms up to shared memory, then global counters
    ("shared", 4096, 8, 16, 0, ("shared", 0), False),
    ("shared", 4096, 8, 16, 0, ("shared", 1), True),
    ("shared", 16384, 8, 16, 0, ("shared", 0), True),
    ("shared", 16384, 8, 16, 0, ("shared", 1), False),
    # cooperative: routes and 12 bytes a bucket in shared memory (deterministic: + counters)
    ("coop", 4096, 8, 64, 0, ("coop", 0), False), ("coop", 4096, 8, 64, 0, ("coop", 1), False),
    ("coop-det", 4096, 8, 64, 0, ("coop", 0), True),
    ("coop-det", 4096, 8, 64, 0, ("coop", 1), True),
    ("coop-slow", 65536, 8, 64, 0, ("coop", 0), False),
    ("coop-slow", 65536, 8, 64, 0, ("coop", 1), False),
    # many buckets
    ("b32768", 4096, 8, 16, 0, 32768, False), ("b32768", 16384, 8, 16, 0, 32768, True),
    ("b65536", 64, 8, 16, 0, 65536, False), ("b65536", 4096, 8, 16, 0, 65536, True),
    ("b131072", 64, 8, 16, 0, 131072, True), ("b131072", 4096, 8, 16, 0, 131072, False),
    ("b131072-slow", 16384, 8, 16, 0, 131072, False),
    # zero tokens
    ("T0", 0, 8, 16, 0, 1025, False), ("T0", 0, 8, 16, 0, 32768, True),
    ("T0", 0, 8, 16, 0, 131072, False),
    # many tokens
    ("T65536", 65536, 8, 64, 0, 256, False), ("T65536", 65536, 8, 64, 0, 256, True),
    ("T65536-slow", 65536, 8, 128, 0, 8192, False),
]
LORA = [
    ("tiny", 64, 8, 16, 4, 256, False), ("tiny", 64, 8, 16, 5, 205, True),      # 1024 | 1025
    ("tiny", 1, 8, 16, 1, 1024, True), ("tiny", 1, 8, 16, 1, 1025, False),
    ("tiny", 16, 8, 16, 16, 256, False), ("tiny", 16, 8, 16, 17, 241, True),    # 4096 | 4097
    ("tiny", 1, 8, 16, 16, 256, True), ("tiny", 1, 8, 16, 17, 241, False),
    ("tiny-det", 255, 8, 16, 4, ("tiny", 0), True), ("tiny-det", 255, 8, 16, 4, ("tiny", 1), True),
    ("single", 16, 8, 16, 16, ("single", 0), False),
    ("single", 16, 8, 16, 16, ("single", 1), False),
    ("single-det", 16, 8, 16, 16, ("single", 0), True),
    ("single-det", 16, 8, 16, 16, ("single", 1), True),
    ("single", 64, 8, 16, 64, ("single", 0), False), ("single", 64, 8, 16, 64, ("single", 1), True),
    ("default", 16, 8, 64, 16, ("default-single", 0), False),
    ("default", 16, 8, 64, 16, ("default-single", 1), False),
    ("shared", 64, 8, 16, 8, ("shared", 0), False), ("shared", 64, 8, 16, 8, ("shared", 1), True),
    ("shared", 4096, 8, 16, 64, ("shared", 0), True),
    ("shared", 4096, 8, 16, 64, ("shared", 1), False),
    ("coop", 4096, 8, 16, 16, ("coop", 0), False), ("coop", 4096, 8, 16, 16, ("coop", 1), False),
    ("coop-det", 4096, 8, 16, 4, ("coop", 0), True),
    ("coop-det", 4096, 8, 16, 4, ("coop", 1), True),
    # 32768 buckets (these crashed with CUDA_ERROR_INVALID_VALUE before)
    ("b32768", 4096, 8, 16, 32, 1024, False), ("b32768", 4096, 8, 16, 16, 2048, True),
    ("b32768", 4096, 8, 16, 8, 4096, False), ("b32768", 16384, 8, 16, 32, 1024, True),
    ("b32768", 16384, 8, 16, 16, 2048, False), ("b32768", 16384, 8, 16, 8, 4096, False),
    ("b65536", 4096, 8, 16, 16, 4096, False), ("b65536", 4096, 8, 16, 64, 1024, True),
    ("b65536", 64, 8, 16, 8, 8192, False),
    ("b131072", 4096, 8, 16, 64, 2048, False), ("b131072", 4096, 8, 16, 16, 8192, True),
    ("b131072", 64, 8, 16, 64, 2048, False),
    ("b131072-slow", 16384, 8, 16, 64, 2048, False),
    ("b131072-slow", 16384, 8, 16, 16, 8192, True),
    ("T0", 0, 8, 16, 16, 2048, False), ("T0", 0, 8, 16, 64, 2048, True),
    ("T0", 0, 8, 16, 64, 1, False),
    ("T65536-slow", 65536, 8, 64, 16, 256, False),
    ("T65536-slow", 65536, 8, 64, 16, 256, True),
]


def _cell_id(cell, variant):
    name, T, K, B, rows, E, det = cell
    e = E if isinstance(E, int) else f"{E[0]}{'+1' if E[1] else ''}"
    side = f"lora{rows}x{e}" if rows else f"base-E{e}"
    return f"{name}-{side}-T{T}-K{K}-B{B}-{'det' if det else 'free'}-{variant or 'default'}"


PARAMS = [(c, v) for c in BASE + LORA for v in VARIANTS]


@functools.lru_cache(maxsize=None)
def _experts(cell):
    name, T, K, B, rows, E, det = cell
    if isinstance(E, int):
        return E
    bound, side = E
    n = BOUNDS[bound](T * K, max(rows, 1), det, B)
    if n is None:
        pytest.skip(f"no {bound} limit at these sizes on this device")
    return n + side


@functools.lru_cache(maxsize=1)  # the four variants of a cell run one after another
def _reference(cell):
    case = _case(cell)
    return case, fc.execute(case, np, gpu_side=False)


def _case(cell):
    name, T, K, B, rows, _, det = cell
    E = _experts(cell)
    rng = np.random.default_rng(zlib.crc32(_cell_id(cell, None).encode()))
    kind = "hot" if (T + E) % 3 == 0 else "uniform"
    if kind == "hot":
        hot = rng.integers(E, size=4)
        ids = hot[rng.integers(4, size=(T, K))]
    else:
        ids = rng.integers(E, size=(T, K))
    ids[rng.random((T, K)) < 0.05] = E  # a few invalid routes
    case = fc.Case(mode="lora" if rows else "base", T=T, K=K, E=E, B=B, dtype="int32",
                   kind=kind, max_loras=rows, det=det, out=True,
                   topk_ids=ids.astype(np.int32), seed="sizes", index=_cell_id(cell, None))
    if rows:
        # one slot disabled (its rows keep the poison) where there are a few to process
        case.mapping, case.lora_ids, case.enabled = make_lora(rng, T, rows,
                                                              disabled=int(rows >= 4))
        case.mapping_kind, case.lora_ids_kind, case.enabled_kind = "random", "engine0", "some_off"
        case.out_layout = "wide" if T % 2 else "exact"
        case.extra = 3 if T % 2 else 0
    else:
        case.scatter = T % 3 == 1
    return case


def _check(cell, variant):
    case, want = _reference(cell)
    case = fc.Case(**{**case.__dict__, "variant": variant})
    try:
        got = fc.execute(case, cupy, gpu_side=True)
    except fc.Refused as e:
        pytest.skip(f"{variant} refused: {e}")
    try:
        fc.compare(case, got, want)
    except fc.CaseFailure as e:
        raise AssertionError(f"{fc.describe(case)}: {e}") from None


@pytest.mark.parametrize("cell,variant", PARAMS, ids=[_cell_id(c, v) for c, v in PARAMS])
def test_size(cell, variant):
    _check(cell, variant)


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
def test_huge_8M_routes(det):
    """T=1048576, K=8, E=256: 8M routes, base, the dispatcher's choice (count + place)."""
    cell = ("huge", 1 << 20, 8, 64, 0, 256, det)
    try:
        _check(cell, None)
    finally:
        _reference.cache_clear()  # 8M routes: do not keep them
