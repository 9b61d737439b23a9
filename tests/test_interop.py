"""Arrays of other libraries through the array protocols, one framework a call, and JAX's
jit refused clearly (host side; no GPU needed)."""

import numpy as np
import pytest

import moe_lora_align as mla

IDS = np.array([[1, 3], [0, 1], [3, 1], [5, -1]], np.int32)


class ArrayOnly:
    """Another library's host array, seen through __array__ alone."""

    def __init__(self, a):
        self._a = a

    def __array__(self, dtype=None, copy=None):
        return self._a if dtype is None else self._a.astype(dtype)


class DLPackOnly:
    """Another library's host array, seen through DLPack alone."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


@pytest.mark.parametrize("wrap", [ArrayOnly, DLPackOnly])
def test_protocol_arrays_run_on_the_host_and_answer_in_numpy(wrap):
    got = mla.moe_align_block_size(wrap(IDS), 4, 4)
    want = mla.moe_align_block_size(IDS, 4, 4)
    assert isinstance(got.sorted_token_ids, np.ndarray)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    lora = mla.moe_lora_align_block_size(wrap(IDS), wrap(np.array([0, -1, 1, 0], np.int32)),
                                         4, 4, 2)
    assert int(np.asarray(lora.num_tokens_post_pad).sum()) > 0


def test_dlpack_out_buffers_are_written():
    P, M = mla.buffer_sizes(IDS.size, 4, 4)
    out = [np.full(n, -7, np.int32) for n in (P, M, 1)]
    got = mla.moe_align_block_size(IDS, 4, 4, out=[DLPackOnly(o) for o in out])
    assert int(out[2][0]) == 12 and isinstance(got.num_tokens_post_pad, DLPackOnly)


def test_array_only_out_buffers_are_refused():
    P, M = mla.buffer_sizes(IDS.size, 4, 4)
    with pytest.raises(TypeError, match="out sorted_token_ids must be an array to write into"):
        mla.moe_align_block_size(IDS, 4, 4, out=[ArrayOnly(np.zeros(P, np.int32)),
                                                 np.zeros(M, np.int32), np.zeros(1, np.int32)])


def test_two_frameworks_in_one_call_are_refused():
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="token_lora_mapping is a numpy array but topk_ids is "
                                         "a torch array"):
        mla.moe_lora_align_block_size(torch.from_numpy(IDS), np.zeros(4, np.int32), 4, 4, 2)


def test_plain_python_data_mixes_with_any_framework():
    mapping = np.array([0, -1, 1, 0], np.int32)
    res = mla.moe_lora_align_block_size(IDS.tolist(), mapping, 4, 4, 2)
    want = mla.moe_lora_align_block_size(IDS, mapping, 4, 4, 2)
    np.testing.assert_array_equal(res.sorted_token_ids, want.sorted_token_ids)


def test_jax_jit_is_refused_clearly():
    jax = pytest.importorskip("jax")

    @jax.jit
    def f(ids):
        return mla.moe_align_block_size(ids, 4, 4).num_tokens_post_pad

    with pytest.raises(TypeError, match="cannot run inside jax.jit"):
        f(IDS)
