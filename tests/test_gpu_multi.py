"""Two GPUs in one process: a call runs on the GPU its inputs are on, whatever the current
device, and every piece of per-device state (kernels, workspaces, side streams, prepared
calls, plans) stays on its own GPU. Skipped on machines with fewer than two GPUs."""

import threading

import numpy as np
import pytest

import moe_lora_align as mla
from gpu_util import HAVE_GPU, canonical, cupy, make_lora, make_routing, segment_starts

TWO = HAVE_GPU and cupy.cuda.runtime.getDeviceCount() >= 2
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not TWO, reason="needs two CUDA GPUs")]

T, K, E, B, L = 64, 8, 64, 16, 4


def _host(x):
    if hasattr(x, "cpu"):
        return x.cpu().numpy()
    if isinstance(x, np.ndarray):
        return x
    if type(x).__module__.startswith("cupy"):
        return cupy.asnumpy(x)
    return np.asarray(x)  # JAX


def _inputs(seed, tokens=T):
    rng = np.random.default_rng(seed)
    ids = make_routing(rng, tokens, K, E)
    mapping, lora_ids, enabled = make_lora(rng, tokens, L)
    return ids, mapping, lora_ids, enabled


def _check_base(got, ids, experts=E, emap=None, ignore=False):
    ref = mla.moe_align_block_size(ids, B, experts, emap, ignore_invalid_experts=ignore)
    g = [_host(x) for x in got]
    starts = segment_starts(ids, experts, B, expert_map=emap, map_before=ignore)
    np.testing.assert_array_equal(canonical(g[0][None], starts), canonical(ref[0][None], starts))
    np.testing.assert_array_equal(g[1], ref[1])
    np.testing.assert_array_equal(g[2], ref[2])


def _check_lora(got, ids, mapping, lora_ids, enabled):
    ref = mla.moe_lora_align_block_size(ids, mapping, B, E, L, lora_ids=lora_ids,
                                        adapter_enabled=enabled)
    g = [_host(x) for x in got]
    starts = segment_starts(ids, E, B, rows=L, mapping=mapping, lora_ids=lora_ids,
                            enabled=enabled)
    np.testing.assert_array_equal(canonical(g[0], starts), canonical(ref[0], starts))
    np.testing.assert_array_equal(g[1], ref[1])
    np.testing.assert_array_equal(g[2], ref[2])


def _on(device, arrays):
    with cupy.cuda.Device(device):
        return [cupy.asarray(x) for x in arrays]


def _sync_all():
    for dev in (0, 1):
        with cupy.cuda.Device(dev):
            cupy.cuda.Device(dev).synchronize()


# ---- inputs on GPU 1 while GPU 0 is current ------------------------------------------------
def test_cupy_inputs_on_the_other_gpu_run_there_and_leave_the_current_device():
    ids, mapping, lora_ids, enabled = _inputs(1)
    d = _on(1, (ids, mapping, lora_ids, enabled))
    with cupy.cuda.Device(0):
        for _ in range(3):  # the first call is the full path, later ones may be prepared
            base = mla.moe_align_block_size(d[0], B, E)
            lora = mla.moe_lora_align_block_size(d[0], d[1], B, E, L, lora_ids=d[2],
                                                 adapter_enabled=d[3])
            pair = mla.align_moe_and_lora(d[0], d[1], B, E, L, lora_ids=d[2],
                                          adapter_enabled=d[3])
            assert cupy.cuda.runtime.getDevice() == 0
            for x in (*base, *lora, *pair[0], *pair[1]):
                assert x.device.id == 1
            _sync_all()
            _check_base(base, ids)
            _check_lora(lora, ids, mapping, lora_ids, enabled)
            _check_base(pair[0], ids)
            _check_lora(pair[1], ids, mapping, lora_ids, enabled)


def test_torch_inputs_on_the_other_gpu_run_there():
    torch = pytest.importorskip("torch")
    ids, mapping, lora_ids, enabled = _inputs(2)
    t = [torch.from_numpy(x).to("cuda:1") for x in (ids, mapping, lora_ids, enabled)]
    with torch.cuda.device(0):
        for _ in range(3):
            base = mla.moe_align_block_size(t[0], B, E)
            lora = mla.moe_lora_align_block_size(t[0], t[1], B, E, L, lora_ids=t[2],
                                                 adapter_enabled=t[3])
            assert torch.cuda.current_device() == 0
            assert all(x.device == torch.device("cuda", 1) for x in (*base, *lora))
            torch.cuda.synchronize(1)
            _check_base(base, ids)
            _check_lora(lora, ids, mapping, lora_ids, enabled)


def test_jax_inputs_on_the_other_gpu_run_there():
    jax = pytest.importorskip("jax")
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) < 2:
        pytest.skip("JAX sees fewer than two GPUs")
    ids = _inputs(3)[0]
    with cupy.cuda.Device(0):
        got = mla.moe_align_block_size(jax.device_put(ids, gpus[1]), B, E)
        assert cupy.cuda.runtime.getDevice() == 0
    _check_base(got, ids)


def test_inputs_split_over_two_gpus_are_refused_naming_them():
    ids, mapping = _inputs(4)[:2]
    d_ids = _on(0, (ids,))[0]
    d_map = _on(1, (mapping,))[0]
    with pytest.raises(ValueError,
                       match="token_lora_mapping is on GPU 1 but topk_ids is on GPU 0"):
        mla.moe_lora_align_block_size(d_ids, d_map, B, E, L)
    out = _on(1, (np.zeros(4096, np.int32), np.zeros(512, np.int32), np.zeros(1, np.int32)))
    with pytest.raises(ValueError, match="GPU 1 but topk_ids is on GPU 0"):
        mla.moe_align_block_size(d_ids, B, E, out=tuple(out))


