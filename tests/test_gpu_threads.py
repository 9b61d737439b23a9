"""Host threads calling the public functions at once (GPU only).

8 threads, 50 calls each: base, LoRA, and base + LoRA with streams "two" and None, on CuPy
arrays, results checked against the NumPy backend. Once with every thread on its own
``cupy.cuda.Stream``, once with all of them on the default stream. Every other call has a late
producer: the input ids are written by a kernel that first spins on the thread's stream, so
an alignment that does not wait for the caller's stream (for example a fork onto the shared
side streams that waits on another thread's event) reads the placeholder ids and fails.
"""

import threading

import numpy as np
import pytest

import fuzz_cases as fc
import moe_lora_align as mla
from gpu_util import cupy, delayed_copy, make_lora, requires_gpu

pytestmark = [requires_gpu, pytest.mark.gpu]

THREADS = 8
CALLS = 50
CONFIGS = [(1, 8, 64, 16, 4), (16, 8, 256, 16, 16), (300, 4, 128, 32, 8),
           (2048, 8, 128, 64, 8)]  # T, K, E, B, L
KINDS = ["base", "lora", "pair-two", "pair-auto"]


def _prepare():
    """Per (config, kind): a fuzz_cases.Case and the NumPy backend's results."""
    prepared = []
    for c, (T, K, E, B, L) in enumerate(CONFIGS):
        rng = np.random.default_rng(100 + c)
        ids = rng.integers(-1, E + 1, size=(T, K)).astype(np.int32)  # a few invalid ids
        mapping, lora_ids, enabled = make_lora(rng, T, L, disabled=1)
        for k, kind in enumerate(KINDS):
            mode = kind.split("-")[0]
            case = fc.Case(mode=mode, T=T, K=K, E=E, B=B, dtype="int32", kind="threads",
                           max_loras=L if mode != "base" else 0,
                           det=(c + k) % 3 == 0,  # some deterministic calls, compared exactly
                           streams="two" if kind == "pair-two" else None,
                           topk_ids=ids, seed="threads", index=f"{c}-{kind}")
            if mode != "base":
                case.mapping, case.lora_ids, case.enabled = mapping, lora_ids, enabled
            prepared.append((case, fc.execute(case, np, gpu_side=False)))
    return prepared


def _one_call(case, d, stream, late):
    """One call on ``stream`` (current stream, or passed as stream=); returns host results."""
    ids = d["ids"]
    if late:  # placeholder ids (all invalid) until the late copy lands
        ids = cupy.full(d["ids"].shape, case.E + 7, dtype=cupy.int32)
        delayed_copy(d["ids"].reshape(-1), ids.reshape(-1), 100_000, blocks=32)
    kw = dict(deterministic=case.det)
    lkw = dict(lora_ids=d.get("lora_ids"), adapter_enabled=d.get("enabled"),
               max_loras=case.max_loras)
    if case.mode == "base":
        res = {"base": mla.moe_align_block_size(ids, case.B, case.E, **kw)}
    elif case.mode == "lora":
        res = {"lora": mla.moe_lora_align_block_size(ids, d["mapping"], case.B, case.E, **kw,
                                                     **lkw)}
    else:
        b, lo = mla.align_moe_and_lora(ids, d["mapping"], case.B, case.E, streams=case.streams,
                                       **kw, **lkw)
        res = {"base": b, "lora": lo}
    names = ("sorted", "experts", "ntpp")
    out = {side: {n: cupy.asnumpy(x, stream=stream) for n, x in zip(names, r)}
           for side, r in res.items()}
    stream.synchronize()
    return out


def _worker(tid, stream, prepared, errors, barrier):
    try:
        with stream:
            dev = [{"ids": cupy.asarray(case.topk_ids),
                    **({} if case.mapping is None else
                       {"mapping": cupy.asarray(case.mapping),
                        "lora_ids": cupy.asarray(case.lora_ids),
                        "enabled": cupy.asarray(case.enabled)})}
                   for case, _ in prepared]
            barrier.wait(timeout=120)  # every thread starts calling at once
            for n in range(CALLS):
                j = (tid * 7 + n * 3) % len(prepared)
                case, want = prepared[j]
                got = _one_call(case, dev[j], stream, late=n % 2 == 1)
                try:
                    fc.compare(case, got, want)
                except fc.CaseFailure as e:
                    errors.append(f"thread {tid} call {n} ({fc.describe(case)}): {e}")
    except Exception as e:  # noqa: BLE001 - reported after the join
        errors.append(f"thread {tid}: {type(e).__name__}: {e}")


@pytest.mark.parametrize("own_streams", [True, False], ids=["own-streams", "default-stream"])
def test_threads_call_at_once(own_streams):
    delayed_copy(cupy.zeros(1, np.int32), cupy.zeros(1, np.int32), 0)  # compiled once, here
    prepared = _prepare()
    # warm-up on this thread: kernels compiled and loaded, the spin kernel too
    warm = cupy.cuda.Stream(non_blocking=True)
    with warm:
        for case, want in prepared[:len(KINDS)]:
            d = {"ids": cupy.asarray(case.topk_ids)}
            if case.mapping is not None:
                d.update(mapping=cupy.asarray(case.mapping), lora_ids=cupy.asarray(case.lora_ids),
                         enabled=cupy.asarray(case.enabled))
            fc.compare(case, _one_call(case, d, warm, late=True), want)
    streams = [cupy.cuda.Stream(non_blocking=True) if own_streams else cupy.cuda.Stream.null
               for _ in range(THREADS)]
    errors = []
    barrier = threading.Barrier(THREADS)
    threads = [threading.Thread(target=_worker, args=(t, streams[t], prepared, errors, barrier))
               for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    cupy.cuda.Device().synchronize()
    assert not errors, f"{len(errors)} failures:\n" + "\n".join(errors[:10])
