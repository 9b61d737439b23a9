"""Device arrays with hostile values and validate=False (GPU only).

token_lora_mapping far outside [-1, max_loras), lora_ids with out-of-range and repeated
entries (and garbage past its first max_loras + 1 entries), adapter_enabled with arbitrary
ints, expert_map entries outside [-1, E), 64-bit ids far outside [0, E) (some whose low 32
bits are valid ids): every variant must leave the guard zones and the rows it does not process
exactly as the caller's out= buffers held them, and compute what the contract reads from those
values: a token with an out-of-range slot is in no row, a route whose expert maps outside
[-1, E) is dropped, an out-of-range lora_ids entry is skipped, a repeated one lists its slot
once more. The expectation is the NumPy backend on inputs sanitised to exactly that
(``fuzz_cases.sanitised``); with the map applied after counting (base,
``ignore_invalid_experts=False``) the tiles read the map's raw entry.
"""

import numpy as np
import pytest

import fuzz_cases as fc
import moe_lora_align as mla
from gpu_util import GUARD, POISON, cupy, guarded, requires_gpu

pytestmark = [requires_gpu, pytest.mark.gpu]

VARIANTS = [None, "shared", "global", "cooperative", "cluster"]
SIZES = [(5, 8, 64, 16), (300, 4, 256, 32), (4096, 8, 256, 64)]  # T, K, E, B
SIZE_IDS = [f"T{t}-K{k}-E{e}-B{b}" for t, k, e, b in SIZES]


def _cases(mode, T, K, E, B, rows, dtype, *, before, det, variant=None, streams=None,
           seed=0):
    """(raw case, reference case, hostile inputs): the raw one runs on the GPU with
    validate=False; the reference one holds the sanitised inputs for the NumPy backend."""
    rng = np.random.default_rng([seed, T, E, rows, int(before), int(det)])
    h = fc.hostile_inputs(rng, T, K, E, max(rows, 1), dtype)
    s = fc.sanitised(h, E, max(rows, 1))
    common = dict(mode=mode, T=T, K=K, E=E, B=B, dtype=np.dtype(dtype).name, kind="hostile",
                  max_loras=rows, det=det, variant=variant, streams=streams, out=True,
                  out_layout="wide" if T % 2 else "exact", extra=3 if T % 2 else 0,
                  scatter=mode == "base", ignore_invalid=before, map_kind="hostile",
                  topk_ids=h["ids"], seed="hostile", index=f"{mode}-{T}-{rows}")
    raw = fc.Case(**common, expert_map=h["emap"], validate_dev=False)
    # With the map applied after counting, routes count by global id: the reference runs
    # without the map and its tiles are relabelled through the raw map (_relabel).
    ref_map = s["emap"] if (before or mode == "lora") else None
    if mode == "pair" and not before:
        ref_map = None  # the LoRA side runs on its own reference case (see _pair_want)
    ref = fc.Case(**common, expert_map=ref_map)
    if rows:
        raw.mapping, raw.lora_ids, raw.enabled = h["mapping"], h["lora_ids"], h["enabled"]
        ref.mapping, ref.lora_ids, ref.enabled = s["mapping"], s["lora_ids"], h["enabled"]
        raw.mapping_kind = ref.mapping_kind = "hostile"
        raw.lora_ids_kind = ref.lora_ids_kind = "hostile"
        raw.enabled_kind = ref.enabled_kind = "ints"
    return raw, ref, h, s


def _relabel(whole, M, emap):
    """Tiles of global expert e read emap[e] (raw), the tail -1 (map after counting)."""
    out = whole.copy()
    tiles = out[GUARD:GUARD + M]
    tiles[:] = np.where(tiles >= 0, emap[np.maximum(tiles, 0)], tiles)
    return out


def _gpu(raw):
    try:
        return fc.execute(raw, cupy, gpu_side=True)
    except fc.Refused as e:
        pytest.skip(f"refused: {e}")


