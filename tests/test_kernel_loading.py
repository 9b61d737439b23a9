"""Kernels load one at a time, on first use: which ones a launch needs, that each compiles once
however many threads ask, and what a failed load leaves behind. CuPy is replaced by a
recorder, so this runs without a GPU (tests/test_compile.py compiles the real thing)."""

import contextlib
import sys
import threading
import time
import types

import numpy as np
import pytest

from moe_lora_align import _dispatch, _kernels, _launch

SMEM_OPTIN = 232448


class FakeKernel:
    def __init__(self, name, static_smem):
        self.name = name
        self.shared_size_bytes = static_smem
        self.max_dynamic_shared_size_bytes = None
        self.kernel = types.SimpleNamespace(ptr=1000 + len(name))


class FakeCupy(types.ModuleType):
    """Records every compile: the name expressions of each RawModule and the device it ran on."""

    def __init__(self, static_smem=0, delay=0.0, fail=None, fragile_first=False):
        super().__init__("cupy")
        self.compiles = []
        self.fragile_first, self.running = fragile_first, 0
        self.lock = threading.Lock()
        self.static_smem, self.delay, self.fail = static_smem, delay, fail
        self.current = threading.local()
        fake = self

        @contextlib.contextmanager
        def device(i):
            fake.current.id = i
            yield

        class RawModule:
            def __init__(self, code, options, name_expressions):
                assert "struct Problem" in code
                self.names = list(name_expressions)

            def get_function(self, name):
                assert name in self.names
                with fake.lock:
                    fake.running += 1
                    first_ones = not fake.compiles and fake.running > 1
                time.sleep(fake.delay)
                with fake.lock:
                    fake.running -= 1
                    if fake.fragile_first and (first_ones or not fake.compiles
                                               and fake.running):
                        raise RuntimeError("nvrtc: error: failed to open libnvrtc-builtins")
                    if fake.fail and fake.fail in name:
                        raise RuntimeError(f"NVRTC failed on {name}")
                    fake.compiles.append((tuple(self.names), getattr(fake.current, "id", None)))
                return FakeKernel(name, fake.static_smem)

        self.RawModule = RawModule
        self.cuda = types.SimpleNamespace(Device=device)


@pytest.fixture
def fake_cupy(monkeypatch):
    def install(**kw):
        fake = FakeCupy(**kw)
        monkeypatch.setitem(sys.modules, "cupy", fake)
        monkeypatch.setattr(_kernels, "_loaded", {})
        monkeypatch.setattr(_kernels, "_first_load_done", threading.Event())  # a new process
        monkeypatch.setattr(_kernels.os, "cpu_count", lambda: 4)  # threads on any CI machine
        return fake
    return install


def test_a_kernel_compiles_alone_and_once(fake_cupy):
    cupy = fake_cupy()
    ks = _kernels.kernels_for(np.int32, 3, SMEM_OPTIN)
    assert cupy.compiles == [] and not ks.loaded([("tiny", False)])
    handle = ks.handle(("tiny", False))
    assert cupy.compiles == [(("align_tiny<int, false>",), 3)]
    assert handle == ks.handles[("tiny", False)] and handle
    assert ks[("tiny", False)].max_dynamic_shared_size_bytes == SMEM_OPTIN
    ks.handle(("tiny", False))
    ks[("tiny", False)]
    assert len(cupy.compiles) == 1
    assert _kernels.kernels_loaded(np.int32, 3, [("tiny", False)])
    assert not _kernels.kernels_loaded(np.int32, 3, [("tiny", False), ("order", False)])
    assert not _kernels.kernels_loaded(np.int32, 0, [("tiny", False)])
    assert not _kernels.kernels_loaded(np.int64, 3, [("tiny", False)])


