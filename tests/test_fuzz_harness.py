"""The fuzz harness without a GPU (runs in CI).

Cases drawn by ``fuzz_cases`` run through the harness on the NumPy backend (xp=numpy) and
must equal an oracle written here from the contract (docs/contract.md) alone: plain Python loops over the
routes and the experts, sharing nothing with ``moe_lora_align._reference``. The comparison
helpers the GPU tests rely on must accept a free-order permutation inside a segment and catch
everything else, and the generator must cover what the GPU fuzz promises.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import fuzz_cases as fc
import moe_lora_align as mla
from gpu_util import GUARD, POISON, canonical

SEED = int(os.environ.get("FUZZ_HARNESS_SEED", 20250611))
CASES = 300
# Small enough for the pure-Python oracle: 300 cases in a few seconds.
SMALL = dict(max_numel=8192, max_buckets=8192, max_entries=2**18)


# ---- the oracle (docs/contract.md) -----------------------------------------------------------
def oracle_sizes(numel, E, B, pad):
    P = numel + E * (B - 1)
    if pad:
        P = (P + B - 1) // B * B
    if numel < E:
        P = min(numel * B, P)
    return P, (P + B - 1) // B


def oracle_alignment(routes, E, B, numel, P, M, label):
    """``routes``: (flat index, expert) pairs of the kept routes in ascending flat index.
    Returns (sorted_token_ids, expert_ids, num_tokens_post_pad) as lists."""
    buckets = [[] for _ in range(E)]
    for i, e in routes:
        buckets[e].append(i)
    sorted_ids, experts, pos = [numel] * P, [-1] * M, 0
    for e in range(E):
        c = len(buckets[e])
        if c == 0:
            continue  # an expert with no routes owns nothing
        sorted_ids[pos:pos + c] = buckets[e]
        tiles = (c + B - 1) // B
        experts[pos // B:pos // B + tiles] = [label(e)] * tiles
        pos += tiles * B
    assert len(sorted_ids) == P and len(experts) == M
    return sorted_ids, experts, pos


def oracle_route_expert(v, E, emap, map_before):
    """The (local) expert of a route with id ``v``, or None when it is dropped."""
    if not 0 <= v < E:
        return None
    if emap is not None and map_before:
        local = emap[v]
        return None if local == -1 else local
    return v


def oracle(case):
    """Expected results in the layout ``fuzz_cases.execute`` returns them."""
    flat = [int(v) for v in case.topk_ids.reshape(-1).tolist()]
    numel, E, B, K = len(flat), case.E, case.B, case.K
    P, M = oracle_sizes(numel, E, B, case.pad)
    emap = None if case.expert_map is None else [int(x) for x in case.expert_map]
    out = {}
    if case.has_base:
        before = emap is not None and case.ignore_invalid
        routes = []
        for i, v in enumerate(flat):
            e = oracle_route_expert(v, E, emap, before)
            if e is not None:
                routes.append((i, e))
        label = (lambda e: emap[e]) if emap is not None and not before else (lambda e: e)
        s, x, total = oracle_alignment(routes, E, B, numel, P, M, label)
        scatter = [-1] * numel
        for i, _ in routes:
            scatter[i] = i
        res = {"sorted": s, "experts": x, "ntpp": [total], "scatter": scatter}
        if not case.scatter:
            del res["scatter"]
        if case.out:
            res = {n: _in_guarded(v, len(v) + case.extra) for n, v in res.items()}
        out["base"] = {n: np.asarray(v, dtype=np.int32) for n, v in res.items()}
    if case.has_lora:
        L = case.max_loras
        mapping = [int(x) for x in case.mapping]
        if case.lora_ids is None:
            listed = set(range(L))
        else:
            listed = {int(x) for x in list(case.lora_ids)[:L + 1] if 0 <= int(x) < L}
        rows = {}
        for slot in range(L):
            enabled = case.enabled is None or int(case.enabled[slot]) != 0
            if slot not in listed or not enabled:
                continue
            routes = []
            for i, v in enumerate(flat):
                if mapping[i // K] != slot:
                    continue
                e = oracle_route_expert(v, E, emap, True)  # LoRA: the map applies before
                if e is not None:
                    routes.append((i, e))
            rows[slot] = oracle_alignment(routes, E, B, numel, P, M, lambda e: e)
        out["lora"] = _lora_layout(case, rows, numel, P, M)
    return out


def _in_guarded(values, length):
    whole = [POISON] * (2 * GUARD + length)
    whole[GUARD:GUARD + len(values)] = values
    return whole


def _lora_layout(case, rows, numel, P, M):
    L, x = case.max_loras, case.extra
    if not case.out:  # allocated: rows not processed read as the empty alignment
        s = np.full((L, P), numel, dtype=np.int32)
        e = np.full((L, M), -1, dtype=np.int32)
        t = np.zeros(L, dtype=np.int32)
        for r, (rs, re_, rt) in rows.items():
            s[r], e[r], t[r] = rs, re_, rt
        return {"sorted": s, "experts": e, "ntpp": t}
    # out=: rows not processed keep the caller's poison
    sp, ep = (P + x, M + x) if case.out_layout == "wide" else (P, M)
    slen = L * sp + (x if case.out_layout == "flat" else 0)
    elen = L * ep + (x if case.out_layout == "flat" else 0)
    s = np.full(2 * GUARD + slen, POISON, dtype=np.int32)
    e = np.full(2 * GUARD + elen, POISON, dtype=np.int32)
    t = np.full(2 * GUARD + L + x, POISON, dtype=np.int32)
    for r, (rs, re_, rt) in rows.items():
        s[GUARD + r * sp:GUARD + r * sp + P] = rs
        e[GUARD + r * ep:GUARD + r * ep + M] = re_
        t[GUARD + r] = rt
    return {"sorted": s, "experts": e, "ntpp": t}


# ---- the oracle itself on the contract's worked examples -----------------------------------
def _case(**kw):
    c = fc.Case(**kw)
    c.seed, c.index = "example", 0
    return c


def test_oracle_on_the_contract_examples():
    ids = np.array([[1, 3], [0, 1], [3, 1], [5, -1]], dtype=np.int32)
    want = oracle(_case(mode="base", T=4, K=2, E=4, B=4, dtype="int32", kind="-", topk_ids=ids,
                        scatter=True))["base"]
    assert want["sorted"].tolist() == [2, 8, 8, 8, 0, 3, 5, 8, 1, 4, 8, 8] + [8] * 8
    assert want["experts"].tolist() == [0, 1, 3, -1, -1]
    assert want["ntpp"].tolist() == [12]
    assert want["scatter"].tolist() == [0, 1, 2, 3, 4, 5, -1, -1]
    emap = np.array([-1, 0, -1, 1], dtype=np.int32)
    want = oracle(_case(mode="base", T=4, K=2, E=4, B=4, dtype="int32", kind="-", topk_ids=ids,
                        expert_map=emap, ignore_invalid=True))["base"]
    assert want["sorted"].tolist() == [0, 3, 5, 8, 1, 4, 8, 8] + [8] * 12
    assert want["experts"].tolist() == [0, 1, -1, -1, -1]
    assert want["ntpp"].tolist() == [8]

    ids = np.array([[0, 2], [1, 2], [2, 0], [0, 1]], dtype=np.int32)
    want = oracle(_case(mode="lora", T=4, K=2, E=3, B=2, dtype="int32", kind="-", max_loras=2,
                        topk_ids=ids, mapping=np.array([1, -1, 1, 0], np.int32),
                        lora_ids=np.array([-1, 0, 1], np.int32)))["lora"]
    assert want["sorted"].tolist() == [[6, 8, 7, 8] + [8] * 7, [0, 5, 1, 4] + [8] * 7]
    assert want["experts"].tolist() == [[0, 1, -1, -1, -1, -1], [0, 2, -1, -1, -1, -1]]
    assert want["ntpp"].tolist() == [4, 4]


# ---- the NumPy backend through the harness equals the oracle -------------------------------
def _small_cases(n=CASES, seed=SEED):
    return [fc.case_for(seed, i, **SMALL) for i in range(n)]


def test_numpy_backend_matches_the_oracle():
    failures = []
    for case in _small_cases():
        try:
            want = oracle(case)
            for gpu_side in (True, False):  # with and without the forced variant / streams
                got = fc.execute(case, np, gpu_side=gpu_side)
                assert got.keys() == want.keys()
                for side in want:
                    assert got[side].keys() == want[side].keys(), side
                    for name in want[side]:
                        g, w = got[side][name], want[side][name]
                        if not np.array_equal(g, w):
                            raise AssertionError(fc._first_diff(f"{side} {name}", g, w))
            assert fc.run_case(case, np) == "ok"
        except Exception as e:  # noqa: BLE001 - report every case with its seed
            failures.append(f"seed {case.seed} case {case.index}: {fc.describe(case)}\n    "
                            f"{type(e).__name__}: {e}")
    assert not failures, "\n".join(failures[:10]) + f"\n({len(failures)} failing cases)"


# ---- the comparison: free order passes, anything else fails --------------------------------
def _segments(case, side, want):
    """(row, start, count) of every segment with at least one route, from the oracle."""
    rows, pitch, offset = fc.sorted_layout(case, side)
    starts = fc.starts_of(case, side)
    w = want[side]["sorted"].reshape(-1)
    numel = case.numel
    segs = []
    for r in range(rows):
        for e in range(case.E):
            a, b = int(starts[r, e]), int(starts[r, e + 1])
            c = int((w[offset + r * pitch + a:offset + r * pitch + b] != numel).sum())
            if c:
                segs.append((offset + r * pitch + a, c))
    return segs


def _expect_failure(case, got, want):
    with pytest.raises(fc.CaseFailure):
        fc.compare(case, got, want)


def _copy(res):
    return {s: {n: a.copy() for n, a in d.items()} for s, d in res.items()}


def test_compare_accepts_free_order_and_catches_everything_else():
    rng = np.random.default_rng(5)
    checked = Counter()
    for case in _small_cases(120, seed=SEED + 1):
        want = fc.execute(case, np, gpu_side=False)
        for side in want:
            segs = _segments(case, side, want)
            multi = [s for s in segs if s[1] >= 2]
            if multi:  # a permutation inside a segment: fine unless deterministic
                a, c = multi[int(rng.integers(len(multi)))]
                got = _copy(want)
                s = got[side]["sorted"].reshape(-1)  # a view: the arrays are contiguous
                s[a:a + c] = s[a:a + c][::-1].copy()
                if case.det:
                    _expect_failure(case, got, want)
                else:
                    fc.compare(case, got, want)
                checked["permuted"] += 1
            if len(segs) >= 2:  # two routes trading segments
                (a, _), (b, _) = segs[0], segs[-1]
                got = _copy(want)
                s = got[side]["sorted"].reshape(-1)
                if s[a] != s[b]:
                    s[a], s[b] = s[b], s[a]
                    _expect_failure(case, got, want)
                    checked["swapped"] += 1
            if segs:  # a route lost (sentinel instead)
                got = _copy(want)
                got[side]["sorted"].reshape(-1)[segs[0][0]] = case.numel
                _expect_failure(case, got, want)
                checked["lost"] += 1
            for name in want[side]:  # one entry anywhere else changed
                arr = want[side][name]
                if arr.size == 0:
                    continue
                got = _copy(want)
                flat = got[side][name].reshape(-1)
                j = int(rng.integers(flat.size))
                if name == "sorted" and any(a <= j < a + c for a, c in segs):
                    continue
                flat[j] = flat[j] + 1 if flat[j] != POISON else 0
                _expect_failure(case, got, want)
                checked[name] += 1
            if case.out:  # the guard zone
                got = _copy(want)
                got[side]["sorted"].reshape(-1)[0] = 0
                _expect_failure(case, got, want)
                checked["guard"] += 1
    assert min(checked.values()) >= 10, checked


def test_free_order_keys_agree_with_canonical():
    rng = np.random.default_rng(9)
    for _ in range(300):
        rows, E, P = int(rng.integers(1, 4)), int(rng.integers(1, 6)), int(rng.integers(0, 30))
        cuts = np.sort(rng.integers(0, P + 1, size=(rows, E)), axis=1)
        starts = np.concatenate([np.zeros((rows, 1), np.int64), cuts], axis=1)
        a = rng.integers(0, 4, size=(rows, P)).astype(np.int32)
        b = a.copy()
        if rng.random() < 0.5 and P:
            r = int(rng.integers(rows))
            i, j = rng.integers(P, size=2)
            b[r, i], b[r, j] = b[r, j], b[r, i]
        if rng.random() < 0.3 and P:
            b[int(rng.integers(rows)), int(rng.integers(P))] = -7
        totals = starts[:, -1]
        same_canon = np.array_equal(canonical(a, starts), canonical(b, starts))
        ka, _ = fc.free_order_keys(a, starts, totals)
        kb, _ = fc.free_order_keys(b, starts, totals)
        same_keys = np.array_equal(ka, kb)
        # canonical folds the tail past the total in as one more segment; the keys leave it
        # to compare_sorted's exact check
        tails = all(sorted(a[r, totals[r]:]) == sorted(b[r, totals[r]:]) for r in range(rows))
        assert same_canon == (same_keys and tails)


# ---- the generator -------------------------------------------------------------------------
def test_draw_is_reproducible_and_within_bounds():
    seen = Counter()
    for i in range(1500):
        case = fc.case_for(77, i)
        again = fc.case_for(77, i)
        assert fc.describe(case) == fc.describe(again) and "\n" not in fc.describe(case)
        for name in ("topk_ids", "mapping", "lora_ids", "enabled", "expert_map"):
            x, y = getattr(case, name), getattr(again, name)
            assert (x is None and y is None) or np.array_equal(x, y)
        P, M = case.sizes
        rows = (case.max_loras if case.has_lora else 0) + case.has_base
        assert case.numel <= fc.MAX_NUMEL
        assert max(case.max_loras, 1) * case.E <= fc.MAX_BUCKETS
        assert rows * (P + M) <= fc.MAX_ENTRIES
        assert case.topk_ids.dtype == np.dtype(case.dtype)
        assert case.topk_ids.shape == (case.T, case.K)
        if case.has_lora:
            assert case.mapping.dtype == np.int32 and case.mapping.shape == (case.T,)
            assert ((case.mapping >= -1) & (case.mapping < case.max_loras)).all()
            assert 1 <= case.max_loras <= 64
        if case.expert_map is not None:
            assert ((case.expert_map >= -1) & (case.expert_map < case.E)).all()
        seen.update([("mode", case.mode), ("dtype", case.dtype), ("kind", case.kind),
                     ("variant", case.variant), ("streams", case.streams),
                     ("lora_ids", case.lora_ids_kind), ("enabled", case.enabled_kind),
                     ("map", case.map_kind), ("ignore", case.ignore_invalid),
                     ("layout", case.out_layout if case.out else "alloc"),
                     ("det", case.det), ("pad", case.pad), ("scatter", case.scatter),
                     ("E", case.E), ("B", case.B)])
        seen[("T0", case.T == 0)] += 1
        seen[("Tbig", case.T > 8192)] += 1
        seen[("K", case.K)] += 1
    for key, values in [("mode", ("base", "lora", "pair")), ("dtype", fc.DTYPES),
                        ("kind", fc.KINDS), ("variant", fc.VARIANTS),
                        ("streams", ("one", "two", "fused")),
                        ("lora_ids", ("none", "engine", "engine0", "subset", "junk", "long")),
                        ("enabled", ("none", "ones", "some_off", "ints")),
                        ("map", ("none", "slice", "perm", "shared", "all-1")),
                        ("ignore", (True, False)), ("layout", ("alloc", "exact", "wide", "flat")),
                        ("det", (True, False)), ("pad", (True, False)), ("scatter", (True,)),
                        ("T0", (True,)), ("Tbig", (True,)), ("K", tuple(range(1, 11))),
                        ("E", (1, 7, 33, 257, 1024, 8192)), ("B", fc.BLOCKS)]:
        for v in values:
            assert seen[(key, v)] > 0, (key, v)


def test_huge_values_are_drawn_and_dropped():
    """64-bit ids beyond 32 bits, some whose low 32 bits are a valid id (what a kernel that
    truncated ids would count): drawn, and dropped by the oracle (and so by the backend)."""
    beyond = truncation_traps = 0
    for i in range(600):
        case = fc.case_for(3, i)
        ids = case.topk_ids.reshape(-1)
        if case.kind != "huge" or ids.dtype.itemsize != 8 or ids.size == 0:
            continue
        vals = ids.astype(object)
        big = [v for v in vals if v >= 2**32 or v < -(2**31)]
        beyond += len(big)
        truncation_traps += sum(1 for v in big if (v & 0xFFFFFFFF) < case.E)
        assert all(v >= case.E or v < 0 for v in big)
    assert beyond > 0 and truncation_traps > 0, (beyond, truncation_traps)


# ---- hostile values on the host: raw with validate=False equals the sanitised run ----------
def test_host_backend_on_hostile_values_equals_sanitised_inputs():
    """What tests/test_gpu_hostile.py expects of the kernels: values outside their ranges
    are dropped or skipped; the NumPy backend with validation off agrees."""
    for seed in range(6):
        for T, K, E, rows in ((5, 8, 64, 8), (300, 4, 256, 40)):
            h = fc.hostile_inputs(np.random.default_rng(seed), T, K, E, rows, np.int64)
            s = fc.sanitised(h, E, rows)
            raw = mla.moe_lora_align_block_size(h["ids"], h["mapping"], 16, E, rows,
                                                lora_ids=h["lora_ids"],
                                                adapter_enabled=h["enabled"],
                                                expert_map=h["emap"], validate=False)
            ref = mla.moe_lora_align_block_size(h["ids"], s["mapping"], 16, E, rows,
                                                lora_ids=s["lora_ids"],
                                                adapter_enabled=h["enabled"],
                                                expert_map=s["emap"])
            for a, b in zip(raw, ref):
                np.testing.assert_array_equal(a, b)
            raw = mla.moe_align_block_size(h["ids"], 16, E, h["emap"],
                                           ignore_invalid_experts=True, validate=False)
            ref = mla.moe_align_block_size(h["ids"], 16, E, s["emap"],
                                           ignore_invalid_experts=True)
            for a, b in zip(raw, ref):
                np.testing.assert_array_equal(a, b)


# ---- the long-run script -------------------------------------------------------------------
def _fuzz_script(tmp_path, flag, cases, seed, timeout):
    """``scripts/fuzz.py`` run as a user would; returns its output and its JSON summary."""
    root = Path(__file__).resolve().parents[1]
    summary = tmp_path / "fuzz.json"
    proc = subprocess.run([sys.executable, str(root / "scripts" / "fuzz.py"), flag,
                           "--cases", str(cases), "--seed", str(seed), "--json", str(summary)],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, json.loads(summary.read_text())


def test_fuzz_script_runs_on_numpy(tmp_path):
    out, data = _fuzz_script(tmp_path, "--numpy", 40, 7, 120)
    assert data["seed"] == 7 and data["run"] + data["refused"] == 40 and data["failed"] == 0
    assert "seed 7" in out


@pytest.mark.emulator
@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                    reason="needs a C++ compiler for the kernel emulator")
def test_fuzz_script_runs_on_the_emulator(tmp_path):
    """The GPU fuzz's cases with the kernels on the CPU emulator (smaller sizes): every dtype,
    mode, forced variant and streams mode the cases draw, against the NumPy backend."""
    _, data = _fuzz_script(tmp_path, "--emulator", 60, 11, 600)
    assert data["run"] + data["refused"] == 60 and data["failed"] == 0
    assert data["run"] >= 50
