"""The torch custom ops on CPU tensors (the host backend): eager, ``torch.library.opcheck``
and ``torch.compile(fullgraph=True)``, against the NumPy backend. Skipped without torch; the
CUDA side is tests/test_gpu_torch_ops.py."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import moe_lora_align as mla  # noqa: E402
from moe_lora_align import torch_ops  # noqa: E402,F401  (registers the ops)

OPS = torch.ops.moe_lora_align
T, K, E, B, L = 12, 4, 16, 4, 3


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(-1, E + 1, size=(T, K)).astype(np.int32)
    mapping = rng.integers(-1, L, size=T).astype(np.int32)
    lora_ids = np.array([-1, 0, 1, 2], np.int32)
    enabled = np.array([1, 0, 1, 1], np.int32)
    return ids, mapping, lora_ids, enabled


def test_public_ops_equal_the_numpy_backend():
    ids, mapping, lora_ids, enabled = _inputs()
    got = OPS.moe_align_block_size(torch.from_numpy(ids), B, E)
    want = mla.moe_align_block_size(ids, B, E)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.numpy(), w)
    got = OPS.moe_lora_align_block_size(torch.from_numpy(ids), torch.from_numpy(mapping), B, E,
                                        L, torch.from_numpy(lora_ids), torch.from_numpy(enabled))
    want = mla.moe_lora_align_block_size(ids, mapping, B, E, L, lora_ids=lora_ids,
                                         adapter_enabled=enabled)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.numpy(), w)


def test_engine_ops_write_the_callers_tensors():
    ids, *_ = _inputs(1)
    P, M = mla.buffer_sizes(T * K, E, B)
    out = [torch.full((n,), -7, dtype=torch.int32) for n in (P + 3, M + 1, 1)]
    assert OPS.vllm_moe_align_block_size(torch.from_numpy(ids), E, B, *out) is None
    want = mla.moe_align_block_size(ids, B, E)
    np.testing.assert_array_equal(out[0][:P].numpy(), want.sorted_token_ids)
    np.testing.assert_array_equal(out[1][:M].numpy(), want.expert_ids)


def _opcheck_samples():
    ids, mapping, lora_ids, enabled = _inputs(2)
    t = {k: torch.from_numpy(v) for k, v in
         dict(ids=ids, mapping=mapping, lora_ids=lora_ids, enabled=enabled).items()}
    P, M = mla.buffer_sizes(T * K, E, B)
    bufs = lambda n: [torch.zeros(x, dtype=torch.int32) for x in n]  # noqa: E731
    return [
        (OPS.moe_align_block_size, (t["ids"], B, E)),
        (OPS.moe_lora_align_block_size, (t["ids"], t["mapping"], B, E, L, t["lora_ids"],
                                         t["enabled"])),
        (OPS.vllm_moe_align_block_size, (t["ids"], E, B, *bufs((P, M, 1)))),
        (OPS.vllm_moe_lora_align_block_size, (t["ids"], t["mapping"], E, B, L, P, M,
                                              *bufs((L * P, L * M, L)), t["enabled"],
                                              t["lora_ids"])),
        (OPS.sglang_moe_align_block_size, (t["ids"], E, B, *bufs((P, M, 1, E + 2)))),
    ]


@pytest.mark.parametrize("index", range(5))
def test_opcheck(index):
    op, args = _opcheck_samples()[index]
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor",
                                                "test_aot_dispatch_dynamic"))


def test_compile_fullgraph():
    ids, mapping, lora_ids, enabled = _inputs(3)

    def step(topk_ids, token_lora_mapping):
        base = OPS.moe_align_block_size(topk_ids, B, E)
        lora = OPS.moe_lora_align_block_size(topk_ids, token_lora_mapping, B, E, L)
        return base[2] + lora[2].sum(), base, lora

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    total, base, lora = compiled(torch.from_numpy(ids), torch.from_numpy(mapping))
    want_b = mla.moe_align_block_size(ids, B, E)
    want_l = mla.moe_lora_align_block_size(ids, mapping, B, E, L)
    np.testing.assert_array_equal(base[0].numpy(), want_b.sorted_token_ids)
    np.testing.assert_array_equal(lora[0].numpy(), want_l.sorted_token_ids)
    assert int(total[0]) == int(want_b.num_tokens_post_pad[0]) + int(
        want_l.num_tokens_post_pad.sum())


def test_dtypes_numpy_lacks_are_named():
    """A torch dtype NumPy has no type for (bfloat16) gets the argument's own dtype error,
    from the public functions and the ops alike."""
    ids, mapping, _, _ = _inputs()
    with pytest.raises(TypeError, match="topk_ids must have an integer dtype.*bfloat16"):
        mla.moe_align_block_size(torch.from_numpy(ids).bfloat16(), B, E)
    with pytest.raises(TypeError, match="topk_ids must have an integer dtype.*bfloat16"):
        OPS.moe_align_block_size(torch.from_numpy(ids).bfloat16(), B, E)
    with pytest.raises(TypeError, match="token_lora_mapping must be int32.*bfloat16"):
        mla.moe_lora_align_block_size(torch.from_numpy(ids),
                                      torch.from_numpy(mapping).bfloat16(), B, E, L)
