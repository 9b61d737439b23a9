"""The NumPy backend: the whole contract, vectorised. It is also the oracle of every GPU test.

One routine serves base and LoRA alignment: a route's bucket is ``row * E + expert`` (row 0 for
the base alignment, the adapter slot for LoRA), and every row is aligned on its own.
"""

from __future__ import annotations

import numpy as np


def processed_rows(rows: int, lora_ids=None, adapter_enabled=None) -> np.ndarray:
    """Boolean mask of the rows (adapter slots) an alignment call processes."""
    enabled = np.ones(rows, dtype=bool)
    if adapter_enabled is not None:
        enabled = np.asarray(adapter_enabled)[:rows] != 0
    if lora_ids is None:
        return enabled
    ids = np.asarray(lora_ids, dtype=np.int64)[: rows + 1]  # the contract's max_loras + 1
    ids = ids[(ids >= 0) & (ids < rows)]
    mask = np.zeros(rows, dtype=bool)
    mask[ids] = True
    return mask & enabled


def route_buckets(flat_ids, num_experts, expert_map=None, map_before=False,
                  route_rows=None, processed=None):
    """Bucket of every route (``row * E + expert``) and the mask of routes that are kept."""
    E = int(num_experts)
    ids = np.asarray(flat_ids)
    if ids.dtype.kind == "u":
        valid = ids < E  # compare unsigned: huge uint64 values must not wrap to valid ids
    else:
        valid = (ids >= 0) & (ids < E)
    expert = np.where(valid, ids, 0).astype(np.int64)
    if expert_map is not None and map_before:
        local = np.asarray(expert_map, dtype=np.int64)[expert]
        valid &= (local >= 0) & (local < E)
        expert = np.where(valid, local, 0)
    if route_rows is None:
        return expert, valid
    rows = processed.shape[0]
    row = np.asarray(route_rows, dtype=np.int64)
    in_range = (row >= 0) & (row < rows)
    valid &= in_range
    valid &= processed[np.where(in_range, row, 0)]
    return np.where(valid, row, 0) * E + expert, valid


def align_rows(flat_ids, num_experts, block_size, sorted_ids, expert_ids, num_post_pad, *,
               expert_map=None, map_before=False, route_rows=None, processed=None):
    """Write the alignment of every processed row into the 2-D output views.

    ``sorted_ids[rows, >=P]``, ``expert_ids[rows, >=M]`` and ``num_post_pad[rows]`` are written
    in the first ``P``/``M`` columns of processed rows only; other rows are left untouched.
    Routes are placed in ascending flat index (the deterministic order). Returns the mask of
    kept routes.
    """
    E, B = int(num_experts), int(block_size)
    numel = int(np.asarray(flat_ids).size)
    rows = sorted_ids.shape[0]
    P, M = sorted_ids.shape[1], expert_ids.shape[1]
    if processed is None:
        processed = np.ones(rows, dtype=bool)
    bucket, valid = route_buckets(flat_ids, E, expert_map, map_before, route_rows, processed)

    kept = np.flatnonzero(valid)
    kept_bucket = bucket[kept]
    order = np.argsort(kept_bucket, kind="stable")  # stable: ascending flat index per bucket
    kept, kept_bucket = kept[order], kept_bucket[order]

    counts = np.bincount(kept_bucket, minlength=rows * E)
    padded = (counts + B - 1) // B * B
    starts = np.zeros(rows * E + 1, dtype=np.int64)
    np.cumsum(padded, out=starts[1:])
    row_start = starts[np.arange(rows + 1) * E]  # padded offset of each row, all rows concatenated
    totals = np.diff(row_start)

    first_of_bucket = np.zeros(rows * E, dtype=np.int64)
    np.cumsum(counts[:-1], out=first_of_bucket[1:])
    rank = np.arange(kept.size) - first_of_bucket[kept_bucket]
    route_row = kept_bucket // E
    position = starts[kept_bucket] - row_start[route_row] + rank

    # Tiles: bucket b owns padded[b] / B tiles, in bucket order inside its row.
    tile_bucket = np.repeat(np.arange(rows * E), padded // B)
    tile_row = tile_bucket // E
    tile_index = np.arange(tile_bucket.size) - row_start[tile_row] // B
    tile_expert = tile_bucket % E
    if expert_map is not None and not map_before:
        tile_expert = np.asarray(expert_map, dtype=np.int64)[tile_expert]

    sel = np.flatnonzero(processed)
    sorted_ids[sel, :P] = numel
    expert_ids[sel, :M] = -1
    sorted_ids[route_row, position] = kept
    expert_ids[tile_row, tile_index] = tile_expert
    num_post_pad[sel] = totals[sel]
    return valid
