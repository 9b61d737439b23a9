"""Host models of align_tiny (kernels/one_block.cuh) against the NumPy backend: the ballot
path's arithmetic (align_ballot: bucket bits compared from the top, tile counts summed as
popcounts of their bits) and the parts of each row that the blocks of a spread launch
write, and which block writes each entry when the counting path spreads in free order
(align_tiny_buckets). They run without a GPU, so a slip in the arithmetic shows in CI; the
kernels themselves are checked by tests/test_gpu_kernels.py."""

import numpy as np
import pytest

import moe_lora_align as mla

FULL = (1 << 32) - 1


def _popc(x):
    return bin(x).count("1")


def _ballot(values, predicate):
    return sum(1 << lane for lane, v in enumerate(values) if predicate(v))


def _compare(words, nbits, x):
    """compare_lanes: lanes below x and equal to x, from one warp's published words."""
    lt, eq = 0, words["active"]
    for k in range(nbits - 1, -1, -1):
        want = FULL if (x >> k) & 1 else 0
        lt |= eq & ~words[k] & want & FULL
        eq &= ~(words[k] ^ want) & FULL
    return lt, eq


def _tiles_of_lanes(words, tbits, lanes):
    return sum(_popc(lanes & words["t", m]) << m for m in range(tbits))


def _row_part(length, group, s, slices):
    per = ((length // group + slices - 1) // slices) * group
    return min(length, s * per), (length if s == slices - 1 else min(length, (s + 1) * per))


def ballot_model(buckets, rows, E, B, P, M, written, processed, numel, slices):
    """The outputs align_ballot writes over ``slices`` blocks (rows not written stay None)."""
    W = max(1, -(-len(buckets) // 32))
    lanes = [[buckets[w * 32 + l] if w * 32 + l < len(buckets) else -1 for l in range(32)]
             for w in range(W)]
    nb = rows * E
    nbits = max(nb - 1, 0).bit_length()
    tbits = (-(-numel // B)).bit_length()
    words = []
    for w in range(W):  # bucket -1 has every bit set, like the kernel's int
        d = {k: _ballot(lanes[w], lambda v, k=k: (v >> k) & 1) for k in range(nbits)}
        d["active"] = _ballot(lanes[w], lambda v: v >= 0)
        words.append(d)
    rank, tiles = {}, {}
    for w in range(W):
        for lane in range(32):
            b, count, r = lanes[w][lane], 0, 0
            for v in range(W):
                same = _compare(words[v], nbits, b)[1]
                count += _popc(same)
                r += _popc(same) if v < w else _popc(same & ((1 << lane) - 1)) if v == w else 0
            rank[w, lane] = r
            tiles[w, lane] = -(-count // B) if b >= 0 and r == 0 else 0
    for w in range(W):
        for m in range(tbits):
            words[w]["t", m] = _ballot([tiles[w, l] for l in range(32)],
                                       lambda t, m=m: (t >> m) & 1)
    below_row = [sum(_tiles_of_lanes(words[v], tbits, _compare(words[v], nbits, r * E)[0])
                     for v in range(W)) for r in range(rows)]
    all_tiles = sum(_tiles_of_lanes(words[v], tbits, FULL) for v in range(W))
    sorted_ids = [[None] * P for _ in range(rows)]
    expert_ids = [[None] * M for _ in range(rows)]
    for s in range(slices):
        lo, hi = _row_part(P, 4, s, slices)
        assert lo % 4 == 0 or lo == P  # int4 stores from the part's start
        tlo, thi = _row_part(M, 1, s, slices)
        for r in range(rows):
            if written[r]:
                sorted_ids[r][lo:hi] = [numel] * (hi - lo)
                expert_ids[r][tlo:thi] = [-1] * (thi - tlo)
        for w in range(W):
            for lane in range(32):
                b = lanes[w][lane]
                if b < 0:
                    continue
                start = sum(_tiles_of_lanes(words[v], tbits, _compare(words[v], nbits, b)[0])
                            for v in range(W))
                r = b // E
                tile0 = start - below_row[r]
                at = tile0 * B + rank[w, lane]
                if lo <= at < hi:
                    sorted_ids[r][at] = w * 32 + lane
                for t in range(max(tile0, tlo), min(tile0 + tiles[w, lane], thi)):
                    expert_ids[r][t] = b - r * E
    totals = [((below_row[r + 1] if r + 1 < rows else all_tiles) - below_row[r]) * B
              if processed[r] else 0 for r in range(rows)]
    return sorted_ids, expert_ids, totals


CASES = [  # E, T, K, B, rows (None: base), slices
    (64, 1, 8, 16, None, 1), (7, 3, 10, 1, None, 3), (1, 40, 1, 4, None, 1),
    (512, 8, 8, 64, None, 5), (64, 13, 5, 16, 4, 1), (128, 4, 8, 16, 16, 9),
    (3, 70, 1, 2, 32, 2), (64, 2, 6, 5, 4, 130)]


def _case(E, T, K, B, rows, kind):
    """Routes of a random case as align_tiny's buckets (-1: not aligned), the rows, which
    are processed, and the NumPy backend's (sorted_ids, expert_ids, totals) a row."""
    rng = np.random.default_rng(E * 31 + T * 7 + K + (kind == "skewed"))
    ids = rng.integers(-1, E + 1, size=(T, K)).astype(np.int32)  # a few invalid ids
    if kind == "skewed":
        ids[rng.random((T, K)) < 0.7] = E // 2
    if rows is None:
        ref = mla.moe_align_block_size(ids, B, E)
        buckets = [int(i) if 0 <= i < E else -1 for i in ids.ravel()]
        return buckets, 1, [True], [[np.asarray(ref[0])], [np.asarray(ref[1])],
                                    [int(np.asarray(ref[2])[0])]]
    mapping = rng.integers(-1, rows, size=T).astype(np.int32)
    listed = [r for r in range(rows) if r % 3 != 1]
    lora_ids = np.array(listed + [-1] * (rows + 1 - len(listed)), dtype=np.int32)
    enabled = np.ones(rows + 1, dtype=np.int32)
    enabled[rows - 1] = 0
    processed = [r in listed and enabled[r] != 0 for r in range(rows)]
    ref = mla.moe_lora_align_block_size(ids, mapping, B, E, rows, lora_ids=lora_ids,
                                        adapter_enabled=enabled)
    buckets = []
    for i, e in enumerate(ids.ravel()):
        slot = int(mapping[i // K])
        ok = 0 <= e < E and 0 <= slot < rows and processed[slot]
        buckets.append(slot * E + int(e) if ok else -1)
    return buckets, rows, processed, [list(np.asarray(ref[0])), list(np.asarray(ref[1])),
                                      [int(x) for x in np.asarray(ref[2])]]


@pytest.mark.parametrize("kind", ["uniform", "skewed"])
@pytest.mark.parametrize("E,T,K,B,rows,slices", CASES)
def test_ballot_arithmetic_matches_the_numpy_backend(E, T, K, B, rows, slices, kind):
    numel = T * K
    P, M = mla.buffer_sizes(numel, E, B)
    buckets, nrows, processed, refs = _case(E, T, K, B, rows, kind)
    got = ballot_model(buckets, nrows, E, B, P, M, processed, processed, numel, slices)
    for r, row in enumerate(got[0]):
        if row[0] is not None:
            np.testing.assert_array_equal(np.array(row), refs[0][r], err_msg=f"sorted row {r}")
            np.testing.assert_array_equal(np.array(got[1][r]), refs[1][r],
                                          err_msg=f"tiles row {r}")
            assert got[2][r] == refs[2][r], f"total row {r}"


def free_spread_model(buckets, rows, E, B, P, written, slices, group, rng):
    """The sorted ids that align_tiny's counting path writes when it spreads in free order
    (kernels/one_block.cuh: align_tiny_buckets, `late`), and how often each entry is
    written. Each slice ranks the routes of a bucket in an order of its own (shared atomics);
    a segment's routes come from the slice whose part holds the segment's start, its pads
    and the row's tail from the slice whose part holds them."""
    numel, nb = len(buckets), rows * E
    count = np.bincount([b for b in buckets if b >= 0], minlength=nb)
    padded = -(-count // B) * B
    starts = np.concatenate([[0], np.cumsum(padded)])  # the scan over every row's buckets
    out = np.full((rows, P), -7)
    writes = np.zeros((rows, P), int)

    def put(r, k, value):
        out[r, k] = value
        writes[r, k] += 1

    for s in range(slices):
        lo, hi = _row_part(P, group, s, slices)
        rank = {}
        for b in range(nb):
            members = [i for i, x in enumerate(buckets) if x == b]
            rank.update(zip(rng.permutation(members), range(len(members))))
        for i, b in enumerate(buckets):
            segment = starts[b] - starts[b // E * E] if b >= 0 else -1
            if lo <= segment < hi:
                put(b // E, segment + rank[i], i)
        for b in range(nb):
            pads = starts[b] - starts[b // E * E] + count[b]
            for k in range(max(pads, lo), min(pads + padded[b] - count[b], hi)):
                put(b // E, k, numel)
        for r in range(rows):
            if written[r]:
                for k in range(max(lo, starts[(r + 1) * E] - starts[r * E]), hi):
                    put(r, k, numel)
    for b in range(nb):  # routes within a segment in flat order, as the NumPy backend has them
        first = starts[b] - starts[b // E * E]
        out[b // E, first:first + count[b]].sort()
    return out, writes


@pytest.mark.parametrize("fill_unprocessed", [False, True])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("kind", ["uniform", "skewed"])
@pytest.mark.parametrize("E,T,K,B,rows,slices", CASES + [
    (256, 300, 8, 16, None, 7), (64, 256, 8, 16, 16, 13), (8, 64, 8, 64, None, 40)])
def test_free_order_spread_writes_each_entry_once(E, T, K, B, rows, slices, kind, group,
                                                 fill_unprocessed):
    numel = T * K
    P, _ = mla.buffer_sizes(numel, E, B)
    buckets, nrows, processed, refs = _case(E, T, K, B, rows, kind)
    written = [True] * nrows if fill_unprocessed else processed
    rng = np.random.default_rng(slices)
    out, writes = free_spread_model(buckets, nrows, E, B, P, written, slices, group, rng)
    for r in range(nrows):
        assert (writes[r] == (1 if written[r] else 0)).all(), f"row {r}"
        if processed[r]:
            np.testing.assert_array_equal(out[r], refs[0][r], err_msg=f"sorted row {r}")
        elif written[r]:  # sentinels only
            assert (out[r] == numel).all(), f"row {r}"
