"""``compat.sglang``: SGLang's raw-op signature, fed buffers the way SGLang's wrapper sizes
them (``num_experts + 1`` experts, the filtered id ``num_experts`` a bucket of its own),
against the NumPy backend."""

import numpy as np
import pytest

import moe_lora_align as mla
from moe_lora_align.compat import sglang

POISON = -7777


def sglang_buffers(numel, E, B, pad):
    """As SGLang's wrapper sizes them for ``E`` experts (it passes ``E + 1`` to the op, and
    rounds the length up to ``B`` when it pads)."""
    padded = numel + (E + 1) * (B - 1)
    if pad:
        padded = -(-padded // B) * B
    blocks = -(-padded // B)
    return (np.full(padded, POISON, np.int32), np.full(blocks, POISON, np.int32),
            np.full(1, POISON, np.int32), np.zeros(E + 2, np.int32))


@pytest.mark.parametrize("T,K,E,B", [(4, 8, 256, 64), (1, 1, 8, 16), (37, 2, 7, 4),
                                     (300, 8, 64, 16)])
@pytest.mark.parametrize("pad", [False, True])
def test_moe_align_block_size(T, K, E, B, pad):
    rng = np.random.default_rng(T + E)
    ids = rng.integers(0, E + 1, size=(T, K)).astype(np.int32)  # E: a filtered route
    sorted_ids, expert_ids, ntpp, cumsum = sglang_buffers(T * K, E, B, pad)
    if not pad:
        sorted_ids[:] = T * K  # SGLang's caller fills the sentinel itself without padding
    assert sglang.moe_align_block_size(ids, E + 1, B, sorted_ids, expert_ids, ntpp, cumsum,
                                       pad) is None
    ref = mla.moe_align_block_size(ids, B, E + 1, pad_sorted_ids=pad)
    P, M = mla.buffer_sizes(T * K, E + 1, B, pad)
    np.testing.assert_array_equal(sorted_ids[:P], ref.sorted_token_ids)
    np.testing.assert_array_equal(expert_ids[:M], ref.expert_ids)
    np.testing.assert_array_equal(ntpp, ref.num_tokens_post_pad)
    assert (sorted_ids[P:] == T * K).all()  # the sentinel to the end of the buffer
    assert (cumsum == 0).all()              # the engine's scratch: not written


def test_topk_ids_as_a_list_with_padding():
    """A Python list of ids, which the public functions take, pads to the buffer's end too."""
    ids = [[0, 1], [2, 3]]
    sorted_ids, expert_ids, ntpp, cumsum = sglang_buffers(4, 4, 4, True)
    sglang.moe_align_block_size(ids, 5, 4, sorted_ids, expert_ids, ntpp, cumsum, True)
    P, _ = mla.buffer_sizes(4, 5, 4, True)
    ref = mla.moe_align_block_size(np.array(ids, np.int32), 4, 5, pad_sorted_ids=True)
    np.testing.assert_array_equal(sorted_ids[:P], ref.sorted_token_ids)
    assert (sorted_ids[P:] == 4).all()
