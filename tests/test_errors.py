"""Bad input gets a clear error naming the argument (the contract's last section), on host."""

from __future__ import annotations

import numpy as np
import pytest

from moe_lora_align import (align_moe_and_lora, buffer_sizes, moe_align_block_size,
                            moe_lora_align_block_size)

T, K, E, B, R = 6, 2, 4, 4, 3
NUMEL = T * K
P, M = buffer_sizes(NUMEL, E, B)
POISON = -7777


def ids(dtype=np.int32, shape=(T, K)):
    return (np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape) % E).astype(dtype)


def i32(values):
    return np.asarray(values, dtype=np.int32)


MAPPING = i32([0, 1, 2, -1, 0, 1])


def base(**kw):
    args = dict(topk_ids=ids(), block_size=B, num_experts=E)
    args.update(kw)
    return moe_align_block_size(**args)


def lora(**kw):
    args = dict(topk_ids=ids(), token_lora_mapping=MAPPING, block_size=B, num_experts=E,
                max_loras=R)
    args.update(kw)
    return moe_lora_align_block_size(**args)


def both(**kw):
    args = dict(topk_ids=ids(), token_lora_mapping=MAPPING, block_size=B, num_experts=E,
                max_loras=R)
    args.update(kw)
    return align_moe_and_lora(**args)


ALL = [base, lora, both]
ALL_IDS = ["base", "lora", "both"]
LORA_FNS = [lora, both]
LORA_IDS = ["lora", "both"]


def base_out(sizes=(P, M, 1), dtype=np.int32):
    return tuple(np.full(n, POISON, dtype=dtype) for n in sizes)


def lora_out(sizes=((R, P), (R, M), (R,)), dtype=np.int32):
    return tuple(np.full(s, POISON, dtype=dtype) for s in sizes)


def test_sane_defaults_pass():
    # the fixtures of this file are valid: each error below comes from the one bad argument
    for fn in ALL:
        fn()
    base(out=base_out())
    lora(out=lora_out())
    both(out_base=base_out(), out_lora=lora_out())


# ---- topk_ids -------------------------------------------------------------------------------
@pytest.mark.parametrize("fn", ALL, ids=ALL_IDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.bool_])
def test_topk_ids_float_or_bool(fn, dtype):
    with pytest.raises(TypeError, match="topk_ids"):
        fn(topk_ids=ids(dtype))


@pytest.mark.parametrize("fn", ALL, ids=ALL_IDS)
@pytest.mark.parametrize("shape", [(T * K,), (T, K, 1), (1, T, K)])
def test_topk_ids_not_2d(fn, shape):
    with pytest.raises(ValueError, match="topk_ids.*2-D"):
        fn(topk_ids=ids(shape=shape))


# ---- scalars --------------------------------------------------------------------------------
@pytest.mark.parametrize("fn", ALL, ids=ALL_IDS)
@pytest.mark.parametrize("value", [0, -1, -256])
def test_block_size_not_positive(fn, value):
    with pytest.raises(ValueError, match="block_size"):
        fn(block_size=value)


@pytest.mark.parametrize("fn", ALL, ids=ALL_IDS)
@pytest.mark.parametrize("value", [0, -3])
def test_num_experts_not_positive(fn, value):
    with pytest.raises(ValueError, match="num_experts"):
        fn(num_experts=value)


@pytest.mark.parametrize("fn", ALL, ids=ALL_IDS)
@pytest.mark.parametrize("name", ["block_size", "num_experts"])
@pytest.mark.parametrize("value", [4.0, True, "4"])
def test_scalars_not_integers(fn, name, value):
    with pytest.raises(TypeError, match=name):
        fn(**{name: value})


@pytest.mark.parametrize("fn", LORA_FNS, ids=LORA_IDS)
@pytest.mark.parametrize("value", [0, -1])
def test_max_loras_not_positive(fn, value):
    with pytest.raises(ValueError, match="max_loras"):
        fn(max_loras=value)


