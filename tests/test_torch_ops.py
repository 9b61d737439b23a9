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


# ---- torch's bookkeeping of tensors written in place ----------------------------------------
def _outs(P, M, rows=None):
    shapes = [(P,), (M,), (1,)] if rows is None else [(rows, P), (rows, M), (rows,)]
    return tuple(torch.full(s, -7, dtype=torch.int32) for s in shapes)


def _pair_outs():
    P, M = mla.buffer_sizes(T * K, E, B)
    return _outs(P, M), _outs(P, M, L)


@pytest.mark.parametrize("op", ["base", "lora", "pair", "vllm", "vllm lora", "sglang"])
def test_out_tensors_have_their_version_raised(op):
    """Every tensor a call writes in place gets a new version, as after a torch op: autograd
    reads the counter to refuse a backward through a saved tensor that was overwritten."""
    ids, mapping, lora_ids, enabled = (torch.from_numpy(a) for a in _inputs(3))
    (base, lora), P, M = _pair_outs(), *mla.buffer_sizes(T * K, E, B)
    if op == "base":
        written, run = base, lambda: mla.moe_align_block_size(ids, B, E, out=base)
    elif op == "lora":
        written, run = lora, lambda: mla.moe_lora_align_block_size(
            ids, mapping, B, E, L, lora_ids=lora_ids, adapter_enabled=enabled, out=lora)
    elif op == "pair":
        written, run = base + lora, lambda: mla.align_moe_and_lora(
            ids, mapping, B, E, L, lora_ids=lora_ids, adapter_enabled=enabled,
            out_base=base, out_lora=lora)
    elif op == "vllm":
        written, run = base, lambda: mla.compat.vllm.moe_align_block_size(ids, E, B, *base)
    elif op == "vllm lora":
        flat = (torch.zeros(L * P, dtype=torch.int32), torch.zeros(L * M, dtype=torch.int32),
                torch.zeros(L, dtype=torch.int32))
        ids_l = torch.tensor([-1, 0, 1, 2, 2], dtype=torch.int32)[:L + 1]
        on = torch.ones(L + 1, dtype=torch.int32)
        written, run = flat, lambda: mla.compat.vllm.moe_lora_align_block_size(
            ids, mapping, E, B, L, P, M, *flat, on, ids_l)
    else:
        written = _outs(P, M)
        run = lambda: mla.compat.sglang.moe_align_block_size(  # noqa: E731
            ids, E, B, *written, torch.zeros(E + 2, dtype=torch.int32))
    before = [t._version for t in written]
    run()
    assert all(t._version > v for t, v in zip(written, before))
    assert ids._version == 0 and mapping._version == 0  # inputs are read, not written


def test_backward_through_an_overwritten_index_is_refused():
    """The reason for the versions: a gather saved its index, the alignment then rewrote
    that index, and backward would have scattered the gradient to the wrong rows."""
    ids, *_ = _inputs(4)
    out = _outs(*mla.buffer_sizes(T * K, E, B))
    mla.moe_align_block_size(torch.from_numpy(ids), B, E, out=out)
    x = torch.randn(T * K + 1, 2, requires_grad=True)
    picked = x.index_select(0, out[0])
    mla.moe_align_block_size(torch.from_numpy(_inputs(5)[0]), B, E, out=out)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        picked.sum().backward()


def test_inference_tensors_are_written_as_the_custom_ops_write_them():
    """Outputs made under ``torch.inference_mode`` have no version counter. torch's custom
    ops write them outside inference mode too, and so do the public functions."""
    ids, *_ = _inputs(6)
    P, M = mla.buffer_sizes(T * K, E, B)
    with torch.inference_mode():
        out = _outs(P, M)
    mla.moe_align_block_size(torch.from_numpy(ids), B, E, out=out)
    want = mla.moe_align_block_size(ids, B, E)
    np.testing.assert_array_equal(out[0].numpy(), want.sorted_token_ids)
    OPS.vllm_moe_align_block_size(torch.from_numpy(ids), E, B, *out)  # the op agrees


class _Tagged(torch.Tensor):
    """A tensor subclass defined outside torch (its module is this test's)."""


def test_a_tensor_subclass_is_answered_in_torch():
    ids, mapping, _, _ = _inputs(7)
    got = mla.moe_align_block_size(torch.from_numpy(ids).as_subclass(_Tagged), B, E)
    assert all(isinstance(x, torch.Tensor) for x in got)
    np.testing.assert_array_equal(got.sorted_token_ids.numpy(),
                                  mla.moe_align_block_size(ids, B, E).sorted_token_ids)
    got = mla.moe_lora_align_block_size(torch.from_numpy(ids).as_subclass(_Tagged),
                                        torch.from_numpy(mapping), B, E, L)
    assert all(isinstance(x, torch.Tensor) for x in got)
