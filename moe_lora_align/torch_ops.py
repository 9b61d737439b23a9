"""The alignment as torch custom ops (``torch.library``), for ``torch.compile(fullgraph=True)``
and torch's CUDA-graph capture. Importing this module registers them (it imports torch; the
package itself never does):

- ``torch.ops.moe_lora_align.moe_align_block_size(topk_ids, block_size, num_experts,
  expert_map, pad_sorted_ids, ignore_invalid_experts, deterministic)`` and
  ``moe_lora_align_block_size(topk_ids, token_lora_mapping, block_size, num_experts,
  max_loras, lora_ids, adapter_enabled, expert_map, pad_sorted_ids, deterministic)``: new
  output tensors, as the public functions return them;
- ``vllm_moe_align_block_size``, ``vllm_moe_lora_align_block_size`` and
  ``sglang_moe_align_block_size``: the engines' raw ops (``moe_lora_align.compat``), writing
  into the caller's tensors.

Each has a fake implementation (shapes only) and declares the tensors it writes.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import api
from ._sizes import buffer_sizes, padded_sizes
from .compat import sglang, vllm

LIB = "moe_lora_align"


def _empty(shape, like: Tensor) -> Tensor:
    return torch.empty(shape, dtype=torch.int32, device=like.device)


# ---- the public operations -----------------------------------------------------------------
@torch.library.custom_op(f"{LIB}::moe_align_block_size", mutates_args=())
def moe_align_block_size(topk_ids: Tensor, block_size: int, num_experts: int,
                         expert_map: Optional[Tensor] = None, pad_sorted_ids: bool = False,
                         ignore_invalid_experts: bool = False,
                         deterministic: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    P, M = buffer_sizes(topk_ids.numel(), num_experts, block_size, pad_sorted_ids)
    out = (_empty((P,), topk_ids), _empty((M,), topk_ids), _empty((1,), topk_ids))
    api.moe_align_block_size(topk_ids, block_size, num_experts, expert_map,
                             pad_sorted_ids=pad_sorted_ids,
                             ignore_invalid_experts=ignore_invalid_experts,
                             deterministic=deterministic, out=out)
    return out


@moe_align_block_size.register_fake
def _(topk_ids, block_size, num_experts, expert_map=None, pad_sorted_ids=False,
      ignore_invalid_experts=False, deterministic=False):
    P, M = padded_sizes(topk_ids.numel(), num_experts, block_size, pad_sorted_ids,
                        torch.sym_min)
    return _empty((P,), topk_ids), _empty((M,), topk_ids), _empty((1,), topk_ids)


@torch.library.custom_op(f"{LIB}::moe_lora_align_block_size", mutates_args=())
def moe_lora_align_block_size(topk_ids: Tensor, token_lora_mapping: Tensor, block_size: int,
                              num_experts: int, max_loras: int,
                              lora_ids: Optional[Tensor] = None,
                              adapter_enabled: Optional[Tensor] = None,
                              expert_map: Optional[Tensor] = None, pad_sorted_ids: bool = False,
                              deterministic: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    numel = topk_ids.numel()
    P, M = buffer_sizes(numel, num_experts, block_size, pad_sorted_ids)
    # Rows of slots no call processes read as the empty alignment, as when the function
    # allocates; each output is a tensor of its own (a custom op's outputs do not alias).
    out = (torch.full((max_loras, P), numel, dtype=torch.int32, device=topk_ids.device),
           torch.full((max_loras, M), -1, dtype=torch.int32, device=topk_ids.device),
           torch.zeros((max_loras,), dtype=torch.int32, device=topk_ids.device))
    api.moe_lora_align_block_size(topk_ids, token_lora_mapping, block_size, num_experts,
                                  max_loras, lora_ids=lora_ids, adapter_enabled=adapter_enabled,
                                  expert_map=expert_map, pad_sorted_ids=pad_sorted_ids,
                                  deterministic=deterministic, out=out)
    return out


@moe_lora_align_block_size.register_fake
def _(topk_ids, token_lora_mapping, block_size, num_experts, max_loras, lora_ids=None,
      adapter_enabled=None, expert_map=None, pad_sorted_ids=False, deterministic=False):
    P, M = padded_sizes(topk_ids.numel(), num_experts, block_size, pad_sorted_ids,
                        torch.sym_min)
    return (_empty((max_loras, P), topk_ids), _empty((max_loras, M), topk_ids),
            _empty((max_loras,), topk_ids))


# ---- the engines' raw ops ------------------------------------------------------------------
@torch.library.custom_op(f"{LIB}::vllm_moe_align_block_size",
                         mutates_args=("sorted_token_ids", "experts_ids", "num_tokens_post_pad"))
def vllm_moe_align_block_size(topk_ids: Tensor, num_experts: int, block_size: int,
                              sorted_token_ids: Tensor, experts_ids: Tensor,
                              num_tokens_post_pad: Tensor,
                              expert_map: Optional[Tensor] = None) -> None:
    vllm.moe_align_block_size(topk_ids, num_experts, block_size, sorted_token_ids,
                              experts_ids, num_tokens_post_pad, expert_map)


@vllm_moe_align_block_size.register_fake
def _(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids, num_tokens_post_pad,
      expert_map=None):
    return None


@torch.library.custom_op(f"{LIB}::vllm_moe_lora_align_block_size",
                         mutates_args=("sorted_token_ids", "experts_ids", "num_tokens_post_pad"))
def vllm_moe_lora_align_block_size(topk_ids: Tensor, token_lora_mapping: Tensor,
                                   num_experts: int, block_size: int, max_loras: int,
                                   max_num_tokens_padded: int, max_num_m_blocks: int,
                                   sorted_token_ids: Tensor, experts_ids: Tensor,
                                   num_tokens_post_pad: Tensor, adapter_enabled: Tensor,
                                   lora_ids: Tensor, expert_map: Optional[Tensor] = None) -> None:
    vllm.moe_lora_align_block_size(topk_ids, token_lora_mapping, num_experts, block_size,
                                   max_loras, max_num_tokens_padded, max_num_m_blocks,
                                   sorted_token_ids, experts_ids, num_tokens_post_pad,
                                   adapter_enabled, lora_ids, expert_map)


@vllm_moe_lora_align_block_size.register_fake
def _(topk_ids, token_lora_mapping, num_experts, block_size, max_loras, max_num_tokens_padded,
      max_num_m_blocks, sorted_token_ids, experts_ids, num_tokens_post_pad, adapter_enabled,
      lora_ids, expert_map=None):
    return None


@torch.library.custom_op(f"{LIB}::sglang_moe_align_block_size",
                         mutates_args=("sorted_token_ids", "experts_ids", "num_tokens_post_pad"))
def sglang_moe_align_block_size(topk_ids: Tensor, num_experts: int, block_size: int,
                                sorted_token_ids: Tensor, experts_ids: Tensor,
                                num_tokens_post_pad: Tensor, cumsum_buffer: Tensor,
                                pad_sorted_token_ids: bool = False) -> None:
    sglang.moe_align_block_size(topk_ids, num_experts, block_size, sorted_token_ids,
                                experts_ids, num_tokens_post_pad, cumsum_buffer,
                                pad_sorted_token_ids)


@sglang_moe_align_block_size.register_fake
def _(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids, num_tokens_post_pad,
      cumsum_buffer, pad_sorted_token_ids=False):
    return None
