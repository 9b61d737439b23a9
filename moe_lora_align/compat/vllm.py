"""vLLM's raw alignment ops, with vLLM's signatures, argument order and buffer conventions.

Each writes into the caller's buffers (torch CUDA tensors in vLLM; any array the public
functions take works) on the framework's current stream, and returns ``None``, as vLLM's
``torch.ops._moe_C`` ops do. Buffers larger than the contract's sizes are fine: entries past
``P`` and ``M`` (of each row) are left as they were; the fused MoE GEMM never reads them.
"""

from __future__ import annotations

from typing import Any, Optional

from .. import _checks
from .._sizes import MAX_BUCKETS
from ..api import moe_align_block_size as _align
from ..api import moe_lora_align_block_size as _lora_align

Array = Any


def moe_align_block_size(topk_ids: Array, num_experts: int, block_size: int,
                         sorted_token_ids: Array, experts_ids: Array,
                         num_tokens_post_pad: Array, expert_map: Optional[Array] = None) -> None:
    """vLLM's ``moe_align_block_size``: ``sorted_token_ids[>= numel + E*(B-1)]``,
    ``experts_ids[>= its / B]``, ``num_tokens_post_pad[1]``, all int32. With ``expert_map``,
    every in-range global expert is counted and each tile's id is mapped afterwards (non-local
    tiles read -1), as vLLM does."""
    _align(topk_ids, block_size, num_experts, expert_map, ignore_invalid_experts=False,
           out=(sorted_token_ids, experts_ids, num_tokens_post_pad))


def moe_lora_align_block_size(topk_ids: Array, token_lora_mapping: Array, num_experts: int,
                              block_size: int, max_loras: int, max_num_tokens_padded: int,
                              max_num_m_blocks: int, sorted_token_ids: Array,
                              experts_ids: Array, num_tokens_post_pad: Array,
                              adapter_enabled: Array, lora_ids: Array,
                              expert_map: Optional[Array] = None) -> None:
    """vLLM's ``moe_lora_align_block_size``: flat buffers ``sorted_token_ids[max_loras *
    max_num_tokens_padded]``, ``experts_ids[max_loras * max_num_m_blocks]``,
    ``num_tokens_post_pad[max_loras]``; row ``L`` of each starts at ``L`` times its row
    length. ``lora_ids`` and ``adapter_enabled`` hold ``max_loras + 1`` entries. Rows of slots
    that are not processed are left as they were."""
    max_loras = _checks.positive_int("max_loras", max_loras, MAX_BUCKETS)
    sorted_rows = _rows("sorted_token_ids", sorted_token_ids, max_loras,
                        _checks.positive_int("max_num_tokens_padded", max_num_tokens_padded))
    expert_rows = _rows("experts_ids", experts_ids, max_loras,
                        _checks.positive_int("max_num_m_blocks", max_num_m_blocks))
    _lora_align(topk_ids, token_lora_mapping, block_size, num_experts, max_loras,
                lora_ids=lora_ids, adapter_enabled=adapter_enabled, expert_map=expert_map,
                out=(sorted_rows, expert_rows, num_tokens_post_pad))


def _rows(name: str, flat: Array, rows: int, length: int) -> Array:
    """The first ``rows * length`` entries of the flat buffer ``flat`` as ``[rows, length]``
    (a view), after checking that it is a 1-D array that holds them."""
    shape = getattr(flat, "shape", None)
    if shape is None:
        raise TypeError(f"{name} must be a flat int32 array, got {type(flat).__name__}")
    need = rows * length
    if len(shape) != 1 or int(shape[0]) < need:
        raise ValueError(f"{name} must be a flat array of at least max_loras * its row length "
                         f"= {rows} * {length} = {need} entries, got shape {tuple(shape)}")
    return flat[:need].reshape(rows, length)
