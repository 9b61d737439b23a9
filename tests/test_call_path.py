"""The one call path on the host: the prepared-call key, the pointer slots a prepared call
rewrites, its overlap check, and options checked once (no GPU needed)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import moe_lora_align as mla
from moe_lora_align import _call, _checks, _launch


class FakeCupy:
    """Stands in for a CuPy array: the attributes the key and the pointers read."""

    def __init__(self, ptr, shape=(4, 2), strides=None, dtype=np.int32, device=0):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.strides = strides or tuple(
            int(np.prod(shape[i + 1:])) * self.dtype.itemsize for i in range(len(shape)))
        self.data = SimpleNamespace(ptr=ptr, device_id=device)
        self._c_contiguous = self.strides == tuple(
            int(np.prod(shape[i + 1:])) * self.dtype.itemsize for i in range(len(shape)))
        self.nbytes = int(np.prod(shape)) * self.dtype.itemsize


class FakeTorch:
    def __init__(self, ptr, shape=(4, 2), dtype="int32", device=0):
        self.shape, self.dtype, self._ptr, self._device = tuple(shape), dtype, ptr, device

    def is_contiguous(self):
        return True

    def get_device(self):
        return self._device

    def data_ptr(self):
        return self._ptr


@pytest.fixture(autouse=True)
def fake_kinds(monkeypatch):
    monkeypatch.setattr(_call, "_KINDS", {FakeCupy: "cupy", FakeTorch: "torch"})


def key(*arrays):
    found = _call.properties(arrays)
    return None if found is None else found[0]


def test_key_follows_every_property_and_not_the_address():
    base = key(FakeCupy(100), None, FakeCupy(200, (4,)))
    assert key(FakeCupy(999), None, FakeCupy(555, (4,))) == base
    assert _call.properties((FakeCupy(999), None))[1] == [999, 0]
    for changed in (FakeCupy(100, (8, 2)), FakeCupy(100, strides=(16, 4)),
                    FakeCupy(100, dtype=np.int64), FakeCupy(100, device=1)):
        assert key(changed, None, FakeCupy(200, (4,))) != base
    assert key(FakeCupy(100), FakeCupy(1, (4,)), FakeCupy(200, (4,))) != base  # None -> array


def test_key_for_torch_tensors_and_refusals():
    assert key(FakeTorch(1)) == key(FakeTorch(2))
    assert key(FakeTorch(1)) != key(FakeTorch(1, device=1))
    assert key(FakeTorch(1)) != key(FakeCupy(1))
    assert _call.properties((FakeTorch(1), FakeCupy(2))) is None      # two frameworks
    assert _call.properties((np.zeros((4, 2), np.int32),)) is None     # host arrays: full path
    assert _call.properties(([1, 2],)) is None


def _job(ptr, rows=1, lora=False, scatter=False, emap=False):
    dev = FakeCupy
    return _launch.Job(
        topk_ids=dev(ptr, (8,)), numel=8, topk=2, num_experts=4, block_size=4, rows=rows,
        padded_len=20, num_tiles=5, sorted_ids=dev(ptr + 0x100, (rows, 20)),
        expert_ids=dev(ptr + 0x200, (rows, 5)), num_post_pad=dev(ptr + 0x300, (rows,)),
        sorted_pitch=20, expert_pitch=5, token_slot=dev(ptr + 0x10, (4,)) if lora else None,
        lora_ids=dev(ptr + 0x20, (rows + 1,)) if lora else None,
        adapter_enabled=dev(ptr + 0x30, (rows + 1,)) if lora else None,
        scatter_idx=dev(ptr + 0x400, (8,)) if scatter else None,
        expert_map=dev(ptr + 0x40, (4,)) if emap else None)


def _prepared(calls, monkeypatch):
    """A prepared call built from jobs the way the full path leaves them."""
    for c in calls:
        c.job.packed = np.zeros(_launch.PROBLEM_DTYPE.itemsize, np.uint8)
    recorded = [_launch.RecordedLaunch(1, 1, 32, 0, 7, 0, ())]
    j = calls[-1].job
    ptrs = [j.topk_ids.data.ptr, 0, 0, 0, 0 if j.expert_map is None else j.expert_map.data.ptr]
    if calls[-1].job.token_slot is not None:
        ptrs[1:4] = [calls[-1].job.token_slot.data.ptr, calls[-1].job.lora_ids.data.ptr,
                     calls[-1].job.adapter_enabled.data.ptr]
    for c in calls:  # then the outputs, as the key's pointers come
        outs = (c.job.sorted_ids, c.job.expert_ids, c.job.num_post_pad, c.job.scatter_idx)
        ptrs += [x.data.ptr for x in outs if x is not None]
    launched = []
    monkeypatch.setattr(_call, "replay_launches", lambda launches, st: launched.append(st))
    prep = _call.build_prepared(calls, (recorded, None, [], None), ptrs, "cupy", 7)
    return prep, launched


def _fields(job):
    view = np.frombuffer(job.packed, dtype=_launch.PROBLEM_DTYPE)[0]
    return [int(view[n]) for n in _launch._POINTERS[:9]]


def _call_of(job):
    return _call.Call("device", "cupy", 0, job, (job.sorted_ids, job.expert_ids,
                                                job.num_post_pad), None)


def test_prepared_pair_points_each_job_at_its_own_arrays(monkeypatch):
    base = _call_of(_job(0x1000, emap=True))
    lora = _call_of(_job(0x1000, rows=3, lora=True, emap=True))
    prep, launched = _prepared([base, lora], monkeypatch)
    # a new call: inputs 11..15, base outputs 21..23, LoRA outputs 31..33 (bytes apart)
    ptrs = [1100, 1200, 1300, 1400, 1500, 2100, 2200, 2300, 3100, 3200, 3300]
    prep.spans = ([8] * 11, [False] * 5 + [True] * 6, [str(i) for i in range(11)])
    prep.run(list(ptrs), "outs", 9)
    assert _fields(base.job) == [1100, 0, 0, 0, 1500, 2100, 2200, 2300, 0]
    assert _fields(lora.job) == [1100, 1200, 1300, 1400, 1500, 3100, 3200, 3300, 0]
    assert launched == [9]


def test_prepared_base_with_scatter_and_no_map(monkeypatch):
    call = _call_of(_job(0x1000, scatter=True))
    prep, _ = _prepared([call], monkeypatch)
    prep.spans = ([8] * 9, [False] * 5 + [True] * 4, [str(i) for i in range(9)])
    prep.run([1100, 0, 0, 0, 0, 2100, 2200, 2300, 2400], "outs", 9)
    assert _fields(call.job) == [1100, 0, 0, 0, 0, 2100, 2200, 2300, 2400]


def test_prepared_call_refuses_overlapping_out_buffers(monkeypatch):
    call = _call_of(_job(0x1000))
    prep, launched = _prepared([call], monkeypatch)
    prep.spans = ([32, 0, 0, 0, 0, 80, 20, 4], [False] * 5 + [True] * 3,
                  ["topk_ids", "token_lora_mapping", "lora_ids", "adapter_enabled",
                   "expert_map", "out sorted_token_ids", "out expert_ids",
                   "out num_tokens_post_pad"])
    with pytest.raises(ValueError, match="out sorted_token_ids and out expert_ids overlap"):
        prep.run([5000, 0, 0, 0, 0, 1000, 1040, 2000], "outs", 9)
    with pytest.raises(ValueError, match="out expert_ids and topk_ids overlap"):
        prep.run([5000, 0, 0, 0, 0, 1000, 5010, 2000], "outs", 9)
    assert launched == []
    prep.run([5000, 0, 0, 0, 0, 1000, 2000, 3000], "outs", 9)
    assert launched == [9] and prep.packed == [5000, 0, 0, 0, 0, 1000, 2000, 3000]


def test_prepared_call_goes_stale_when_its_workspace_grows():
    ws = SimpleNamespace(generation=3)
    prep = _call.Prepared("cupy", 0, [], [], (), None, None, ((ws, 3),), None, None)
    cache = {"k": prep}
    assert _call.lookup(cache, "k") is prep
    ws.generation = 4
    assert _call.lookup(cache, "k") is None


def test_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(_call, "CACHE_SIZE", 3)
    cache = {}
    for k in range(5):
        _call.keep(cache, k, k)
    assert list(cache) == [2, 3, 4]


@pytest.mark.parametrize("fn,expected", [("base", ["variant", "streams"]),
                                         ("lora", ["variant", "streams"]),
                                         ("pair", ["variant", "streams"])])
def test_each_option_is_checked_once(fn, expected, monkeypatch):
    seen = []
    real = _checks.option
    monkeypatch.setattr(_checks, "option", lambda name, v, allowed: seen.append(name) or
                        real(name, v, allowed))
    ids = np.array([[0, 1], [2, 3]], np.int32)
    mapping = np.array([0, -1], np.int32)
    if fn == "base":
        mla.moe_align_block_size(ids, 4, 4)
    elif fn == "lora":
        mla.moe_lora_align_block_size(ids, mapping, 4, 4, 2)
    else:
        mla.align_moe_and_lora(ids, mapping, 4, 4, 2)
    assert seen == expected


def test_host_calls_are_never_prepared():
    ids = np.array([[0, 1], [2, 3]], np.int32)
    before = dict(_call._caches)
    mla.moe_align_block_size(ids, 4, 4)
    assert _call._caches == before


def test_public_call_takes_the_prepared_path_end_to_end(monkeypatch):
    """A public call whose arrays have the properties of a prepared call goes through it:
    pointers rewritten in the packed arguments, the recorded launches replayed on the
    caller's stream, the caller's out= arrays returned (fake CuPy arrays, no driver)."""
    from types import SimpleNamespace

    monkeypatch.setattr(_call, "_fast", {"get_device": lambda: 0,
                                         "current_stream": lambda: SimpleNamespace(ptr=7)})
    call = _call_of(_job(0x1000))
    prep, launched = _prepared([call], monkeypatch)
    ids = FakeCupy(0x1000, (8, 1))
    out = (FakeCupy(0x2000, (20,)), FakeCupy(0x3000, (5,)), FakeCupy(0x4000, (1,)))
    opts = ("base", 4, 4, None, False, False, False, False, None, None, None)
    key, *_ = _call._fast_key(opts, (ids, None, None, None, None), (out, None), None)
    monkeypatch.setitem(_call._caches, 0, {key: prep})
    prep.spans = ([32, 0, 0, 0, 0, 80, 20, 4], [False] * 5 + [True] * 3,
                  ["topk_ids", "token_lora_mapping", "lora_ids", "adapter_enabled",
                   "expert_map", "sorted", "experts", "total"])
    new_ids = FakeCupy(0x9000, (8, 1))
    new_out = (FakeCupy(0xa000, (20,)), FakeCupy(0xb000, (5,)), FakeCupy(0xc000, (1,)))
    res = mla.moe_align_block_size(new_ids, 4, 4, out=new_out)
    assert tuple(res) == new_out
    assert _fields(call.job) == [0x9000, 0, 0, 0, 0, 0xa000, 0xb000, 0xc000, 0]
    assert launched == [7]
    # A property that differs (the block size) misses the prepared call: the full path,
    # which refuses these fake arrays.
    with pytest.raises(TypeError):
        mla.moe_align_block_size(new_ids, 8, 4, out=new_out)


LAYOUT_SHAPES = [[(20,), (5,), (1,)], [(3, 20), (3, 5), (3,)],
                 [(20,), (5,), (1,), (8,), (3, 21), (3, 7), (3,)], [(0,), (2, 0), (1,)]]


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("shapes", LAYOUT_SHAPES)
def test_allocating_layout_places_outputs_apart(shapes, split):
    layout = _call.OutLayout(shapes, split)
    sizes = [int(np.prod(s)) for s in shapes]
    if split:  # torch splits the allocation into exactly the outputs
        assert layout.pieces == sizes and sum(sizes) == layout.entries
        assert layout.offsets == [sum(sizes[:i]) for i in range(len(sizes))]
    else:
        assert [off % 4 for off in layout.offsets] == [0] * len(shapes)  # 16-byte starts
    ends = [off + n for off, n in zip(layout.offsets, sizes)]
    assert all(end <= nxt for end, nxt in zip(ends, layout.offsets[1:]))
    assert max(ends) <= layout.entries < max(ends) + 4 and layout.nbytes == 4 * layout.entries
    # torch's as_strided views: the contiguous strides of each shape, at its offset
    for (shape, strides, off), want, at in zip(layout.views, shapes, layout.offsets):
        assert shape == want and off == at
        if np.prod(want):  # (NumPy's strides of an empty shape differ; nothing is read there)
            assert tuple(4 * x for x in strides) == np.empty(want, np.int32).strides


def test_torch_splits_only_one_dimensional_outputs():
    assert _call.torch_splits([(20,), (5,), (1,)])              # base: one split
    assert _call.torch_splits([(20,), (5,), (1,), (8,)])        # base with scatter_idx
    assert not _call.torch_splits([(3, 20), (3, 5), (3,)])      # LoRA: as_strided each
    assert not _call.torch_splits(LAYOUT_SHAPES[2])             # base + LoRA


# ---- allocating prepared calls: outputs handed out again once the caller dropped them ----
class FakePointer:
    """A CuPy memory pointer as the spare check reads it: an address on one allocation."""

    def __init__(self, mem, ptr):
        self.mem, self.ptr = mem, ptr

    def __add__(self, offset):
        return FakePointer(self.mem, self.ptr + offset)


class FakeOutput:
    """An output array made on a pointer (what ``cupy.ndarray(shape, dtype, memptr)`` gives)."""

    def __init__(self, shape, dtype, memptr):
        self.shape, self.dtype, self.data = shape, dtype, memptr


def _spare_arrays():
    mem = object()
    return tuple(FakeOutput((n,), np.int32, FakePointer(mem, 0x1000 + 64 * i))
                 for i, n in enumerate((20, 5, 1)))


@pytest.mark.parametrize("hold", ["array", "view", "pointer", "allocation", "weakref",
                                  "result", "reshaped"])
def test_spare_is_free_only_when_nothing_outside_holds_it(hold):
    import weakref

    arrays = _spare_arrays()
    spare = _call.Spare(arrays, [0x1000, 0x1040, 0x1080])
    assert spare.unheld()
    kept = {"array": lambda: arrays[1],
            "view": lambda: SimpleNamespace(base=arrays[0]),
            "pointer": lambda: arrays[2].data,
            "allocation": lambda: arrays[0].data.mem,
            "weakref": lambda: weakref.ref(arrays[1]),
            "result": lambda: mla.Alignment(*arrays),
            "reshaped": lambda: setattr(arrays[0], "shape", (4, 5))}[hold]()
    assert not spare.unheld()
    if hold == "reshaped":  # a reshaped array stays out, whoever holds it
        arrays[0].shape = (20,)
        assert spare.unheld()
        return
    del kept
    assert spare.unheld()


def _allocating_prepared(monkeypatch, kind="cupy"):
    """An allocating prepared base call with fake allocation and launches; returns it, the
    allocations made and the launches issued."""
    allocations, launched = [], []
    address = iter(range(0x100000, 0x10000000, 0x10000))

    def alloc(nbytes):
        allocations.append(nbytes)
        return FakePointer(object(), next(address))

    monkeypatch.setattr(_call, "_fast", {"is_capturing": lambda sp: 0, "alloc": alloc,
                                         "ndarray": FakeOutput})
    monkeypatch.setattr(_call, "_note_allocators", lambda kind: None)
    monkeypatch.setattr(_call, "replay_launches", lambda launches, st: launched.append(st))
    job = _job(0x1000)
    job.packed = np.zeros(_launch.PROBLEM_DTYPE.itemsize, np.uint8)
    call = _call.Call("device", kind, 0, job, None, [(20,), (5,), (1,)])
    recorded = [_launch.RecordedLaunch(1, 1, 32, 0, 7, 0, ())]
    prep = _call.build_prepared([call], (recorded, None, [], None), [0x1000, 0, 0, 0, 0],
                                kind, 7)
    return prep, allocations, launched


def test_allocating_call_hands_dropped_outputs_out_again(monkeypatch):
    prep, allocations, launched = _allocating_prepared(monkeypatch)
    packs = []
    real = _call.POINTERS
    monkeypatch.setattr(_call, "POINTERS", SimpleNamespace(
        pack_into=lambda *a: packs.append(a[2:]) or real.pack_into(*a)))
    first = prep.run([0x1000, 0, 0, 0, 0], None, 9)
    ids = [id(x) for x in first]
    fields = _fields(prep.jobs[0])
    assert len(allocations) == 1 and len(packs) == 1 and launched == [9]
    assert fields[5:8] == [x.data.ptr for x in first] and fields[0] == 0x1000
    del first
    again = prep.run([0x1000, 0, 0, 0, 0], None, 9)       # dropped: the same outputs
    assert [id(x) for x in again] == ids and len(allocations) == 1
    assert len(packs) == 1 and launched == [9, 9]           # same pointers: nothing packed
    held = again
    new = prep.run([0x2000, 0, 0, 0, 0], None, 9)         # held by the caller: new outputs
    assert not set(map(id, new)) & set(map(id, held)) and len(allocations) == 2
    assert len(packs) == 2 and _fields(prep.jobs[0])[5:8] == [x.data.ptr for x in new]
    assert _fields(prep.jobs[0])[0] == 0x2000
    del new
    assert [id(x) for x in prep.run([0x2000, 0, 0, 0, 0], None, 9)] != ids  # the free set


def test_allocating_calls_in_a_rebinding_loop_take_turns_on_two_sets(monkeypatch):
    """``res = f(x)``: the last result is still bound during the call, the one before not."""
    prep, allocations, _ = _allocating_prepared(monkeypatch)
    seen = []
    res = None
    for _ in range(6):
        res = prep.run([0x1000, 0, 0, 0, 0], None, 9)
        seen.append(res[0].data.ptr)
    assert len(allocations) == 2 and len(set(seen)) == 2 and seen[2:] == seen[:2] * 2


def test_allocating_call_refuses_capture_before_handing_out_a_spare(monkeypatch):
    prep, allocations, launched = _allocating_prepared(monkeypatch)
    prep.run([0x1000, 0, 0, 0, 0], None, 9)
    _call._fast["is_capturing"] = lambda sp: 1
    with pytest.raises(RuntimeError, match="out="):
        prep.run([0x1000, 0, 0, 0, 0], None, 9)
    assert launched == [9]


def test_no_spare_where_reference_counts_are_not_exact(monkeypatch):
    prep, allocations, _ = _allocating_prepared(monkeypatch)
    monkeypatch.setattr(_call, "REFCOUNTS_EXACT", False)
    prep.run([0x1000, 0, 0, 0, 0], None, 9)
    prep.run([0x1000, 0, 0, 0, 0], None, 9)
    assert len(allocations) == 2 and prep.spares == []


def test_no_spare_for_large_or_torch_outputs(monkeypatch):
    prep, allocations, _ = _allocating_prepared(monkeypatch)
    monkeypatch.setattr(_call, "SPARE_MAX_BYTES", 64)
    prep.run([0x1000, 0, 0, 0, 0], None, 9)
    prep.run([0x1000, 0, 0, 0, 0], None, 9)
    assert len(allocations) == 2 and prep.spares == []
    monkeypatch.setitem(__import__("sys").modules, "torch",
                        SimpleNamespace(device=lambda kind, index: f"{kind}:{index}"))
    prep, _, _ = _allocating_prepared(monkeypatch, kind="torch")
    made = []

    class Buf:
        def data_ptr(self):
            return 0x5000

        def unsafe_split_with_sizes(self, pieces):  # base's 1-D outputs: one split
            return [made.append(n) or SimpleNamespace(n=n) for n in pieces]

    _call._fast.update(torch_empty=lambda n, dtype, device: Buf(), torch_int32="int32")
    prep.run([0x1000, 0, 0, 0, 0], None, 9)
    prep.run([0x1000, 0, 0, 0, 0], None, 9)
    assert prep.spares == [] and len(made) == 6   # torch: new tensors every call


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("shapes", LAYOUT_SHAPES + [[(16, 3968), (16, 248), (16,)]])
def test_torch_outputs_are_contiguous_views_of_one_allocation(shapes, split):
    """The torch allocating path on real (CPU) tensors: each output a contiguous int32 view
    of its own bytes of the one allocation, at the address the kernels are given."""
    torch = pytest.importorskip("torch")
    prep = SimpleNamespace(kind="torch", out_layout=_call.OutLayout(shapes, split),
                           framework_device=torch.device("cpu"))
    saved = dict(_call._fast)
    _call._fast.update(torch_empty=torch.empty, torch_int32=torch.int32)
    try:
        views, ptrs = _call.Prepared._allocate(prep)
    finally:
        _call._fast.clear()
        _call._fast.update(saved)
    assert [tuple(v.shape) for v in views] == [tuple(s) for s in shapes]
    for v, ptr, k in zip(views, ptrs, range(len(views))):
        assert v.dtype == torch.int32 and v.is_contiguous()
        if v.numel():
            assert v.data_ptr() == ptr and (split or ptr % 16 == 0)
            v.fill_(k)  # every output's bytes its own
    for v, k in zip(views, range(len(views))):
        assert bool((v == k).all())


def test_out_given_call_packs_only_new_pointers(monkeypatch):
    call = _call_of(_job(0x1000))
    prep, launched = _prepared([call], monkeypatch)
    prep.spans = ([32, 0, 0, 0, 0, 80, 20, 4], [False] * 5 + [True] * 3,
                  [str(i) for i in range(8)])
    packs, checks = [], []
    real = _call.POINTERS
    monkeypatch.setattr(_call, "POINTERS", SimpleNamespace(
        pack_into=lambda *a: packs.append(a[2:]) or real.pack_into(*a)))
    monkeypatch.setattr(_checks, "check_spans", lambda *a: checks.append(a))
    same = [call.job.topk_ids.data.ptr, 0, 0, 0, 0] + [
        x.data.ptr for x in (call.job.sorted_ids, call.job.expert_ids, call.job.num_post_pad)]
    prep.run(list(same), "outs", 9)          # what the full path packed and checked
    assert packs == [] and checks == [] and launched == [9]
    moved = [0x9000] + same[1:]
    prep.run(list(moved), "outs", 9)
    prep.run(list(moved), "outs", 9)
    assert len(packs) == 1 and len(checks) == 1 and launched == [9, 9, 9]
    assert _fields(call.job)[0] == 0x9000


def test_spare_outputs_stay_within_the_device_budget(monkeypatch):
    monkeypatch.setattr(_call, "_spare_bytes", {})
    monkeypatch.setattr(_call, "_spare_owners", {})
    first, _, _ = _allocating_prepared(monkeypatch)
    nbytes = first.out_layout.nbytes
    monkeypatch.setattr(_call, "SPARE_BUDGET", nbytes)
    monkeypatch.setattr(_call, "CACHE_SIZE", 1)
    second, _, _ = _allocating_prepared(monkeypatch)
    cache = {}
    _call.keep(cache, "first", first)
    first.run([0x1000, 0, 0, 0, 0], None, 9)
    assert len(first.spares) == 1 and _call._spare_bytes[0] == nbytes
    second.run([0x1000, 0, 0, 0, 0], None, 9)     # over the budget: the oldest claim goes
    assert first.spares == [] and len(second.spares) == 1
    assert _call._spare_bytes[0] == nbytes and first.spare_bytes == 0
    first.run([0x1000, 0, 0, 0, 0], None, 9)      # and back
    assert len(first.spares) == 1 and second.spares == [] and _call._spare_bytes[0] == nbytes
    _call.keep(cache, "second", second)           # evicts the first: its claim comes back
    assert first.spares == [] and _call._spare_bytes[0] == 0 and first.dropped
    first.run([0x1000, 0, 0, 0, 0], None, 9)      # dropped: claims nothing
    assert first.spares == [] and _call._spare_bytes[0] == 0
    second.run([0x1000, 0, 0, 0, 0], None, 9)
    assert len(second.spares) == 1 and _call._spare_bytes[0] == nbytes
