"""Public functions: what each computes and takes; every call goes through ``_call.align``."""

from __future__ import annotations

from typing import (Any, Literal, NamedTuple, Optional, Protocol, Sequence, Tuple, Union,
                    overload)

from . import _call
from ._dispatch import AlignPolicy


class Array(Protocol):
    """An array the functions take and return: NumPy, CuPy, PyTorch or JAX."""

    @property
    def shape(self) -> Tuple[int, ...]: ...

    @property
    def dtype(self) -> Any: ...


Variant = Optional[Literal["shared", "global", "cooperative", "cluster"]]
Streams = Optional[Literal["fused", "one", "two"]]


# Every result type prints its own summary and shows as a table in notebooks.
def _summary(self) -> str:
    """Routes, tiles, experts and padding, in a line (copies the arrays to the host)."""
    from . import viz

    return viz.summary(self)


def _repr_html(self) -> str:
    from . import viz

    return viz.html(self)


class Alignment(NamedTuple):
    """Base alignment: ``sorted_token_ids[P]``, ``expert_ids[M]``, ``num_tokens_post_pad[1]``."""
    sorted_token_ids: Array
    expert_ids: Array
    num_tokens_post_pad: Array

    def summary(self) -> str:
        return _summary(self)

    def _repr_html_(self) -> str:
        return _repr_html(self)


class AlignmentWithScatter(NamedTuple):
    """Base alignment plus ``scatter_idx[numel]`` (``i`` for a kept route ``i``, else -1)."""
    sorted_token_ids: Array
    expert_ids: Array
    num_tokens_post_pad: Array
    scatter_idx: Array

    def summary(self) -> str:
        return _summary(self)

    def _repr_html_(self) -> str:
        return _repr_html(self)


class LoraAlignment(NamedTuple):
    """LoRA alignment: ``[max_loras, P]``, ``[max_loras, M]``, ``[max_loras]``, all int32."""
    sorted_token_ids: Array
    expert_ids: Array
    num_tokens_post_pad: Array

    def summary(self) -> str:
        return _summary(self)

    def _repr_html_(self) -> str:
        return _repr_html(self)


for _shown in (Alignment, AlignmentWithScatter, LoraAlignment):
    _shown.summary.__doc__ = _summary.__doc__

# The result types made straight from a sequence (``tuple.__new__``): the named tuples' own
# constructor is a Python function, a few tenths of a microsecond of every eager call.
_new = tuple.__new__


def _base_result(outputs) -> Union[Alignment, AlignmentWithScatter]:
    return _new(Alignment if len(outputs) == 3 else AlignmentWithScatter,  # type: ignore
                outputs)


def _lora_result(outputs) -> LoraAlignment:
    return _new(LoraAlignment, outputs)


def _pair_result(outputs) -> Tuple[Alignment, LoraAlignment]:
    return _new(Alignment, outputs[:3]), _new(LoraAlignment, outputs[3:])


# ---- public API ---------------------------------------------------------------------------
# For type checkers: return_scatter_idx=True gives AlignmentWithScatter, False (the default)
# Alignment, a bool known only at run time either. typing.overload needs each case's whole
# signature.
@overload
def moe_align_block_size(
        topk_ids: Array, block_size: int, num_experts: int, expert_map: Optional[Array] = ...,
        *, pad_sorted_ids: bool = ..., ignore_invalid_experts: bool = ...,
        return_scatter_idx: Literal[False] = ..., deterministic: bool = ...,
        out: Optional[Sequence[Array]] = ..., variant: Variant = ..., stream: Any = ...,
        validate: Optional[bool] = ..., policy: Optional[AlignPolicy] = ...,
) -> Alignment: ...


@overload
def moe_align_block_size(
        topk_ids: Array, block_size: int, num_experts: int, expert_map: Optional[Array] = ...,
        *, pad_sorted_ids: bool = ..., ignore_invalid_experts: bool = ...,
        return_scatter_idx: Literal[True], deterministic: bool = ...,
        out: Optional[Sequence[Array]] = ..., variant: Variant = ..., stream: Any = ...,
        validate: Optional[bool] = ..., policy: Optional[AlignPolicy] = ...,
) -> AlignmentWithScatter: ...


@overload
def moe_align_block_size(
        topk_ids: Array, block_size: int, num_experts: int, expert_map: Optional[Array] = ...,
        *, pad_sorted_ids: bool = ..., ignore_invalid_experts: bool = ...,
        return_scatter_idx: bool = ..., deterministic: bool = ...,
        out: Optional[Sequence[Array]] = ..., variant: Variant = ..., stream: Any = ...,
        validate: Optional[bool] = ..., policy: Optional[AlignPolicy] = ...,
) -> Union[Alignment, AlignmentWithScatter]: ...