def test_load_all_compiles_each_kernel_once_from_many_threads(fake_cupy):
    cupy = fake_cupy(delay=0.01)
    ks = _kernels.kernels_for(np.uint16, 0, SMEM_OPTIN)
    ks.handle(("order", False))
    threads = [threading.Thread(target=ks.load_all) for _ in range(4)]
    threads += [threading.Thread(target=ks.handle, args=(("tiny", True),)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    compiled = sorted(names[0] for names, _ in cupy.compiles)
    assert compiled == sorted(ks.names.values())  # each once, every one alone
    assert ks.loaded(ks.names)


def test_the_first_load_of_a_process_runs_alone(fake_cupy):
    """Where two first compiles at once fail (NVRTC opening its builtins library), the
    process's first load runs before the others start."""
    cupy = fake_cupy(delay=0.02, fragile_first=True)
    ks = _kernels.kernels_for(np.int32, 0, SMEM_OPTIN)
    ks.load_all([("count", 0), ("place", 0), ("order", False), ("tiny", False)])
    assert len(cupy.compiles) == 4


def test_the_stand_in_fails_two_first_compiles_at_once(fake_cupy):
    """The check above has teeth: without the first load alone, the stand-in fails."""
    cupy = fake_cupy(delay=0.02, fragile_first=True)
    ks = _kernels.kernels_for(np.int32, 0, SMEM_OPTIN)
    _kernels._first_load_done.set()  # as if a load had run: nothing holds the others back
    with pytest.raises(RuntimeError, match="libnvrtc-builtins"):
        ks.load_all([("count", 0), ("place", 0), ("order", False), ("tiny", False)])
    assert not cupy.compiles


def test_load_all_of_some_keys(fake_cupy):
    cupy = fake_cupy()
    ks = _kernels.kernels_for(np.int32, 0, SMEM_OPTIN)
    ks.load_all([("count", 1), ("place", 1)])
    assert sorted(n for (n,), _ in cupy.compiles) == ["align_count<int, 1>",
                                                     "align_place<int, 1>"]


def test_a_failed_compile_raises_and_leaves_the_kernel_unloaded(fake_cupy):
    fake_cupy(fail="align_order")
    ks = _kernels.kernels_for(np.int32, 0, SMEM_OPTIN)
    with pytest.raises(RuntimeError, match="align_order"):
        ks.load_all()
    assert not ks.loaded([("order", False)])
    with pytest.raises(RuntimeError, match="align_order"):
        ks.handle(("order", False))


def test_static_shared_memory_over_the_slack_is_refused_by_name(fake_cupy):
    fake_cupy(static_smem=_dispatch.SMEM_SLACK + 4)
    ks = _kernels.kernels_for(np.int32, 0, SMEM_OPTIN)
    with pytest.raises(RuntimeError, match=r"align_single<int, false> has .* static shared"):
        ks[("single", False)]
    assert not ks.loaded([("single", False)])


def _launches():
    """Launches the dispatcher picks over a spread of sizes, modes and variants."""
    limits = _dispatch.DeviceLimits.h200()
    for numel in (0, 1, 16, 300, 4096, 20000, 200000):
        for nb, rows in ((64, 1), (256, 1), (4 * 256, 4), (8192, 1), (16 * 512, 16)):
            for det in (False, True):
                for variant in (None,) + tuple(_dispatch.VARIANTS):
                    try:
                        yield _launch.checked_launch(numel, nb, rows, limits, det, variant,
                                                     rows * 4096)
                    except (ValueError, RuntimeError):
                        continue


def test_every_launch_step_names_a_kernel_of_the_set():
    names = _kernels.kernel_names(np.int32)
    kinds = set()
    for launch in _launches():
        steps = _dispatch.launch_kernels(launch)
        assert steps and all(key in names for key, *_ in steps), launch
        kinds.update(key[0] for key, *_ in steps)
    assert kinds >= {"tiny", "single", "cooperative", "count", "place", "order"}


def test_every_fused_pair_step_names_a_kernel_of_the_set():
    limits = _dispatch.DeviceLimits.h200()
    names = _kernels.kernel_names(np.int32)
    kinds = set()
    for numel in (1, 16, 300, 4096, 20000):
        for det in (False, True):
            pairs = [_dispatch.choose_pair(numel, 64, 4 * 64, 4, limits, deterministic=det,
                                           out_entries=4 * 8192, policy=policy)
                     for policy in (_dispatch.DEFAULT_POLICY,
                                    _dispatch.AlignPolicy(tiny_row_blocks=False))]
            pairs += [_dispatch.choose_cooperative_pair(numel, 64, 4 * 64, 4, limits,
                                                        base_entries=8192,
                                                        lora_entries=4 * 8192,
                                                        deterministic=det),
                      _dispatch.choose_cluster_pair(numel, 64, 4 * 64, 4, limits,
                                                    deterministic=det)]
            for pair in filter(None, pairs):
                (key, *_), = _dispatch.launch_kernels(pair, fused=True)
                assert key in names, pair
                kinds.add(key[0])
    assert kinds >= {"tiny_pair", "tiny_rows_pair", "cooperative_pair", "cluster_pair"}
