"""One call path: where a call's arguments become a checked, launch-ready problem.

The public functions and ``AlignPlan`` both come through here. A call is checked from its
arguments alone (``prepare``), its outputs allocated only after every check passed
(``allocate``), then run on the NumPy backend or launched on the GPU. On the GPU a call whose
arguments have the properties of an earlier one (framework, shapes, strides, dtypes, device,
options, stream, ``out=`` given or not) is served by that call's ``Prepared`` form: its checks
held for exactly these properties and its launches are recorded, so only the pointers are
rewritten before the same kernels go to the driver again. An allocating CuPy call there may
get an earlier call's outputs back once nothing else holds them (``Spare``).
"""

from __future__ import annotations

import contextlib
import math
import operator
import sys
import threading
from sys import getrefcount
from typing import Any, Optional, Tuple
from weakref import getweakrefcount

import numpy as np

from . import _checks, _interop, _kernels
from ._dispatch import DEFAULT_POLICY, VARIANTS, AlignPolicy
from ._launch import (MAP_AFTER, MAP_BEFORE, MAP_NONE, POINTERS, Job, replay_form,
                      replay_launches)
from ._reference import align_rows, processed_rows
from ._sizes import MAX_BUCKETS, buffer_sizes

INT32 = np.dtype(np.int32)

BASE_OUTS = ("sorted_token_ids", "expert_ids", "num_tokens_post_pad")
SCATTER_OUT = ("scatter_idx",)
STREAM_MODES = ("fused", "one", "two")


def map_mode(expert_map, ignore_invalid_experts):
    if expert_map is None:
        return MAP_NONE
    return MAP_BEFORE if ignore_invalid_experts else MAP_AFTER


# ---- checking a call ----------------------------------------------------------------------
class Call:
    """A checked call: where it runs, the framework to answer in, and the job to run. The
    outputs it allocates itself come later (``allocate``), once every check has passed."""

    def __init__(self, where, framework, device_id, job, results, out_shapes):
        self.where, self.framework, self.device_id = where, framework, device_id
        self.job, self.results, self.out_shapes = job, results, out_shapes


def _alloc(where, device_id, shape):
    if where == _interop.HOST:
        return np.empty(shape, dtype=np.int32)
    import cupy

    with cupy.cuda.Device(device_id):
        return cupy.empty(shape, dtype=np.int32)


def _available_memory(where, device_id) -> int:
    """Bytes the outputs could ever have: the GPU's memory, or the host's (0: unknown)."""
    if where == _interop.DEVICE:
        from ._launch import device_memory

        return device_memory(device_id)
    try:
        import os

        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def _native(name, x, where):
    """``x`` as NumPy or CuPy; a list NumPy cannot make an array of (ragged), or an array
    of a dtype NumPy has no type for (torch.bfloat16), is refused by name."""
    try:
        return _interop.to_native(x, where)
    except ValueError as e:
        raise ValueError(f"{name} is not an array NumPy can make: {e}") from None
    except TypeError:
        if getattr(x, "dtype", None) is None:
            raise
        raise _checks.dtype_error(name, x.dtype) from None


