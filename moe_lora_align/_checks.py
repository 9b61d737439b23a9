"""Argument checks of the contract, raised before any launch.

Shape, dtype and device checks read metadata only (no device sync), so they also hold inside a
CUDA graph capture. Value checks read the data: on host arrays unless the caller says
``validate=False``, on device arrays only when the caller asks (they cost a sync).
"""

from __future__ import annotations

import operator

import numpy as np

from ._sizes import INT32_MAX, MAX_BUCKETS, MAX_ROUTES, check_index_range

ID_DTYPES = tuple(np.dtype(t) for t in (
    np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64))
INT32 = np.dtype(np.int32)


def integer(name: str, value, lo: int, hi: int) -> int:
    """``value`` as an int through ``operator.index`` (so no floats, strings or bools), in
    ``[lo, hi]``; the error names the argument."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None
    if v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    if v > hi:
        raise ValueError(f"{name} must be <= {hi}, got {v}")
    return v


def positive_int(name: str, value, hi: int = INT32_MAX) -> int:
    return integer(name, value, 1, hi)


def option(name: str, value, allowed: tuple):
    """A string option out of ``allowed`` (or None)."""
    if value is not None and (not isinstance(value, str) or value not in allowed):
        raise ValueError(f"{name} must be one of {allowed} or None, got {value!r}")
    return value


def flag(name: str, value) -> bool:
    """True or False (also 0 or 1); anything else is a TypeError naming the argument."""
    if not isinstance(value, (bool, np.bool_, int, np.integer)) or value not in (0, 1):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def check_buckets(num_experts: int, rows: int) -> None:
    nb = num_experts * rows
    if nb > MAX_BUCKETS:
        what = "num_experts" if rows == 1 else f"max_loras * num_experts ({rows} * {num_experts})"
        raise ValueError(f"{what} = {nb} buckets, more than the {MAX_BUCKETS} supported")


def out_buffers(out, names: tuple, arg: str = "out"):
    """The ``out=`` tuple as a tuple of ``len(names)`` arrays, or None; lists of numbers,
    ``None`` entries and JAX arrays (immutable) are refused by name."""
    if out is None:
        return None
    listing = f"{len(names)} arrays ({', '.join(names)})"
    if not isinstance(out, (tuple, list)):
        raise TypeError(f"{arg} must be a tuple of {listing}, got {type(out).__name__}")
    if len(out) != len(names):
        raise ValueError(f"{arg} must hold {listing}, got {len(out)}")
    for name, x in zip(names, out):
        if x is None:
            raise TypeError(f"{arg} {name} is None: pass an int32 array, or {arg}=None to "
                            "have the function allocate every output")
        mod = type(x).__module__.split(".")[0]
        known = mod in ("numpy", "cupy", "torch", "jax", "jaxlib")
        viewable = hasattr(x, "__cuda_array_interface__") or hasattr(x, "__dlpack__")
        if not (known or viewable) or np.isscalar(x):
            # (an object with only __array__ might hand over a copy: the results would be lost)
            raise TypeError(f"{arg} {name} must be an array to write into, got "
                            f"{type(x).__name__}")
        if mod in ("jax", "jaxlib"):
            raise TypeError(f"{arg} {name} is a JAX array, which cannot be written in place: "
                            f"leave {arg}=None and use the returned arrays")
    return tuple(out)


def dtype_error(name: str, got) -> TypeError:
    """The error for an input of the wrong dtype (``got``: NumPy's, or a framework's that
    NumPy has no type for, such as torch.bfloat16)."""
    if name == "topk_ids":
        return TypeError(
            f"topk_ids must have an integer dtype (int8/16/32/64 or uint8/16/32/64), got {got}")
    return TypeError(f"{name} must be int32, got {got}")


def check_topk_ids(topk_ids):
    dt = np.dtype(topk_ids.dtype)
    if dt not in ID_DTYPES:
        raise dtype_error("topk_ids", dt)
    if topk_ids.ndim != 2:
        raise ValueError(f"topk_ids must be 2-D [tokens, topk], got shape {tuple(topk_ids.shape)}")
    check_index_range("topk_ids", int(topk_ids.size))


def check_int32_vector(name: str, x, min_len: int, exact: bool = False):
    if x is None:
        return
    if np.dtype(x.dtype) != INT32:
        raise dtype_error(name, np.dtype(x.dtype))
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
    """Validate one output buffer (``name``: how the error names it, e.g. "out expert_ids");
    return its row pitch (elements between rows)."""
    if np.dtype(x.dtype) != INT32:
        raise dtype_error(name, np.dtype(x.dtype))
    if not x.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    if not getattr(x.flags, "writeable", True):
        raise ValueError(f"{name} is read-only")
    if x.ndim == 2 and rows > 1:
        if x.shape[0] != rows or x.shape[1] < length:
            raise ValueError(
                f"{name} must have shape [{rows}, >= {length}], got {tuple(x.shape)}"
            )
        pitch = int(x.shape[1])
    else:
        if int(x.size) < rows * length:
            raise ValueError(
                f"{name} is too small: needs {rows * length} int32 entries, has {int(x.size)}"
            )
        pitch = length
    check_index_range(name, rows * pitch + length)
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
    if numel > MAX_ROUTES:
        raise ValueError(f"topk_ids has {numel} routes, more than the {MAX_ROUTES} supported")
    check_index_range("sorted_token_ids", rows * padded + block_size)
    check_index_range("expert_ids", rows * num_tiles)


def check_memory(nbytes: int, available: int, where: str):
    """Refuse outputs that could never be allocated (before trying)."""
    if available and nbytes > available:
        raise ValueError(f"the outputs need {nbytes / 2**30:.1f} GiB but the {where} has "
                         f"{available / 2**30:.1f} GiB: reduce the sizes")


# ---- buffers that overlap -----------------------------------------------------------------
def _address(x) -> int:
    data = x.data
    return int(data.ptr) if hasattr(data, "ptr") else int(x.__array_interface__["data"][0])


def byte_extent(x, entries=None):
    """``[lo, hi)`` byte addresses of an array (all of it, or its first ``entries`` elements
    when it is contiguous), or None when empty."""
    if entries is not None:
        lo = _address(x)
        return (lo, lo + entries * x.itemsize) if entries > 0 else None
    if x.size == 0:
        return None
    lo = hi = _address(x)
    for n, stride in zip(x.shape, x.strides):
        reach = (n - 1) * stride
        lo, hi = (lo + reach, hi) if reach < 0 else (lo, hi + reach)
    return lo, hi + x.itemsize


def check_spans(names, starts, sizes, written) -> None:
    """Byte spans ``[starts[i], starts[i] + sizes[i])``: refuse one that is ``written`` and
    overlaps any other, naming both. (A prepared call runs this on new addresses alone.)"""
    for i, (lo, size) in enumerate(zip(starts, sizes)):
        if not written[i] or not size:
            continue
        for j, (olo, osize) in enumerate(zip(starts, sizes)):
            if j != i and osize and lo < olo + osize and olo < lo + size:
                raise ValueError(f"{names[i]} and {names[j]} overlap in memory: every output "
                                 "buffer needs memory of its own, apart from the inputs")


def check_disjoint(outputs: dict, inputs: dict) -> None:
    """``outputs``: name -> (array, entries written); ``inputs``: name -> array or None.
    Refuse an output that overlaps another output or an input, naming both."""
    names, starts, sizes, written = [], [], [], []
    for named, is_output in ((outputs, True), (inputs, False)):
        for name, x in named.items():
            ext = None
            if is_output:
                ext = byte_extent(*x)
            elif x is not None:
                ext = byte_extent(x)
            if ext is not None:
                names.append(name)
                starts.append(ext[0])
                sizes.append(ext[1] - ext[0])
                written.append(is_output)
    check_spans(names, starts, sizes, written)


# ---- value checks -------------------------------------------------------------------------
def _host(x):
    return x if isinstance(x, np.ndarray) else x.get()


def _check_range(name: str, values, top: int, what: str):
    """Every entry of ``values`` in ``[-1, top)``, else a ValueError naming the first bad one."""
    m = _host(values)
    bad = (m < -1) | (m >= top)
    if bad.any():
        j = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{name} entries must be {what}; {name}[{j}] = {int(m[j])}")


def check_expert_map_values(expert_map, num_experts: int):
    _check_range("expert_map", expert_map, num_experts,
                 f"-1 or a local id in [0, {num_experts})")


def check_token_lora_mapping_values(mapping, max_loras: int):
    _check_range("token_lora_mapping", mapping, max_loras, f"in [-1, {max_loras})")


def check_lora_ids_values(lora_ids, max_loras: int):
    ids = _host(lora_ids)[: max_loras + 1]  # the entries the kernels read
    slots = ids[(ids >= 0) & (ids < max_loras)]
    uniq, counts = np.unique(slots, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"lora_ids lists slot {int(uniq[counts > 1][0])} more than once")
