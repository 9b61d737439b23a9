"""Argument checks of the contract, raised before any launch.

Shape, dtype and device checks read metadata only (no device sync), so they also hold inside a
CUDA graph capture. Value checks read the data: always on host arrays, on device arrays only when
the caller asks (they cost a sync).
"""

from __future__ import annotations

import operator

import numpy as np

from ._sizes import INT32_MAX, check_index_range

ID_DTYPES = tuple(np.dtype(t) for t in (
    np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64))
INT32 = np.dtype(np.int32)


def positive_int(name: str, value) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None
    if v <= 0:
        raise ValueError(f"{name} must be > 0, got {v}")
    return v


def check_topk_ids(topk_ids):
    dt = np.dtype(topk_ids.dtype)
    if dt not in ID_DTYPES:
        raise TypeError(
            f"topk_ids must have an integer dtype (int8/16/32/64 or uint8/16/32/64), got {dt}"
        )
    if topk_ids.ndim != 2:
        raise ValueError(f"topk_ids must be 2-D [tokens, topk], got shape {tuple(topk_ids.shape)}")
    check_index_range("topk_ids", int(topk_ids.size))


def check_int32_vector(name: str, x, min_len: int, exact: bool = False):
    if x is None:
        return
    if np.dtype(x.dtype) != INT32:
        raise TypeError(f"{name} must be int32, got {np.dtype(x.dtype)}")
    if x.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(x.shape)}")
    n = int(x.shape[0])
    if exact and n != min_len:
        raise ValueError(f"{name} must have exactly {min_len} entries, got {n}")
    if n < min_len:
        raise ValueError(f"{name} must have at least {min_len} entries, got {n}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{name} must be contiguous")


def check_output(name: str, x, rows: int, length: int):
    """Validate one output buffer; return its row pitch (elements between rows)."""
    if np.dtype(x.dtype) != INT32:
        raise TypeError(f"out {name} must be int32, got {np.dtype(x.dtype)}")
    if not x.flags.c_contiguous:
        raise ValueError(f"out {name} must be C-contiguous")
    if x.ndim == 2 and rows > 1:
        if x.shape[0] != rows or x.shape[1] < length:
            raise ValueError(
                f"out {name} must have shape [{rows}, >= {length}], got {tuple(x.shape)}"
            )
        pitch = int(x.shape[1])
    else:
        if int(x.size) < rows * length:
            raise ValueError(
                f"out {name} is too small: needs {rows * length} int32 entries, has {int(x.size)}"
            )
        pitch = length
    check_index_range(f"out {name}", rows * pitch + length)
    return pitch


def check_same_device(named: dict):
    first = None
    for name, x in named.items():
        if x is None:
            continue
        dev = int(x.device.id)
        if first is None:
            first = (name, dev)
        elif dev != first[1]:
            raise ValueError(
                f"{name} is on GPU {dev} but {first[0]} is on GPU {first[1]}: "
                "all arrays must be on one device"
            )
    return first[1] if first else None


def check_sizes(numel: int, rows: int, padded: int, num_tiles: int, block_size: int):
    check_index_range("sorted_token_ids", rows * padded + block_size)
    check_index_range("expert_ids", rows * num_tiles)
    if numel > INT32_MAX:
        check_index_range("topk_ids", numel)


# ---- value checks -------------------------------------------------------------------------
def _host(x):
    return x if isinstance(x, np.ndarray) else x.get()


def check_expert_map_values(expert_map, num_experts: int):
    m = _host(expert_map)
    bad = (m < -1) | (m >= num_experts)
    if bad.any():
        j = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"expert_map entries must be -1 or a local id in [0, {num_experts}); "
            f"expert_map[{j}] = {int(m[j])}"
        )


def check_token_lora_mapping_values(mapping, max_loras: int):
    m = _host(mapping)
    bad = (m < -1) | (m >= max_loras)
    if bad.any():
        j = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"token_lora_mapping entries must be in [-1, {max_loras}); "
            f"token_lora_mapping[{j}] = {int(m[j])}"
        )


def check_lora_ids_values(lora_ids, max_loras: int):
    ids = _host(lora_ids)
    slots = ids[(ids >= 0) & (ids < max_loras)]
    uniq, counts = np.unique(slots, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"lora_ids lists slot {int(uniq[counts > 1][0])} more than once")