def prepare(topk_ids, block_size, num_experts, *, rows, token_lora_mapping=None,
             lora_ids=None, adapter_enabled=None, expert_map=None, map_mode=MAP_NONE,
             pad_sorted_ids=False, scatter=False, deterministic=False, out=None,
             validate=None, lora=False, out_arg="out", fill_unprocessed=None,
             plan_outputs=False, stream=None):
    """Check one call from its arguments alone and build its job (outputs not allocated);
    ``stream``: the caller's, where the value checks and a strided input's copy run."""
    block_size = _checks.positive_int("block_size", block_size)
    num_experts = _checks.positive_int("num_experts", num_experts)
    _checks.check_buckets(num_experts, rows)
    pad_sorted_ids = _checks.flag("pad_sorted_ids", pad_sorted_ids)
    deterministic = _checks.flag("deterministic", deterministic)
    if validate is not None:
        validate = _checks.flag("validate", validate)
    names = BASE_OUTS + (SCATTER_OUT if scatter else ())
    outs = _checks.out_buffers(out, names, out_arg)
    if topk_ids is None:
        raise TypeError("topk_ids is required: a [tokens, topk] integer array")
    if lora and token_lora_mapping is None:
        raise TypeError("token_lora_mapping is required: an int32 [tokens] array")
    inputs = {"topk_ids": topk_ids, "token_lora_mapping": token_lora_mapping,
              "lora_ids": lora_ids, "adapter_enabled": adapter_enabled,
              "expert_map": expert_map}
    out_named = {f"{out_arg} {n}": o for n, o in zip(names, outs or ())}
    # An AlignPlan's own buffers (CuPy) may serve inputs of another framework.
    where, framework = _interop.classify({**inputs, **out_named},
                                         exempt=tuple(out_named) if plan_outputs else ())
    native = {k: _native(k, v, where) for k, v in inputs.items()}
    given = {k: _interop.to_native(v, where) for k, v in out_named.items()}
    device_id = None
    if where == _interop.DEVICE:
        device_id = _checks.check_same_device({**native, **given})

    ids = native["topk_ids"]
    _checks.check_topk_ids(ids)
    tokens, topk = int(ids.shape[0]), int(ids.shape[1])
    numel = tokens * topk
    if native["expert_map"] is not None:
        _checks.check_int32_vector("expert_map", native["expert_map"], num_experts, exact=True)
    if lora:
        _checks.check_int32_vector("token_lora_mapping", native["token_lora_mapping"], tokens,
                                   exact=True)
        _checks.check_int32_vector("lora_ids", native["lora_ids"], rows + 1)
        _checks.check_int32_vector("adapter_enabled", native["adapter_enabled"], rows + 1)

    P, M = buffer_sizes(numel, num_experts, block_size, pad_sorted_ids)
    _checks.check_sizes(numel, rows, P, M, block_size)

    pitches, written = [], {}
    for n, length in zip(names, (P, M, 1, numel)):
        buf = given.get(f"{out_arg} {n}")
        if buf is None:
            continue
        r = rows if n in ("sorted_token_ids", "expert_ids") else 1
        full = length if n != "num_tokens_post_pad" else rows
        pitch = _checks.check_output(f"{out_arg} {n}", buf, r, full)
        pitches.append(pitch)
        written[f"{out_arg} {n}"] = (buf, r * pitch)
    if outs is None:
        shapes = [(rows, P), (rows, M), (rows,)] if lora else [(P,), (M,), (1,)]
        shapes += [(numel,)] if scatter else []
        nbytes = 4 * sum(math.prod(sh) for sh in shapes)  # Python ints: no overflow
        _checks.check_memory(nbytes, _available_memory(where, device_id),
                             "GPU" if where == _interop.DEVICE else "host")
    else:
        shapes = None
        _checks.check_disjoint(written, native)

    if validate is None:
        validate = where == _interop.HOST
    contiguous = bool(ids.flags.c_contiguous)
    order: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if where == _interop.DEVICE and (validate or not contiguous):
        # On the device check_same_device found the arrays' device, so device_id is an int.
        order = _interop.ordered_on(framework, device_id, stream)  # type: ignore[arg-type]
    with order:
        if validate:
            if native["expert_map"] is not None:
                _checks.check_expert_map_values(native["expert_map"], num_experts)
            if lora:
                _checks.check_token_lora_mapping_values(native["token_lora_mapping"], rows)
                if native["lora_ids"] is not None:
                    _checks.check_lora_ids_values(native["lora_ids"], rows)
        # The kernels read the routes as one contiguous run: a strided view (even one that
        # flattens to a strided 1-D view) is copied first.
        flat = (ids if contiguous else ids.copy()).reshape(-1)

    bufs = [given[f"{out_arg} {n}"] for n in names] if outs is not None else [None] * len(names)
    job = Job(topk_ids=flat, numel=numel, topk=topk, num_experts=num_experts,
              block_size=block_size, rows=rows, padded_len=P, num_tiles=M,
              sorted_ids=bufs[0], expert_ids=bufs[1], num_post_pad=bufs[2],
              sorted_pitch=pitches[0] if pitches else P,
              expert_pitch=pitches[1] if pitches else M, map_mode=map_mode,
              expert_map=native["expert_map"], token_slot=native["token_lora_mapping"],
              lora_ids=native["lora_ids"], adapter_enabled=native["adapter_enabled"],
              scatter_idx=bufs[3] if scatter else None,
              fill_unprocessed=outs is None if fill_unprocessed is None else fill_unprocessed,
              deterministic=deterministic)
    return Call(where, framework, device_id, job, outs, shapes)




def allocate(call: Call, stream=None) -> None:
    """Allocate the outputs of a call that was given no ``out=`` (after every check)."""
    if call.out_shapes is None:
        return
    if call.where == _interop.DEVICE:
        from ._launch import check_capturable

        check_capturable(_interop.caller_stream(call.framework, call.device_id, stream), True,
                         "a call without out= buffers")
    bufs = [_alloc(call.where, call.device_id, sh) for sh in call.out_shapes]
    job = call.job
    job.sorted_ids, job.expert_ids, job.num_post_pad = bufs[:3]
    job.scatter_idx = bufs[3] if len(bufs) > 3 else None
    call.results = tuple(bufs)