def _check(ref, got, want):
    try:
        fc.compare(ref, got, want)
    except fc.CaseFailure as e:
        raise AssertionError(f"{fc.describe(ref)}: {e}") from None


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("dtype", [np.int64, np.uint64], ids=["int64", "uint64"])
@pytest.mark.parametrize("before", [True, False], ids=["map-before", "map-after"])
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v or "default")
@pytest.mark.parametrize("T,K,E,B", SIZES, ids=SIZE_IDS)
def test_hostile_base(T, K, E, B, variant, before, dtype, det):
    raw, ref, h, _ = _cases("base", T, K, E, B, 0, dtype, before=before, det=det,
                            variant=variant)
    got = _gpu(raw)
    want = fc.execute(ref, np, gpu_side=False)
    if not before:
        want["base"]["experts"] = _relabel(want["base"]["experts"], ref.sizes[1], h["emap"])
    _check(ref, got, want)


@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v or "default")
@pytest.mark.parametrize("rows", [8, 40])  # up to 32 slots one warp marks them; above, all
@pytest.mark.parametrize("T,K,E,B", SIZES, ids=SIZE_IDS)
def test_hostile_lora(T, K, E, B, rows, variant, det):
    dtype = np.int64 if (T + rows) % 2 else np.uint64
    raw, ref, _, _ = _cases("lora", T, K, E, B, rows, dtype, before=True, det=det,
                            variant=variant)
    got = _gpu(raw)
    want = fc.execute(ref, np, gpu_side=False)
    _check(ref, got, want)


@pytest.mark.parametrize("before", [True, False], ids=["map-before", "map-after"])
@pytest.mark.parametrize("det", [False, True], ids=["free", "det"])
@pytest.mark.parametrize("streams", [None, "one", "two", "fused"], ids=lambda s: s or "auto")
@pytest.mark.parametrize("T,K,E,B", SIZES, ids=SIZE_IDS)
def test_hostile_pair(T, K, E, B, streams, det, before):
    rows = 8 if T % 2 else 40
    raw, ref, h, s = _cases("pair", T, K, E, B, rows, np.int64, before=before, det=det,
                            streams=streams)
    got = _gpu(raw)
    if before:
        want = fc.execute(ref, np, gpu_side=False)
        _check(ref, got, want)
        return
    # base counted by global id (tiles relabelled through the raw map), LoRA mapped before
    base_ref = fc.Case(**{**ref.__dict__, "mode": "base", "scatter": False})
    lora_ref = fc.Case(**{**ref.__dict__, "mode": "lora", "expert_map": s["emap"]})
    want_b = fc.execute(base_ref, np, gpu_side=False)
    want_b["base"]["experts"] = _relabel(want_b["base"]["experts"], ref.sizes[1], h["emap"])
    _check(base_ref, {"base": got["base"]}, want_b)
    _check(lora_ref, {"lora": got["lora"]}, fc.execute(lora_ref, np, gpu_side=False))


@pytest.mark.parametrize("what", ["token_lora_mapping", "lora_ids", "expert_map"])
def test_validate_true_refuses_hostile_values_before_writing(what):
    """The same values with validate=True: a ValueError naming the argument, out= intact."""
    T, K, E, B, rows = 300, 4, 256, 32, 8
    rng = np.random.default_rng(1)
    h = fc.hostile_inputs(rng, T, K, E, rows, np.int64, tail=False)
    s = fc.sanitised(h, E, rows)
    args = {"token_lora_mapping": s["mapping"], "lora_ids": s["lora_ids"],
            "expert_map": s["emap"]}
    bad = {"token_lora_mapping": h["mapping"], "expert_map": h["emap"],
           "lora_ids": np.array([0, 1, 1, -1, 2, 3, 4, 5, 6], np.int32)}
    args[what] = bad[what]
    P, M = mla.buffer_sizes(T * K, E, B)
    bufs = [guarded([rows, P], cupy), guarded([rows, M], cupy), guarded([rows], cupy)]
    with pytest.raises(ValueError, match=what):
        mla.moe_lora_align_block_size(cupy.asarray(h["ids"]),
                                      cupy.asarray(args["token_lora_mapping"]), B, E, rows,
                                      lora_ids=cupy.asarray(args["lora_ids"]),
                                      expert_map=cupy.asarray(args["expert_map"]),
                                      out=[v for _, v in bufs], validate=True)
    cupy.cuda.Device().synchronize()
    for whole, _ in bufs:
        assert bool((whole == POISON).all())
