"""SGLang's raw alignment op (``sgl_kernel.moe_align_block_size``), with its signature,
argument order and buffer conventions.

It writes into the caller's buffers (torch CUDA tensors in SGLang; any array the public
functions take works) on the framework's current stream and returns ``None``.
``num_experts`` is the count the caller passes (SGLang's wrapper passes one more than the
model's experts, so that the id it gives filtered routes is a bucket of its own); ids outside
``[0, num_experts)`` are dropped. ``cumsum_buffer`` is the scratch SGLang's kernel works in:
it is accepted and not written (this project keeps its own scratch).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._sizes import buffer_sizes
from ..api import moe_align_block_size as _align

Array = Any


def moe_align_block_size(topk_ids: Array, num_experts: int, block_size: int,
                         sorted_token_ids: Array, experts_ids: Array,
                         num_tokens_post_pad: Array, cumsum_buffer: Array,
                         pad_sorted_token_ids: bool = False) -> None:
    """SGLang's ``moe_align_block_size``. With ``pad_sorted_token_ids`` every entry of
    ``sorted_token_ids`` past the routes holds the sentinel ``numel``, up to the end of the
    buffer, as SGLang's kernel leaves it; without it, entries past ``P`` are left as they
    were (SGLang's caller fills them first)."""
    del cumsum_buffer  # scratch of the engine's own kernel
    _align(topk_ids, block_size, num_experts, pad_sorted_ids=bool(pad_sorted_token_ids),
           out=(sorted_token_ids, experts_ids, num_tokens_post_pad))
    if pad_sorted_token_ids:
        tokens, topk = np.shape(topk_ids)  # (a list's too: the call above took it as 2-D)
        numel = int(tokens) * int(topk)
        P, _ = buffer_sizes(numel, num_experts, block_size, True)
        tail = sorted_token_ids[P:]
        if int(tail.shape[0]):
            if hasattr(tail, "fill_"):
                tail.fill_(numel)           # torch
            else:
                tail[...] = numel           # CuPy, NumPy