def check_pair_disjoint(base: Call, lora: Call) -> None:
    """The base and LoRA outputs given to one call must not share memory with each other, nor
    with the other side's inputs (each call checked its own). Allocated outputs are apart."""
    spans = {}
    for call, arg in ((base, "out_base"), (lora, "out_lora")):
        if call.out_shapes is not None:
            continue
        j = call.job
        for n, buf, entries in zip(BASE_OUTS, (j.sorted_ids, j.expert_ids, j.num_post_pad),
                                   (j.rows * j.sorted_pitch, j.rows * j.expert_pitch, j.rows)):
            spans[f"{arg} {n}"] = (buf, entries)
    if not spans:
        return
    j = lora.job
    _checks.check_disjoint(spans, {"token_lora_mapping": j.token_slot, "lora_ids": j.lora_ids,
                                   "adapter_enabled": j.adapter_enabled})


# ---- the NumPy backend ----------------------------------------------------------------------
def _row_views(buf, rows, pitch, length):
    flat = buf.reshape(-1)
    return flat[: rows * pitch].reshape(rows, pitch)[:, :length]


def run_on_host(job: Job):
    """Run a prepared job on the NumPy backend."""
    rows = job.rows
    sorted_v = _row_views(job.sorted_ids, rows, job.sorted_pitch, job.padded_len)
    expert_v = _row_views(job.expert_ids, rows, job.expert_pitch, job.num_tiles)
    ntpp = job.num_post_pad.reshape(-1)[:rows]
    processed = None
    route_rows = None
    if job.token_slot is not None:
        processed = processed_rows(rows, job.lora_ids, job.adapter_enabled)
        route_rows = np.repeat(np.asarray(job.token_slot, dtype=np.int64), job.topk)
    kept = align_rows(job.topk_ids, job.num_experts, job.block_size, sorted_v, expert_v, ntpp,
                      expert_map=job.expert_map, map_before=job.map_mode == MAP_BEFORE,
                      route_rows=route_rows, processed=processed)
    if job.fill_unprocessed and processed is not None:
        idle = np.flatnonzero(~processed)
        sorted_v[idle] = job.numel
        expert_v[idle] = -1
        ntpp[idle] = 0
    if job.scatter_idx is not None:
        job.scatter_idx.reshape(-1)[: job.numel] = np.where(
            kept, np.arange(job.numel, dtype=np.int32), -1)


def answer(call: Call):
    """The call's results in the caller's framework (buffers the caller gave stay as given)."""
    return tuple(_interop.from_native(r, call.framework)
                 if _interop.framework_of(r) in ("numpy", "cupy") else r for r in call.results)


# ---- prepared calls: what an earlier call worked out, reused ------------------------------
# The key of a call: its options, then per array (inputs, then out= buffers) the array's type
# and properties, then the device and the stream. Properties are read the cheap way each
# framework offers; a call with an array of another kind (NumPy, JAX, ...) is not cached.
_KINDS: dict = {}     # array type -> "cupy" | "torch", filled once a call of that type is seen
CACHE_SIZE = 256      # prepared calls kept per device (the oldest go first)


def _note_kinds(*arrays) -> None:
    if not _fast:
        import cupy

        _fast["get_device"] = cupy.cuda.runtime.getDevice
        _fast["is_capturing"] = cupy.cuda.runtime.streamIsCapturing
        _fast["current_stream"] = cupy.cuda.get_current_stream
    for x in arrays:
        if x is not None:
            fw = type(x).__module__.split(".")[0]
            # A CuPy without the _c_contiguous flag the key reads: the full path every time.
            if fw == "torch" or (fw == "cupy" and hasattr(x, "_c_contiguous")):
                _KINDS[type(x)] = fw


def properties(arrays) -> Optional[Tuple[tuple, list, Any]]:
    """``(key part, pointers, framework)`` of device arrays, or None when an array is of a
    kind the prepared calls do not serve (then the call takes the full path).

    Per array the key holds what the checks read: type, shape, dtype, device and the
    C-contiguity flag (the checks read only that flag, never the strides; torch and CuPy
    both ignore the strides of size-1 dimensions in it). The loop is the hot path of every
    eager call: kept flat on purpose."""
    props: list = []
    ptrs: list = []
    kind, kinds = None, _KINDS
    prop, ptr = props.append, ptrs.append
    for x in arrays:
        if x is None:
            prop(None)
            ptr(0)
            continue
        t = type(x)
        k = kinds.get(t)
        if k != kind:
            if k is None or kind is not None:
                return None
            kind = k
        elif k is None:
            return None
        if k == "cupy":
            data = x.data
            prop((t, x.shape, x._c_contiguous, x.dtype, data.device_id))
            ptr(data.ptr)
        else:
            prop((t, x.shape, x.is_contiguous(), x.dtype, x.get_device()))
            ptr(x.data_ptr())
    return tuple(props), ptrs, kind


