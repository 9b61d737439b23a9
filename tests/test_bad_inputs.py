"""The README's table of bad inputs: every row raises the error it names, naming the argument,
before anything is allocated or written (host arrays; CI runs this without a GPU)."""

from __future__ import annotations

from pathlib import Path

import dataclasses
import numpy as np
import pytest

import moe_lora_align as mla

T, K, E, B, R = 6, 2, 4, 4, 3
NUMEL = T * K
P, M = mla.buffer_sizes(NUMEL, E, B)
POISON = -7777
IDS = (np.arange(NUMEL) % E).astype(np.int32).reshape(T, K)
MAPPING = np.array([0, 1, 2, -1, 0, 1], dtype=np.int32)


def base_out():
    return [np.full(n, POISON, np.int32) for n in (P, M, 1)]


def lora_out():
    return [np.full(s, POISON, np.int32) for s in ((R, P), (R, M), (R,))]


def read_only(n):
    x = np.full(n, POISON, np.int32)
    x.flags.writeable = False
    return x


class Call:
    """A public call with its arguments, and the NumPy out= buffers it was given."""

    def __init__(self, fn, **kwargs):
        self.fn, self.kwargs = fn, kwargs
        out = kwargs.get("out")
        self.outs = [a for a in out if isinstance(a, np.ndarray)] \
            if isinstance(out, (list, tuple)) else []

    def __call__(self):
        return self.fn(**self.kwargs)


def base(**kw):
    return Call(mla.moe_align_block_size, **{"topk_ids": IDS, "block_size": B,
                                             "num_experts": E, **kw})


def lora(**kw):
    return Call(mla.moe_lora_align_block_size, **{
        "topk_ids": IDS, "token_lora_mapping": MAPPING, "block_size": B, "num_experts": E,
        "max_loras": R, **kw})


_shared = np.full(P + M + 1, POISON, np.int32)

