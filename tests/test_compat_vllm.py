"""``compat.vllm``: vLLM's raw-op signatures, fed buffers sized and filled the way vLLM's Python
wrappers size them, against the NumPy backend (host arrays here; torch CUDA tensors in
tests/test_gpu_compat.py)."""

import numpy as np
import pytest

import moe_lora_align as mla
from moe_lora_align.compat import vllm

POISON = -7777


def vllm_base_buffers(numel, E, B, pad_sorted_ids=False, xp=np):
    """As vLLM's moe_align_block_size wrapper sizes them (uninitialised: poisoned here)."""
    padded = numel + E * (B - 1)
    if pad_sorted_ids:
        padded = -(-padded // B) * B
    blocks = -(-padded // B)
    return (xp.full(padded, POISON, np.int32), xp.full(blocks, POISON, np.int32),
            xp.full(1, POISON, np.int32))


def vllm_lora_buffers(numel, E, B, L, xp=np):
    padded = numel + E * (B - 1)
    blocks = -(-padded // B)
    return padded, blocks, (xp.full(L * padded, POISON, np.int32),
                            xp.full(L * blocks, POISON, np.int32), xp.full(L, POISON, np.int32))


@pytest.mark.parametrize("T,K,E,B", [(4, 8, 256, 64), (1, 1, 8, 16), (37, 2, 7, 4),
                                     (300, 8, 64, 16), (0, 8, 64, 16)])
@pytest.mark.parametrize("with_map", [False, True])
def test_moe_align_block_size(T, K, E, B, with_map):
    rng = np.random.default_rng(T + E)
    ids = rng.integers(-1, E + 1, size=(T, K)).astype(np.int32)
    emap = None
    if with_map:
        emap = np.full(E, -1, np.int32)
        local = rng.choice(E, size=max(1, E // 2), replace=False)
        emap[np.sort(local)] = np.arange(local.size, dtype=np.int32)
    sorted_ids, expert_ids, ntpp = vllm_base_buffers(T * K, E, B)
    assert vllm.moe_align_block_size(ids, E, B, sorted_ids, expert_ids, ntpp, emap) is None
    ref = mla.moe_align_block_size(ids, B, E, emap)  # vLLM maps tile ids after counting
    P, M = mla.buffer_sizes(T * K, E, B)
    np.testing.assert_array_equal(sorted_ids[:P], ref.sorted_token_ids)
    np.testing.assert_array_equal(expert_ids[:M], ref.expert_ids)
    np.testing.assert_array_equal(ntpp, ref.num_tokens_post_pad)
    assert (sorted_ids[P:] == POISON).all() and (expert_ids[M:] == POISON).all()


def test_the_engine_order_matters():
    """The project's own function takes (topk_ids, block_size, num_experts): called in vLLM's
    order it aligns something else. The drop-in exists for that."""
    ids = np.arange(32, dtype=np.int32).reshape(4, 8) * 7 % 256
    sorted_ids, expert_ids, ntpp = vllm_base_buffers(32, 256, 64)
    vllm.moe_align_block_size(ids, 256, 64, sorted_ids, expert_ids, ntpp)
    kept = (sorted_ids[:int(ntpp[0])] < 32).sum()
    assert kept == 32
    wrong = mla.moe_align_block_size(ids, 256, 64)  # block_size=256, num_experts=64
    assert (wrong.sorted_token_ids < 32).sum() < 32


@pytest.mark.parametrize("T,K,E,B,L", [(16, 8, 64, 16, 4), (1, 2, 8, 4, 1), (100, 4, 33, 8, 16)])
@pytest.mark.parametrize("with_map", [False, True])
def test_moe_lora_align_block_size(T, K, E, B, L, with_map):
    rng = np.random.default_rng(T * L + E)
    ids = rng.integers(0, E, size=(T, K)).astype(np.int32)
    mapping = rng.integers(-1, L, size=T).astype(np.int32)
    used = np.unique(mapping[mapping >= 0])
    lora_ids = np.full(L + 1, -1, np.int32)
    lora_ids[1:1 + used.size] = used            # vLLM: -1 may sit at position 0
    enabled = np.ones(L + 1, np.int32)
    if L > 1:
        enabled[used[:1]] = 0                   # one adapter disabled
    emap = None
    if with_map:
        emap = np.full(E, -1, np.int32)
        local = rng.choice(E, size=max(1, E // 2), replace=False)
        emap[np.sort(local)] = np.arange(local.size, dtype=np.int32)
    padded, blocks, (sorted_ids, expert_ids, ntpp) = vllm_lora_buffers(T * K, E, B, L)
    assert vllm.moe_lora_align_block_size(ids, mapping, E, B, L, padded, blocks, sorted_ids,
                                          expert_ids, ntpp, enabled, lora_ids, emap) is None
    out = (np.full((L, padded), POISON, np.int32), np.full((L, blocks), POISON, np.int32),
           np.full(L, POISON, np.int32))
    mla.moe_lora_align_block_size(ids, mapping, B, E, L, lora_ids=lora_ids,
                                  adapter_enabled=enabled, expert_map=emap, out=out)
    np.testing.assert_array_equal(sorted_ids.reshape(L, padded), out[0])
    np.testing.assert_array_equal(expert_ids.reshape(L, blocks), out[1])
    np.testing.assert_array_equal(ntpp, out[2])
    processed = mla._reference.processed_rows(L, lora_ids, enabled)
    assert (sorted_ids.reshape(L, padded)[~processed] == POISON).all()  # left as they were


def test_buffers_too_small_are_named():
    ids = np.zeros((4, 2), np.int32)
    with pytest.raises(ValueError, match="sorted_token_ids"):
        vllm.moe_align_block_size(ids, 8, 4, np.zeros(3, np.int32), np.zeros(9, np.int32),
                                  np.zeros(1, np.int32))


@pytest.mark.parametrize("change,error,words", [
    (dict(sorted_token_ids=np.full(21, POISON, np.int32)), ValueError,
     "sorted_token_ids must be a flat array of at least"),
    (dict(sorted_token_ids=np.full((2, 40), POISON, np.int32)), ValueError,
     "sorted_token_ids must be a flat array"),
    (dict(experts_ids=None), TypeError, "experts_ids must be a flat int32 array"),
    (dict(max_num_tokens_padded=-1), ValueError, "max_num_tokens_padded must be >= 1"),
    (dict(max_num_m_blocks=2.0), TypeError, "max_num_m_blocks must be an integer"),
    (dict(max_loras=2.0), TypeError, "max_loras must be an integer"),
])
def test_lora_arguments_are_named_before_anything_is_written(change, error, words):
    """The flat buffers and the sizes that cut them into rows are checked first: a buffer
    too small or not flat, or a size that is not a positive integer, is named."""
    args = dict(topk_ids=np.array([[0, 1], [2, 3]], np.int32),
                token_lora_mapping=np.array([0, 1], np.int32), num_experts=4, block_size=4,
                max_loras=2, max_num_tokens_padded=40, max_num_m_blocks=10,
                sorted_token_ids=np.full(80, POISON, np.int32),
                experts_ids=np.full(20, POISON, np.int32),
                num_tokens_post_pad=np.full(2, POISON, np.int32),
                adapter_enabled=np.ones(3, np.int32), lora_ids=np.array([0, 1, -1], np.int32))
    args.update(change)
    with pytest.raises(error, match=words):
        vllm.moe_lora_align_block_size(**args)
    for name in ("sorted_token_ids", "experts_ids", "num_tokens_post_pad"):
        if isinstance(args[name], np.ndarray):
            assert (args[name] == POISON).all(), name
