"""deterministic=True: 100 runs bit-identical, and equal to the NumPy backend (GPU only).

Every variant (the dispatcher's choice, shared, global, cooperative; a forced one the
dispatcher refuses is skipped), base, LoRA and both together, uniform and skewed routing, at
a prefill size and a decode size; each through both ways to deterministic output: every
segment sorted after the free-order kernels ("sorted", at every size: inside the cooperative
launch, ``align_order`` after count + place), and the kernels' own ordered ranks ("ordered",
``sort_for_determinism=False``). The outputs are out= buffers poisoned before every run, so a
run that leaves an entry unwritten cannot pass by reading the previous run's value.
"""

import dataclasses

import numpy as np
import pytest

import fuzz_cases as fc
import moe_lora_align as mla
from gpu_util import POISON, cupy, make_lora, requires_gpu

pytestmark = [requires_gpu, pytest.mark.gpu]

RUNS = 100
SIZES = {"prefill": (4096, 8, 256, 64, 16), "decode": (16, 8, 256, 16, 16)}  # T, K, E, B, L
VARIANTS = [None, "shared", "global", "cooperative", "cluster"]
POLICIES = {"sorted": mla.AlignPolicy(sort_min_buckets=0),
            "ordered": dataclasses.replace(mla.AlignPolicy(), sort_for_determinism=False)}


def _inputs(size, kind):
    T, K, E, B, L = SIZES[size]
    rng = np.random.default_rng([T, len(kind)])
    if kind == "skewed":
        ids = np.full((T, K), 3, dtype=np.int32)
        ids[:, 1::2] = 200  # two experts take every route
    else:
        ids = rng.integers(E, size=(T, K)).astype(np.int32)
    mapping, lora_ids, enabled = make_lora(rng, T, L, disabled=1)
    return ids, mapping, lora_ids, enabled


def _outputs(mode, P, M, L):
    base = [cupy.empty(n, np.int32) for n in (P, M, 1)] if mode != "lora" else None
    lora = [cupy.empty((L, n), np.int32) for n in (P, M)] + [cupy.empty(L, np.int32)] \
        if mode != "base" else None
    return base, lora


def _call(mode, d, B, E, L, variant, base_out, lora_out, policy):
    ids, mapping, lora_ids, enabled = d
    lkw = dict(lora_ids=lora_ids, adapter_enabled=enabled)
    if mode == "base":
        mla.moe_align_block_size(ids, B, E, deterministic=True, variant=variant, out=base_out,
                                 policy=policy)
    elif mode == "lora":
        mla.moe_lora_align_block_size(ids, mapping, B, E, L, deterministic=True,
                                      variant=variant, out=lora_out, policy=policy, **lkw)
    else:
        mla.align_moe_and_lora(ids, mapping, B, E, L, deterministic=True, variant=variant,
                               out_base=base_out, out_lora=lora_out, policy=policy, **lkw)


@pytest.mark.parametrize("how", list(POLICIES))
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v or "default")
@pytest.mark.parametrize("mode", ["base", "lora", "pair"])
@pytest.mark.parametrize("kind", ["uniform", "skewed"])
@pytest.mark.parametrize("size", list(SIZES))
def test_deterministic_runs_are_bit_identical(size, kind, mode, variant, how):
    policy = POLICIES[how]
    T, K, E, B, L = SIZES[size]
    host = _inputs(size, kind)
    d = [cupy.asarray(x) for x in host]
    P, M = mla.buffer_sizes(T * K, E, B)
    base_out, lora_out = _outputs(mode, P, M, L)
    outs = (base_out or []) + (lora_out or [])
    for x in outs:
        x.fill(POISON)
    try:
        _call(mode, d, B, E, L, variant, base_out, lora_out, policy)
    except ValueError as e:
        if variant is not None and "variant" in str(e):
            pytest.skip(f"{variant} refused: {e}")
        raise
    first = [x.copy() for x in outs]
    cupy.cuda.get_current_stream().synchronize()

    # equal to the NumPy backend, exactly (unprocessed rows keep the poison on both sides)
    ids, mapping, lora_ids, enabled = host
    ref = []
    if mode != "lora":
        ref += list(mla.moe_align_block_size(ids, B, E))
    if mode != "base":
        lo = [np.full((L, P), POISON, np.int32), np.full((L, M), POISON, np.int32),
              np.full(L, POISON, np.int32)]
        mla.moe_lora_align_block_size(ids, mapping, B, E, L, lora_ids=lora_ids,
                                      adapter_enabled=enabled, out=lo)
        ref += lo
    for name, g, w in zip(("sorted", "experts", "ntpp") * 2, first, ref):
        g = g.get()
        if not np.array_equal(g, w):
            raise AssertionError(fc._first_diff(f"first run {name}", g, w))

    mismatches = cupy.zeros(1, dtype=cupy.int64)
    for _ in range(RUNS - 1):
        for x in outs:
            x.fill(POISON)
        _call(mode, d, B, E, L, variant, base_out, lora_out, policy)
        for x, f in zip(outs, first):
            mismatches += cupy.count_nonzero(x != f)
    assert int(mismatches.get()[0]) == 0, f"{int(mismatches.get()[0])} entries differed " \
                                          f"from the first run over {RUNS - 1} runs"