# (README row, the call, the outputs it was given, error type, words the message holds)
CASES = [
    ("`topk_ids=None`", base(topk_ids=None), None, TypeError, "topk_ids is required"),
    ("`topk_ids` a string or another object that is not array-like", base(topk_ids="ids"),
     None, TypeError, "topk_ids: unsupported array type"),
    ("`topk_ids` a ragged list", base(topk_ids=[[0, 1], [2]]), None, ValueError,
     "topk_ids is not an array NumPy can make"),
    ("`topk_ids` float or bool", base(topk_ids=IDS.astype(np.float32)), None, TypeError,
     "topk_ids must have an integer dtype"),
    ("`topk_ids` not 2-D (a scalar too)", base(topk_ids=5), None, ValueError,
     "topk_ids must be 2-D"),
    ("`block_size`, `num_experts`, `max_loras` not integers (`12.9`, `\"12\"`, `True`)",
     base(block_size=4.0), None, TypeError, "block_size must be an integer"),
    ("`block_size`, `num_experts`, `max_loras` <= 0", lora(max_loras=0), None, ValueError,
     "max_loras must be >= 1"),
    ("`num_experts` above int32 (`2**31`, `2**63`)", base(num_experts=2**63), None,
     ValueError, "num_experts must be <= 2147483647"),
    ("more buckets than `MAX_BUCKETS` (`max_loras * num_experts`)",
     lora(num_experts=2**16, max_loras=2**16), None, ValueError, "buckets, more than the"),
    ("`P` or `M` overflowing int32 indices",
     base(topk_ids=np.zeros((2**16, 1), np.int32), block_size=2**16, num_experts=2**16),
     None, ValueError, "sorted_token_ids.*overflow int32"),
    ("outputs larger than the device's (or host's) memory", None, None, ValueError,
     "the outputs need"),
    ("`out=5` (not a tuple)", base(out=5), None, TypeError, "out must be a tuple of 3 arrays"),
    ("`out` with the wrong number of arrays", base(out=base_out()[:2]), None, ValueError,
     "out must hold 3 arrays"),
    ("`None` in `out` (also `out=(None, None, None)`, or `None` for `scatter_idx`)",
     base(out=base_out()[:2] + [None]), "given", TypeError, "out num_tokens_post_pad is None"),
    ("a Python list in `out`", base(out=[[0] * P, [0] * M, [0]]), None, TypeError,
     "out sorted_token_ids must be an array"),
    ("an `out` buffer too small", base(out=[np.full(P - 1, POISON, np.int32)] + base_out()[1:]),
     "given", ValueError, "out sorted_token_ids is too small"),
    ("an `out` buffer not int32", base(out=[np.zeros(P, np.int64)] + base_out()[1:]), "given",
     TypeError, "out sorted_token_ids must be int32"),
    ("an `out` buffer not C-contiguous",
     base(out=base_out()[:1] + [np.full(2 * M, POISON, np.int32)[::2]] + base_out()[2:]),
     "given", ValueError, "out expert_ids must be C-contiguous"),
    ("a read-only `out` buffer", base(out=base_out()[:2] + [read_only(1)]), "given",
     ValueError, "out num_tokens_post_pad is read-only"),
    ("`out` buffers that overlap each other",
     base(out=[_shared[:P], _shared[P - 1:P - 1 + M], _shared[-1:]]), "given", ValueError,
     "out sorted_token_ids and out expert_ids overlap"),
    ("an `out` buffer that overlaps an input", None, None, ValueError,
     "out sorted_token_ids and topk_ids overlap"),
    ("`out_base` overlapping `out_lora`, or an input of the LoRA side", None, None, ValueError,
     "out_base sorted_token_ids and out_lora num_tokens_post_pad overlap"),
    ("a JAX array in `out`", None, None, TypeError, "JAX array, which cannot be written"),
    ("`token_lora_mapping=None`", lora(token_lora_mapping=None), None, TypeError,
     "token_lora_mapping is required"),
    ("`token_lora_mapping` of the wrong length", lora(token_lora_mapping=MAPPING[:-1]), None,
     ValueError, "token_lora_mapping must have exactly 6 entries"),
    ("`token_lora_mapping`, `lora_ids`, `adapter_enabled` or `expert_map` not int32",
     lora(token_lora_mapping=MAPPING.astype(np.int64)), None, TypeError,
     "token_lora_mapping must be int32"),
    ("`token_lora_mapping`, `lora_ids`, `adapter_enabled` or `expert_map` not contiguous "
     "(`topk_ids` is copied)", lora(lora_ids=np.zeros(2 * R + 2, np.int32)[::2]), None,
     ValueError, "lora_ids must be contiguous"),
    ("`lora_ids` or `adapter_enabled` shorter than `max_loras + 1`",
     lora(lora_ids=np.zeros(R, np.int32)), None, ValueError, "lora_ids must have at least 4"),
    ("`expert_map` of the wrong length", base(expert_map=np.zeros(E + 1, np.int32)), None,
     ValueError, "expert_map must have exactly 4 entries"),
    ("`token_lora_mapping` values outside `[-1, max_loras)` (host arrays unless "
     "`validate=False`; device arrays with `validate=True`)",
     lora(out=lora_out(), token_lora_mapping=np.array([0, 1, 2, R, 0, 1], np.int32)), "given",
     ValueError, "token_lora_mapping\\[3\\] = 3"),
    ("`lora_ids` listing a slot twice in its first `max_loras + 1` entries",
     lora(out=lora_out(), lora_ids=np.array([1, 1, -1, -1], np.int32)), "given", ValueError,
     "lora_ids lists slot 1 more than once"),
    ("`expert_map` values outside `[-1, num_experts)`",
     base(out=base_out(), expert_map=np.array([0, 1, 2, -5], np.int32)), "given", ValueError,
     "expert_map\\[3\\] = -5"),
    ("arrays on the host and the GPU, or on two GPUs", None, None, ValueError,
     "on the host or all on the same GPU"),
    ("unknown `variant` or `streams`", base(variant="fast"), None, ValueError,
     "variant must be one of"),
    ("a forced `variant` that cannot run the sizes", None, None, ValueError,
     "variant='shared' cannot run"),
    ("`deterministic`, `pad_sorted_ids`, `ignore_invalid_experts` and other flags not "
     "booleans (0 and 1 pass)", base(deterministic="yes"), None, TypeError,
     "deterministic must be True or False"),
    ("`AlignPlan` without a GPU", None, None, RuntimeError, "AlignPlan needs CuPy and a CUDA GPU"),
]
# Rows the table covers with a test elsewhere in this file (they need a second setup).
ELSEWHERE = {
    "outputs larger than the device's (or host's) memory": "test_outputs_larger_than_memory",
    "an `out` buffer that overlaps an input": "test_out_overlapping_an_input",
    "`out_base` overlapping `out_lora`, or an input of the LoRA side":
        "test_base_and_lora_outputs_overlapping",
    "a JAX array in `out`": "test_jax_out_is_refused",
    "arrays on the host and the GPU, or on two GPUs": "tests/test_gpu_kernels.py",
    "a forced `variant` that cannot run the sizes": "tests/test_dispatch.py",
    "`AlignPlan` without a GPU": "test_align_plan_checks_before_the_device",
}


