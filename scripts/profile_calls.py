"""Where the host time of an eager call goes: wall time and cProfile over N calls, for the
public functions and AlignPlan, base, LoRA or both; ``--pieces`` times the allocation
pieces the allocating paths are built from.

    python scripts/profile_calls.py [--calls N] [--op base|lora|pair]
        [--path plan|cupy_out|cupy_alloc|torch_out|torch_alloc|cupy_new|torch_new] [--wall]
        [--pieces] [--breakdown]

``cupy_new`` / ``torch_new``: each call with the next of the benchmark's new token counts
(the full path, as in eager prefill).
"""

import argparse
import contextlib
import cProfile
import pstats
import time
import timeit
from types import SimpleNamespace

import numpy as np

import moe_lora_align as mla
from moe_lora_align import _call
from moe_lora_align.bench import each_call_a_new_shape, public_call


def inputs(op, path, T=16, K=8, E=256, B=16, L=16):
    """The call to time, as the benchmark's eager table makes it."""
    import cupy

    rng = np.random.default_rng(0)
    ids = rng.integers(0, E, size=(T, K)).astype(np.int32)
    mapping = rng.integers(-1, L, size=T).astype(np.int32)
    lora_ids = np.arange(-1, L, dtype=np.int32)
    enabled = np.ones(L + 1, np.int32)
    d = [cupy.asarray(x) for x in (ids, mapping, lora_ids, enabled)]
    P, M = mla.buffer_sizes(T * K, E, B)
    if path.endswith("_new"):  # the benchmark's full-path columns: a new token count a call
        torch = None
        if path.startswith("torch"):
            import torch
        fns = {}
        each_call_a_new_shape(op, T, K, E, B, L if op != "base" else None, fns, torch)
        return fns[path]
    if path == "plan":
        plan = mla.AlignPlan(T, K, E, B, max_loras=None if op == "base" else L)
        fn = (lambda: plan(d[0])) if op == "base" else (
            lambda: plan(d[0], d[1], lora_ids=d[2], adapter_enabled=d[3]))
        fn.plan = plan
        fn.args = (d[0], None if op == "base" else d[1], None if op == "base" else d[2],
                   None if op == "base" else d[3], None)
        return fn
    if path.startswith("torch"):
        import torch

        d = [torch.from_dlpack(x) for x in d]
        empty = lambda n: torch.empty(n, dtype=torch.int32, device="cuda")  # noqa: E731
    else:
        empty = lambda n: cupy.empty(n, np.int32)  # noqa: E731
    outs = None
    if path.endswith("_out"):
        base_out = tuple(empty(n) for n in (P, M, 1))
        lora_out = tuple(empty(n) for n in (L * P, L * M, L))
        outs = base_out if op == "base" else lora_out if op == "lora" else (base_out, lora_out)
    return public_call(op, d, B, E, L, outs)


def prepared_summary(plan=None):
    """How the cached calls launch: stream mode and launches per call."""
    caches = dict(_call._caches)
    if plan is not None:
        caches["plan"] = plan._prepared
    for dev, cache in caches.items():
        for key, prep in cache.items():
            n = (sum(len(x) for x in prep.launches) if prep.mode == "two"
                 else len(prep.launches))
            print(f"  prepared ({dev}): mode {prep.mode}, {n} launches, "
                  f"{'allocating' if prep.out_layout else 'out= given'}")


