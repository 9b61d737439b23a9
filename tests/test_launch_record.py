"""The launcher's recording of direct launches (what AlignPlan replays), without a GPU: the
driver call is replaced by a stand-in that logs its arguments."""

from types import SimpleNamespace

import numpy as np

from moe_lora_align import _launch


def _fake_driver(monkeypatch):
    """Both driver launchers logged; a cooperative call's arguments are tagged with it."""
    calls = []

    def launcher(cooperative=False):
        return lambda *a: calls.append(("coop",) + a if cooperative else a)

    monkeypatch.setattr(_launch, "_direct_launcher", launcher)
    return calls


def _job(addr):
    return SimpleNamespace(packed=np.zeros(8, np.uint8), params=np.zeros(1, np.uint64),
                           params_addr=addr, pair_params=None)


def test_recorded_launches_replay_on_another_stream(monkeypatch):
    calls = _fake_driver(monkeypatch)
    ks = SimpleNamespace(handle={("single", False): 111, ("count", 0): 222}.get)
    job = _job(0xABC0)
    with _launch.record_launches() as recorded:
        _launch.launch_kernel(ks, ("single", False), 1, 256, 4096, SimpleNamespace(ptr=7), job)
        _launch.launch_kernel(ks, ("count", 0), 132, 1024, 0, SimpleNamespace(ptr=7), job)
    assert [(r.fn, r.grid, r.block, r.smem, r.stream_ptr, r.params_addr) for r in recorded] == \
        [(111, 1, 256, 4096, 7, 0xABC0), (222, 132, 1024, 0, 7, 0xABC0)]
    assert recorded[0].held[0][1] is job.packed  # the bytes behind the address stay alive
    calls.clear()
    _launch.replay_launches(_launch.replay_form(recorded), 9)
    assert calls == [(111, 1, 1, 1, 256, 1, 1, 4096, 9, 0xABC0, 0),
                     (222, 132, 1, 1, 1024, 1, 1, 0, 9, 0xABC0, 0)]


def test_cooperative_launches_replay_through_the_cooperative_launcher(monkeypatch):
    calls = _fake_driver(monkeypatch)
    ks = SimpleNamespace(handle={("cooperative", 0): 333, ("single", False): 111}.get)
    job = _job(0xDEF0)
    with _launch.record_launches() as recorded:
        _launch.launch_kernel(ks, ("cooperative", 0), 128, 1024, 60000, SimpleNamespace(ptr=7),
                              job, cooperative=True)
        _launch.launch_kernel(ks, ("single", False), 1, 256, 0, SimpleNamespace(ptr=7), job)
    assert calls[0] == ("coop", 333, 128, 1, 1, 1024, 1, 1, 60000, 7, 0xDEF0, 0)
    assert [r.cooperative for r in recorded] == [True, False]
    calls.clear()
    _launch.replay_launches(_launch.replay_form(recorded), 9)
    assert calls == [("coop", 333, 128, 1, 1, 1024, 1, 1, 60000, 9, 0xDEF0, 0),
                     (111, 1, 1, 1, 256, 1, 1, 0, 9, 0xDEF0, 0)]


def test_cooperative_launch_without_the_driver_launcher_is_an_error(monkeypatch):
    monkeypatch.setattr(_launch, "_direct_launcher", lambda cooperative=False: None)
    ks = SimpleNamespace(handle={}.get)
    try:
        _launch.launch_kernel(ks, ("cooperative", 0), 1, 1024, 0, SimpleNamespace(ptr=1),
                              _job(16), cooperative=True)
    except RuntimeError as e:
        assert "launchCooperativeKernel" in str(e)
    else:
        raise AssertionError("expected a RuntimeError")


def test_recording_stops_after_the_block(monkeypatch):
    _fake_driver(monkeypatch)
    ks = SimpleNamespace(handle={("single", False): 111}.get)
    with _launch.record_launches() as recorded:
        pass
    _launch.launch_kernel(ks, ("single", False), 1, 128, 0, SimpleNamespace(ptr=1), _job(16))
    assert recorded == []


def test_array_pointers_are_the_first_nine_fields():
    packed = np.zeros(_launch.PROBLEM_DTYPE.itemsize, np.uint8)
    _launch.POINTERS.pack_into(packed, 0, *range(1, 10))
    view = np.frombuffer(packed, dtype=_launch.PROBLEM_DTYPE)[0]
    assert _launch._POINTERS[:9] == ("topk_ids", "token_slot", "lora_ids", "adapter_enabled",
                                     "expert_map", "sorted_ids", "expert_ids", "num_post_pad",
                                     "scatter_idx")
    assert [int(view[n]) for n in _launch._POINTERS[:9]] == list(range(1, 10))