def _cells(path=Path(__file__).resolve().parents[1] / "README.md"):
    text = path.read_text()
    section = text[text.index("### Bad inputs"):]
    section = section[section.index("| --"):section.index("\n\n", section.index("| --"))]
    return [line.split(" | ")[0][2:] for line in section.splitlines()[1:]]


def test_readme_table_rows_are_all_tested():
    rows = _cells()
    assert rows == [c[0] for c in CASES]


def test_rows_without_a_call_here_are_tested_elsewhere():
    assert {c[0] for c in CASES if c[1] is None} == set(ELSEWHERE)


@pytest.mark.parametrize("row,call,given,error,words", [c for c in CASES if c[1] is not None])
def test_bad_input_row(row, call, given, error, words):
    # The poisoned out= buffers a call was given are left exactly as they were.
    before = [a.copy() for a in call.outs]
    with pytest.raises(error, match=words):
        call()
    for was, now in zip(before, call.outs):
        np.testing.assert_array_equal(was, now)


def test_outputs_larger_than_memory(monkeypatch):
    monkeypatch.setattr(mla._call, "_available_memory", lambda where, device: 64)
    with pytest.raises(ValueError, match="the outputs need"):
        base()()


def test_out_overlapping_an_input():
    buf = np.zeros(P + NUMEL, np.int32)
    ids = buf[P - 1:P - 1 + NUMEL].reshape(T, K)  # its first route is the output's last entry
    ids[:] = IDS
    with pytest.raises(ValueError, match="out sorted_token_ids and topk_ids overlap"):
        mla.moe_align_block_size(ids, B, E, out=(buf[:P], np.zeros(M, np.int32),
                                                 np.zeros(1, np.int32)))
    np.testing.assert_array_equal(buf[:P - 1], 0)


def test_base_and_lora_outputs_overlapping():
    out_b, out_l = base_out(), lora_out()
    out_l[2] = out_b[0][:R]
    with pytest.raises(ValueError, match="out_base sorted_token_ids and out_lora "
                                         "num_tokens_post_pad overlap"):
        mla.align_moe_and_lora(IDS, MAPPING, B, E, R, out_base=out_b, out_lora=out_l)
    assert all((a == POISON).all() for a in out_b + out_l)


@pytest.mark.parametrize("name", ["token_lora_mapping", "lora_ids", "adapter_enabled"])
def test_base_outputs_overlapping_a_lora_input(name):
    """The base side's out= buffers must not share memory with an input only the LoRA side
    reads: the base alignment would overwrite it before the LoRA one reads it."""
    inputs = {"token_lora_mapping": MAPPING.copy(),
              "lora_ids": np.array([0, 1, 2, -1], np.int32),
              "adapter_enabled": np.ones(R + 1, np.int32)}
    before = inputs[name].copy()
    out_b = base_out()[:2] + [inputs[name][:1]]
    with pytest.raises(ValueError, match=f"out_base num_tokens_post_pad and {name} overlap"):
        mla.align_moe_and_lora(IDS, inputs["token_lora_mapping"], B, E, R,
                               lora_ids=inputs["lora_ids"],
                               adapter_enabled=inputs["adapter_enabled"], out_base=out_b)
    np.testing.assert_array_equal(inputs[name], before)
    assert all((a == POISON).all() for a in out_b[:2])


@pytest.mark.parametrize("flag", ["deterministic", "pad_sorted_ids", "ignore_invalid_experts",
                                  "return_scatter_idx"])
@pytest.mark.parametrize("value", [2, -1, "no", None, []])
def test_flags_take_true_false_0_and_1_only(flag, value):
    with pytest.raises(TypeError, match=f"{flag} must be True or False"):
        base(expert_map=np.arange(E, dtype=np.int32), **{flag: value})()
    for ok in (0, 1, np.bool_(True)):
        base(expert_map=np.arange(E, dtype=np.int32), **{flag: ok})()