# ---- token_lora_mapping ---------------------------------------------------------------------
@pytest.mark.parametrize("fn", LORA_FNS, ids=LORA_IDS)
@pytest.mark.parametrize("length", [0, T - 1, T + 1])
def test_token_lora_mapping_wrong_length(fn, length):
    with pytest.raises(ValueError, match="token_lora_mapping"):
        fn(token_lora_mapping=np.zeros(length, dtype=np.int32))


@pytest.mark.parametrize("fn", LORA_FNS, ids=LORA_IDS)
@pytest.mark.parametrize("dtype", [np.int64, np.int16, np.uint32, np.float32])
def test_token_lora_mapping_wrong_dtype(fn, dtype):
    with pytest.raises(TypeError, match="token_lora_mapping"):
        fn(token_lora_mapping=MAPPING.astype(dtype))


@pytest.mark.parametrize("fn", LORA_FNS, ids=LORA_IDS)
@pytest.mark.parametrize("bad", [R, R + 10, -2, -(2**31)])
def test_token_lora_mapping_values(fn, bad):
    mapping = MAPPING.copy()
    mapping[4] = bad
    with pytest.raises(ValueError, match="token_lora_mapping"):
        fn(token_lora_mapping=mapping)


# ---- lora_ids / adapter_enabled -------------------------------------------------------------
@pytest.mark.parametrize("fn", LORA_FNS, ids=LORA_IDS)
@pytest.mark.parametrize("name", ["lora_ids", "adapter_enabled"])
@pytest.mark.parametrize("length", [0, 1, R])
def test_slot_vectors_too_short(fn, name, length):
    with pytest.raises(ValueError, match=name):
        fn(**{name: np.zeros(length, dtype=np.int32)})


@pytest.mark.parametrize("fn", LORA_FNS, ids=LORA_IDS)
@pytest.mark.parametrize("name", ["lora_ids", "adapter_enabled"])
def test_slot_vectors_wrong_dtype(fn, name):
    with pytest.raises(TypeError, match=name):
        fn(**{name: np.zeros(R + 1, dtype=np.int64)})


@pytest.mark.parametrize("fn", LORA_FNS, ids=LORA_IDS)
@pytest.mark.parametrize("entries", [[0, 0, 1, -1], [-1, 2, 1, 2], [1, 1, 1, 1]])
def test_lora_ids_duplicated_slot(fn, entries):
    with pytest.raises(ValueError, match="lora_ids"):
        fn(lora_ids=i32(entries))


@pytest.mark.parametrize("entries", [[-1, -1, -1, 0], [R, R, 0, 1], [-1, 0, 1, 2]])
def test_lora_ids_repeated_skipped_entries_are_fine(entries):
    # -1 and values >= max_loras are skipped, so repeating them is no duplicate slot
    lora(lora_ids=i32(entries))


# ---- expert_map -----------------------------------------------------------------------------
@pytest.mark.parametrize("fn", ALL, ids=ALL_IDS)
@pytest.mark.parametrize("length", [0, E - 1, E + 1])
def test_expert_map_wrong_length(fn, length):
    with pytest.raises(ValueError, match="expert_map"):
        fn(expert_map=np.zeros(length, dtype=np.int32))


@pytest.mark.parametrize("fn", ALL, ids=ALL_IDS)
@pytest.mark.parametrize("dtype", [np.int64, np.int8, np.float32])
def test_expert_map_wrong_dtype(fn, dtype):
    with pytest.raises(TypeError, match="expert_map"):
        fn(expert_map=np.zeros(E, dtype=dtype))


@pytest.mark.parametrize("fn", ALL, ids=ALL_IDS)
@pytest.mark.parametrize("bad", [-2, E, E + 100, 2**31 - 1])
def test_expert_map_values(fn, bad):
    emap = i32([0, -1, 1, 2])
    emap[1] = bad
    with pytest.raises(ValueError, match="expert_map"):
        fn(expert_map=emap)


@pytest.mark.parametrize("ignore", [True, False])
def test_expert_map_values_checked_in_both_modes(ignore):
    with pytest.raises(ValueError, match="expert_map"):
        base(expert_map=i32([0, 1, 2, E]), ignore_invalid_experts=ignore)


