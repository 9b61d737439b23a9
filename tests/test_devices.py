"""Which device a call runs on, decided from its inputs, and state kept per device: the
host-side half of multi-GPU support (the two-GPU runs are tests/test_gpu_*.py on a 2-GPU
machine)."""

from types import SimpleNamespace

import numpy as np
import pytest

from moe_lora_align import _call, _checks
from test_call_path import FakeCupy


def on(device):
    return SimpleNamespace(device=SimpleNamespace(id=device))


def test_the_inputs_device_is_the_calls():
    assert _checks.check_same_device({"topk_ids": on(1), "expert_map": None,
                                      "out sorted_token_ids": on(1)}) == 1


def test_inputs_split_over_two_gpus_are_refused_by_name():
    with pytest.raises(ValueError, match="token_lora_mapping is on GPU 0 but topk_ids is on "
                                         "GPU 1"):
        _checks.check_same_device({"topk_ids": on(1), "token_lora_mapping": on(0)})


@pytest.fixture
def fake_gpu(monkeypatch):
    """Two fake GPUs: CuPy-like arrays, a current device, a current stream."""
    state = SimpleNamespace(current=0)
    monkeypatch.setattr(_call, "_KINDS", {FakeCupy: "cupy"})
    monkeypatch.setattr(_call, "_fast", {"get_device": lambda: state.current,
                                         "current_stream": lambda: SimpleNamespace(ptr=7)})
    return state


def _key(ids):
    opts = ("base", 16, 64, None, False, False, False, False, None, None, None)
    return _call._fast_key(opts, (ids, None, None, None, None), (None, None), None)


def test_prepared_calls_are_kept_apart_per_device(fake_gpu):
    key0 = _key(FakeCupy(100, device=0))
    fake_gpu.current = 1
    key1 = _key(FakeCupy(100, device=1))
    assert key0 is not None and key1 is not None
    assert key0[2] == 0 and key1[2] == 1 and key0[0] != key1[0]


def test_a_call_on_another_gpu_than_the_current_takes_the_full_path(fake_gpu):
    """The prepared path launches without switching devices, so it serves only calls whose
    inputs are on the current device; the full path switches and restores the device."""
    fake_gpu.current = 0
    assert _key(FakeCupy(100, device=1)) is None
    fake_gpu.current = 1
    assert _key(FakeCupy(100, device=1)) is not None


def test_host_arrays_never_reach_the_device_logic():
    assert _call.properties((np.zeros((2, 2), np.int32),)) is None