def stream_pointer(kind: str, device_id: int, stream):
    """The raw stream a call is ordered on, read the framework's cheapest way, or None."""
    if stream is None:
        if kind == "torch":
            return _torch_current_stream(device_id)
        return _fast["current_stream"]().ptr
    ptr = getattr(stream, "ptr", None)
    if ptr is None:
        ptr = getattr(stream, "cuda_stream", None)
    return ptr if isinstance(ptr, int) else None


def _torch_current_stream(device_id: int) -> int:
    raw = _fast.get("torch_stream")
    if raw is None:
        import torch

        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
            lambda d: torch.cuda.current_stream(d).cuda_stream)
        _fast["torch_stream"] = raw
    return raw(device_id)


class Prepared:
    """A device call whose checks and launches are settled: ``run`` points its packed
    arguments at a new call's arrays (same properties) and issues the recorded launches."""

    def __init__(self, kind, device_id, jobs, slots, launches, mode, sides, workspaces,
                 out_layout, spans, fixed=None, framework_device=None):
        self.kind, self.device_id = kind, device_id
        self.jobs = jobs              # packed arguments, one a job (base, lora or both)
        self.slots = slots            # per job: itemgetter of its nine pointers
        self.launches = launches      # replay_form of its launches; for "two": (first, second)
        self.mode, self.sides = mode, sides
        self.workspaces = workspaces  # ((workspace, generation), ...) the packing used
        self.build = _kernels.current_build()  # what its recorded kernels were compiled from
        self.out_layout = out_layout  # None (out= given) or the OutLayout to allocate
        self.spans = spans            # bytes of each array, for the overlap check (out= given)
        self.fixed = fixed            # AlignPlan: (its output pointers, its result views)
        self.framework_device = framework_device
        self.answer = None            # AlignPlan: its result tuples, the same every call
        # torch tensors written in place (out= or a plan's views): their version counters go
        # up after each launch, as a torch op's would.
        self.bump = (_interop.torch_bumper()
                     if kind == "torch" and out_layout is None else None)
        self.held = ()                # the recorded launches: what their parameters point into
        # The pointers the packed arguments hold now (with out= given: found free of
        # overlaps); a call with the same pointers packs nothing.
        self.packed = None
        self.spares = []              # CuPy outputs it may hand out again, oldest first
        self.spare_bytes = 0          # of the device's spare budget, claimed by this call
        self.dropped = False          # out of the cache: claims no more budget
        self.lock = threading.Lock()  # one call at a time rewrites and launches

    def current(self) -> bool:
        """False once a workspace it points into was reallocated, or once an experiment
        switched the kernels' build (``_kernels.use_build``): its launches are the old
        build's kernels."""
        if self.build is not _kernels._build:
            return False
        for ws, gen in self.workspaces:
            if ws.generation != gen:
                return False
        return True

    def run(self, ptrs, outs, stream_ptr):
        """Align the call whose arrays have addresses ``ptrs`` (inputs, then ``out=``
        buffers; a fresh list, extended here); returns its outputs: ``outs``, the plan's
        views, or new arrays."""
        if self.fixed is not None:
            ptrs += self.fixed[0]
            outs = self.fixed[1]
        with self.lock:
            if self.out_layout is not None:
                outs, out_ptrs = self._outputs(stream_ptr)
                ptrs += out_ptrs
            if ptrs != self.packed:
                if self.out_layout is None:
                    self._check_disjoint(ptrs)
                self.packed = ptrs
                ptrs = ptrs + [0]  # the slot of a missing array
                for job, slot in zip(self.jobs, self.slots):
                    POINTERS.pack_into(job.packed, 0, *slot(ptrs))
            if self.mode != "two":
                replay_launches(self.launches, stream_ptr)
            else:
                first, second = self.launches
                self.sides.run_raw(stream_ptr, lambda st: replay_launches(first, st),
                                   lambda st: replay_launches(second, st))
        if self.bump is not None:
            self.bump(outs)
        return outs

    def _check_disjoint(self, ptrs):
        """Every out= buffer's written bytes apart from every other array's bytes (the
        properties are those of the checked call; the addresses may not be)."""
        sizes, written, names = self.spans
        _checks.check_spans(names, ptrs, sizes, written)

    def _outputs(self, stream_ptr):
        """The outputs of an allocating call: an earlier call's CuPy outputs where nothing
        outside this prepared call holds them any more (``Spare``), else new ones."""
        if _fast["is_capturing"](stream_ptr) != 0:
            from ._launch import CAPTURE_HINT

            raise RuntimeError(f"a call without out= buffers {CAPTURE_HINT}")
        spares = self.spares
        for i, spare in enumerate(spares):
            # The oldest first: in a loop like `res = f(x)`, the newest set is still bound
            # to `res` during the call, the one before it was dropped when `res` was rebound.
            if spare.unheld():
                spares.append(spares.pop(i))
                # A list of them: the spare's own tuple never leaves, so a caller holding
                # what it got holds the arrays themselves.
                return list(spare.arrays), list(spare.ptrs)
        arrays, ptrs = self._allocate()
        if len(spares) == SPARE_SETS:
            spares.pop(0)  # held by the caller: theirs now
            spares.append(Spare(arrays, ptrs))
        elif self.kind == "cupy" and REFCOUNTS_EXACT and _claim_spare(self):
            self.spares.append(Spare(arrays, ptrs))  # (a claim may have emptied the list)
        return list(arrays), ptrs

    def _allocate(self):
        """New outputs in one allocation (``OutLayout``); returns (arrays, their addresses).
        The cheapest pieces measured on the H200 host: CuPy's pool allocation with an array
        made on each slice of it; torch's one ``empty`` split into the outputs (a view more
        for each 2-D one), or an ``as_strided`` view per output where that is fewer calls."""
        layout = self.out_layout
        if self.kind == "cupy":
            mem = _fast["alloc"](layout.nbytes)
            base = mem.ptr
            new = _fast["ndarray"]
            views = tuple([new(shape, INT32, mem + 4 * off)
                           for off, shape in zip(layout.offsets, layout.shapes)])
        else:
            buf = _fast["torch_empty"](layout.entries, dtype=_fast["torch_int32"],
                                       device=self.framework_device)
            base = buf.data_ptr()
            if layout.split:
                # Pieces without autograd's view tracking (int32 outputs never need it).
                parts = buf.unsafe_split_with_sizes(layout.pieces)
                views = tuple([part if len(shape) == 1 else part.view(shape)
                               for part, shape in zip(parts, layout.shapes)])
            else:
                view = buf.as_strided
                views = tuple([view(shape, strides, off)
                               for shape, strides, off in layout.views])
        return views, [base + 4 * off for off in layout.offsets]


