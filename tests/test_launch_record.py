"""The launcher's recording of direct launches (what AlignPlan replays), without a GPU: the
driver call is replaced by a stand-in that logs its arguments."""

from types import SimpleNamespace

import numpy as np

from moe_lora_align import _launch


def _fake_driver(monkeypatch):
    calls = []
    monkeypatch.setattr(_launch, "_direct_launcher", lambda: lambda *a: calls.append(a))
    return calls


def _job(addr):
    return SimpleNamespace(packed=np.zeros(8, np.uint8), params=np.zeros(1, np.uint64),
                           params_addr=addr, pair_params=None)


def test_recorded_launches_replay_on_another_stream(monkeypatch):
    calls = _fake_driver(monkeypatch)
    ks = SimpleNamespace(handles={("single", False): 111, ("count", 0): 222})
    job = _job(0xABC0)
    with _launch.record_launches() as recorded:
        _launch.launch_kernel(ks, ("single", False), 1, 256, 4096, SimpleNamespace(ptr=7), job)
        _launch.launch_kernel(ks, ("count", 0), 132, 1024, 0, SimpleNamespace(ptr=7), job)
    assert [(r.fn, r.grid, r.block, r.smem, r.stream_ptr, r.params_addr) for r in recorded] == \
        [(111, 1, 256, 4096, 7, 0xABC0), (222, 132, 1024, 0, 7, 0xABC0)]
    assert recorded[0].held[0][1] is job.packed  # the bytes behind the address stay alive
    calls.clear()
    _launch.replay_launches(recorded, 9)
    assert calls == [(111, 1, 1, 1, 256, 1, 1, 4096, 9, 0xABC0, 0),
                     (222, 132, 1, 1, 1024, 1, 1, 0, 9, 0xABC0, 0)]


def test_recording_stops_after_the_block(monkeypatch):
    _fake_driver(monkeypatch)
    ks = SimpleNamespace(handles={("single", False): 111})
    with _launch.record_launches() as recorded:
        pass
    _launch.launch_kernel(ks, ("single", False), 1, 128, 0, SimpleNamespace(ptr=1), _job(16))
    assert recorded == []


def test_input_pointers_are_the_first_five_fields():
    packed = np.zeros(_launch.PROBLEM_DTYPE.itemsize, np.uint8)
    _launch.set_input_pointers(packed, 1, 2, 3, 4, 5)
    view = np.frombuffer(packed, dtype=_launch.PROBLEM_DTYPE)[0]
    assert [int(view[n]) for n in _launch._POINTERS[:5]] == [1, 2, 3, 4, 5]