def pieces(n=20000):
    """µs per call of the pieces an allocating call could be built from."""
    import cupy

    i32 = np.dtype(np.int32)
    sizes = (2048, 192, 1)
    offs = (0, 2048, 2240)
    total = 2244

    def views_ctor():
        buf = cupy.empty(total, i32)
        mem = buf.data
        return [cupy.ndarray((s,), i32, mem + 4 * o) for s, o in zip(sizes, offs)]

    def views_slice():
        buf = cupy.empty(total, i32)
        return [buf[o:o + s] for s, o in zip(sizes, offs)]

    def three_empty():
        return [cupy.empty(s, i32) for s in sizes]

    def alloc_only():
        return cupy.cuda.alloc(4 * total)

    def ctor_memptr():
        mem = cupy.cuda.alloc(4 * total)
        return [cupy.ndarray((s,), i32, mem + 4 * o) for s, o in zip(sizes, offs)]

    s = cupy.cuda.get_current_stream()
    cands = {"cupy.empty + 3 ndarray(memptr)": views_ctor, "cupy.empty + 3 slices": views_slice,
             "3 cupy.empty": three_empty, "cupy.cuda.alloc": alloc_only,
             "cupy.cuda.alloc + 3 ndarray(memptr)": ctor_memptr,
             "streamIsCapturing": lambda: cupy.cuda.runtime.streamIsCapturing(s.ptr),
             "get_current_stream().ptr": lambda: cupy.cuda.get_current_stream().ptr,
             "getDevice": cupy.cuda.runtime.getDevice}
    try:
        import torch

        dev = torch.device("cuda", 0)
        cands["torch.empty + 3 slices"] = lambda: (
            lambda b: [b[o:o + s] for s, o in zip(sizes, offs)])(
            torch.empty(total, dtype=torch.int32, device=dev))
        cands["torch.empty + split_with_sizes"] = lambda: torch.empty(
            total, dtype=torch.int32, device=dev).split_with_sizes([2048, 192, 4])
        cands["torch.empty"] = lambda: torch.empty(total, dtype=torch.int32, device=dev)
        cands["3 torch.empty"] = lambda: [torch.empty(s, dtype=torch.int32, device=dev)
                                          for s in sizes]
        tt = torch.empty(4, dtype=torch.int32, device=dev)
        cands["tensor props (shape, stride(), dtype, get_device(), data_ptr())"] = lambda: (
            tt.shape, tt.stride(), tt.dtype, tt.get_device(), tt.data_ptr())
        raw = torch._C._cuda_getCurrentRawStream
        cands["_cuda_getCurrentRawStream"] = lambda: raw(0)
    except ImportError:
        pass
    x = cupy.empty(4, i32)
    cands["cupy props (shape, strides, dtype, data.device_id, data.ptr)"] = lambda: (
        x.shape, x.strides, x.dtype, x.data.device_id, x.data.ptr)
    cands["cupy props (shape, _c_contiguous, dtype, data.device_id, data.ptr)"] = lambda: (
        x.shape, x._c_contiguous, x.dtype, x.data.device_id, x.data.ptr)
    for name, fn in cands.items():
        for _ in range(200):
            fn()
        t = min(timeit.repeat(fn, number=n, repeat=3)) / n * 1e6
        print(f"  {t:7.2f} µs  {name}")


def breakdown(n=20000):
    """µs of each piece of a prepared AlignPlan call (base and pair) at the benchmark's
    sizes, on a created stream and on the legacy default stream."""
    import cupy

    from moe_lora_align import _launch

    def us(fn):
        for _ in range(100):
            fn()
        cupy.cuda.Device().synchronize()
        t = min(timeit.repeat(fn, number=n, repeat=3)) / n * 1e6
        cupy.cuda.Device().synchronize()
        return t

    for T, E, L in ((1, 64, 4), (16, 256, 16), (4096, 256, 16)):
        for op in ("base", "pair"):
            for stream in (cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream.null):
                with stream:
                    fn = inputs(op, "plan", T=T, E=E, L=L)
                    fn()
                    plan = fn.plan
                    (key, prep), = plan._prepared.items()
                    sp = key[2]
                    launches = prep.launches if prep.mode != "two" else prep.launches[0]
                    row = {"call": us(fn),
                           "launch": us(lambda: _launch.replay_launches(launches, sp)),
                           "props": us(lambda: _call.properties(fn.args)),
                           "lookup": us(lambda: _call.lookup(plan._prepared, key))}
                cells = "  ".join(f"{k} {v:6.2f}" for k, v in row.items())
                print(f"  plan {op:4} T={T:5} E={E:3} L={L:2} "
                      f"{'null' if stream.ptr == 0 else 'own '} mode {prep.mode}: {cells}")