def moe_align_block_size(topk_ids: Array, block_size: int, num_experts: int,
                         expert_map: Optional[Array] = None, *, pad_sorted_ids: bool = False,
                         ignore_invalid_experts: bool = False, return_scatter_idx: bool = False,
                         deterministic: bool = False, out: Optional[Sequence[Array]] = None,
                         variant: Variant = None, stream: Any = None,
                         validate: Optional[bool] = None,
                         policy: Optional[AlignPolicy] = None
                         ) -> Union[Alignment, AlignmentWithScatter]:
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
            (counters in global memory, any number of buckets), ``"cooperative"`` (one
            launch of resident blocks with a grid-wide barrier) or ``"cluster"`` (one
            launch of one 8-block thread-block cluster, sm_90 and newer, up to 65536
            routes, not deterministic).
        stream: GPU only: the stream to order the work on (a ``cupy.cuda.Stream`` or a
            framework stream); default: the current stream of the input's framework.
        validate: check values (``expert_map`` range); default on for host arrays, off for
            device arrays (it costs a device sync). ``False`` skips them on the host too:
            whatever the values, nothing outside the arrays is read or written.
        policy: the dispatcher's tuning (``AlignPolicy``); default: the H200-measured one.

    Returns:
        ``Alignment(sorted_token_ids, expert_ids, num_tokens_post_pad)`` (or
        ``AlignmentWithScatter`` with ``scatter_idx``), arrays of the input's framework. On the
        GPU the call only enqueues work on the stream; the host never blocks.
    """
    # (op, topk_ids, mapping, B, E, max_loras, lora_ids, enabled, expert_map, ignore, pad,
    #  scatter, deterministic, out_base, out_lora, streams, variant, stream, validate, policy)
    return _call.align("base", topk_ids, None, block_size, num_experts, None, None, None,
                       expert_map, ignore_invalid_experts, pad_sorted_ids, return_scatter_idx,
                       deterministic, out, None, None, variant, stream, validate, policy,
                       _base_result)


def moe_lora_align_block_size(topk_ids: Array, token_lora_mapping: Array, block_size: int,
                              num_experts: int, max_loras: int, *,
                              lora_ids: Optional[Array] = None,
                              adapter_enabled: Optional[Array] = None,
                              expert_map: Optional[Array] = None, pad_sorted_ids: bool = False,
                              deterministic: bool = False,
                              out: Optional[Sequence[Array]] = None, variant: Variant = None,
                              stream: Any = None, validate: Optional[bool] = None,
                              policy: Optional[AlignPolicy] = None) -> LoraAlignment:
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
        variant, stream, validate, deterministic, pad_sorted_ids, policy: as for
            ``moe_align_block_size``; validation also checks ``token_lora_mapping`` and
            ``lora_ids`` values.

    Returns:
        ``LoraAlignment(sorted_token_ids, expert_ids, num_tokens_post_pad)``.
    """
    return _call.align("lora", topk_ids, token_lora_mapping, block_size, num_experts,
                       max_loras, lora_ids, adapter_enabled, expert_map, False, pad_sorted_ids,
                       False, deterministic, None, out, None, variant, stream, validate, policy,
                       _lora_result)


def align_moe_and_lora(topk_ids: Array, token_lora_mapping: Array, block_size: int,
                       num_experts: int, max_loras: int, *, lora_ids: Optional[Array] = None,
                       adapter_enabled: Optional[Array] = None,
                       expert_map: Optional[Array] = None, ignore_invalid_experts: bool = False,
                       pad_sorted_ids: bool = False, deterministic: bool = False,
                       out_base: Optional[Sequence[Array]] = None,
                       out_lora: Optional[Sequence[Array]] = None, streams: Streams = None,
                       variant: Variant = None, stream: Any = None,
                       validate: Optional[bool] = None,
                       policy: Optional[AlignPolicy] = None) -> Tuple[Alignment, LoraAlignment]:
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
    return _call.align("pair", topk_ids, token_lora_mapping, block_size, num_experts,
                       max_loras, lora_ids, adapter_enabled, expert_map,
                       ignore_invalid_experts, pad_sorted_ids, False, deterministic,
                       out_base, out_lora, streams, variant, stream, validate, policy,
                       _pair_result)
