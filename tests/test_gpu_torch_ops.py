"""The torch custom ops on CUDA tensors: eager, torch.compile(fullgraph=True) and
torch.cuda.graph capture, against the NumPy backend (GPU and torch only)."""

import numpy as np
import pytest

from gpu_util import canonical, requires_gpu, segment_starts

pytestmark = [requires_gpu, pytest.mark.gpu]
torch = pytest.importorskip("torch")

import moe_lora_align as mla  # noqa: E402
from moe_lora_align import torch_ops  # noqa: E402,F401

OPS = torch.ops.moe_lora_align
T, K, E, B, L = 64, 8, 64, 16, 4


def _inputs(seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, E, size=(T, K)).astype(np.int32)
    mapping = rng.integers(-1, L, size=T).astype(np.int32)
    return ids, mapping


def _check(base, lora, ids, mapping):
    want_b = mla.moe_align_block_size(ids, B, E)
    want_l = mla.moe_lora_align_block_size(ids, mapping, B, E, L)
    sb, sl = segment_starts(ids, E, B), segment_starts(ids, E, B, rows=L, mapping=mapping)
    got_b = [x.cpu().numpy() for x in base]
    got_l = [x.cpu().numpy() for x in lora]
    np.testing.assert_array_equal(canonical(got_b[0][None], sb),
                                  canonical(want_b.sorted_token_ids[None], sb))
    np.testing.assert_array_equal(got_b[1], want_b.expert_ids)
    np.testing.assert_array_equal(canonical(got_l[0], sl), canonical(want_l.sorted_token_ids, sl))
    np.testing.assert_array_equal(got_l[1], want_l.expert_ids)
    np.testing.assert_array_equal(got_l[2], want_l.num_tokens_post_pad)


def step(topk_ids, token_lora_mapping):
    return (OPS.moe_align_block_size(topk_ids, B, E),
            OPS.moe_lora_align_block_size(topk_ids, token_lora_mapping, B, E, L))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compile"])
def test_ops_eager_and_compiled(compiled):
    fn = torch.compile(step, fullgraph=True) if compiled else step
    for seed in range(3):
        ids, mapping = _inputs(seed)
        base, lora = fn(torch.from_numpy(ids).cuda(), torch.from_numpy(mapping).cuda())
        torch.cuda.synchronize()
        _check(base, lora, ids, mapping)


def test_engine_op_under_cuda_graph_capture():
    ids, _ = _inputs(5)
    t = torch.from_numpy(ids).cuda()
    P, M = mla.buffer_sizes(T * K, E, B)
    out = [torch.empty(n, dtype=torch.int32, device="cuda") for n in (P, M, 1)]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        OPS.vllm_moe_align_block_size(t, E, B, *out)  # warm-up where the capture runs
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        OPS.vllm_moe_align_block_size(t, E, B, *out)
    for seed in (6, 7):
        ids, _ = _inputs(seed)
        t.copy_(torch.from_numpy(ids))
        graph.replay()
        torch.cuda.synchronize()
        want = mla.moe_align_block_size(ids, B, E)
        sb = segment_starts(ids, E, B)
        np.testing.assert_array_equal(canonical(out[0][:P].cpu().numpy()[None], sb),
                                      canonical(want.sorted_token_ids[None], sb))
        np.testing.assert_array_equal(out[1][:M].cpu().numpy(), want.expert_ids)