def steps(n=20000):
    """µs of each step of a prepared public call (``_call.align``'s fast path) at decode,
    base and pair, CuPy and torch, out= given and allocating; then candidate pieces."""
    import sys
    import weakref

    import cupy

    from moe_lora_align import _launch, api

    def us(fn):
        for _ in range(200):
            fn()
        t = min(timeit.repeat(fn, number=n, repeat=3)) / n * 1e6
        cupy.cuda.Device().synchronize()
        return t

    stream = cupy.cuda.Stream(non_blocking=True)
    def gpu_us(fn, calls=100, reps=7):
        """GPU µs per call of back-to-back calls, between events (the eager table's way)."""
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        out = []
        for _ in range(reps):
            stream.synchronize()
            start.record(stream)
            for _ in range(calls):
                fn()
            stop.record(stream)
            stop.synchronize()
            out.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3 / calls)
        return sorted(out)[reps // 2]

    for op, T, E, L in (("base", 1, 64, 4), ("pair", 1, 64, 4), ("lora", 16, 256, 16),
                        ("pair", 4096, 256, 16)):
        for path in ("cupy_out", "cupy_alloc", "torch_out", "torch_alloc"):
            try:
                with stream:
                    fn = inputs(op, path, T=T, E=E, L=L)
            except ImportError:
                continue
            ctx = contextlib.nullcontext()
            if path.startswith("torch"):
                import torch

                ctx = torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr))
            with stream, ctx:
                fn()
                (dev, cache), = [(d, c) for d, c in _call._caches.items() if c]
                key = next(reversed(cache))
                prep = cache[key]
                cl = fn.__code__.co_freevars
                x = fn.__closure__[cl.index("x")].cell_contents
                outs = fn.__closure__[cl.index("outs")].cell_contents
                base_out = lora_out = None
                if op == "base":
                    base_out = outs
                elif op == "lora":
                    lora_out = outs
                elif outs:
                    base_out, lora_out = outs
                inputs_ = (x[0], None if op == "base" else x[1], None if op == "base" else x[2],
                           None if op == "base" else x[3], None)
                opts = key[0]
                outs2 = (base_out, lora_out)
                fk = _call._fast_key(opts, inputs_, outs2, None)
                k2, ptrs, device_id, sp, given = fk
                typed = {"base": api._base_result, "lora": api._lora_result,
                         "pair": api._pair_result}[op]
                res = list(prep.run(list(ptrs), given, sp))
                launches = prep.launches if prep.mode != "two" else prep.launches[0]
                job, slot = prep.jobs[0], prep.slots[0]
                full = list(ptrs) + [0] * 12
                row = {
                    "gpu100": gpu_us(fn),
                    "call": us(fn),
                    "fast_key": us(lambda: _call._fast_key(opts, inputs_, outs2, None)),
                    "properties": us(lambda: _call.properties(inputs_ + given)),
                    "cur_device": us(_call.current_device),
                    "stream_ptr": us(lambda: _call.stream_pointer(
                        "torch" if path.startswith("torch") else "cupy", 0, None)),
                    "lookup": us(lambda: cache.get(k2).current()),
                    "run": us(lambda: prep.run(list(ptrs), given, sp)),
                    "replay": us(lambda: _launch.replay_launches(launches, sp)),
                    "pack": us(lambda: _launch.POINTERS.pack_into(job.packed, 0, *slot(full))),
                    "typed": us(lambda: typed(res)),
                }
            print(f"  {op:4} T={T:3} E={E:3} {path:11} mode {prep.mode} "
                  + "  ".join(f"{k} {v:5.2f}" for k, v in row.items()), flush=True)
    # candidate pieces
    i32 = np.dtype(np.int32)
    a = cupy.empty(16, i32)
    mem = cupy.cuda.alloc(4096)
    nt = api.Alignment
    trio = (a, a, a)
    try:
        wr = weakref.ref(a)
        wr_ok = wr() is a
    except TypeError:
        wr_ok = False
    print(f"  cupy ndarray weakref: {wr_ok}; type {type(a).__mro__}")
    cands = {
        "sys.getrefcount(a)": lambda: sys.getrefcount(a),
        "weakref.getweakrefcount(a)": lambda: weakref.getweakrefcount(a),
        "mem + 64": lambda: mem + 64,
        "ndarray((16,), i32, mem)": lambda: cupy.ndarray((16,), i32, mem),
        "ndarray((4, 4), i32, mem)": lambda: cupy.ndarray((4, 4), i32, mem),
        "a.view()": lambda: a.view(),
        "a[0:8]": lambda: a[0:8],
        "Alignment(*trio)": lambda: nt(*trio),
        "tuple.__new__(Alignment, trio)": lambda: tuple.__new__(nt, trio),
        "a.data.ptr": lambda: a.data.ptr,
        "a.shape": lambda: a.shape,
        "(a.shape, a._c_contiguous, a.dtype, a.data.device_id)": lambda: (
            a.shape, a._c_contiguous, a.dtype, a.data.device_id),
        "cupy.cuda.alloc(4096)": lambda: cupy.cuda.alloc(4096),
    }
    try:
        import torch

        t = torch.empty(16, dtype=torch.int32, device="cuda")
        cd = t.untyped_storage()._cdata
        use = torch._C._storage_Use_Count
        cands["torch _storage_Use_Count(cdata)"] = lambda: use(cd)
        cands["torch t.untyped_storage()._cdata"] = lambda: t.untyped_storage()._cdata
        cands["torch t.shape"] = lambda: t.shape
        cands["torch t.is_contiguous()"] = lambda: t.is_contiguous()
        cands["torch t.get_device()"] = lambda: t.get_device()
        cands["torch t.data_ptr()"] = lambda: t.data_ptr()
        cands["torch t.dtype"] = lambda: t.dtype
        cands["torch empty(64)"] = lambda: torch.empty(64, dtype=torch.int32,
                                                        device=t.device)
        b = torch.empty(64, dtype=torch.int32, device=t.device)
        cands["torch b.split_with_sizes([16,16,16,16])"] = lambda: b.split_with_sizes(
            [16, 16, 16, 16])
        cands["torch b[0:16]"] = lambda: b[0:16]
        cands["torch b.view(4, 16)"] = lambda: b.view(4, 16)
        cands["torch b.as_strided((16,), (1,), 16)"] = lambda: b.as_strided((16,), (1,), 16)
        cands["torch weakref.getweakrefcount(t)"] = lambda: weakref.getweakrefcount(t)
    except ImportError:
        pass
    big = 4 * 850000  # bytes of base + LoRA outputs at T=4096, E=256, 16 slots
    cands[f"cupy.cuda.alloc({big})"] = lambda: cupy.cuda.alloc(big)
    try:
        import torch

        cands[f"torch empty({big // 4})"] = lambda: torch.empty(big // 4, dtype=torch.int32,
                                                                device="cuda")
    except ImportError:
        pass
    try:
        import torch

        _call._fast.update(torch_empty=torch.empty, torch_int32=torch.int32)
        # The package's own torch allocation, both ways, for the decode rows' outputs:
        # base T=1 E=64, LoRA T=16 E=256 16 slots, base + LoRA T=1 E=64 4 slots.
        layouts = {"base": [(968,), (61,), (1,)],
                   "LoRA": [(16, 3968), (16, 248), (16,)],
                   "pair": [(968,), (61,), (1,), (4, 968), (4, 61), (4,)]}
        for name, shapes in layouts.items():
            for split in (True, False):
                prep = SimpleNamespace(kind="torch", out_layout=_call.OutLayout(shapes, split),
                                       framework_device=torch.device("cuda", 0))
                way = "split (+ views)" if split else "as_strided each"
                now = " (now)" if split == _call.torch_splits(shapes) else ""
                cands[f"torch {name} outputs: {way}{now}"] = (
                    lambda prep=prep: _call.Prepared._allocate(prep))
    except ImportError:
        pass
    for name, f in cands.items():
        print(f"  {us(f):7.3f} µs  {name}", flush=True)