def test_error_names_a_pair_output_once():
    out_l = lora_out()
    out_l[2] = np.full(1, POISON, np.int32)
    with pytest.raises(ValueError, match="^out_lora num_tokens_post_pad is too small"):
        mla.align_moe_and_lora(IDS, MAPPING, B, E, R, out_lora=out_l)


def test_scratch_bytes_without_a_gpu_asks_for_limits():
    if mla.gpu_available():
        pytest.skip("a GPU is here")
    with pytest.raises(RuntimeError, match="scratch_bytes needs the device's limits"):
        mla.scratch_bytes(8, E, B)
    with pytest.raises(ValueError, match="max_loras must be >= 1"):
        mla.scratch_bytes(8, E, B, max_loras=0, limits=mla._dispatch.DeviceLimits.h200())


def test_jax_out_is_refused():
    jnp = pytest.importorskip("jax.numpy")
    with pytest.raises(TypeError, match="JAX array, which cannot be written"):
        base(out=[jnp.zeros(P, np.int32)] + base_out()[1:])()


@pytest.mark.parametrize("kw,error,words", [
    (dict(variant="x"), ValueError, "variant must be one of"),
    (dict(streams="x"), ValueError, "streams must be one of"),
    (dict(dtype=np.float32), TypeError, "dtype must be an integer dtype"),
    (dict(max_loras=0), ValueError, "max_loras must be >= 1"),
    (dict(device=-1), ValueError, "device must be >= 0"),
    (dict(deterministic="no"), TypeError, "deterministic must be True or False"),
])
def test_align_plan_checks_before_the_device(kw, error, words):
    args = dict(max_tokens=16, topk=2, num_experts=E, block_size=B)
    with pytest.raises(error, match=words):
        mla.AlignPlan(**args, **kw)


def test_align_plan_without_a_gpu_says_so():
    if mla.gpu_available():
        pytest.skip("a GPU is here")
    with pytest.raises(RuntimeError, match="AlignPlan needs CuPy and a CUDA GPU"):
        mla.AlignPlan(16, 2, E, B)


@pytest.mark.parametrize("value", [12.9, "12", True, None, 2**63])
def test_buffer_sizes_takes_integers_only(value):
    with pytest.raises((TypeError, ValueError), match="numel"):
        mla.buffer_sizes(value, E, B)


def test_lora_ids_past_the_read_entries_are_not_checked():
    ids = np.array([0, 1, -1, -1, 1, 1, 99], np.int32)  # only the first R + 1 are read
    res = mla.moe_lora_align_block_size(IDS, MAPPING, B, E, R, lora_ids=ids)
    assert res.num_tokens_post_pad[2] == 0


def test_more_routes_than_supported():
    ids = np.broadcast_to(np.int8(1), (mla.MAX_ROUTES + 1, 1))  # no memory behind it
    with pytest.raises(ValueError, match="routes, more than the"):
        mla.moe_align_block_size(ids, B, E)
    mla._checks.check_sizes(mla.MAX_ROUTES, 1, 1, 1, 1)


def test_scratch_bytes_formula():
    h200 = mla._dispatch.DeviceLimits.h200()
    # decode: one block, a workspace of 1 bucket's worth unused, b = 256
    assert mla.scratch_bytes(8, 256, 64, limits=h200) == 4 * (5 * 256 + 10 + 1)
    # deterministic prefill, sorted inside the cooperative launch: no matrix
    sort = dataclasses.replace(mla.AlignPolicy(), sort_min_buckets=0)
    assert mla.scratch_bytes(32768, 256, 64, deterministic=True, limits=h200,
                             policy=sort) == 4 * (5 * 256 + 10 + 1)
    # ranked in flat order (the cooperative kernel's ordered ranks, or count + place's):
    # per-block or per-chunk counts, blocks * b
    no_coop = dataclasses.replace(h200, cooperative=False)
    ordered = dataclasses.replace(mla.AlignPolicy(), sort_for_determinism=False)
    for limits in (h200, no_coop):
        launch = mla._dispatch.choose_launch(32768, 256, 1, limits, deterministic=True,
                                             out_entries=32768 * 2 + 256 * 64, policy=ordered)
        assert launch.deterministic and not launch.sorted and not launch.order_grid
        chunks = (launch.grid - launch.fill_grid) // launch.ranges
        assert mla.scratch_bytes(32768, 256, 64, deterministic=True, limits=limits,
                                 policy=ordered) == 4 * (5 * 256 + 10 + chunks * 256)
