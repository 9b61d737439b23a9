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


# ---- every engine op under torch.compile(fullgraph=True) and torch.cuda.graph -------------
def _engine_step(op):
    """A step calling one engine op into preallocated torch buffers, and how to read what it
    wrote as (base result or None, LoRA result or None)."""
    from test_compat_sglang import sglang_buffers
    from test_compat_vllm import vllm_base_buffers, vllm_lora_buffers

    cuda = lambda x: torch.from_numpy(np.ascontiguousarray(x)).cuda()  # noqa: E731
    P, M = mla.buffer_sizes(T * K, E, B)
    if op == "vllm_base":
        bufs = [cuda(b) for b in vllm_base_buffers(T * K, E, B)]
        step = lambda ids, mapping: OPS.vllm_moe_align_block_size(ids, E, B, *bufs)  # noqa
        read = lambda: ((bufs[0][:P], bufs[1][:M], bufs[2]), None)  # noqa: E731
    elif op == "sglang":
        # SGLang passes E + 1 experts (its last id marks filtered routes) and sizes for it.
        bufs = [cuda(b) for b in sglang_buffers(T * K, E - 1, B, False)]
        bufs[0].fill_(T * K)
        step = lambda ids, mapping: OPS.sglang_moe_align_block_size(  # noqa: E731
            ids, E, B, *bufs, False)
        read = lambda: ((bufs[0][:P], bufs[1][:M], bufs[2]), None)  # noqa: E731
    else:  # "vllm_lora"
        padded, blocks, host = vllm_lora_buffers(T * K, E, B, L)
        bufs = [cuda(b) for b in host]
        lora_ids = cuda(np.arange(-1, L, dtype=np.int32))
        enabled = cuda(np.ones(L + 1, np.int32))
        step = lambda ids, mapping: OPS.vllm_moe_lora_align_block_size(  # noqa: E731
            ids, mapping, E, B, L, padded, blocks, *bufs, enabled, lora_ids)
        read = lambda: (None, (bufs[0].view(L, padded)[:, :P], bufs[1].view(L, blocks)[:, :M],  # noqa
                               bufs[2]))
    return step, read


def _check_sides(base, lora, ids, mapping):
    if base is not None:
        want = mla.moe_align_block_size(ids, B, E)
        sb = segment_starts(ids, E, B)
        np.testing.assert_array_equal(canonical(base[0].cpu().numpy()[None], sb),
                                      canonical(want.sorted_token_ids[None], sb))
        np.testing.assert_array_equal(base[1].cpu().numpy(), want.expert_ids)
        np.testing.assert_array_equal(base[2].cpu().numpy(), want.num_tokens_post_pad)
    if lora is not None:
        want = mla.moe_lora_align_block_size(ids, mapping, B, E, L)
        sl = segment_starts(ids, E, B, rows=L, mapping=mapping)
        np.testing.assert_array_equal(canonical(lora[0].cpu().numpy(), sl),
                                      canonical(want.sorted_token_ids, sl))
        np.testing.assert_array_equal(lora[1].cpu().numpy(), want.expert_ids)
        np.testing.assert_array_equal(lora[2].cpu().numpy(), want.num_tokens_post_pad)


@pytest.mark.parametrize("op", ["vllm_base", "vllm_lora", "sglang"])
def test_engine_ops_compiled_fullgraph(op):
    step, read = _engine_step(op)
    compiled = torch.compile(step, fullgraph=True)
    for seed in range(3):
        ids, mapping = _inputs(20 + seed)
        compiled(torch.from_numpy(ids).cuda(), torch.from_numpy(mapping).cuda())
        torch.cuda.synchronize()
        _check_sides(*read(), ids, mapping)


@pytest.mark.parametrize("op", ["public", "vllm_lora", "sglang"])
def test_ops_under_cuda_graph_capture(op):
    # The public ops return new tensors each call: read what the captured call returned.
    run, read = (step, None) if op == "public" else _engine_step(op)
    ids, mapping = _inputs(30)
    t_ids, t_map = torch.from_numpy(ids).cuda(), torch.from_numpy(mapping).cuda()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        run(t_ids, t_map)  # warm-up where the capture runs
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        captured = run(t_ids, t_map)
    for seed in (31, 32):
        ids, mapping = _inputs(seed)
        t_ids.copy_(torch.from_numpy(ids))
        t_map.copy_(torch.from_numpy(mapping))
        graph.replay()
        torch.cuda.synchronize()
        _check_sides(*(captured if op == "public" else read()), ids, mapping)


# ---- the full path with torch tensors: ordered on torch's stream, legal inside a capture ---
def test_full_path_call_inside_a_torch_capture():
    # out= buffers of a new length: a call unlike any before it, so not a prepared one. Its
    # stream's workspace is ready (the warm-up), so it may be captured: converting the tensors
    # must not touch the legacy stream, which a torch capture refuses.
    ids, _ = _inputs(40)
    t = torch.from_numpy(ids).cuda()
    P, M = mla.buffer_sizes(T * K, E, B)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        mla.moe_align_block_size(t, B, E, out=[torch.empty(n, dtype=torch.int32, device="cuda")
                                               for n in (P, M, 1)])
    torch.cuda.synchronize()
    out = [torch.full((n,), -7, dtype=torch.int32, device="cuda") for n in (P + 4, M + 4, 1)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        mla.moe_align_block_size(t, B, E, out=out)
    ids, _ = _inputs(41)
    t.copy_(torch.from_numpy(ids))
    graph.replay()
    torch.cuda.synchronize()
    _check_sides((out[0][:P], out[1][:M], out[2]), None, ids, None)


def test_full_path_work_is_ordered_on_torchs_stream():
    # A late producer on a torch side stream (non-blocking) writes the routes and the mapping
    # over invalid values. validate=True reads the mapping and a strided topk_ids is copied:
    # both must wait for the producer, as the kernels do.
    import cupy

    from gpu_util import delayed_copy

    ids, mapping = _inputs(42)
    wide = np.repeat(ids, 2, axis=1)  # topk_ids = wide[:, ::2], a strided view
    src_ids, src_map = torch.from_numpy(wide).cuda(), torch.from_numpy(mapping).cuda()
    t_wide = torch.full_like(src_ids, 10**6)
    t_map = torch.full_like(src_map, 10**6)
    delayed_copy(cupy.zeros(1, np.int32), cupy.zeros(1, np.int32), 0)  # compiled here
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        with cupy.cuda.ExternalStream(side.cuda_stream):
            delayed_copy(cupy.from_dlpack(src_ids).reshape(-1),
                         cupy.from_dlpack(t_wide).reshape(-1), 20_000_000)
            delayed_copy(cupy.from_dlpack(src_map), cupy.from_dlpack(t_map), 0)
        base = mla.moe_align_block_size(t_wide[:, ::2], B, E, validate=True)
        lora = mla.moe_lora_align_block_size(t_wide[:, ::2], t_map, B, E, L, validate=True)
    torch.cuda.synchronize()
    _check_sides(base, lora, ids, mapping)