# An allocating CuPy call may hand the outputs of an earlier call out again once nothing
# holds them: what CuPy's memory pool would do with the freed block (the next allocation of
# that size on the same stream gets it), minus the allocation, the arrays and the free.
SPARE_SETS = 2              # output sets kept per prepared call (a caller may hold the last)
# Reference counts tell "nothing else holds it" only where one lock orders every count
# change: not in a free-threaded Python, which then allocates every time.
REFCOUNTS_EXACT = getattr(sys, "_is_gil_enabled", lambda: True)()
SPARE_MAX_BYTES = 4 << 20   # bytes of one set, at most (up to prefill of a few K tokens)
SPARE_BUDGET = 32 << 20     # bytes of spare sets kept per device, at most
_spare_bytes: dict = {}     # device id -> bytes of spare sets kept now
_spare_owners: dict = {}    # device id -> {id: prepared call holding a claim}, oldest first


def _claim_spare(prep) -> bool:
    """Whether ``prep`` may keep one more spare set: a set small enough, within the device's
    budget once the oldest claims are given back (a process that moved on to other sizes
    leaves no budget stranded); the cache dropping ``prep`` gives its claim back."""
    nbytes = prep.out_layout.nbytes
    if nbytes > SPARE_MAX_BYTES or nbytes > SPARE_BUDGET:
        return False
    dev = prep.device_id
    with _cache_lock:
        if prep.dropped:
            return False
        owners = _spare_owners.setdefault(dev, {})
        while _spare_bytes.get(dev, 0) + nbytes > SPARE_BUDGET:
            _give_back(owners[next(iter(owners))])
        _spare_bytes[dev] = _spare_bytes.get(dev, 0) + nbytes
        prep.spare_bytes += nbytes
        owners.pop(id(prep), None)
        owners[id(prep)] = prep  # the newest claim last
    return True


def _give_back(prep) -> None:
    """Drop a prepared call's spare sets and give their bytes back (caller holds
    ``_cache_lock``)."""
    owners = _spare_owners.get(prep.device_id)
    if owners is not None:
        owners.pop(id(prep), None)
    prep.spares = []
    if prep.spare_bytes:
        _spare_bytes[prep.device_id] -= prep.spare_bytes
        prep.spare_bytes = 0


def _release_spare(prep) -> None:
    """The cache dropped ``prep``: its spare sets go, and it claims no more (caller holds
    ``_cache_lock``)."""
    if isinstance(prep, Prepared):
        prep.dropped = True
        _give_back(prep)


