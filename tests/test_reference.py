"""Host tests of the NumPy backend against the contract (docs/contract.md).

The oracle below is written on purpose with plain Python loops (one pass over the routes, one
pass over the experts), so that it shares nothing with the vectorised backend it checks.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_lora_align import (align_moe_and_lora, buffer_sizes, moe_align_block_size,
                            moe_lora_align_block_size)

POISON = -7777  # no correct output ever holds this value
SIGNED = (np.int8, np.int16, np.int32, np.int64)
UNSIGNED = (np.uint8, np.uint16, np.uint32, np.uint64)
ALL_DTYPES = SIGNED + UNSIGNED

PROPS = settings(max_examples=100, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FEW = settings(max_examples=40, deadline=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def i32(values):
    return np.asarray(values, dtype=np.int32)


# ---------------------------------------------------------------------------------------------
# The oracle
# ---------------------------------------------------------------------------------------------
def ceil_to(n, b):
    return (n + b - 1) // b * b


def oracle_sizes(numel, E, B, pad_sorted_ids=False):
    P = numel + E * (B - 1)
    if pad_sorted_ids:
        P = ceil_to(P, B)
    if numel < E:
        P = min(numel * B, P)
    return P, (P + B - 1) // B


def oracle_buckets(flat, E, expert_map=None, map_first=False, take=None):
    """For every (local or global) expert, the ascending list of its routes' flat indices.

    ``take(i)`` says whether route ``i`` belongs to the alignment at all (LoRA: its token's
    slot); ``map_first`` applies ``expert_map`` before counting.
    """
    buckets = [[] for _ in range(E)]
    for i, v in enumerate(flat):
        if take is not None and not take(i):
            continue
        if v < 0 or v >= E:
            continue
        if expert_map is not None and map_first:
            v = expert_map[v]
            if v == -1:
                continue
        buckets[v].append(i)
    return buckets


def oracle_layout(buckets, numel, B, P, M, label):
    """Lay the buckets out expert after expert; ``label(e)`` is what a tile of e reads."""
    sorted_ids = np.full(P, numel, dtype=np.int64)
    experts = np.full(M, -1, dtype=np.int64)
    pos = 0
    for e in range(len(buckets)):
        routes = buckets[e]
        if not routes:
            continue
        for j, i in enumerate(routes):
            sorted_ids[pos + j] = i
        tiles = (len(routes) + B - 1) // B
        for t in range(tiles):
            experts[pos // B + t] = label(e)
        pos += tiles * B
    return sorted_ids, experts, pos


def oracle_base(topk_ids, E, B, expert_map=None, ignore_invalid_experts=False,
                pad_sorted_ids=False):
    flat = np.asarray(topk_ids).reshape(-1).tolist()
    numel = len(flat)
    emap = None if expert_map is None else [int(x) for x in expert_map]
    map_first = emap is not None and ignore_invalid_experts
    buckets = oracle_buckets(flat, E, emap, map_first)
    P, M = oracle_sizes(numel, E, B, pad_sorted_ids)
    if emap is not None and not map_first:
        label = lambda e: emap[e]  # noqa: E731
    else:
        label = lambda e: e  # noqa: E731
    sorted_ids, experts, total = oracle_layout(buckets, numel, B, P, M, label)
    scatter = [-1] * numel
    for routes in buckets:
        for i in routes:
            scatter[i] = i
    return dict(sorted=sorted_ids, experts=experts, ntpp=total, scatter=np.array(scatter),
                P=P, M=M, numel=numel, buckets=buckets, label=label)


def oracle_processed(max_loras, lora_ids=None, adapter_enabled=None):
    if lora_ids is None:
        slots = set(range(max_loras))
    else:
        # only the contract's max_loras + 1 entries are read; longer arrays' extras are ignored
        slots = {int(x) for x in list(lora_ids)[: max_loras + 1] if 0 <= int(x) < max_loras}
    if adapter_enabled is not None:
        slots = {s for s in slots if int(adapter_enabled[s]) != 0}
    return slots


def oracle_lora(topk_ids, token_lora_mapping, E, B, max_loras, lora_ids=None,
                adapter_enabled=None, expert_map=None, pad_sorted_ids=False):
    topk_ids = np.asarray(topk_ids)
    K = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).tolist()
    numel = len(flat)
    mapping = [int(x) for x in token_lora_mapping]
    emap = None if expert_map is None else [int(x) for x in expert_map]
    P, M = oracle_sizes(numel, E, B, pad_sorted_ids)
    processed = oracle_processed(max_loras, lora_ids, adapter_enabled)
    rows = {}
    for slot in range(max_loras):
        if slot not in processed:
            continue
        buckets = oracle_buckets(flat, E, emap, True, take=lambda i: mapping[i // K] == slot)
        sorted_ids, experts, total = oracle_layout(buckets, numel, B, P, M, lambda e: e)
        rows[slot] = dict(sorted=sorted_ids, experts=experts, ntpp=total, buckets=buckets)
    return dict(rows=rows, processed=processed, P=P, M=M, numel=numel)


# ---------------------------------------------------------------------------------------------
# Checks shared by the tests
# ---------------------------------------------------------------------------------------------
def assert_unordered(sorted_ids, experts, ntpp, buckets, label, numel, B, P, M):
    """The properties that hold in any order: segments hold exactly their routes."""
    sorted_ids, experts = np.asarray(sorted_ids), np.asarray(experts)
    assert sorted_ids.shape == (P,) and experts.shape == (M,)
    assert ntpp % B == 0
    pos = 0
    for e in range(len(buckets)):
        routes = buckets[e]
        if not routes:
            continue
        span = ceil_to(len(routes), B)
        seg = sorted_ids[pos:pos + span]
        assert sorted(seg[:len(routes)].tolist()) == routes
        assert (seg[len(routes):] == numel).all()
        assert (experts[pos // B:(pos + span) // B] == label(e)).all()
        pos += span
    assert ntpp == pos
    assert (sorted_ids[pos:] == numel).all()
    assert (experts[pos // B:] == -1).all()


def assert_base_equal(res, want, scatter=False):
    for arr in res:
        assert isinstance(arr, np.ndarray) and arr.dtype == np.int32
    np.testing.assert_array_equal(res.sorted_token_ids, want["sorted"])
    np.testing.assert_array_equal(res.expert_ids, want["experts"])
    np.testing.assert_array_equal(res.num_tokens_post_pad, [want["ntpp"]])
    if scatter:
        np.testing.assert_array_equal(res.scatter_idx, want["scatter"])


def assert_lora_allocated(res, want, max_loras):
    P, M, numel = want["P"], want["M"], want["numel"]
    assert res.sorted_token_ids.shape == (max_loras, P)
    assert res.expert_ids.shape == (max_loras, M)
    assert res.num_tokens_post_pad.shape == (max_loras,)
    for arr in res:
        assert arr.dtype == np.int32
    for slot in range(max_loras):
        row = want["rows"].get(slot)
        if row is None:  # not processed: the empty alignment, never garbage
            assert (res.sorted_token_ids[slot] == numel).all()
            assert (res.expert_ids[slot] == -1).all()
            assert res.num_tokens_post_pad[slot] == 0
        else:
            np.testing.assert_array_equal(res.sorted_token_ids[slot], row["sorted"])
            np.testing.assert_array_equal(res.expert_ids[slot], row["experts"])
            assert res.num_tokens_post_pad[slot] == row["ntpp"]


# ---------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------
def make_ids(rng, dtype, T, K, E, pattern):
    dtype = np.dtype(dtype)
    info = np.iinfo(dtype)
    hi = min(E, int(info.max) + 1)  # valid ids representable in the dtype: [0, hi)
    shape = (T, K)
    if pattern == "skewed":
        ids = np.full(shape, int(rng.integers(0, hi)), dtype=np.int64)
    elif pattern == "few":
        pool = rng.integers(0, hi, size=int(rng.integers(1, 4)))
        ids = rng.choice(pool, size=shape)
    else:
        ids = rng.integers(0, hi, size=shape)
    ids = ids.astype(dtype)
    if pattern == "invalid" and ids.size:
        bad = rng.random(shape) < 0.3
        choices = []
        if info.min < 0:
            choices.append(rng.integers(info.min, -1, size=shape, endpoint=True, dtype=dtype))
            choices.append(np.full(shape, -1, dtype=dtype))
        if E <= info.max:
            choices.append(rng.integers(E, info.max, size=shape, endpoint=True, dtype=dtype))
            choices.append(np.full(shape, E, dtype=dtype))
            choices.append(np.full(shape, info.max, dtype=dtype))
        if choices:
            pick = rng.integers(0, len(choices), size=shape)
            repl = np.choose(pick, choices)
            ids = np.where(bad, repl, ids).astype(dtype)
    assert ids.dtype == dtype
    return ids


SMALL_T = st.integers(0, 8) | st.integers(0, 64) | st.integers(0, 400) | st.integers(0, 3000)
EXPERTS = st.integers(1, 8) | st.integers(1, 300) | st.integers(1, 4096)
BLOCKS = st.sampled_from([1, 2, 16, 64, 128, 256]) | st.integers(1, 256)
PATTERNS = st.sampled_from(["uniform", "skewed", "few", "invalid", "invalid"])


@st.composite
def routing(draw, tokens=SMALL_T, experts=EXPERTS):
    dtype = draw(st.sampled_from(ALL_DTYPES))
    T = draw(tokens)
    K = draw(st.integers(1, 16))
    E = draw(experts)
    B = draw(BLOCKS)
    pattern = draw(PATTERNS)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return dict(ids=make_ids(rng, dtype, T, K, E, pattern), E=E, B=B, rng=rng,
                pad=draw(st.booleans()))


def make_expert_map(rng, E, mode):
    emap = np.full(E, -1, dtype=np.int32)
    if mode == "none_local":
        return emap
    if mode == "identity":
        return np.arange(E, dtype=np.int32)
    if mode == "arbitrary":  # any value check passes: -1 or in [0, E), repeats allowed
        return rng.integers(-1, E, size=E).astype(np.int32)
    # an expert-parallel shard: some globals get the local ids 0..n-1
    n_local = int(rng.integers(0, E + 1))
    chosen = rng.choice(E, size=n_local, replace=False)
    if mode == "shard_sorted":
        chosen = np.sort(chosen)
    emap[chosen] = np.arange(n_local, dtype=np.int32)
    return emap


MAP_MODES = st.sampled_from(["shard_sorted", "shard_random", "arbitrary", "identity",
                             "none_local"])


@st.composite
def lora_case(draw):
    case = draw(routing(tokens=st.integers(0, 8) | st.integers(0, 64) | st.integers(0, 1500),
                        experts=st.integers(1, 8) | st.integers(1, 300) | st.integers(1, 4096)))
    rng = case["rng"]
    T = case["ids"].shape[0]
    max_loras = draw(st.integers(1, 4) | st.integers(1, 10))
    base_share = draw(st.sampled_from([0.0, 0.3, 1.0]))
    mapping = rng.integers(0, max_loras, size=T)
    mapping[rng.random(T) < base_share] = -1
    if draw(st.booleans()) and T:  # only a few slots actually used
        used = rng.integers(0, max_loras, size=int(rng.integers(1, 3)))
        mapping = np.where(mapping >= 0, rng.choice(used, size=T), -1)
    mapping = mapping.astype(np.int32)

    lora_mode = draw(st.sampled_from(["none", "engine", "engine_drop", "random"]))
    length = max_loras + 1 + draw(st.sampled_from([0, 0, 0, 3]))
    if lora_mode == "none":
        lora_ids = None
    elif lora_mode in ("engine", "engine_drop"):
        # the engines' way: sorted unique slots, tail-filled with -1 (-1 first when used)
        uniq = np.unique(mapping).tolist()
        if lora_mode == "engine_drop" and uniq:
            uniq = [u for u in uniq if rng.random() < 0.6]
        lora_ids = i32(uniq + [-1] * (length - len(uniq)))
    else:
        slots = rng.permutation(max_loras)[: int(rng.integers(0, max_loras + 1))].tolist()
        junk = rng.choice([-1, max_loras, max_loras + 5, 2**31 - 1, -5],
                          size=length - len(slots)).tolist()
        entries = slots + junk
        rng.shuffle(entries)
        lora_ids = i32(entries)

    if draw(st.booleans()):
        adapter_enabled = None
    else:
        adapter_enabled = rng.choice([0, 1, 1, 3, -2], size=max_loras + 1 +
                                     draw(st.sampled_from([0, 2]))).astype(np.int32)
    expert_map = None
    if draw(st.integers(0, 3)) == 0:
        expert_map = make_expert_map(rng, case["E"], draw(MAP_MODES))
    case.update(mapping=mapping, max_loras=max_loras, lora_ids=lora_ids,
                adapter_enabled=adapter_enabled, expert_map=expert_map)
    return case


def lora_call(case, **kw):
    return moe_lora_align_block_size(
        case["ids"], case["mapping"], case["B"], case["E"], case["max_loras"],
        lora_ids=case["lora_ids"], adapter_enabled=case["adapter_enabled"],
        expert_map=case["expert_map"], pad_sorted_ids=case["pad"], **kw)


def lora_oracle(case):
    return oracle_lora(case["ids"], case["mapping"], case["E"], case["B"], case["max_loras"],
                       lora_ids=case["lora_ids"], adapter_enabled=case["adapter_enabled"],
                       expert_map=case["expert_map"], pad_sorted_ids=case["pad"])


# ---------------------------------------------------------------------------------------------
# The contract's worked examples, verbatim
# ---------------------------------------------------------------------------------------------
EX_BASE = np.array([[1, 3], [0, 1], [3, 1], [5, -1]], dtype=np.int32)
EX_LORA = np.array([[0, 2], [1, 2], [2, 0], [0, 1]], dtype=np.int32)
EX_MAPPING = i32([1, -1, 1, 0])


@pytest.mark.parametrize("deterministic", [True, False])
def test_worked_example_base(deterministic):
    assert buffer_sizes(8, 4, 4) == (20, 5)
    res = moe_align_block_size(EX_BASE, 4, 4, return_scatter_idx=True,
                               deterministic=deterministic)
    np.testing.assert_array_equal(
        res.sorted_token_ids, [2, 8, 8, 8, 0, 3, 5, 8, 1, 4, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8])
    np.testing.assert_array_equal(res.expert_ids, [0, 1, 3, -1, -1])
    np.testing.assert_array_equal(res.num_tokens_post_pad, [12])
    np.testing.assert_array_equal(res.scatter_idx, [0, 1, 2, 3, 4, 5, -1, -1])
    for arr in res:
        assert arr.dtype == np.int32


def test_worked_example_base_expert_map_ignore_invalid():
    res = moe_align_block_size(EX_BASE, 4, 4, i32([-1, 0, -1, 1]), ignore_invalid_experts=True,
                               deterministic=True)
    np.testing.assert_array_equal(res.sorted_token_ids, [0, 3, 5, 8, 1, 4, 8, 8] + [8] * 12)
    np.testing.assert_array_equal(res.expert_ids, [0, 1, -1, -1, -1])
    np.testing.assert_array_equal(res.num_tokens_post_pad, [8])


def test_worked_example_base_expert_map_engine_default():
    # Derived from the contract: global ids counted (segments as without a map), then each
    # tile's id mapped: tiles of e0, e1, e3 read -1, 0, 1.
    res = moe_align_block_size(EX_BASE, 4, 4, i32([-1, 0, -1, 1]), deterministic=True)
    np.testing.assert_array_equal(
        res.sorted_token_ids, [2, 8, 8, 8, 0, 3, 5, 8, 1, 4, 8, 8] + [8] * 8)
    np.testing.assert_array_equal(res.expert_ids, [-1, 0, 1, -1, -1])
    np.testing.assert_array_equal(res.num_tokens_post_pad, [12])


@pytest.mark.parametrize("lora_ids", [i32([-1, 0, 1]), None])
def test_worked_example_lora(lora_ids):
    assert buffer_sizes(8, 3, 2) == (11, 6)
    res = moe_lora_align_block_size(EX_LORA, EX_MAPPING, 2, 3, 2, lora_ids=lora_ids,
                                    adapter_enabled=i32([1, 1, 1]), deterministic=True)
    np.testing.assert_array_equal(res.sorted_token_ids, [[6, 8, 7, 8, 8, 8, 8, 8, 8, 8, 8],
                                                         [0, 5, 1, 4, 8, 8, 8, 8, 8, 8, 8]])
    np.testing.assert_array_equal(res.expert_ids, [[0, 1, -1, -1, -1, -1],
                                                   [0, 2, -1, -1, -1, -1]])
    np.testing.assert_array_equal(res.num_tokens_post_pad, [4, 4])
    # token 1 (mapping -1) owns routes 2 and 3: they appear in no row
    assert not np.isin(res.sorted_token_ids, [2, 3]).any()


def test_worked_example_lora_disabled_slot():
    enabled = i32([0, 1, 1])
    res = moe_lora_align_block_size(EX_LORA, EX_MAPPING, 2, 3, 2, lora_ids=i32([-1, 0, 1]),
                                    adapter_enabled=enabled, deterministic=True)
    np.testing.assert_array_equal(res.sorted_token_ids[0], [8] * 11)
    np.testing.assert_array_equal(res.expert_ids[0], [-1] * 6)
    np.testing.assert_array_equal(res.sorted_token_ids[1], [0, 5, 1, 4] + [8] * 7)
    np.testing.assert_array_equal(res.num_tokens_post_pad, [0, 4])

    out = (np.full((2, 11), POISON, np.int32), np.full((2, 6), POISON, np.int32),
           np.full(2, POISON, np.int32))
    res = moe_lora_align_block_size(EX_LORA, EX_MAPPING, 2, 3, 2, lora_ids=i32([-1, 0, 1]),
                                    adapter_enabled=enabled, deterministic=True, out=out)
    assert all(r is o for r, o in zip(res, out))
    assert (out[0][0] == POISON).all() and (out[1][0] == POISON).all() and out[2][0] == POISON
    np.testing.assert_array_equal(out[1][1], [0, 2, -1, -1, -1, -1])
    assert out[2][1] == 4


def test_worked_examples_match_oracle():
    assert_base_equal(moe_align_block_size(EX_BASE, 4, 4, return_scatter_idx=True,
                                           deterministic=True),
                      oracle_base(EX_BASE, 4, 4), scatter=True)
    want = oracle_lora(EX_LORA, EX_MAPPING, 3, 2, 2, lora_ids=[-1, 0, 1])
    assert_lora_allocated(moe_lora_align_block_size(EX_LORA, EX_MAPPING, 2, 3, 2,
                                                    lora_ids=i32([-1, 0, 1]),
                                                    deterministic=True), want, 2)


# ---------------------------------------------------------------------------------------------
# Property tests against the oracle
# ---------------------------------------------------------------------------------------------
@PROPS
@given(routing())
def test_base_matches_oracle(case):
    ids, E, B = case["ids"], case["E"], case["B"]
    ids_before = ids.copy()
    res = moe_align_block_size(ids, B, E, pad_sorted_ids=case["pad"], return_scatter_idx=True,
                               deterministic=True)
    assert_base_equal(res, oracle_base(ids, E, B, pad_sorted_ids=case["pad"]), scatter=True)
    np.testing.assert_array_equal(ids, ids_before)  # inputs are never written


@PROPS
@given(routing(), MAP_MODES, st.booleans())
def test_base_expert_map_matches_oracle(case, map_mode, ignore_invalid):
    ids, E, B = case["ids"], case["E"], case["B"]
    emap = make_expert_map(case["rng"], E, map_mode)
    emap_before = emap.copy()
    res = moe_align_block_size(ids, B, E, emap, ignore_invalid_experts=ignore_invalid,
                               pad_sorted_ids=case["pad"], return_scatter_idx=ignore_invalid,
                               deterministic=True)
    want = oracle_base(ids, E, B, expert_map=emap, ignore_invalid_experts=ignore_invalid,
                       pad_sorted_ids=case["pad"])
    assert_base_equal(res, want, scatter=ignore_invalid)
    np.testing.assert_array_equal(emap, emap_before)


@PROPS
@given(routing(), st.sampled_from([None, "map_first", "map_after"]))
def test_base_default_order_properties(case, map_mode):
    ids, E, B = case["ids"], case["E"], case["B"]
    emap = None if map_mode is None else make_expert_map(case["rng"], E, "shard_random")
    ignore = map_mode == "map_first"
    res = moe_align_block_size(ids, B, E, emap, ignore_invalid_experts=ignore,
                               pad_sorted_ids=case["pad"])
    want = oracle_base(ids, E, B, expert_map=emap, ignore_invalid_experts=ignore,
                       pad_sorted_ids=case["pad"])
    assert_unordered(res.sorted_token_ids, res.expert_ids, int(res.num_tokens_post_pad[0]),
                     want["buckets"], want["label"], want["numel"], B, want["P"], want["M"])


@PROPS
@given(lora_case())
def test_lora_matches_oracle(case):
    inputs = {k: (None if case[k] is None else case[k].copy())
              for k in ("ids", "mapping", "lora_ids", "adapter_enabled", "expert_map")}
    res = lora_call(case, deterministic=True)
    assert_lora_allocated(res, lora_oracle(case), case["max_loras"])
    for k, v in inputs.items():
        if v is not None:
            np.testing.assert_array_equal(case[k], v)


@FEW
@given(lora_case())
def test_lora_default_order_properties(case):
    res = lora_call(case)
    want = lora_oracle(case)
    for slot, row in want["rows"].items():
        assert_unordered(res.sorted_token_ids[slot], res.expert_ids[slot],
                         int(res.num_tokens_post_pad[slot]), row["buckets"], lambda e: e,
                         want["numel"], case["B"], want["P"], want["M"])


@FEW
@given(lora_case(), st.sampled_from(["2d", "2d_wide", "flat"]), st.booleans())
def test_lora_out_poisoned(case, layout, deterministic):
    want = lora_oracle(case)
    R, P, M, numel = case["max_loras"], want["P"], want["M"], want["numel"]
    if layout == "2d":
        shapes = ((R, P), (R, M))
    elif layout == "2d_wide":
        shapes = ((R, P + 5), (R, M + 3))
    else:
        shapes = ((R * P + 7,), (R * M + 2,))
    out = tuple(np.full(s, POISON, np.int32) for s in shapes) + (np.full(R + 2, POISON,
                                                                          np.int32),)
    res = lora_call(case, deterministic=deterministic, out=out)
    assert all(r is o for r, o in zip(res, out))
    if layout == "flat":
        sorted_rows = out[0][:R * P].reshape(R, P)
        expert_rows = out[1][:R * M].reshape(R, M)
        assert (out[0][R * P:] == POISON).all() and (out[1][R * M:] == POISON).all()
    else:
        sorted_rows, expert_rows = out[0][:, :P], out[1][:, :M]
        assert (out[0][:, P:] == POISON).all() and (out[1][:, M:] == POISON).all()
    assert (out[2][R:] == POISON).all()
    for slot in range(R):
        row = want["rows"].get(slot)
        if row is None:
            assert (sorted_rows[slot] == POISON).all()
            assert (expert_rows[slot] == POISON).all()
            assert out[2][slot] == POISON
        elif deterministic:
            np.testing.assert_array_equal(sorted_rows[slot], row["sorted"])
            np.testing.assert_array_equal(expert_rows[slot], row["experts"])
            assert out[2][slot] == row["ntpp"]
        else:
            assert_unordered(sorted_rows[slot], expert_rows[slot], int(out[2][slot]),
                             row["buckets"], lambda e: e, numel, case["B"], P, M)


@FEW
@given(routing(), st.booleans(), st.sampled_from([None, "map_first", "map_after"]))
def test_base_out_poisoned(case, larger, map_mode):
    ids, E, B = case["ids"], case["E"], case["B"]
    emap = None if map_mode is None else make_expert_map(case["rng"], E, "shard_random")
    ignore = map_mode == "map_first"
    want = oracle_base(ids, E, B, expert_map=emap, ignore_invalid_experts=ignore,
                       pad_sorted_ids=case["pad"])
    P, M, numel = want["P"], want["M"], want["numel"]
    extra = (11, 4, 3, 6) if larger else (0, 0, 0, 0)
    out = tuple(np.full(n + x, POISON, np.int32) for n, x in zip((P, M, 1, numel), extra))
    res = moe_align_block_size(ids, B, E, emap, ignore_invalid_experts=ignore,
                               pad_sorted_ids=case["pad"], return_scatter_idx=True,
                               deterministic=True, out=out)
    assert all(r is o for r, o in zip(res, out))
    np.testing.assert_array_equal(out[0][:P], want["sorted"])
    np.testing.assert_array_equal(out[1][:M], want["experts"])
    assert out[2][0] == want["ntpp"]
    if map_mode != "map_after":
        np.testing.assert_array_equal(out[3][:numel], want["scatter"])
    for buf, n in zip(out, (P, M, 1, numel)):
        assert (buf[n:] == POISON).all()


@FEW
@given(lora_case(), st.booleans(), st.booleans())
def test_align_moe_and_lora_equals_separate_calls(case, ignore_invalid, with_out):
    ids, E, B, R = case["ids"], case["E"], case["B"], case["max_loras"]
    P, M = oracle_sizes(ids.size, E, B, case["pad"])
    kw = {}
    if with_out:
        kw = dict(out_base=(np.full(P, POISON, np.int32), np.full(M, POISON, np.int32),
                            np.full(1, POISON, np.int32)),
                  out_lora=(np.full((R, P), POISON, np.int32), np.full((R, M), POISON, np.int32),
                            np.full(R, POISON, np.int32)))
    base, lora = align_moe_and_lora(
        ids, case["mapping"], B, E, R, lora_ids=case["lora_ids"],
        adapter_enabled=case["adapter_enabled"], expert_map=case["expert_map"],
        ignore_invalid_experts=ignore_invalid, pad_sorted_ids=case["pad"], deterministic=True,
        **kw)
    base2 = moe_align_block_size(ids, B, E, case["expert_map"],
                                 ignore_invalid_experts=ignore_invalid,
                                 pad_sorted_ids=case["pad"], deterministic=True)
    lora_out = None
    if with_out:
        lora_out = tuple(np.full_like(a, POISON) for a in kw["out_lora"])
    lora2 = lora_call(case, deterministic=True, out=lora_out)
    for a, b in zip(base, base2):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(lora, lora2):
        np.testing.assert_array_equal(a, b)
    if with_out:
        assert all(r is o for r, o in zip(base, kw["out_base"]))
        assert all(r is o for r, o in zip(lora, kw["out_lora"]))


# Hypothesis favours small draws; these fixed cases make sure the large end is covered too.
LARGE = [
    (np.int32, 3000, 16, 4096, 256, "uniform", False, None),
    (np.int64, 2048, 8, 256, 64, "invalid", True, "shard_random"),
    (np.uint16, 4000, 4, 4096, 1, "skewed", False, None),
    (np.int8, 3000, 8, 4096, 128, "invalid", False, "arbitrary"),
    (np.uint64, 1500, 16, 512, 16, "invalid", True, "shard_sorted"),
    (np.uint8, 2500, 6, 200, 256, "few", False, None),
    (np.int16, 1, 1, 4096, 256, "uniform", True, "identity"),
    (np.uint32, 3000, 2, 1, 7, "invalid", False, None),
]


@pytest.mark.parametrize("dtype,T,K,E,B,pattern,pad,map_mode", LARGE)
def test_large_base_cases_match_oracle(dtype, T, K, E, B, pattern, pad, map_mode):
    rng = np.random.default_rng(T * 31 + E)
    ids = make_ids(rng, dtype, T, K, E, pattern)
    assert_base_equal(moe_align_block_size(ids, B, E, pad_sorted_ids=pad,
                                           return_scatter_idx=True, deterministic=True),
                      oracle_base(ids, E, B, pad_sorted_ids=pad), scatter=True)
    if map_mode is not None:
        emap = make_expert_map(rng, E, map_mode)
        for ignore in (True, False):
            res = moe_align_block_size(ids, B, E, emap, ignore_invalid_experts=ignore,
                                       pad_sorted_ids=pad, deterministic=True)
            assert_base_equal(res, oracle_base(ids, E, B, expert_map=emap,
                                               ignore_invalid_experts=ignore,
                                               pad_sorted_ids=pad))


@pytest.mark.parametrize("dtype,T,K,E,B,R,map_mode", [
    (np.int32, 2000, 8, 256, 64, 8, None),
    (np.uint32, 1500, 4, 4096, 16, 4, "shard_random"),
    (np.int64, 3000, 2, 64, 1, 6, None),
])
def test_large_lora_cases_match_oracle(dtype, T, K, E, B, R, map_mode):
    rng = np.random.default_rng(T + E + R)
    ids = make_ids(rng, dtype, T, K, E, "invalid")
    mapping = rng.integers(-1, R, size=T).astype(np.int32)
    uniq = np.unique(mapping).tolist()
    lora_ids = i32(uniq + [-1] * (R + 1 - len(uniq)))
    enabled = np.ones(R + 1, dtype=np.int32)
    enabled[1] = 0
    emap = None if map_mode is None else make_expert_map(rng, E, map_mode)
    res = moe_lora_align_block_size(ids, mapping, B, E, R, lora_ids=lora_ids,
                                    adapter_enabled=enabled, expert_map=emap,
                                    deterministic=True)
    want = oracle_lora(ids, mapping, E, B, R, lora_ids=lora_ids, adapter_enabled=enabled,
                       expert_map=emap)
    assert 1 not in want["processed"] and len(want["processed"]) == R - 1
    assert_lora_allocated(res, want, R)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_every_dtype_same_result(dtype):
    rng = np.random.default_rng(7)
    E = 100
    ids = rng.integers(0, E, size=(37, 4)).astype(dtype)
    ids[0, 0] = E  # out of range: dropped
    ids[1, 1] = np.iinfo(dtype).max  # out of range for every dtype (max >= 127 > E)
    if np.iinfo(dtype).min < 0:
        ids[2, 2] = np.iinfo(dtype).min
        ids[3, 3] = -1
    ref = oracle_base(ids, E, 8)
    assert ref["ntpp"] > 0
    assert_base_equal(moe_align_block_size(ids, 8, E, deterministic=True), ref)
    assert_base_equal(moe_align_block_size(ids.astype(np.int64), 8, E, deterministic=True), ref)


def test_huge_unsigned_ids_are_dropped():
    ids = np.array([[2**64 - 1, 1], [2**63, 0], [2**63 - 1, 3]], dtype=np.uint64)
    res = moe_align_block_size(ids, 2, 4, return_scatter_idx=True, deterministic=True)
    assert_base_equal(res, oracle_base(ids, 4, 2), scatter=True)
    np.testing.assert_array_equal(res.scatter_idx, [-1, 1, -1, 3, -1, 5])


def test_strided_topk_ids():
    rng = np.random.default_rng(3)
    wide = rng.integers(-2, 20, size=(50, 12)).astype(np.int32)
    view = wide[:, ::3]  # [50, 4], not contiguous
    res = moe_align_block_size(view, 4, 18, deterministic=True)
    assert_base_equal(res, oracle_base(np.ascontiguousarray(view), 18, 4))


def test_deterministic_is_bit_identical_across_runs():
    rng = np.random.default_rng(11)
    ids = rng.integers(0, 64, size=(500, 8)).astype(np.int32)
    mapping = rng.integers(-1, 4, size=500).astype(np.int32)
    a = moe_lora_align_block_size(ids, mapping, 16, 64, 4, deterministic=True)
    b = moe_lora_align_block_size(ids, mapping, 16, 64, 4, deterministic=True)
    for x, y in zip(a, b):
        assert x.tobytes() == y.tobytes()


# ---------------------------------------------------------------------------------------------
# Targeted LoRA cases
# ---------------------------------------------------------------------------------------------
def test_lora_unlisted_and_unused_slots():
    ids = np.array([[0, 1], [1, 1], [2, 0]], dtype=np.int32)
    mapping = i32([2, 2, -1])
    # every slot processed by default; slots 0, 1 and 3 have no tokens: the empty alignment
    res = moe_lora_align_block_size(ids, mapping, 2, 3, 4, deterministic=True)
    want = oracle_lora(ids, mapping, 3, 2, 4)
    assert want["processed"] == {0, 1, 2, 3}
    assert_lora_allocated(res, want, 4)
    # slot 2 = tokens 0, 1 = routes 0 (e0), 1, 2, 3 (e1): segments [0, 2) and [2, 6)
    np.testing.assert_array_equal(res.num_tokens_post_pad, [0, 0, 6, 0])
    np.testing.assert_array_equal(res.sorted_token_ids[2], [0, 6, 1, 2, 3, 6, 6, 6, 6])
    np.testing.assert_array_equal(res.expert_ids[2], [0, 1, 1, -1, -1])

    # lora_ids listing slot 2 only, plus entries to skip (-1, >= max_loras)
    out = (np.full((4, 9), POISON, np.int32), np.full((4, 5), POISON, np.int32),
           np.full(4, POISON, np.int32))
    P, M = buffer_sizes(6, 3, 2)
    assert (P, M) == (9, 5)
    moe_lora_align_block_size(ids, mapping, 2, 3, 4, lora_ids=i32([-1, 2, 4, 7, -1]),
                              deterministic=True, out=out)
    for slot in (0, 1, 3):
        assert (out[0][slot] == POISON).all() and (out[1][slot] == POISON).all()
        assert out[2][slot] == POISON
    np.testing.assert_array_equal(out[0][2], res.sorted_token_ids[2])
    np.testing.assert_array_equal(out[1][2], res.expert_ids[2])
    assert out[2][2] == 6


def test_lora_all_base_tokens():
    ids = np.array([[0, 1], [1, 1]], dtype=np.int32)
    res = moe_lora_align_block_size(ids, i32([-1, -1]), 4, 2, 3, deterministic=True)
    np.testing.assert_array_equal(res.num_tokens_post_pad, [0, 0, 0])
    assert (res.sorted_token_ids == 4).all() and (res.expert_ids == -1).all()


def test_lora_expert_map_applied_first():
    ids = np.array([[0, 1], [2, 3], [3, 0]], dtype=np.int32)
    mapping = i32([0, 0, 1])
    emap = i32([-1, 1, 0, -1])  # global 2 -> local 0, global 1 -> local 1
    res = moe_lora_align_block_size(ids, mapping, 2, 4, 2, expert_map=emap, deterministic=True)
    want = oracle_lora(ids, mapping, 4, 2, 2, expert_map=emap)
    assert_lora_allocated(res, want, 2)
    np.testing.assert_array_equal(res.sorted_token_ids[0][:4], [2, 6, 1, 6])
    np.testing.assert_array_equal(res.expert_ids[0][:2], [0, 1])
    np.testing.assert_array_equal(res.num_tokens_post_pad, [4, 0])


# ---------------------------------------------------------------------------------------------
# Zero tokens
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("K,E,B,pad", [(1, 1, 1, False), (2, 4, 4, False), (8, 256, 64, True),
                                       (16, 4096, 256, False)])
def test_zero_tokens_base(K, E, B, pad):
    ids = np.zeros((0, K), dtype=np.int32)
    res = moe_align_block_size(ids, B, E, pad_sorted_ids=pad, return_scatter_idx=True)
    P, M = buffer_sizes(0, E, B, pad)
    assert res.sorted_token_ids.shape == (P,) and res.expert_ids.shape == (M,)
    assert (res.sorted_token_ids == 0).all() and (res.expert_ids == -1).all()
    np.testing.assert_array_equal(res.num_tokens_post_pad, [0])
    assert res.scatter_idx.shape == (0,)
    emap = np.arange(E, dtype=np.int32)
    for ignore in (True, False):
        r = moe_align_block_size(ids, B, E, emap, ignore_invalid_experts=ignore)
        np.testing.assert_array_equal(r.num_tokens_post_pad, [0])
    out = (np.full(4, POISON, np.int32), np.full(3, POISON, np.int32),
           np.full(1, POISON, np.int32))
    moe_align_block_size(ids, B, E, out=out, pad_sorted_ids=pad)
    assert out[2][0] == 0


@pytest.mark.parametrize("K,E,B,R", [(1, 1, 1, 1), (2, 4, 4, 3), (8, 256, 64, 8)])
def test_zero_tokens_lora(K, E, B, R):
    ids = np.zeros((0, K), dtype=np.int64)
    mapping = np.zeros(0, dtype=np.int32)
    res = moe_lora_align_block_size(ids, mapping, B, E, R,
                                    lora_ids=i32([-1] + list(range(R))))
    np.testing.assert_array_equal(res.num_tokens_post_pad, np.zeros(R))
    P, M = buffer_sizes(0, E, B)
    assert res.sorted_token_ids.shape == (R, P) and res.expert_ids.shape == (R, M)
    base, lora = align_moe_and_lora(ids, mapping, B, E, R)
    np.testing.assert_array_equal(base.num_tokens_post_pad, [0])
    np.testing.assert_array_equal(lora.num_tokens_post_pad, np.zeros(R))


# ---------------------------------------------------------------------------------------------
# Buffer sizes
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("numel,E,B,pad,P,M", [
    (8, 4, 4, False, 20, 5),           # the base worked example
    (8, 3, 2, False, 11, 6),           # the LoRA worked example
    (8, 3, 2, True, 12, 6),
    (0, 4, 4, False, 0, 0),            # numel < E: min(numel*B, P)
    (0, 1, 16, True, 0, 0),
    (1, 256, 16, False, 16, 1),        # min(16, 1 + 256*15)
    (3, 8, 4, True, 12, 3),            # 27 -> 28 padded, then min(12, 28)
    (4, 5, 3, True, 12, 4),            # 14 -> 15 padded, then min(12, 15)
    (5, 5, 3, False, 15, 5),           # numel == E: no min
    (10, 4, 1, False, 10, 10),         # B = 1: no padding at all
    (10, 4, 1, True, 10, 10),
    (100, 1, 7, False, 106, 16),       # M = ceil(106 / 7)
    (100, 1, 7, True, 112, 16),
    (7, 3, 256, True, 1024, 4),        # 772 -> 1024
    (7, 3, 256, False, 772, 4),
    (1048576, 256, 64, False, 1064704, 16636),
    (2048 * 8, 4096, 256, False, 1060864, 4144),
])
def test_buffer_sizes_table(numel, E, B, pad, P, M):
    assert buffer_sizes(numel, E, B, pad) == (P, M)
    assert buffer_sizes(numel, E, B, pad_sorted_ids=pad) == (P, M)
    assert oracle_sizes(numel, E, B, pad) == (P, M)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 4096), st.integers(1, 256), st.booleans())
def test_buffer_sizes_formula(numel, E, B, pad):
    assert buffer_sizes(numel, E, B, pad) == oracle_sizes(numel, E, B, pad)


def test_allocated_outputs_have_contract_sizes():
    ids = np.zeros((5, 3), dtype=np.int16)
    res = moe_align_block_size(ids, 8, 10, pad_sorted_ids=True)
    P, M = buffer_sizes(15, 10, 8, True)
    assert res.sorted_token_ids.shape == (P,) and res.expert_ids.shape == (M,)
    assert res.num_tokens_post_pad.shape == (1,)
    lres = moe_lora_align_block_size(ids, i32([0] * 5), 8, 10, 3, pad_sorted_ids=True)
    assert lres.sorted_token_ids.shape == (3, P) and lres.expert_ids.shape == (3, M)


# ---------------------------------------------------------------------------------------------
# One million routes through the NumPy backend (a smoke run, no timing asserted)
# ---------------------------------------------------------------------------------------------
def test_one_million_routes():
    T, K, E, B = 131072, 8, 256, 64
    rng = np.random.default_rng(2024)
    ids = rng.integers(0, E, size=(T, K)).astype(np.int32)
    res = moe_align_block_size(ids, B, E, deterministic=True)
    numel = T * K
    counts = np.bincount(ids.reshape(-1), minlength=E)
    padded = (counts + B - 1) // B * B
    total = int(padded.sum())
    assert res.num_tokens_post_pad[0] == total
    s = res.sorted_token_ids
    assert s.shape == (buffer_sizes(numel, E, B)[0],)
    real = s[s != numel]
    assert real.size == numel
    np.testing.assert_array_equal(np.sort(real), np.arange(numel))
    # every tile's expert owns the routes in it
    tiles = res.expert_ids[: total // B]
    np.testing.assert_array_equal(tiles, np.repeat(np.arange(E), padded // B))
    assert (res.expert_ids[total // B:] == -1).all()
    flat = ids.reshape(-1)
    tile_of = np.repeat(tiles, B)
    keep = s[:total] != numel
    np.testing.assert_array_equal(flat[s[:total][keep]], tile_of[keep])


# ---------------------------------------------------------------------------------------------
# Torch CPU tensors
# ---------------------------------------------------------------------------------------------
def test_torch_cpu_tensors():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    ids = rng.integers(-1, 12, size=(40, 4)).astype(np.int32)
    mapping = rng.integers(-1, 3, size=40).astype(np.int32)
    base_np = moe_align_block_size(ids, 4, 10, deterministic=True)
    base_t = moe_align_block_size(torch.from_numpy(ids), 4, 10, deterministic=True)
    for a, b in zip(base_t, base_np):
        assert isinstance(a, torch.Tensor) and a.dtype == torch.int32
        np.testing.assert_array_equal(a.numpy(), b)
    lora_np = moe_lora_align_block_size(ids, mapping, 4, 10, 3, deterministic=True)
    lora_t = moe_lora_align_block_size(torch.from_numpy(ids), torch.from_numpy(mapping), 4, 10,
                                       3, deterministic=True)
    for a, b in zip(lora_t, lora_np):
        assert isinstance(a, torch.Tensor)
        np.testing.assert_array_equal(a.numpy(), b)
    P, M = buffer_sizes(160, 10, 4)
    out = (torch.full((P,), POISON, dtype=torch.int32), torch.full((M,), POISON,
                                                                   dtype=torch.int32),
           torch.full((1,), POISON, dtype=torch.int32))
    res = moe_align_block_size(torch.from_numpy(ids), 4, 10, deterministic=True, out=out)
    assert all(r is o for r, o in zip(res, out))
    np.testing.assert_array_equal(out[0].numpy(), base_np.sorted_token_ids)