# ---- alternating devices --------------------------------------------------------------------
@pytest.mark.parametrize("streams", [None, "fused", "one", "two"])
def test_alternating_gpus_public_functions(streams):
    for rep in range(6):
        for dev in ((0, 1) if rep % 2 == 0 else (1, 0)):
            ids, mapping, lora_ids, enabled = _inputs(10 * rep + dev)
            d = _on(dev, (ids, mapping, lora_ids, enabled))
            with cupy.cuda.Device(dev):
                try:
                    base, lora = mla.align_moe_and_lora(d[0], d[1], B, E, L, lora_ids=d[2],
                                                        adapter_enabled=d[3], streams=streams)
                except ValueError as e:  # "fused" where it cannot run: refused up front
                    assert streams == "fused", e
                    continue
                alone = mla.moe_align_block_size(d[0], B, E)
                cupy.cuda.Device(dev).synchronize()
            _check_base(base, ids)
            _check_base(alone, ids)
            _check_lora(lora, ids, mapping, lora_ids, enabled)


@pytest.mark.parametrize("streams", [None, "one", "two"])
def test_alternating_gpus_plans_with_graph_capture(streams):
    plans, captured = {}, {}
    for dev in (0, 1):
        with cupy.cuda.Device(dev):
            plans[dev] = mla.AlignPlan(T, K, E, B, max_loras=L, streams=streams)
            d = _on(dev, _inputs(dev))
            stream = cupy.cuda.Stream(non_blocking=True)
            with stream:
                call = lambda p=plans[dev], d=d, s=stream: p(  # noqa: E731
                    d[0], d[1], lora_ids=d[2], adapter_enabled=d[3], stream=s)
                call()
                stream.synchronize()
                stream.begin_capture()
                res = call()
                graph = stream.end_capture()
            captured[dev] = (graph, stream, d, res)
    for rep in range(4):
        for dev in ((0, 1) if rep % 2 == 0 else (1, 0)):
            graph, stream, d, (base, lora) = captured[dev]
            new = _inputs(100 + 10 * rep + dev)
            with cupy.cuda.Device(dev):
                for dst, src in zip(d, new):
                    dst.set(src, stream=stream)
                base[0].fill(-5)
                lora[0].fill(-5)
                graph.launch(stream)
                stream.synchronize()
            _check_lora(lora, *new)
            _check_base(base, new[0])
            with cupy.cuda.Device(dev):  # the same plan eagerly, on the device's null stream
                eager = plans[dev](d[0], d[1], lora_ids=d[2], adapter_enabled=d[3])
                cupy.cuda.Device(dev).synchronize()
            _check_base(eager[0], new[0])
            _check_lora(eager[1], *new)


# ---- one host thread per GPU ----------------------------------------------------------------
def test_one_thread_per_gpu_at_once():
    errors, barrier = [], threading.Barrier(2)

    def work(dev):
        try:
            with cupy.cuda.Device(dev):
                stream = cupy.cuda.Stream(non_blocking=True)
                barrier.wait()
                for i in range(40):
                    ids, mapping, lora_ids, enabled = _inputs(1000 * dev + i)
                    d = [cupy.asarray(x) for x in (ids, mapping, lora_ids, enabled)]
                    base, lora = mla.align_moe_and_lora(d[0], d[1], B, E, L, lora_ids=d[2],
                                                        adapter_enabled=d[3], stream=stream)
                    stream.synchronize()
                    _check_base(base, ids)
                    _check_lora(lora, ids, mapping, lora_ids, enabled)
        except BaseException as e:  # reported by the main thread
            errors.append((dev, e))

    threads = [threading.Thread(target=work, args=(dev,)) for dev in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors


# ---- expert parallelism: half the experts on each GPU ---------------------------------------
def test_expert_parallel_halves_cover_every_route_once():
    ids = make_routing(np.random.default_rng(7), 512, K, E)
    half = E // 2
    maps = []
    for rank in (0, 1):
        m = np.full(E, -1, np.int32)
        m[rank * half:(rank + 1) * half] = np.arange(half, dtype=np.int32)
        maps.append(m)
    seen = np.zeros(ids.size, np.int64)
    for rank in (0, 1):
        d_ids, d_map = _on(rank, (ids, maps[rank]))
        with cupy.cuda.Device(rank):
            got = mla.moe_align_block_size(d_ids, B, E, d_map, ignore_invalid_experts=True)
            cupy.cuda.Device(rank).synchronize()
        _check_base(got, ids, emap=maps[rank], ignore=True)
        s = _host(got.sorted_token_ids)
        routes = s[(s >= 0) & (s < ids.size)]
        assert set(np.unique(_host(got.expert_ids))) <= set(range(half)) | {-1}
        seen[routes] += 1
        flat = ids.reshape(-1)
        mine = (flat >= rank * half) & (flat < (rank + 1) * half)
        assert sorted(routes.tolist()) == np.flatnonzero(mine).tolist()
    valid = (ids.reshape(-1) >= 0) & (ids.reshape(-1) < E)
    np.testing.assert_array_equal(seen[valid], 1)
    np.testing.assert_array_equal(seen[~valid], 0)
