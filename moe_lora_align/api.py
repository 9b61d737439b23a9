"""Public functions: argument checks, array interop, then the NumPy backend or the GPU launcher."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import _checks, _interop
from ._launch import MAP_AFTER, MAP_BEFORE, MAP_NONE, Job
from ._reference import align_rows, processed_rows
from ._dispatch import VARIANTS
from ._sizes import MAX_BUCKETS, buffer_sizes


class Alignment(NamedTuple):
    """Base alignment: ``sorted_token_ids[P]``, ``expert_ids[M]``, ``num_tokens_post_pad[1]``."""
    sorted_token_ids: object
    expert_ids: object
    num_tokens_post_pad: object


class AlignmentWithScatter(NamedTuple):
    """Base alignment plus ``scatter_idx[numel]`` (``i`` for a kept route ``i``, else -1)."""
    sorted_token_ids: object
    expert_ids: object
    num_tokens_post_pad: object
    scatter_idx: object


class LoraAlignment(NamedTuple):
    """LoRA alignment: ``[max_loras, P]``, ``[max_loras, M]``, ``[max_loras]``, all int32."""
    sorted_token_ids: object
    expert_ids: object
    num_tokens_post_pad: object


# ---- preparing a call ---------------------------------------------------------------------
# Every check runs here, before anything is allocated, launched or written.
BASE_OUTS = ("sorted_token_ids", "expert_ids", "num_tokens_post_pad")
SCATTER_OUT = ("scatter_idx",)
STREAM_MODES = ("fused", "one", "two")


class _Call:
    """A checked call: where it runs, the framework to answer in, and the job to run. The
    outputs it allocates itself come later (``_allocate``), once every check has passed."""

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


def _prepare(topk_ids, block_size, num_experts, *, rows, token_lora_mapping=None,
             lora_ids=None, adapter_enabled=None, expert_map=None, map_mode=MAP_NONE,
             pad_sorted_ids=False, scatter=False, deterministic=False, out=None,
             validate=None, lora=False, out_arg="out"):
    """Check one call from its arguments alone and build its job (outputs not allocated)."""
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
    where, framework = _interop.classify({**inputs, **out_named})
    native = {k: _interop.to_native(v, where) for k, v in inputs.items()}
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
        pitch = _checks.check_output(f"{out_arg} {n}" if out_arg != "out" else n, buf, r, full)
        pitches.append(pitch)
        written[f"{out_arg} {n}"] = (buf, r * pitch)
    if outs is None:
        shapes = [(rows, P), (rows, M), (rows,)] if lora else [(P,), (M,), (1,)]
        shapes += [(numel,)] if scatter else []
        nbytes = 4 * sum(int(np.prod(sh)) for sh in shapes)
        _checks.check_memory(nbytes, _available_memory(where, device_id),
                             "GPU" if where == _interop.DEVICE else "host")
    else:
        shapes = None
        _checks.check_disjoint(written, native)

    if validate is None:
        validate = where == _interop.HOST
    if validate:
        if native["expert_map"] is not None:
            _checks.check_expert_map_values(native["expert_map"], num_experts)
        if lora:
            _checks.check_token_lora_mapping_values(native["token_lora_mapping"], rows)
            if native["lora_ids"] is not None:
                _checks.check_lora_ids_values(native["lora_ids"], rows)

    bufs = [given[f"{out_arg} {n}"] for n in names] if outs is not None else [None] * len(names)
    job = Job(topk_ids=ids.reshape(-1), numel=numel, topk=topk, num_experts=num_experts,
              block_size=block_size, rows=rows, padded_len=P, num_tiles=M,
              sorted_ids=bufs[0], expert_ids=bufs[1], num_post_pad=bufs[2],
              sorted_pitch=pitches[0] if pitches else P,
              expert_pitch=pitches[1] if pitches else M, map_mode=map_mode,
              expert_map=native["expert_map"], token_slot=native["token_lora_mapping"],
              lora_ids=native["lora_ids"], adapter_enabled=native["adapter_enabled"],
              scatter_idx=bufs[3] if scatter else None, fill_unprocessed=outs is None,
              deterministic=deterministic)
    return _Call(where, framework, device_id, job, outs, shapes)


def _allocate(call: _Call, stream=None) -> None:
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


def _check_pair_disjoint(base: _Call, lora: _Call) -> None:
    """The base and LoRA outputs given to one call must not share memory either."""
    if base.results is None or lora.results is None:
        return
    spans = {}
    for call, arg in ((base, "out_base"), (lora, "out_lora")):
        j = call.job
        for n, buf, entries in zip(BASE_OUTS, (j.sorted_ids, j.expert_ids, j.num_post_pad),
                                   (j.rows * j.sorted_pitch, j.rows * j.expert_pitch, j.rows)):
            spans[f"{arg} {n}"] = (buf, entries)
    _checks.check_disjoint(spans, {})


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


def _execute(call: _Call, variant=None, stream=None):
    _allocate(call, stream)
    if call.where == _interop.HOST:
        run_on_host(call.job)
    else:
        from . import _launch

        _launch.run(call.job, call.device_id, call.framework, variant=variant, stream=stream,
                    needs_alloc=call.job.fill_unprocessed)
    return _answer(call)


def _answer(call: _Call):
    """The call's results in the caller's framework (buffers the caller gave stay as given)."""
    return tuple(_interop.from_native(r, call.framework)
                 if _interop.framework_of(r) in ("numpy", "cupy") else r for r in call.results)


def _map_mode(expert_map, ignore_invalid_experts):
    if expert_map is None:
        return MAP_NONE
    return MAP_BEFORE if ignore_invalid_experts else MAP_AFTER


# ---- public API ---------------------------------------------------------------------------
def moe_align_block_size(topk_ids, block_size, num_experts, expert_map=None, *,
                         pad_sorted_ids=False, ignore_invalid_experts=False,
                         return_scatter_idx=False, deterministic=False, out=None,
                         variant=None, stream=None, validate=None):
    """Group the routes of ``topk_ids`` by expert, padded to tiles of ``block_size``.

    Args:
        topk_ids: ``[T, K]`` integer array (int8..int64, uint8..uint64) of expert ids; NumPy
            (runs on the host backend), or CuPy / PyTorch CUDA / JAX GPU (runs on the GPU).
        block_size: tile height ``B`` of the fused MoE GEMM, > 0.
        num_experts: ``E``, the global expert count; ids outside ``[0, E)`` are dropped.
        expert_map: optional int32 ``[E]``, global id -> local id or -1 (expert parallelism).
        pad_sorted_ids: round ``P`` up to a multiple of ``B``.
        ignore_invalid_experts: with ``expert_map``, drop non-local routes before counting
            (tiles hold local ids); otherwise count global ids and map each tile's id.
        return_scatter_idx: also return ``scatter_idx[numel]``.
        deterministic: routes inside each segment in ascending flat index, bit-identical.
        out: optional ``(sorted_token_ids[>=P], expert_ids[>=M], num_tokens_post_pad[>=1]
            [, scatter_idx[>=numel]])`` int32 contiguous buffers, written in place and returned.
            Sizes: ``buffer_sizes(numel, E, B, pad_sorted_ids)``.
        variant: ``None`` (the dispatcher picks), ``"shared"`` (shared-memory histograms:
            one block at decode sizes, else a count and a place launch), ``"global"``
            (counters in global memory, any number of buckets) or ``"cooperative"`` (one
            launch of resident blocks with a grid-wide barrier).
        stream: GPU only: the stream to order the work on (a ``cupy.cuda.Stream`` or a
            framework stream); default: the current stream of the input's framework.
        validate: check values (``expert_map`` range); default on for host arrays, off for
            device arrays (it costs a device sync).

    Returns:
        ``Alignment(sorted_token_ids, expert_ids, num_tokens_post_pad)`` (or
        ``AlignmentWithScatter`` with ``scatter_idx``), arrays of the input's framework. On the
        GPU the call only enqueues work on the stream; the host never blocks.
    """
    variant = _checks.option("variant", variant, VARIANTS)
    return_scatter_idx = _checks.flag("return_scatter_idx", return_scatter_idx)
    call = _prepare(topk_ids, block_size, num_experts, rows=1, expert_map=expert_map,
                    map_mode=_map_mode(expert_map, ignore_invalid_experts),
                    pad_sorted_ids=pad_sorted_ids, scatter=return_scatter_idx,
                    deterministic=deterministic, out=out, validate=validate)
    res = _execute(call, variant, stream)
    return AlignmentWithScatter(*res) if return_scatter_idx else Alignment(*res)


def moe_lora_align_block_size(topk_ids, token_lora_mapping, block_size, num_experts, max_loras,
                              *, lora_ids=None, adapter_enabled=None, expert_map=None,
                              pad_sorted_ids=False, deterministic=False, out=None,
                              variant=None, stream=None, validate=None):
    """Align the routes of every LoRA adapter slot on its own, one output row per slot.

    Row ``L`` is exactly the base alignment of the routes of the tokens with
    ``token_lora_mapping[t] == L`` (flat indices stay global, the sentinel stays ``numel``).

    Args:
        topk_ids: ``[T, K]`` integer expert ids (see ``moe_align_block_size``).
        token_lora_mapping: int32 ``[T]``, the slot of each token or -1 (base-model token).
        block_size, num_experts: as for ``moe_align_block_size``.
        max_loras: number of adapter slots (rows), > 0.
        lora_ids: optional int32 ``[>= max_loras + 1]``, the slots to process; -1 and values
            ``>= max_loras`` are skipped, and only the first ``max_loras + 1`` entries are read.
            Default: every slot.
        adapter_enabled: optional int32 ``[>= max_loras + 1]`` indexed by slot, 0 = disabled.
        expert_map: optional int32 ``[E]``, applied before counting (non-local routes dropped).
        out: optional ``(sorted_token_ids, expert_ids, num_tokens_post_pad)``: ``[max_loras,
            >=P]`` (or flat ``>= max_loras*P``), ``[max_loras, >=M]``, ``[>= max_loras]``.
            Rows of slots that are not processed are left exactly as they were. Without
            ``out``, such rows read as the empty alignment (0, all -1, all ``numel``).
        variant, stream, validate, deterministic, pad_sorted_ids: as for
            ``moe_align_block_size``; validation also checks ``token_lora_mapping`` and
            ``lora_ids`` values.

    Returns:
        ``LoraAlignment(sorted_token_ids, expert_ids, num_tokens_post_pad)``.
    """
    max_loras = _checks.positive_int("max_loras", max_loras, MAX_BUCKETS)
    variant = _checks.option("variant", variant, VARIANTS)
    call = _prepare(topk_ids, block_size, num_experts, rows=max_loras,
                    token_lora_mapping=token_lora_mapping, lora_ids=lora_ids,
                    adapter_enabled=adapter_enabled, expert_map=expert_map,
                    map_mode=MAP_NONE if expert_map is None else MAP_BEFORE,
                    pad_sorted_ids=pad_sorted_ids, deterministic=deterministic, out=out,
                    validate=validate, lora=True)
    return LoraAlignment(*_execute(call, variant, stream))


def align_moe_and_lora(topk_ids, token_lora_mapping, block_size, num_experts, max_loras, *,
                       lora_ids=None, adapter_enabled=None, expert_map=None,
                       ignore_invalid_experts=False, pad_sorted_ids=False, deterministic=False,
                       out_base=None, out_lora=None, streams=None, variant=None, stream=None,
                       validate=None):
    """Base and LoRA alignment of one batch at once; returns ``(Alignment, LoraAlignment)``.

    The arguments are those of ``moe_align_block_size`` (base: ``expert_map`` with
    ``ignore_invalid_experts``) and ``moe_lora_align_block_size`` (LoRA: ``expert_map`` always
    applied before counting); ``out_base``/``out_lora`` are their ``out=`` buffers.

    On the GPU, ``streams`` picks how the two run, ordered on the caller's stream:
    ``"fused"`` one launch that computes both (one block each at decode sizes, else one
    cooperative launch with the SMs split between them), ``"two"`` the LoRA and base
    alignments forked onto two side streams and joined back, ``"one"`` both after each other
    on the caller's stream; ``None`` lets the dispatcher choose (fused where it can run). On
    the host both simply run.
    """
    max_loras = _checks.positive_int("max_loras", max_loras, MAX_BUCKETS)
    variant = _checks.option("variant", variant, VARIANTS)
    streams = _checks.option("streams", streams, STREAM_MODES)
    base = _prepare(topk_ids, block_size, num_experts, rows=1, expert_map=expert_map,
                    map_mode=_map_mode(expert_map, ignore_invalid_experts),
                    pad_sorted_ids=pad_sorted_ids, deterministic=deterministic, out=out_base,
                    validate=validate, out_arg="out_base")
    lora = _prepare(topk_ids, block_size, num_experts, rows=max_loras,
                    token_lora_mapping=token_lora_mapping, lora_ids=lora_ids,
                    adapter_enabled=adapter_enabled, expert_map=expert_map,
                    map_mode=MAP_NONE if expert_map is None else MAP_BEFORE,
                    pad_sorted_ids=pad_sorted_ids, deterministic=deterministic, out=out_lora,
                    validate=validate, lora=True, out_arg="out_lora")
    _check_pair_disjoint(base, lora)
    _allocate(base, stream)
    _allocate(lora, stream)
    if base.where == _interop.HOST:
        run_on_host(base.job)
        run_on_host(lora.job)
    else:
        from . import _launch

        _launch.run_pair(base.job, lora.job, base.device_id, base.framework, streams=streams,
                         variant=variant, stream=stream,
                         needs_alloc=base.job.fill_unprocessed or lora.job.fill_unprocessed)
    return (Alignment(*_answer(base)), LoraAlignment(*_answer(lora)))