# ---- out buffers: base ----------------------------------------------------------------------
@pytest.mark.parametrize("which,name", [(0, "sorted_token_ids"), (1, "expert_ids"),
                                        (2, "num_tokens_post_pad"), (3, "scatter_idx")])
def test_base_out_too_small(which, name):
    sizes = [P, M, 1, NUMEL]
    sizes[which] -= 1
    with pytest.raises(ValueError, match=name):
        base(out=base_out(sizes), return_scatter_idx=True)


@pytest.mark.parametrize("which,name", [(0, "sorted_token_ids"), (1, "expert_ids"),
                                        (2, "num_tokens_post_pad"), (3, "scatter_idx")])
@pytest.mark.parametrize("dtype", [np.int64, np.uint32, np.float32])
def test_base_out_wrong_dtype(which, name, dtype):
    out = list(base_out((P, M, 1, NUMEL)))
    out[which] = out[which].astype(dtype)
    with pytest.raises(TypeError, match=name):
        base(out=tuple(out), return_scatter_idx=True)


@pytest.mark.parametrize("which,name", [(0, "sorted_token_ids"), (1, "expert_ids"),
                                        (2, "num_tokens_post_pad"), (3, "scatter_idx")])
def test_base_out_not_contiguous(which, name):
    out = list(base_out((P, M, 1, NUMEL)))
    # (a strided view of one element still counts as contiguous, so take two)
    out[which] = np.full(2 * (out[which].size + 1), POISON, dtype=np.int32)[::2]
    with pytest.raises(ValueError, match=name):
        base(out=tuple(out), return_scatter_idx=True)


@pytest.mark.parametrize("count", [0, 2, 4])
def test_base_out_wrong_count(count):
    out = base_out((P, M, 1, NUMEL))[:count]
    with pytest.raises(ValueError, match="out"):
        base(out=out)


@pytest.mark.parametrize("count", [3, 5])
def test_base_out_wrong_count_with_scatter(count):
    out = base_out((P, M, 1, NUMEL, NUMEL))[:count]
    with pytest.raises(ValueError, match="out"):
        base(out=out, return_scatter_idx=True)


# ---- out buffers: LoRA ----------------------------------------------------------------------
LORA_SMALL = [
    (((R, P - 1), (R, M), (R,)), "sorted_token_ids"),
    (((R - 1, P), (R, M), (R,)), "sorted_token_ids"),
    (((R * P - 1,), (R, M), (R,)), "sorted_token_ids"),
    (((R, P), (R, M - 1), (R,)), "expert_ids"),
    (((R, P), (R * M - 1,), (R,)), "expert_ids"),
    (((R, P), (R, M), (R - 1,)), "num_tokens_post_pad"),
]


@pytest.mark.parametrize("sizes,name", LORA_SMALL)
def test_lora_out_too_small(sizes, name):
    with pytest.raises(ValueError, match=name):
        lora(out=lora_out(sizes))
    with pytest.raises(ValueError, match=name):
        both(out_lora=lora_out(sizes))


@pytest.mark.parametrize("which,name", [(0, "sorted_token_ids"), (1, "expert_ids"),
                                        (2, "num_tokens_post_pad")])
def test_lora_out_wrong_dtype(which, name):
    out = list(lora_out())
    out[which] = out[which].astype(np.int64)
    with pytest.raises(TypeError, match=name):
        lora(out=tuple(out))


@pytest.mark.parametrize("which,name", [(0, "sorted_token_ids"), (1, "expert_ids"),
                                        (2, "num_tokens_post_pad")])
def test_lora_out_not_contiguous(which, name):
    out = list(lora_out())
    shape = out[which].shape
    big = np.full(shape[:-1] + (2 * shape[-1],), POISON, dtype=np.int32)
    out[which] = big[..., ::2]
    with pytest.raises(ValueError, match=name):
        lora(out=tuple(out))


def test_lora_out_fortran_order():
    out = list(lora_out())
    out[0] = np.asfortranarray(np.full((R, P), POISON, dtype=np.int32))
    with pytest.raises(ValueError, match="sorted_token_ids"):
        lora(out=tuple(out))


