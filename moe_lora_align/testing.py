"""Helpers for testing and benchmarking the alignment: random routing of several kinds,
poisoned buffers with guard zones, and the canonical form that compares a free-order
alignment with the NumPy backend's (which is ascending inside every segment).

The GPU tests and ``python -m moe_lora_align.bench`` both use them. NumPy only.
"""

from __future__ import annotations

import numpy as np

from . import _reference

POISON = -7777          # no correct kernel writes this
GUARD = 37              # poisoned entries around every output buffer


def make_routing(rng, tokens, topk, num_experts, dtype=np.int32, kind="uniform"):
    """[T, K] expert ids. kinds: uniform (distinct per token when possible), skewed (every
    route to one expert), hot (a few hot experts), invalid (some ids outside [0, E)),
    duplicates (repeated experts inside a token)."""
    if kind == "skewed":
        ids = np.full((tokens, topk), rng.integers(num_experts), dtype=np.int64)
    elif kind == "hot":
        hot = rng.integers(num_experts, size=max(1, min(4, num_experts)))
        ids = hot[rng.integers(hot.size, size=(tokens, topk))]
    elif kind == "duplicates":
        ids = rng.integers(max(1, num_experts // 4 + 1), size=(tokens, topk))
    else:
        if topk <= num_experts:
            ids = np.argsort(rng.random((tokens, num_experts)), axis=1)[:, :topk] \
                if num_experts <= 512 else rng.integers(num_experts, size=(tokens, topk))
        else:
            ids = rng.integers(num_experts, size=(tokens, topk))
    ids = ids.astype(np.int64)
    if kind == "invalid" and ids.size:
        mask = rng.random(ids.shape) < 0.2
        bad = rng.choice([-1, num_experts, num_experts + 5], size=ids.shape)
        ids = np.where(mask, bad, ids)
    return ids.astype(dtype)  # negative ids wrap to huge unsigned values: still invalid


def make_lora(rng, tokens, max_loras, *, base_fraction=0.15, disabled=0):
    mapping = rng.integers(max_loras, size=tokens).astype(np.int32)
    mapping[rng.random(tokens) < base_fraction] = -1
    used = np.unique(mapping[mapping >= 0])
    lora_ids = np.full(max_loras + 1, -1, dtype=np.int32)
    lora_ids[1:1 + used.size] = used  # engines' layout: -1 may sit at position 0
    enabled = np.ones(max_loras + 1, dtype=np.int32)
    if disabled:
        enabled[rng.choice(max_loras, size=min(disabled, max_loras), replace=False)] = 0
    return mapping, lora_ids, enabled


def guarded(shape, xp):
    """A poisoned buffer with GUARD poisoned entries on both sides; returns (whole, view)."""
    n = int(np.prod(shape))
    whole = xp.full(n + 2 * GUARD, POISON, dtype=np.int32)
    return whole, whole[GUARD:GUARD + n].reshape(shape)


def segment_starts(topk_ids, num_experts, block_size, *, rows=1, expert_map=None,
                   map_before=False, mapping=None, lora_ids=None, enabled=None):
    """Padded segment starts of every row ([rows, E+1]) from the oracle's bucketing."""
    flat = np.asarray(topk_ids).reshape(-1)
    K = np.asarray(topk_ids).shape[1]
    route_rows = processed = None
    if mapping is not None:
        processed = _reference.processed_rows(rows, lora_ids, enabled)
        route_rows = np.repeat(mapping.astype(np.int64), K)
    bucket, valid = _reference.route_buckets(flat, num_experts, expert_map, map_before,
                                             route_rows, processed)
    counts = np.bincount(bucket[valid], minlength=rows * num_experts).reshape(rows, num_experts)
    padded = (counts + block_size - 1) // block_size * block_size
    starts = np.zeros((rows, num_experts + 1), dtype=np.int64)
    np.cumsum(padded, axis=1, out=starts[:, 1:])
    return starts


def canonical(sorted_rows, starts):
    """Sort the entries of every segment: equal to the oracle iff each segment holds the right
    set (the oracle is already ascending inside segments). Positions past the total form one
    trailing segment."""
    out = np.array(sorted_rows, dtype=np.int64, copy=True).reshape(starts.shape[0], -1)
    P = out.shape[1]
    pos = np.arange(P)
    for r in range(out.shape[0]):
        seg = np.searchsorted(starts[r], pos, side="right")
        order = np.lexsort((out[r], seg))
        out[r] = out[r][order]
    return out
