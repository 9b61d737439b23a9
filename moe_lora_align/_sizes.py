"""Buffer-size formulas of the contract: the one place every other module asks."""

from __future__ import annotations

INT32_MAX = 2**31 - 1
# The largest problems supported (and tested on the GPU): routes (T * K) and buckets
# (max_loras * num_experts; num_experts for the base alignment).
MAX_ROUTES = 2**24
MAX_BUCKETS = 2**20


def buffer_sizes(numel: int, num_experts: int, block_size: int,
                 pad_sorted_ids: bool = False) -> "tuple[int, int]":
    """Return ``(P, M)``: the length of ``sorted_token_ids`` and of ``expert_ids``.

    ``P = numel + E*(B-1)``, rounded up to a multiple of ``B`` with ``pad_sorted_ids``, and
    ``min(numel*B, P)`` when ``numel < E``; ``M = ceil(P / B)``. With an expert map, ``E`` is the
    global expert count (``len(expert_map)``).
    """
    from ._checks import integer

    numel = integer("numel", numel, 0, INT32_MAX)
    num_experts = integer("num_experts", num_experts, 1, INT32_MAX)
    block_size = integer("block_size", block_size, 1, INT32_MAX)
    return padded_sizes(numel, num_experts, block_size, pad_sorted_ids)


def padded_sizes(numel, num_experts: int, block_size: int, pad_sorted_ids: bool, minimum=min):
    """``buffer_sizes`` without the argument checks, for a ``numel`` that may be symbolic
    (``minimum``: ``torch.sym_min`` under ``torch.compile``). ``min(numel*B, P)`` applies at
    every size: it is ``P`` itself whenever ``numel >= E`` (also rounded up to ``B``)."""
    padded = numel + num_experts * (block_size - 1)
    if pad_sorted_ids:
        padded = (padded + block_size - 1) // block_size * block_size
    padded = minimum(numel * block_size, padded)
    return padded, (padded + block_size - 1) // block_size


def check_index_range(name: str, count: int) -> None:
    """Raise when ``count`` entries could not be addressed with int32 indices."""
    if count > INT32_MAX:
        raise ValueError(
            f"{name}: {count} entries overflow int32 indices (at most {INT32_MAX} supported)"
        )
