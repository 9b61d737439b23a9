"""``compat.vllm`` with torch CUDA tensors, as vLLM calls it, against the NumPy backend
(GPU and torch only)."""

import numpy as np
import pytest

import moe_lora_align as mla
from gpu_util import requires_gpu
from moe_lora_align.testing import canonical, segment_starts
from moe_lora_align.compat import vllm
from test_compat_vllm import POISON, vllm_base_buffers, vllm_lora_buffers

pytestmark = [requires_gpu, pytest.mark.gpu]
torch = pytest.importorskip("torch")


def cuda(x):
    return torch.from_numpy(np.ascontiguousarray(x)).cuda()


@pytest.mark.parametrize("T,K,E,B", [(4, 8, 256, 64), (255, 8, 64, 16), (4096, 8, 256, 64)])
def test_moe_align_block_size_torch(T, K, E, B):
    rng = np.random.default_rng(T)
    ids = rng.integers(-1, E + 1, size=(T, K)).astype(np.int32)
    bufs = [cuda(b) for b in vllm_base_buffers(T * K, E, B)]
    for _ in range(3):  # the second and third calls take the prepared path
        vllm.moe_align_block_size(cuda(ids), E, B, *bufs)
    torch.cuda.synchronize()
    ref = mla.moe_align_block_size(ids, B, E, deterministic=True)
    P, M = mla.buffer_sizes(T * K, E, B)
    got = [b.cpu().numpy() for b in bufs]
    total = int(got[2][0])
    assert total == int(ref.num_tokens_post_pad[0])
    np.testing.assert_array_equal(got[1][:M], ref.expert_ids)
    for e in range(E):  # each expert's segment holds the same routes (order is free)
        seg = ref.expert_ids == e
        rows = np.flatnonzero(np.repeat(seg, B)[:P])
        np.testing.assert_array_equal(np.sort(got[0][rows]), np.sort(ref.sorted_token_ids[rows]))
    assert (got[0][P:] == POISON).all()


@pytest.mark.parametrize("T,K,E,B,L", [(16, 8, 64, 16, 4), (512, 8, 256, 64, 16)])
def test_moe_lora_align_block_size_torch(T, K, E, B, L):
    rng = np.random.default_rng(T * L)
    ids = rng.integers(0, E, size=(T, K)).astype(np.int32)
    mapping = rng.integers(-1, L, size=T).astype(np.int32)
    used = np.unique(mapping[mapping >= 0])
    lora_ids = np.full(L + 1, -1, np.int32)
    lora_ids[1:1 + used.size] = used
    enabled = np.ones(L + 1, np.int32)
    padded, blocks, bufs = vllm_lora_buffers(T * K, E, B, L)
    tb = [cuda(b) for b in bufs]
    vllm.moe_lora_align_block_size(cuda(ids), cuda(mapping), E, B, L, padded, blocks, *tb,
                                   cuda(enabled), cuda(lora_ids))
    torch.cuda.synchronize()
    out = (np.full((L, padded), POISON, np.int32), np.full((L, blocks), POISON, np.int32),
           np.full(L, POISON, np.int32))
    mla.moe_lora_align_block_size(ids, mapping, B, E, L, lora_ids=lora_ids,
                                  adapter_enabled=enabled, out=out)
    got = [b.cpu().numpy() for b in tb]
    np.testing.assert_array_equal(got[1].reshape(L, blocks), out[1])
    np.testing.assert_array_equal(got[2], out[2])
    # each expert's segment holds the same routes (order inside a segment is free)
    starts = segment_starts(ids, E, B, rows=L, mapping=mapping, lora_ids=lora_ids,
                            enabled=enabled)
    np.testing.assert_array_equal(canonical(got[0].reshape(L, padded), starts),
                                  canonical(out[0], starts))


@pytest.mark.parametrize("pad", [False, True])
def test_sglang_moe_align_block_size_torch(pad):
    from moe_lora_align.compat import sglang
    from test_compat_sglang import sglang_buffers

    T, K, E, B = 300, 8, 64, 16
    ids = np.random.default_rng(5).integers(0, E + 1, size=(T, K)).astype(np.int32)
    bufs = [cuda(b) for b in sglang_buffers(T * K, E, B, pad)]
    if not pad:
        bufs[0].fill_(T * K)
    sglang.moe_align_block_size(cuda(ids), E + 1, B, *bufs, pad)
    torch.cuda.synchronize()
    ref = mla.moe_align_block_size(ids, B, E + 1, pad_sorted_ids=pad, deterministic=True)
    P, M = mla.buffer_sizes(T * K, E + 1, B, pad)
    got = [b.cpu().numpy() for b in bufs]
    np.testing.assert_array_equal(got[1][:M], ref.expert_ids)
    np.testing.assert_array_equal(got[2], ref.num_tokens_post_pad)
    # each expert's segment holds the same routes (order inside a segment is free; an
    # expert with more than B routes may split them across its tiles in any way)
    starts = segment_starts(ids, E + 1, B)
    np.testing.assert_array_equal(canonical(got[0][:P], starts),
                                  canonical(ref.sorted_token_ids, starts))
    assert (got[0][P:] == T * K).all()