def _holders(a):
    """References to an array, its memory pointer and the allocation behind it, its weak
    references, and its shape. Equal to what was taken when the array was new exactly when
    nothing outside the ``Spare`` holds it (the caller, a view, an interface export, a kept
    ``.data`` or a pointer into the allocation, a weak reference) and no one reshaped it in
    place (CuPy's ``shape`` setter; dtype and memory cannot change)."""
    data = a.data
    return (getrefcount(a), getrefcount(data), getrefcount(data.mem), getweakrefcount(a),
            a.shape)


class Spare:
    """CuPy outputs an allocating prepared call made, kept to be handed out again."""

    def __init__(self, arrays, ptrs):
        self.arrays, self.ptrs = arrays, tuple(ptrs)
        # Taken while only this tuple holds the arrays, through the same plain loop as
        # `unheld` (a zip or a comprehension would hold references of its own).
        self.alone = alone = []
        for a in arrays:
            alone.append(_holders(a))

    def unheld(self) -> bool:
        alone, i = self.alone, 0
        for a in self.arrays:
            if _holders(a) != alone[i]:
                return False
            i += 1
        return True


class OutLayout:
    """Where the outputs of an allocating call sit in its one allocation. Each output
    starts on 16 bytes (the kernels' vector stores) unless ``split``: then the outputs lie
    back to back, for torch to split the allocation into exactly them (``pieces``), and
    the kernels store scalars where a start is not aligned. ``views``: (shape, contiguous
    strides, offset) of each output, for torch's ``as_strided``."""

    def __init__(self, shapes, split=False):
        self.shapes = [tuple(shape) for shape in shapes]
        self.split = split
        self.pieces = [_count(shape) for shape in self.shapes]
        self.offsets, self.views, off = [], [], 0
        for shape, n in zip(self.shapes, self.pieces):
            self.offsets.append(off)
            self.views.append((shape, _strides(shape), off))
            off += n if split else -(-n // 4) * 4
        self.entries, self.nbytes = off, 4 * off


def torch_splits(shapes) -> bool:
    """Whether torch should split its one allocation into these outputs (every output 1-D:
    one call makes them all) rather than make an ``as_strided`` view of each (a 2-D output
    would cost a split piece and a view). H200 host (profile_calls --steps, 299d79a's
    round): LoRA's three outputs, two of them 2-D, 10.4 µs split and viewed, 8.4 as_strided;
    the pair's six 12.2 and 11.7."""
    return all(len(shape) == 1 for shape in shapes)


def _strides(shape):
    """C-contiguous strides of ``shape``, in entries."""
    strides, step = [], 1
    for s in reversed(shape):
        strides.append(step)
        step *= s
    return tuple(reversed(strides))


def _count(shape):
    n = 1
    for s in shape:
        n *= s
    return n


_caches: dict = {}    # device id -> {key: Prepared}
_cache_lock = threading.Lock()


def lookup(cache: dict, key):
    prep = cache.get(key)
    return prep if prep is not None and prep.current() else None


def keep(cache: dict, key, prep) -> None:
    """Store a prepared call, dropping the oldest when the cache is full (a dropped or
    replaced call gives its spare outputs' bytes back to the budget)."""
    with _cache_lock:
        if key not in cache and len(cache) >= CACHE_SIZE:
            _release_spare(cache.pop(next(iter(cache))))
        old = cache.get(key)
        if old is not None and old is not prep:
            _release_spare(old)
        cache[key] = prep


_fast: dict = {}  # CuPy's getDevice, get_current_stream, ...: read at the first device call


def _note_allocators(kind: str) -> None:
    """The allocation functions of ``kind``, looked up once an allocating call is prepared."""
    if kind == "cupy" and "alloc" not in _fast:
        import cupy

        _fast["alloc"], _fast["ndarray"] = cupy.cuda.alloc, cupy.ndarray
    elif kind == "torch" and "torch_empty" not in _fast:
        import torch

        _fast["torch_empty"], _fast["torch_int32"] = torch.empty, torch.int32


def current_device() -> int:
    return _fast["get_device"]()


def build_prepared(calls, launched, ptrs, kind, stream_ptr, fixed=None):
    """The ``Prepared`` form of device ``calls`` that were just launched (``ptrs``: the
    addresses of the call's arrays, inputs first), or None when their
    launches cannot be replayed (CuPy's own launch, a copy of a strided input, a stream
    other than the caller's)."""
    recorded, mode, workspaces, sides = launched
    if not recorded or any(r is None for r in recorded):
        return None
    if len({c.out_shapes is None for c in calls}) > 1:
        return None  # out= given to one side only: the full path each time
    jobs = [c.job for c in calls]
    inputs = [jobs[-1].topk_ids, jobs[-1].token_slot, jobs[-1].lora_ids,
              jobs[-1].adapter_enabled, jobs[-1].expert_map]
    if [0 if x is None else int(x.data.ptr) for x in inputs] != ptrs[:5]:
        return None  # an input was copied (not contiguous): its address is not the caller's
    if mode == "two":
        first = tuple(r for r in recorded if r.stream_ptr == sides.first.ptr)
        second = tuple(r for r in recorded if r.stream_ptr == sides.second.ptr)
        if len(first) + len(second) != len(recorded):
            return None
        launches = (replay_form(first), replay_form(second))
    else:
        if any(r.stream_ptr != stream_ptr for r in recorded):
            return None
        launches = replay_form(recorded)
    # Pointer slots: inputs 0..4, then each call's outputs in order; `zero` is a 0.
    outs_per_call = [4 if c.job.scatter_idx is not None else 3 for c in calls]
    zero = 5 + sum(outs_per_call)
    slots, at = [], 5
    for c, n in zip(calls, outs_per_call):
        lora = c.job.token_slot is not None
        idx = [0, 1 if lora else zero, 2 if lora and c.job.lora_ids is not None else zero,
               3 if lora and c.job.adapter_enabled is not None else zero,
               4 if c.job.expert_map is not None else zero, at, at + 1, at + 2,
               at + 3 if n == 4 else zero]
        slots.append(operator.itemgetter(*idx))
        at += n
    out_layout = None
    spans = None
    if calls[0].out_shapes is not None:
        shapes = [shape for c in calls for shape in c.out_shapes]
        out_layout = OutLayout(shapes, split=kind == "torch" and torch_splits(shapes))
    else:
        sizes, names = [], ["topk_ids", "token_lora_mapping", "lora_ids", "adapter_enabled",
                            "expert_map"]
        sizes = [0 if x is None else int(x.nbytes) for x in inputs]
        for c, arg in zip(calls, ("out_base", "out_lora") if len(calls) == 2 else ("out",)):
            j = c.job
            entries = [j.rows * j.sorted_pitch, j.rows * j.expert_pitch, j.rows]
            if j.scatter_idx is not None:
                entries.append(j.numel)
            sizes += [4 * n for n in entries]
            names += [f"{arg} {n}" for n in (BASE_OUTS + SCATTER_OUT)[:len(entries)]]
        spans = (sizes, [False] * 5 + [True] * (len(sizes) - 5), names)
    framework_device = None
    if out_layout is not None:
        _note_allocators(kind)
        if kind == "torch":
            import torch

            framework_device = torch.device("cuda", calls[0].device_id)
    prep = Prepared(kind, calls[0].device_id, jobs, slots, launches, mode, sides,
                    tuple((ws, ws.generation) for ws in workspaces), out_layout, spans,
                    fixed, framework_device)
    prep.held = recorded
    if out_layout is None:
        # The full path just checked these addresses and packed them.
        prep.packed = list(ptrs) + (list(fixed[0]) if fixed is not None else [])
    return prep


def launch_calls(calls, streams=None, variant=None, stream=None, workspaces=None,
                 sides=None, policy=DEFAULT_POLICY):
    """Launch checked device calls (one, or base and LoRA) on the caller's stream, recording
    the launches; returns ``(recorded, mode, workspaces used, side streams)``."""
    from . import _launch

    c = calls[0]
    with _launch.record_launches() as recorded:
        if len(calls) == 1:
            used = _launch.run(c.job, c.device_id, c.framework, variant=variant, stream=stream,
                               needs_alloc=c.out_shapes is not None, workspace=workspaces,
                               policy=policy)
            mode, side = None, None
        else:
            mode, used, side = _launch.run_pair(
                c.job, calls[1].job, c.device_id, c.framework, streams=streams,
                variant=variant, stream=stream, needs_alloc=c.out_shapes is not None,
                workspaces=workspaces, sides=sides, policy=policy)
    return list(recorded), mode, used, side


def align(op, topk_ids, token_lora_mapping, block_size, num_experts, max_loras, lora_ids,
          adapter_enabled, expert_map, ignore_invalid_experts, pad_sorted_ids, scatter,
          deterministic, out_base, out_lora, streams, variant, stream, validate, policy,
          typed):
    """Every public function's call: ``op`` is "base", "lora" or "pair". Returns ``typed``
    of the list of outputs (the base alignment's, then the LoRA one's): the function's result
    types. The arguments come positionally (cheaper than by keyword on the prepared path)."""
    outs = ((out_base if op != "lora" else None), (out_lora if op != "base" else None))
    inputs = (topk_ids, token_lora_mapping if op != "base" else None,
              lora_ids if op != "base" else None, adapter_enabled if op != "base" else None,
              expert_map)
    # ---- a call like an earlier one: its prepared form, pointers rewritten ------------------
    opts = (op, block_size, num_experts, max_loras, ignore_invalid_experts, pad_sorted_ids,
            scatter, deterministic, streams, variant, policy)
    fast = None
    if (_KINDS and validate is not True and type(block_size) is int is type(num_experts)
            and type(pad_sorted_ids) is bool is type(deterministic) is type(scatter)
            is type(ignore_invalid_experts)):
        fast = _fast_key(opts, inputs, outs, stream)
        if fast is not None:
            key, ptrs, device_id, stream_ptr, given = fast
            cache = _caches.get(device_id)  # lookup(), written out: one call fewer here
            prep = cache.get(key) if cache is not None else None
            if prep is not None and prep.current():
                return typed(prep.run(ptrs, given, stream_ptr))
    # ---- the full path ----------------------------------------------------------------------
    if max_loras is not None:
        max_loras = _checks.positive_int("max_loras", max_loras, MAX_BUCKETS)
    variant = _checks.option("variant", variant, VARIANTS)
    streams = _checks.option("streams", streams, STREAM_MODES)
    scatter = _checks.flag("return_scatter_idx", scatter)
    ignore_invalid_experts = _checks.flag("ignore_invalid_experts", ignore_invalid_experts)
    if policy is None:
        policy = DEFAULT_POLICY
    elif not isinstance(policy, AlignPolicy):
        raise TypeError(f"policy must be an AlignPolicy or None, got {type(policy).__name__}")
    calls = []
    if op != "lora":
        calls.append(prepare(topk_ids, block_size, num_experts, rows=1, expert_map=expert_map,
                             map_mode=map_mode(expert_map, ignore_invalid_experts),
                             pad_sorted_ids=pad_sorted_ids, scatter=scatter,
                             deterministic=deterministic, out=out_base, validate=validate,
                             out_arg="out_base" if op == "pair" else "out", stream=stream))
    if op != "base":
        calls.append(prepare(topk_ids, block_size, num_experts, rows=max_loras,
                             token_lora_mapping=token_lora_mapping, lora_ids=lora_ids,
                             adapter_enabled=adapter_enabled, expert_map=expert_map,
                             map_mode=MAP_NONE if expert_map is None else MAP_BEFORE,
                             pad_sorted_ids=pad_sorted_ids, deterministic=deterministic,
                             out=out_lora, validate=validate, lora=True,
                             out_arg="out_lora" if op == "pair" else "out", stream=stream))
    if op == "pair":
        check_pair_disjoint(*calls)
    for c in calls:
        allocate(c, stream)
    on_host = calls[0].where == _interop.HOST
    if on_host:
        for c in calls:
            run_on_host(c.job)
    else:
        launched = launch_calls(calls, streams, variant, stream, policy=policy)
    _interop.torch_written([x for given in outs if given is not None for x in given])
    if not on_host and validate is not True:
        _note_kinds(*inputs, *(outs[0] or ()), *(outs[1] or ()))
        fast = _fast_key(opts, inputs, outs, stream)
        if fast is not None:
            key, ptrs, device_id, stream_ptr, _ = fast
            prep = build_prepared(calls, launched, ptrs, _KINDS[type(topk_ids)], stream_ptr)
            if prep is not None:
                keep(_caches.setdefault(device_id, {}), key, prep)
    return typed(_answers(calls))


_SEQUENCES = (tuple, list)


def _fast_key(opts, inputs, outs, stream):
    """``(key, pointers, device, stream pointer, out= arrays)`` of a device call the prepared
    calls could serve, else None. Every eager call runs this: kept flat on purpose."""
    out_base, out_lora = outs
    given = ()
    if out_base is not None:
        if type(out_base) not in _SEQUENCES or len(out_base) != (4 if opts[6] else 3):
            return None
        given = tuple(out_base)
    if out_lora is not None:
        if type(out_lora) not in _SEQUENCES or len(out_lora) != 3:
            return None
        given += tuple(out_lora)
    found = properties(inputs + given)
    if found is None or found[0][0] is None:
        return None
    props, ptrs, kind = found
    device_id = props[0][4]
    if device_id < 0 or _fast["get_device"]() != device_id:
        return None
    if stream is None:  # the framework's current stream, its cheapest way
        stream_ptr = (_fast["current_stream"]().ptr if kind == "cupy"
                      else _torch_current_stream(device_id))
    else:
        stream_ptr = stream_pointer(kind, device_id, stream)
        if stream_ptr is None:
            return None
    return (opts, props, stream_ptr), ptrs, device_id, stream_ptr, given


def _answers(calls):
    return [x for c in calls for x in answer(c)]