def by_cpu(n=3000):
    """Host µs per call of a plan's base decode call with the process pinned to each CPU in
    turn (launch cost may depend on the CPU's distance to the GPU), and the GPU's local
    CPUs as the kernel reports them."""
    import os

    import cupy

    bus = cupy.cuda.Device().pci_bus_id.lower()
    for path in (f"/sys/bus/pci/devices/{bus}/local_cpulist",
                 f"/sys/bus/pci/devices/{bus}/numa_node"):
        try:
            print(f"  {path}: {open(path).read().strip()}")
        except OSError as e:
            print(f"  {path}: {e}")
    cpus = sorted(os.sched_getaffinity(0))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        fn = inputs("base", "plan", T=1, E=64)
        for cpu in cpus + cpus[:2]:
            os.sched_setaffinity(0, {cpu})
            for _ in range(300):
                fn()
            stream.synchronize()
            best = []
            for _ in range(3):
                t = time.perf_counter()
                for _ in range(n):
                    fn()
                best.append((time.perf_counter() - t) / n * 1e6)
                stream.synchronize()
            print(f"  cpu {cpu:3d}: plan base T=1 {min(best):6.2f} µs per call (host)")
    os.sched_setaffinity(0, set(cpus))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=10000)
    ap.add_argument("--op", default="base", choices=("base", "lora", "pair"))
    ap.add_argument("--path", default="cupy_out")
    ap.add_argument("--pieces", action="store_true")
    ap.add_argument("--breakdown", action="store_true")
    ap.add_argument("--steps", action="store_true")
    ap.add_argument("--by-cpu", action="store_true")
    ap.add_argument("--wall", action="store_true", help="the wall time only, no profile")
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--sort", default="tottime",
                    help="pstats orders, comma-separated: one table each (e.g. tottime,cumulative)")
    args = ap.parse_args()
    import cupy

    if args.pieces:
        pieces()
        return
    if args.breakdown:
        breakdown()
        return
    if args.steps:
        steps()
        return
    if args.by_cpu:
        by_cpu()
        return
    fn = inputs(args.op, args.path)
    for _ in range(100):
        fn()
    cupy.cuda.Device().synchronize()
    t = time.perf_counter()
    for _ in range(args.calls):
        fn()
    cupy.cuda.Device().synchronize()
    print(f"{args.path} {args.op}: {(time.perf_counter() - t) / args.calls * 1e6:.2f} µs per "
          "call (wall, no profiler)")
    prepared_summary(getattr(fn, "plan", None))
    if args.wall:
        return
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        fn()
    prof.disable()
    cupy.cuda.Device().synchronize()
    for order in args.sort.split(","):
        pstats.Stats(prof).sort_stats(order).print_stats(args.top)


if __name__ == "__main__":
    main()
