"""Random alignment cases: a generator, a runner that compares a backend with the NumPy one,
and the comparison helpers the size, hostile-value, determinism and thread tests share.

Case ``i`` of a run with seed ``S`` is drawn from ``np.random.default_rng([S, i])``
(``case_for(S, i)``), so a failure reported as "seed S case i: <describe>" is reproduced by
itself with ``python scripts/fuzz.py --seed S --only i`` (or ``FUZZ_SEED=S FUZZ_ONLY=i
pytest tests/test_gpu_fuzz.py``).

``run_case(case, cupy)`` runs the case on the GPU with device arrays and on the NumPy backend
with NumPy arrays, and compares: deterministic results exactly, free-order ``sorted_token_ids``
segment by segment as multisets (the ``canonical`` comparison of ``gpu_util``, vectorised),
everything else exactly, including the poisoned guard zones around every ``out=`` buffer, the
columns past ``P`` of a wider buffer and the rows of slots that are not processed (the NumPy
backend leaves them as the caller's buffer held them too, so equal poisoned buffers cover
that). ``run_case(case, numpy)`` runs the same comparison NumPy against NumPy, which is how
the harness itself is tested without a GPU (tests/test_fuzz_harness.py).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

import moe_lora_align as mla
from gpu_util import GUARD, POISON, guarded, segment_starts

EXPERTS = (1, 2, 3, 7, 31, 32, 33, 64, 128, 255, 256, 257, 512, 1024, 2048, 4096, 8192)
BLOCKS = (1, 2, 16, 32, 64, 128, 256)
DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
KINDS = ("uniform", "skewed", "hot", "all_invalid", "invalid_mixed", "repeats", "huge", "edge")
VARIANTS = (None, "shared", "global", "cooperative", "cluster")
STREAMS = (None, "one", "two", "fused")

# Bounds that keep one case fast (the long run does 10,000 in minutes).
MAX_NUMEL = 2**20
MAX_BUCKETS = 2**18
MAX_ENTRIES = 2**25           # output entries rows * (P + M), all outputs of the case
TYPICAL_ENTRIES = 2**21       # most cases stay below this; BIG_FRACTION may use MAX_ENTRIES
BIG_FRACTION = 0.03

# Smaller bounds for the CPU emulator (every CUDA thread a fiber): a case in about 0.2 s.
EMULATOR_BOUNDS = dict(max_numel=2**15, max_buckets=2**14, max_entries=2**21)

# numel values just around the kernels' limits (one block: 512 routes one a thread, 4096 in
# all; the cooperative launch: 132 SMs x 8192 routes on an H200)
NUMEL_EDGES = (511, 512, 513, 1023, 1024, 1025, 2047, 2048, 4095, 4096, 4097, 8192, 132 * 1024,
               132 * 1024 + 1, 132 * 8192, 132 * 8192 + 1)


class Refused(Exception):
    """The dispatcher refused a forced variant or streams mode (ValueError): a skip."""


class CaseFailure(AssertionError):
    pass


@dataclasses.dataclass
class Case:
    mode: str                  # "base", "lora" or "pair" (align_moe_and_lora)
    T: int
    K: int
    E: int
    B: int
    dtype: str
    kind: str                  # routing kind
    max_loras: int = 0         # 0: base only
    mapping_kind: str = "-"
    lora_ids_kind: str = "none"
    enabled_kind: str = "none"
    map_kind: str = "none"     # expert map: none / slice / perm / shared / all-1
    ignore_invalid: bool = False  # base: map before counting (True) or tiles after (False)
    pad: bool = False
    scatter: bool = False
    det: bool = False
    variant: str | None = None
    streams: str | None = None
    out: bool = False
    out_layout: str = "exact"  # LoRA: exact / wide (2-D, longer rows) / flat (1-D)
    extra: int = 0             # entries past what is needed in every out= buffer
    validate_dev: bool | None = None
    validate_host: bool | None = None  # the NumPy side's validate (None: it validates)
    topk_ids: np.ndarray = None
    mapping: np.ndarray = None
    lora_ids: np.ndarray = None
    enabled: np.ndarray = None
    expert_map: np.ndarray = None
    seed: object = None
    index: object = None

    @property
    def numel(self):
        return self.T * self.K

    @property
    def sizes(self):
        return mla.buffer_sizes(self.numel, self.E, self.B, self.pad)

    @property
    def has_base(self):
        return self.mode in ("base", "pair")

    @property
    def has_lora(self):
        return self.mode in ("lora", "pair")


def describe(case: Case) -> str:
    """One line with everything that shapes the case (its arrays follow from the seed)."""
    parts = [case.mode, f"T={case.T}", f"K={case.K}", f"E={case.E}", f"B={case.B}",
             case.dtype, case.kind]
    if case.has_lora:
        parts += [f"L={case.max_loras}", f"mapping={case.mapping_kind}",
                  f"lora_ids={case.lora_ids_kind}", f"enabled={case.enabled_kind}"]
    if case.map_kind != "none":
        when = "before" if (case.ignore_invalid or case.mode == "lora") else "after"
        parts.append(f"map={case.map_kind}/{when}"
                     + ("" if case.mode != "pair" else "(lora before)"))
    flags = [n for n, on in (("pad", case.pad), ("scatter", case.scatter), ("det", case.det))
             if on]
    parts += flags
    if case.variant:
        parts.append(f"variant={case.variant}")
    if case.mode == "pair":
        parts.append(f"streams={case.streams}")
    parts.append(f"out={case.out_layout}+{case.extra}" if case.out else "out=alloc")
    if case.validate_dev:
        parts.append("validate")
    P, M = case.sizes
    rows = (case.max_loras if case.has_lora else 0) + (1 if case.has_base else 0)
    parts.append(f"(numel={case.numel} P={P} M={M} buckets={max(case.max_loras, 1) * case.E}"
                 f" entries={rows * (P + M)})")
    return " ".join(parts)


# ---- drawing -------------------------------------------------------------------------------
def _log_uniform(rng, lo, hi):
    return int(min(hi, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))))


def _draw_tokens(rng):
    u = rng.random()
    if u < 0.05:
        return 0
    if u < 0.20:
        return int(rng.integers(1, 5))
    if u < 0.55:
        return int(rng.integers(5, 65))
    if u < 0.80:
        return _log_uniform(rng, 65, 1024)
    if u < 0.95:
        return _log_uniform(rng, 1025, 8192)
    return _log_uniform(rng, 8193, 65536)


def _choice(rng, seq, p=None):
    return seq[int(rng.choice(len(seq), p=p))]


def _entries(mode, numel, E, B, rows, pad):
    P, M = mla.buffer_sizes(numel, E, B, pad)
    return ((rows if mode != "base" else 0) + (mode != "lora")) * (P + M)


def _shape(rng, mode, max_numel, max_buckets, max_entries):
    """T, K, E, B, max_loras, pad within the bounds (shrinking a random axis until they hold)."""
    K = int(rng.integers(1, 11))
    T = _draw_tokens(rng)
    if rng.random() < 0.08:  # a numel just around a kernel limit
        target = _choice(rng, NUMEL_EDGES)
        K = _choice(rng, [k for k in (1, 2, 4, 8) if target % k == 0] or [1])
        T = target // K
    E = _choice(rng, EXPERTS) if rng.random() < 0.65 else _log_uniform(rng, 1, 8192)
    B = _choice(rng, BLOCKS) if rng.random() < 0.6 else int(rng.integers(1, 300))
    rows = 0
    if mode != "base":
        rows = _choice(rng, (1, 2, 4, 8, 16, 32, 64)) if rng.random() < 0.5 else \
            int(rng.integers(1, 65))
    pad = bool(rng.random() < 0.3)
    budget = max_entries if rng.random() < BIG_FRACTION else min(max_entries, TYPICAL_ENTRIES)
    for _ in range(200):
        over = []
        if T * K > max_numel:
            over.append("T")
        if max(rows, 1) * E > max_buckets:
            over += ["E"] + (["rows"] if rows > 1 else [])
        if _entries(mode, T * K, E, B, rows, pad) > budget:
            over += [a for a, big in (("rows", rows > 1), ("B", B > 1), ("E", E > 1),
                                      ("T", T > 0)) if big]
        if not over:
            break
        axis = _choice(rng, over)
        if axis == "T":
            T = T // 2
        elif axis == "E":
            E = max(1, E // 2)
        elif axis == "B":
            B = max(1, B // 2)
        else:
            rows = max(1, rows // 2)
    return T, K, E, B, rows, pad


def _routing(rng, T, K, E, dtype, kind):
    dt = np.dtype(dtype)
    info = np.iinfo(dt)
    hi = min(E, int(info.max) + 1)  # valid ids representable in the dtype: [0, hi)
    bad = sorted({v for v in (E, E + 1, E + 1000, int(info.max)) if v <= info.max and v >= E})
    if info.min < 0:
        bad += [-1, -2, int(info.min)]
    if dt.itemsize == 8:
        huge = [2**40, 2**40 + 1, 2**32, 2**32 + min(1, hi - 1)]
        huge += [-(2**40), -(2**32) + min(3, hi - 1), 2**62] if info.min < 0 else \
            [2**63, 2**63 + 1, 2**64 - 1]
        huge = [v for v in huge if v >= E or v < 0]
    else:
        huge = bad
    shape = (T, K)
    if kind == "uniform":
        if K <= hi and T * hi <= 2**18 and hi > 1:
            ids = np.argsort(rng.random((T, hi)), axis=1)[:, :K]
        else:
            ids = rng.integers(hi, size=shape)
    elif kind == "skewed":
        ids = np.full(shape, int(rng.integers(hi)))
    elif kind == "hot":
        hot = rng.integers(hi, size=int(rng.integers(1, 5)))
        ids = hot[rng.integers(hot.size, size=shape)]
    elif kind == "repeats":
        per = rng.integers(hi, size=(T, int(rng.integers(1, 3))))
        ids = np.take_along_axis(per, rng.integers(per.shape[1], size=shape), axis=1)
    elif kind == "edge":  # the last valid ids next to the first invalid ones
        vals = np.array(sorted({0, hi - 1, max(0, hi - 2)} | set(bad[:3])), dtype=object)
        ids = vals[rng.integers(vals.size, size=shape)]
    else:
        ids = rng.integers(hi, size=shape)
    ids = np.array(ids, dtype=dt).reshape(shape)  # every value drawn fits the dtype
    pool = huge if kind == "huge" else bad
    if kind in ("all_invalid", "invalid_mixed", "huge") and pool and ids.size:
        frac = 1.0 if kind == "all_invalid" else float(_choice(rng, (0.05, 0.3, 0.7)))
        mask = rng.random(shape) < frac
        ids[mask] = np.array(pool, dtype=dt)[rng.integers(len(pool), size=int(mask.sum()))]
    return np.ascontiguousarray(ids)


def _mapping(rng, T, L):
    kind = _choice(rng, ("random", "few", "one", "all_base", "random"))
    if kind == "random":
        m = rng.integers(L, size=T)
    elif kind == "few":
        slots = rng.choice(L, size=min(L, int(rng.integers(1, 4))), replace=False)
        m = slots[rng.integers(slots.size, size=T)]
    elif kind == "one":
        m = np.full(T, int(rng.integers(L)))
    else:
        m = np.full(T, -1)
    frac = float(_choice(rng, (0.0, 0.15, 0.5)))
    if kind != "all_base" and frac:
        m = np.where(rng.random(T) < frac, -1, m)
        kind += f"/base{frac}"
    return kind, m.astype(np.int32)


def _lora_ids(rng, mapping, L):
    kind = _choice(rng, ("none", "engine", "engine0", "subset", "junk", "long"))
    if kind == "none":
        return kind, None
    used = np.unique(mapping[mapping >= 0])
    ids = np.full(L + 1, -1, dtype=np.int64)
    if kind in ("engine", "long"):
        ids[:used.size] = used
    elif kind == "engine0":  # -1 first: the engines' layout when base tokens are present
        ids[1:1 + used.size] = used
    elif kind == "subset":
        keep = used[rng.random(used.size) < 0.5]
        ids[1:1 + keep.size] = keep
    else:  # junk: some in-range slots (distinct), -1 and >= L entries, shuffled
        n = int(rng.integers(0, L + 1))
        slots = rng.choice(L, size=min(n, L), replace=False)
        ids[:slots.size] = slots
        rest = np.arange(slots.size, L + 1)
        junk = np.array([-1, L, L + 1, 2**31 - 1, 1000], dtype=np.int64)
        ids[rest] = junk[rng.integers(junk.size, size=rest.size)]
        rng.shuffle(ids)
    if kind == "long":  # only the first L + 1 entries are read: anything may follow,
        # repeated slots included (the host validates only the entries read)
        tail = rng.integers(-3, L + 3, size=int(rng.integers(1, 9)))
        tail[rng.random(tail.size) < 0.2] = 2**31 - 1
        ids = np.concatenate([ids, tail])
    return kind, ids.astype(np.int32)


def _enabled(rng, L):
    kind = _choice(rng, ("none", "ones", "some_off", "ints"))
    if kind == "none":
        return kind, None
    n = L + 1 + (int(rng.integers(1, 4)) if rng.random() < 0.2 else 0)
    if kind == "ones":
        return kind, np.ones(n, dtype=np.int32)
    if kind == "some_off":
        en = (rng.random(n) >= float(_choice(rng, (0.2, 0.5, 0.9)))).astype(np.int32)
        return kind, en
    en = rng.integers(-(2**31), 2**31, size=n).astype(np.int32)  # any nonzero is enabled
    en[rng.random(n) < 0.3] = 0
    return kind, en


def _expert_map(rng, E):
    kind = _choice(rng, ("slice", "perm", "shared", "all-1"))
    m = np.full(E, -1, dtype=np.int32)
    if kind == "slice":  # expert parallelism: a contiguous range of global experts is local
        n = int(rng.integers(1, E + 1))
        a = int(rng.integers(0, E - n + 1))
        m[a:a + n] = np.arange(n)
    elif kind == "perm":
        n = int(rng.integers(1, E + 1))
        glob = rng.choice(E, size=n, replace=False)
        m[glob] = rng.permutation(n)
    elif kind == "shared":  # several global experts on one local id (allowed: any local id)
        n = int(rng.integers(1, E + 1))
        glob = rng.choice(E, size=n, replace=False)
        m[glob] = rng.integers(0, max(1, n // 2), size=n)
    return kind, m


def draw_case(rng, *, max_numel=MAX_NUMEL, max_buckets=MAX_BUCKETS,
              max_entries=MAX_ENTRIES) -> Case:
    """One random case (see the module doc); the bounds keep it fast."""
    mode = _choice(rng, ("base", "lora", "pair"), p=(0.35, 0.35, 0.3))
    T, K, E, B, L, pad = _shape(rng, mode, max_numel, max_buckets, max_entries)
    dtype = _choice(rng, DTYPES)
    kind = _choice(rng, KINDS, p=(0.3, 0.1, 0.1, 0.05, 0.15, 0.1, 0.1, 0.1))
    case = Case(mode=mode, T=T, K=K, E=E, B=B, dtype=dtype, kind=kind, max_loras=L, pad=pad)
    case.topk_ids = _routing(rng, T, K, E, dtype, kind)
    if case.has_lora:
        case.mapping_kind, case.mapping = _mapping(rng, T, L)
        case.lora_ids_kind, case.lora_ids = _lora_ids(rng, case.mapping, L)
        case.enabled_kind, case.enabled = _enabled(rng, L)
    if rng.random() < 0.3:
        case.map_kind, case.expert_map = _expert_map(rng, E)
        case.ignore_invalid = bool(rng.random() < 0.5)
    case.scatter = mode == "base" and bool(rng.random() < 0.3)
    case.det = bool(rng.random() < 0.3)
    case.variant = _choice(rng, VARIANTS, p=(0.48, 0.13, 0.13, 0.13, 0.13))
    if mode == "pair":
        case.streams = _choice(rng, STREAMS, p=(0.4, 0.2, 0.2, 0.2))
    case.out = bool(rng.random() < 0.5)
    if case.out:
        case.out_layout = _choice(rng, ("exact", "wide", "flat")) if case.has_lora else "exact"
        case.extra = 0 if rng.random() < 0.5 else int(rng.integers(1, 9))
        if case.out_layout == "wide" and case.extra == 0:
            case.extra = 1
    if rng.random() < 0.1:
        case.validate_dev = True
    return case


def case_for(seed: int, index: int, **bounds) -> Case:
    case = draw_case(np.random.default_rng([seed, index]), **bounds)
    case.seed, case.index = seed, index
    return case


# ---- running -------------------------------------------------------------------------------
def _to_host(x):
    return x if isinstance(x, np.ndarray) else x.get()


def _sync(xp):
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


def _out_buffers(case, xp, side):
    """Poisoned, guarded out= buffers of one side: list of (name, whole, view, pitch)."""
    P, M = case.sizes
    x = case.extra
    if side == "base":
        specs = [("sorted", [P + x], P), ("experts", [M + x], M), ("ntpp", [1 + x], 1)]
        if case.scatter:
            specs.append(("scatter", [case.numel + x], case.numel))
    else:
        L = case.max_loras
        if case.out_layout == "wide":
            specs = [("sorted", [L, P + x], P + x), ("experts", [L, M + x], M + x)]
        elif case.out_layout == "flat":
            specs = [("sorted", [L * P + x], P), ("experts", [L * M + x], M)]
        else:
            specs = [("sorted", [L, P], P), ("experts", [L, M], M)]
        specs.append(("ntpp", [L + x], 1))
    bufs = []
    for name, shape, pitch in specs:
        whole, view = guarded(shape, xp)
        bufs.append((name, whole, view, pitch))
    return bufs


def execute(case: Case, xp, *, gpu_side=True):
    """Run ``case`` on ``xp`` arrays (``gpu_side``: forced variant/streams and device
    validation as drawn; the reference side runs with the dispatcher's choice). Returns
    ``{side: {name: host array}}``: whole guarded buffers with out=, else the returned
    arrays. Raises ``Refused`` for a refused forced variant or streams mode."""
    a = lambda v: None if v is None else xp.asarray(v)  # noqa: E731
    ids, emap = a(case.topk_ids), a(case.expert_map)
    kw = dict(block_size=case.B, num_experts=case.E, pad_sorted_ids=case.pad,
              deterministic=case.det)
    validate = (case.validate_dev if gpu_side else None) if xp is not np else case.validate_host
    variant = case.variant if gpu_side else None
    streams = case.streams if gpu_side else None
    outs = {s: _out_buffers(case, xp, s) if case.out else None
            for s in ("base", "lora") if getattr(case, "has_" + s)}
    lkw = {}
    if case.has_lora:
        lkw = dict(lora_ids=a(case.lora_ids), adapter_enabled=a(case.enabled),
                   max_loras=case.max_loras)
    view = lambda s: None if outs.get(s) is None else [b[2] for b in outs[s]]  # noqa: E731
    try:
        if case.mode == "base":
            res = {"base": mla.moe_align_block_size(
                ids, expert_map=emap, ignore_invalid_experts=case.ignore_invalid,
                return_scatter_idx=case.scatter, out=view("base"), variant=variant,
                validate=validate, **kw)}
        elif case.mode == "lora":
            res = {"lora": mla.moe_lora_align_block_size(
                ids, a(case.mapping), expert_map=emap, out=view("lora"), variant=variant,
                validate=validate, **kw, **lkw)}
        else:
            b, lo = mla.align_moe_and_lora(
                ids, a(case.mapping), expert_map=emap, ignore_invalid_experts=case.ignore_invalid,
                out_base=view("base"), out_lora=view("lora"), streams=streams, variant=variant,
                validate=validate, **kw, **lkw)
            res = {"base": b, "lora": lo}
    except ValueError as e:
        msg = str(e)
        if gpu_side and ((variant is not None and "variant" in msg)
                         or (streams is not None and "streams" in msg)):
            raise Refused(msg) from e
        raise
    _sync(xp)
    got = {}
    for side, r in res.items():
        if outs[side] is not None:
            for (name, whole, v, _), returned in zip(outs[side], r):
                if returned is not v:
                    raise CaseFailure(f"{side} {name}: out= buffer not returned as given")
            got[side] = {name: _to_host(whole) for name, whole, _, _ in outs[side]}
        else:
            names = ("sorted", "experts", "ntpp", "scatter")
            got[side] = {n: _to_host(x) for n, x in zip(names, r)}
            P, M = case.sizes
            L = case.max_loras
            want = {"sorted": (P,) if side == "base" else (L, P),
                    "experts": (M,) if side == "base" else (L, M),
                    "ntpp": (1,) if side == "base" else (L,), "scatter": (case.numel,)}
            for n, arr in got[side].items():
                if arr.dtype != np.int32 or arr.shape != want[n]:
                    raise CaseFailure(f"{side} {n}: {arr.dtype} {arr.shape}, expected int32 "
                                      f"{want[n]}")
    return got


def sorted_layout(case, side):
    """(rows, pitch, offset) of sorted_token_ids inside what ``execute`` returns."""
    P, _ = case.sizes
    if side == "base":
        return 1, P, GUARD if case.out else 0
    if case.out and case.out_layout == "wide":
        return case.max_loras, P + case.extra, GUARD
    return case.max_loras, P, GUARD if case.out else 0


def starts_of(case, side):
    """Padded segment starts [rows, E+1] (from the NumPy backend's bucketing)."""
    if side == "base":
        return segment_starts(case.topk_ids, case.E, case.B, expert_map=case.expert_map,
                              map_before=case.ignore_invalid)
    return segment_starts(case.topk_ids, case.E, case.B, rows=case.max_loras,
                          expert_map=case.expert_map, map_before=True, mapping=case.mapping,
                          lora_ids=case.lora_ids, enabled=case.enabled)


def _first_diff(name, got, want, limit=5):
    got, want = np.asarray(got).reshape(-1), np.asarray(want).reshape(-1)
    if got.shape != want.shape:
        return f"{name}: shape {got.shape} != {want.shape}"
    bad = np.flatnonzero(got != want)
    shown = ", ".join(f"[{i}] {got[i]} != {want[i]}" for i in bad[:limit])
    return f"{name}: {bad.size} of {got.size} entries differ: {shown}"


def free_order_keys(region, starts, totals):
    """The entries of each row's [0, total) as int64 keys (segment, value), sorted: equal for
    two regions iff every segment holds the same multiset (``gpu_util.canonical``'s test)."""
    region = np.asarray(region).reshape(starts.shape[0], -1)
    rows, P = region.shape
    totals = np.clip(np.asarray(totals, dtype=np.int64), 0, P)
    mask = np.arange(P)[None, :] < totals[:, None]
    r, pos = np.nonzero(mask)
    bounds = (starts[:, 1:] + (np.arange(rows, dtype=np.int64) * (P + 1))[:, None]).reshape(-1)
    seg = np.searchsorted(bounds, r * (P + 1) + pos, side="right")
    keys = seg.astype(np.int64) * (1 << 32) + (region[r, pos].astype(np.int64) + (1 << 31))
    keys.sort()
    return keys, mask


def compare_sorted(name, got, want, starts, totals, *, exact, rows, pitch, offset, P):
    """Compare the sorted_token_ids buffers: exactly, or free order inside each segment of
    each row's [0, total) and exactly everywhere else (guards, tails, unprocessed rows)."""
    if exact or np.array_equal(got, want):
        if not np.array_equal(got, want):
            raise CaseFailure(_first_diff(name, got, want))
        return
    g, w = got.reshape(-1).copy(), want.reshape(-1).copy()
    gv = g[offset:offset + rows * pitch].reshape(rows, pitch)[:, :P]
    wv = w[offset:offset + rows * pitch].reshape(rows, pitch)[:, :P]
    gk, mask = free_order_keys(gv, starts, totals)
    wk, _ = free_order_keys(wv, starts, totals)
    if not np.array_equal(gk, wk):
        seg = np.flatnonzero(gk != wk)[0]
        raise CaseFailure(f"{name}: a segment holds other routes (first differing key "
                          f"segment {int(gk[seg] >> 32)}, value {int(gk[seg] & 0xffffffff) - 2**31}"
                          f" vs {int(wk[seg] & 0xffffffff) - 2**31})")
    gv[mask] = 0
    wv[mask] = 0
    if not np.array_equal(g, w):
        raise CaseFailure(_first_diff(name + " (outside the segments)", g, w))


def compare(case: Case, got, want):
    """Compare two ``execute`` results of ``case`` (raises CaseFailure)."""
    P, _ = case.sizes
    for side in want:
        g, w = got[side], want[side]
        for name in ("ntpp", "experts", "scatter"):
            if name in w and not np.array_equal(g[name], w[name]):
                raise CaseFailure(_first_diff(f"{side} {name}", g[name], w[name]))
        rows, pitch, offset = sorted_layout(case, side)
        if case.out:
            totals = w["ntpp"][GUARD:GUARD + rows]
            for n in w:
                for arr in (g[n], w[n]):
                    if not ((arr[:GUARD] == POISON).all() and (arr[-GUARD:] == POISON).all()):
                        raise CaseFailure(f"{side} {n}: guard zone written")
        else:
            totals = w["ntpp"][:rows]
        # totals of rows left as they were read POISON: no segment there (compared exactly)
        totals = np.where(totals < 0, 0, totals)
        compare_sorted(f"{side} sorted", g["sorted"], w["sorted"], starts_of(case, side),
                       totals, exact=case.det, rows=rows, pitch=pitch, offset=offset, P=P)


def execute_emulated(case: Case, emu, seed=0):
    """``execute``'s device side with the kernels on the CPU emulator (``tests/emulator``):
    the call is checked and its outputs made as the host path does (``_call.prepare``,
    ``allocate``), then the package's launch path runs the kernels, the forced variant and
    streams mode as drawn (two side streams become one; the launches are the same)."""
    import emulator
    from moe_lora_align import _call
    from moe_lora_align._launch import MAP_BEFORE, MAP_NONE

    outs = {s: _out_buffers(case, np, s) if case.out else None
            for s in ("base", "lora") if getattr(case, "has_" + s)}
    view = lambda s: None if outs.get(s) is None else [b[2] for b in outs[s]]  # noqa: E731
    kw = dict(pad_sorted_ids=case.pad, deterministic=case.det,
              validate=bool(case.validate_dev))
    pair = case.mode == "pair"
    calls = {}
    if case.has_base:
        calls["base"] = _call.prepare(
            case.topk_ids, case.B, case.E, rows=1, expert_map=case.expert_map,
            map_mode=_call.map_mode(case.expert_map, case.ignore_invalid), scatter=case.scatter,
            out=view("base"), out_arg="out_base" if pair else "out", **kw)
    if case.has_lora:
        calls["lora"] = _call.prepare(
            case.topk_ids, case.B, case.E, rows=case.max_loras, lora=True,
            token_lora_mapping=case.mapping, lora_ids=case.lora_ids,
            adapter_enabled=case.enabled, expert_map=case.expert_map,
            map_mode=MAP_NONE if case.expert_map is None else MAP_BEFORE, out=view("lora"),
            out_arg="out_lora" if pair else "out", **kw)
    for c in calls.values():
        _call.allocate(c)
    try:
        if pair:
            emulator.run_pair(emu, calls["base"].job, calls["lora"].job, streams=case.streams,
                              variant=case.variant, seed=seed)
        else:
            emulator.run(emu, next(iter(calls.values())).job, variant=case.variant, seed=seed)
    except ValueError as e:
        msg = str(e)
        if (case.variant is not None and "variant" in msg) or (
                case.streams is not None and "streams" in msg):
            raise Refused(msg) from e
        raise
    got = {}
    for side, c in calls.items():
        if outs[side] is not None:
            got[side] = {name: whole for name, whole, _, _ in outs[side]}
        else:
            got[side] = dict(zip(("sorted", "experts", "ntpp", "scatter"), c.results))
    return got


def run_case(case: Case, xp) -> str:
    """Run ``case`` on ``xp`` (cupy: the GPU; an ``emulator.Emulator``: the kernels on the
    CPU) and on the NumPy backend and compare. Returns "ok" or "refused" (a forced variant or
    streams mode the dispatcher refuses); raises CaseFailure (or the backend's exception)
    otherwise."""
    try:
        if hasattr(xp, "launch"):
            got = execute_emulated(case, xp, seed=case.index or 0)
        else:
            got = execute(case, xp, gpu_side=True)
    except Refused:
        return "refused"
    want = execute(case, np, gpu_side=False)
    compare(case, got, want)
    return "ok"


def run_many(seed, indices, xp, *, on_result=None, max_failures=None, bounds=None):
    """Run cases ``indices`` of ``seed`` (drawn within ``bounds``, ``draw_case``'s keyword
    arguments); returns (counts, failures). ``on_result(i, case, status, seconds, error)`` is
    called after each case."""
    import time
    import traceback

    counts = {"ok": 0, "refused": 0, "failed": 0}
    failures = []
    for i in indices:
        t0 = time.perf_counter()
        case, err = None, None
        try:
            case = case_for(seed, i, **(bounds or {}))
            status = run_case(case, xp)
        except Exception as e:  # noqa: BLE001 - every failure is reported with its seed
            status = "failed"
            err = "".join(traceback.format_exception_only(type(e), e)).strip()
            if not isinstance(e, AssertionError):
                err += "\n" + "".join(traceback.format_tb(e.__traceback__)[-3:])
            failures.append({"seed": seed, "case": i,
                             "describe": describe(case) if case is not None else "?",
                             "error": err})
        counts[status] += 1
        if on_result is not None:
            on_result(i, case, status, time.perf_counter() - t0, err)
        if max_failures is not None and len(failures) >= max_failures:
            break
    return counts, failures


def failure_line(f):
    return f"seed {f['seed']} case {f['case']}: {f['describe']}\n    {f['error']}"


# ---- hostile values (tests/test_gpu_hostile.py; their host twin in test_fuzz_harness.py) ---
def hostile_inputs(rng, T, K, E, rows, dtype=np.int64, *, tail=True):
    """Inputs whose values lie outside every range the contract allows (what validate=False
    lets through): 64-bit ids far outside [0, E) (some whose low 32 bits are valid ids),
    token_lora_mapping entries outside [-1, rows), lora_ids with out-of-range and duplicated
    entries (and a longer array with garbage past rows + 1 entries), adapter_enabled with
    arbitrary ints, expert_map entries outside [-1, E)."""
    dt = np.dtype(dtype)
    ids = rng.integers(E, size=(T, K)).astype(dt)
    if dt == np.dtype(np.int64):
        bad = [2**40, -(2**40), 2**32 + 1, -(2**32) + 2, 2**63 - 1, -(2**63), -1, E, 2**31]
    else:
        bad = [2**63, 2**63 + 1, 2**64 - 1, 2**32 + 1, 2**40 + 2, E, 2**31]
    mask = rng.random((T, K)) < 0.3
    ids[mask] = np.array(bad, dtype=dt)[rng.integers(len(bad), size=int(mask.sum()))]

    mapping = rng.integers(rows, size=T).astype(np.int64)
    bad_m = np.array([2**31 - 1, -(2**31), rows, rows + 1, -2, 2**30])
    u = rng.random(T)
    mapping = np.where(u < 0.25, bad_m[rng.integers(bad_m.size, size=T)], mapping)
    mapping = np.where((u >= 0.25) & (u < 0.35), -1, mapping).astype(np.int32)

    n = rows + 1
    valid = rng.permutation(rows)[:max(1, 2 * rows // 3)]  # about 2/3 of the slots listed
    junk = np.array([-1, -2, rows, rows + 5, 2**31 - 1, -(2**31)])
    lora_ids = np.concatenate([valid, valid[:max(1, valid.size // 3)],  # listed twice
                               junk[rng.integers(junk.size, size=n)]])[:n]
    rng.shuffle(lora_ids)
    if tail:
        tail_values = rng.integers(-3, rows + 3, size=int(rng.integers(1, 6)))
        lora_ids = np.concatenate([lora_ids, tail_values])
    lora_ids = lora_ids.astype(np.int32)

    enabled = rng.integers(-(2**31), 2**31, size=n).astype(np.int32)
    enabled[rng.random(n) < 0.3] = 0

    emap = rng.integers(E, size=E).astype(np.int64)
    u = rng.random(E)
    bad_e = np.array([-5, E, E + 7, 2**31 - 1, -(2**31)])
    emap = np.where(u < 0.3, bad_e[rng.integers(bad_e.size, size=E)], emap)
    emap = np.where((u >= 0.3) & (u < 0.5), -1, emap).astype(np.int32)
    return {"ids": ids, "mapping": mapping, "lora_ids": lora_ids, "enabled": enabled,
            "emap": emap}


def sanitised(h, E, rows):
    """The hostile inputs as the contract reads them, in values the host accepts: mapping
    entries outside [-1, rows) -> -1 (the token is in no row), expert_map entries outside
    [-1, E) -> -1 (the route is dropped), lora_ids cut to rows + 1 entries with out-of-range
    entries and repeats of a listed slot -> -1."""
    m = h["mapping"]
    mapping = np.where((m >= -1) & (m < rows), m, -1).astype(np.int32)
    em = h["emap"]
    emap = np.where((em >= -1) & (em < E), em, -1).astype(np.int32)
    lora_ids = np.full(rows + 1, -1, dtype=np.int32)
    seen = set()
    for j, x in enumerate(h["lora_ids"][:rows + 1].tolist()):
        if 0 <= x < rows and x not in seen:
            lora_ids[j] = x
            seen.add(x)
    return {"mapping": mapping, "emap": emap, "lora_ids": lora_ids}