@pytest.mark.parametrize("count", [0, 2, 4])
def test_lora_out_wrong_count(count):
    out = (lora_out() + (np.zeros(NUMEL, np.int32),))[:count]
    with pytest.raises(ValueError, match="out"):
        lora(out=out)


def test_both_out_wrong_count():
    with pytest.raises(ValueError, match="out"):
        both(out_base=base_out()[:2])
    with pytest.raises(ValueError, match="out"):
        both(out_lora=lora_out()[:2])


def test_both_base_out_too_small():
    with pytest.raises(ValueError, match="sorted_token_ids"):
        both(out_base=base_out((P - 1, M, 1)))


# ---- variant / streams ----------------------------------------------------------------------
@pytest.mark.parametrize("fn", ALL, ids=ALL_IDS)
@pytest.mark.parametrize("variant", ["fast", "Shared", "", 1])
def test_variant_unknown(fn, variant):
    with pytest.raises(ValueError, match="variant"):
        fn(variant=variant)


@pytest.mark.parametrize("fn", ALL, ids=ALL_IDS)
@pytest.mark.parametrize("variant", [None, "shared", "global"])
def test_variant_known_runs_on_host(fn, variant):
    fn(variant=variant)


@pytest.mark.parametrize("streams", ["three", "Fused", "", 2])
def test_streams_unknown(streams):
    with pytest.raises(ValueError, match="streams"):
        both(streams=streams)


@pytest.mark.parametrize("streams", [None, "fused", "one", "two"])
def test_streams_known_run_on_host(streams):
    both(streams=streams)


# ---- errors come before anything is written -------------------------------------------------
@pytest.mark.parametrize("bad", [
    dict(lora_ids=i32([0, 0, -1, -1])),
    dict(token_lora_mapping=i32([0, 1, 2, R, 0, 1])),
    dict(expert_map=i32([0, 1, 2, -5])),
    dict(variant="nope"),
])
def test_error_leaves_out_buffers_untouched(bad):
    out = lora_out()
    with pytest.raises(ValueError):
        lora(out=out, **bad)
    for buf in out:
        assert (buf == POISON).all()
    out_b, out_l = base_out(), lora_out()
    with pytest.raises(ValueError):
        both(out_base=out_b, out_lora=out_l, **bad)
    for buf in out_b + out_l:
        assert (buf == POISON).all()


def test_validate_false_skips_value_checks_without_crashing():
    # values are not checked, but nothing outside the arrays is read or written
    mapping = i32([0, 1, 2**31 - 1, -(2**31), R, -2])
    res = lora(token_lora_mapping=mapping, lora_ids=i32([1, 1, 2**31 - 1, -9]),
               expert_map=i32([0, 10**6, -7, 1]), validate=False, deterministic=True)
    assert res.sorted_token_ids.shape == (R, P)
    assert int(res.num_tokens_post_pad.sum()) >= 0
    res = base(expert_map=i32([0, 10**6, -7, 1]), validate=False)
    assert res.sorted_token_ids.shape == (P,)


# ---- buffer_sizes ---------------------------------------------------------------------------
@pytest.mark.parametrize("args,name", [((-1, 4, 4), "numel"), ((8, 0, 4), "num_experts"),
                                       ((8, 4, 0), "block_size")])
def test_buffer_sizes_bad_arguments(args, name):
    with pytest.raises(ValueError, match=name):
        buffer_sizes(*args)


# ---- sizes whose indices overflow int32 (raised before anything is allocated) ---------------
def test_base_sizes_overflow_int32():
    topk = np.zeros((2**16, 1), dtype=np.int32)  # numel = E: P = 2**16 + 2**16 * (2**16 - 1)
    with pytest.raises(ValueError, match="sorted_token_ids.*int32"):
        moe_align_block_size(topk, 2**16, 2**16)


def test_lora_sizes_overflow_int32():
    topk = np.zeros((1024, 1), dtype=np.int32)  # P = 2**22 per row, 1024 rows
    mapping = np.zeros(1024, dtype=np.int32)
    with pytest.raises(ValueError, match="sorted_token_ids.*int32"):
        moe_lora_align_block_size(topk, mapping, 4096, 1024, 1024)
