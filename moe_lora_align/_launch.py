"""GPU launcher: packs one alignment problem for the kernels and launches the chosen variant.

Everything per device is created once and cached: the device limits, the compiled kernels and
the scratch workspaces. A call allocates nothing beyond the outputs it returns.
"""

from __future__ import annotations

import contextlib
import functools
import struct
import threading
from dataclasses import dataclass
from typing import Any, NamedTuple, Tuple

import numpy as np

from . import _checks, _dispatch
from ._kernels import kernels_for, kernels_loaded

_POINTERS = ("topk_ids", "token_slot", "lora_ids", "adapter_enabled", "expert_map",
             "sorted_ids", "expert_ids", "num_post_pad", "scatter_idx",
             "counts", "starts", "cursor", "chunk_hist", "ticket")
_INTS = ("numel", "topk", "num_experts", "block_size", "rows", "lora_ids_len", "padded_len",
         "num_tiles", "sorted_pitch", "expert_pitch", "map_mode", "fill_unprocessed", "chunk",
         "range_width", "ranges", "starts_in_smem", "stage_output")
_DIVISORS = ("topk", "block", "experts", "tiles")
_MAGICS = tuple(x for d in _DIVISORS for x in ((d + "_magic", np.uint32), (d + "_shift", np.int32)))
# Mirrors kernels/align_common.cuh: struct Problem.
PROBLEM_DTYPE = np.dtype([(n, np.uint64) for n in _POINTERS] + [(n, np.int32) for n in _INTS]
                         + list(_MAGICS) + [("count_stride", np.int32), ("coop_blocks", np.int32),
                            ("fill_blocks", np.int32)], align=True)

MAP_NONE, MAP_BEFORE, MAP_AFTER = 0, 1, 2
_state_lock = threading.RLock()  # guards the per-device caches that host threads share


@functools.lru_cache(maxsize=None)
def device_limits(device_id: int) -> _dispatch.DeviceLimits:
    import cupy

    attrs = cupy.cuda.Device(device_id).attributes
    return _dispatch.DeviceLimits(sm_count=int(attrs["MultiProcessorCount"]),
                                  smem_optin=int(attrs["MaxSharedMemoryPerBlockOptin"]),
                                  cooperative=bool(attrs.get("CooperativeLaunch", 0))
                                  and _direct_launcher(cooperative=True) is not None,
                                  clusters=int(cupy.cuda.Device(device_id).compute_capability)
                                  >= 90)


@functools.lru_cache(maxsize=None)
def device_memory(device_id: int) -> int:
    """Total memory of the device, bytes."""
    import cupy

    return int(cupy.cuda.runtime.getDeviceProperties(device_id)["totalGlobalMem"])


COOP_CONTROL_WORDS = 8  # kernels/align_kernels.cu: align_cooperative's control words (6 used)


def workspace_entries(num_buckets: int, matrix_entries: int) -> int:
    """int32 entries of one workspace: counts, starts, cursor and the cooperative kernel's two
    count buffers (5 a bucket), the ticket and a spare start, the per-chunk matrix, and the
    cooperative control words."""
    return 5 * num_buckets + 2 + matrix_entries + COOP_CONTROL_WORDS


class Workspace:
    """Reusable scratch of one alignment stream: counters that the kernels leave zeroed, and
    the cooperative kernel's two count buffers and control words (which it keeps itself)."""

    def __init__(self, device_id: int):
        self.device_id = device_id
        self.buckets = -1
        self.matrix = -1
        self.generation = 0  # bumped on every reallocation: packed arguments hold its pointers

    def ensure(self, num_buckets: int, matrix_entries: int, stream=None):
        """Grow to at least these sizes. The zeros are written on ``stream``, the stream the
        kernels run on, so they come first; with no stream the host waits for them."""
        if num_buckets <= self.buckets and matrix_entries <= self.matrix:
            return self
        with _state_lock:  # host threads sharing a stream share its workspace
            return self._grow(num_buckets, matrix_entries, stream)

    def _grow(self, num_buckets: int, matrix_entries: int, stream):
        import cupy

        if num_buckets > self.buckets or matrix_entries > self.matrix:
            nb = max(num_buckets, self.buckets, 1)
            nm = max(matrix_entries, self.matrix, 1)
            with cupy.cuda.Device(self.device_id), (stream or contextlib.nullcontext()):
                # One allocation, zeroed once; the kernels restore the zeros they rely on.
                buf = cupy.zeros(workspace_entries(nb, nm), dtype=np.int32)
                if stream is None:
                    cupy.cuda.get_current_stream().synchronize()
            self._carve(buf, nb, nm)
        return self

    def _carve(self, buf, nb: int, nm: int) -> None:
        """Name the parts of ``buf``, a zeroed allocation of ``workspace_entries(nb, nm)``
        (tests/emulator hands it NumPy memory)."""
        self.buf = buf
        parts, at = {}, 0
        # The cooperative kernel's control words first: it reads four in one 16-byte load.
        for name, n in (("coop_control", COOP_CONTROL_WORDS), ("counts", nb),
                        ("starts", nb + 1), ("cursor", nb), ("chunk_hist", nm),
                        ("ticket", 1), ("coop_counts", 2 * nb)):
            parts[name], at = buf[at:at + n], at + n
        self.counts, self.starts, self.cursor = parts["counts"], parts["starts"], parts["cursor"]
        self.chunk_hist, self.ticket = parts["chunk_hist"], parts["ticket"]
        self.coop_counts, self.coop_control = parts["coop_counts"], parts["coop_control"]
        self.buckets, self.matrix = nb, nm
        self.generation += 1


@dataclass
class Job:
    """One alignment problem on device arrays (CuPy), ready to be packed for the kernels."""
    topk_ids: Any
    numel: int
    topk: int
    num_experts: int
    block_size: int
    rows: int
    padded_len: int
    num_tiles: int
    sorted_ids: Any
    expert_ids: Any
    num_post_pad: Any
    sorted_pitch: int
    expert_pitch: int
    map_mode: int = MAP_NONE
    expert_map: Any = None
    token_slot: Any = None
    lora_ids: Any = None
    adapter_enabled: Any = None
    scatter_idx: Any = None
    fill_unprocessed: bool = False
    deterministic: bool = False
    packed: Any = None        # the packed kernel argument (uint8 array)
    params: Any = None        # kernel-parameter array for the driver: [address of packed]
    params_addr: int = 0      # its address (ndarray.ctypes costs a microsecond per call)
    pair_params: Any = None   # second job of a pair launch: both params, the pair's array

    @property
    def num_buckets(self) -> int:
        return self.rows * self.num_experts


def _ptr(x) -> int:
    return 0 if x is None else int(x.data.ptr)


# Little-endian, no padding: pointers, ints, then (magic, shift) pairs: PROBLEM_DTYPE's layout.
_PACKER = struct.Struct("<%dQ%di%s3i" % (len(_POINTERS), len(_INTS), "Ii" * len(_DIVISORS)))
assert _PACKER.size == PROBLEM_DTYPE.itemsize


@functools.lru_cache(maxsize=1024)
def division_magic(d: int):
    """(magic, shift) with n // d == (n * magic) >> shift for every 0 <= n < 2**31."""
    if d <= 0:
        d = 1
    bits = (d - 1).bit_length()
    return -(-(1 << (31 + bits)) // d), 31 + bits


# The first nine fields of Problem: the call's arrays (inputs, then outputs), rewritten by a
# prepared call (moe_lora_align/_call.py) for each new call.
POINTERS = struct.Struct("<9Q")


def _stage_output(job: Job, launch: _dispatch.Launch) -> int:
    """Problem.stage_output: the place kernel's flag, or a staged align_tiny's image ints."""
    if launch.kind == "single":
        return _dispatch.tiny_stage_entries(launch, job.numel, job.num_experts * job.rows)
    return int(launch.stage_output)


def pack(job: Job, launch: _dispatch.Launch, ws: Workspace, fill_blocks: bool = True) -> None:
    """Pack the kernels' ``Problem`` argument of one job into ``job.packed`` (a prepared
    call later rewrites only its array pointers: ``POINTERS``). ``fill_blocks``: the job
    has the launch's fill blocks (the fused tiny pair's LoRA side; its base side has none)."""
    coop = launch.kind == "cooperative"
    counts, ticket = (ws.coop_counts, ws.coop_control) if coop else (ws.counts, ws.ticket)
    raw = _PACKER.pack(
        _ptr(job.topk_ids), _ptr(job.token_slot), _ptr(job.lora_ids),
        _ptr(job.adapter_enabled), _ptr(job.expert_map), _ptr(job.sorted_ids),
        _ptr(job.expert_ids), _ptr(job.num_post_pad), _ptr(job.scatter_idx),
        _ptr(counts), _ptr(ws.starts), _ptr(ws.cursor), _ptr(ws.chunk_hist), _ptr(ticket),
        job.numel, max(job.topk, 1), job.num_experts, job.block_size, job.rows,
        0 if job.lora_ids is None else int(job.lora_ids.shape[0]), job.padded_len,
        job.num_tiles, job.sorted_pitch, job.expert_pitch, job.map_mode,
        int(job.fill_unprocessed), launch.chunk, launch.range_width, launch.ranges,
        int(launch.starts_in_smem), _stage_output(job, launch), *division_magic(max(job.topk, 1)),
        *division_magic(job.block_size), *division_magic(job.num_experts),
        *division_magic(max(job.num_tiles, 1)), ws.buckets if coop else 0,
        launch.grid if coop else 0, launch.fill_grid if fill_blocks else 0)
    job.packed = np.frombuffer(bytearray(raw), dtype=np.uint8)
    job.params = np.array([job.packed.ctypes.data], dtype=np.uint64)
    job.params_addr = job.params.ctypes.data


@functools.lru_cache(maxsize=None)
def _direct_launcher(cooperative: bool = False):
    """The driver's cuLaunchKernel (or cuLaunchCooperativeKernel) as CuPy exposes it, or None
    (then CuPy's kernel call; the cooperative kernel is not chosen)."""
    try:
        from cupy_backends.cuda.api import driver
    except ImportError:
        return None
    if not cooperative:
        return getattr(driver, "launchKernel", None)
    coop = getattr(driver, "launchCooperativeKernel", None)
    if coop is None:
        return None
    # The same argument list as launchKernel's, which ends in `extra` (always 0 here).
    return lambda f, gx, gy, gz, bx, by, bz, smem, stream, params, extra: coop(
        f, gx, gy, gz, bx, by, bz, smem, stream, params)


def _params_address(jobs) -> int:
    """Address of the driver's kernel-parameter array: one pointer per packed job."""
    if len(jobs) == 1:
        return jobs[0].params_addr
    first, second = jobs
    cached = second.pair_params  # held references, so an identity check is safe
    if cached is None or cached[0] is not first.params or cached[1] is not second.params:
        arr = np.array([first.params[0], second.params[0]], dtype=np.uint64)
        cached = second.pair_params = (first.params, second.params, arr, arr.ctypes.data)
    return cached[3]


class RecordedLaunch(NamedTuple):
    """One direct launch as ``record_launches`` saw it: enough to issue it again."""
    fn: int
    grid: int
    block: int
    smem: int
    stream_ptr: int
    params_addr: int
    held: tuple     # (job, packed, params, pair_params) of each job: what params_addr points into
    cooperative: bool = False


_recorder = threading.local()


@contextlib.contextmanager
def record_launches():
    """Collect this thread's ``launch_kernel`` calls in a list (``None`` for one that went
    through CuPy's call and so cannot be replayed); AlignPlan builds its replays from it."""
    recorded: list = []
    _recorder.launches = recorded
    try:
        yield recorded
    finally:
        _recorder.launches = None


def replay_form(launches) -> tuple:
    """Recorded launches as ``replay_launches`` issues them: (launcher, function, grid, block,
    shared bytes, parameter address) each, worked out once (a prepared call's hot path)."""
    return tuple((_direct_launcher(r.cooperative), r.fn, r.grid, r.block, r.smem,
                  r.params_addr) for r in launches)


def replay_launches(form, stream_ptr: int) -> None:
    """Issue launches (``replay_form``) again, on ``stream_ptr``, with their packed arguments
    as they are now (the caller rewrites the input pointers first)."""
    for launch, fn, grid, block, smem, params in form:
        launch(fn, grid, 1, 1, block, 1, 1, smem, stream_ptr, params, 0)


def launch_kernel(ks, key, grid: int, block: int, smem: int, stream, *jobs,
                  cooperative: bool = False):
    """Launch kernel ``key`` with the packed ``jobs`` as its arguments on ``stream``.

    Straight through cuLaunchKernel where CuPy exposes it: the argument is already packed, so
    this skips CuPy's per-call argument conversion (several microseconds of an eager call).
    The driver copies the parameters at the call, so the packed bytes may change right after.
    ``cooperative``: through cuLaunchCooperativeKernel, which guarantees that every block is
    resident at once (the dispatcher picks that kernel only where this launcher exists).
    """
    launch, fn = _direct_launcher(cooperative), ks.handle(key)
    recorded = getattr(_recorder, "launches", None)
    if launch is not None and fn:
        address = _params_address(jobs)
        launch(fn, grid, 1, 1, block, 1, 1, smem, stream.ptr, address, 0)
        if recorded is not None:
            # The arrays behind `address`, kept alive as long as the recording is.
            held = tuple((j, j.packed, j.params, j.pair_params) for j in jobs)
            recorded.append(RecordedLaunch(fn, grid, block, smem, stream.ptr, address, held,
                                           cooperative))
        return
    if cooperative:
        raise RuntimeError("the cooperative kernel needs CuPy's driver launcher "
                           "(cupy_backends.cuda.api.driver.launchCooperativeKernel)")
    if recorded is not None:
        recorded.append(None)  # CuPy's own launch cannot be replayed
    args = tuple(np.frombuffer(j.packed, dtype=PROBLEM_DTYPE)[0] for j in jobs)
    with _current(stream):  # CuPy launches on the current stream
        ks[key]((grid,), (block,), args, shared_mem=smem)


@functools.lru_cache(maxsize=4096)
def checked_launch(numel: int, num_buckets: int, rows: int, limits: _dispatch.DeviceLimits,
                   deterministic: bool, variant, out_entries: int,
                   policy: _dispatch.AlignPolicy = _dispatch.DEFAULT_POLICY,
                   lora: bool = False) -> _dispatch.Launch:
    """The dispatcher's choice for these sizes, checked against what its kernels need
    (``_dispatch.check_launch``) before anything is launched. Pure, so cached. ``lora``:
    a LoRA alignment (``choose_launch``)."""
    launch = _dispatch.choose_launch(numel, num_buckets, rows, limits,
                                     deterministic=deterministic, variant=variant,
                                     out_entries=out_entries, policy=policy, lora=lora)
    _dispatch.check_launch(launch, numel, [(num_buckets, rows)], limits)
    return launch


def plan_launch(job: Job, device_id: int, variant=None,
                policy: _dispatch.AlignPolicy = _dispatch.DEFAULT_POLICY) -> _dispatch.Launch:
    return checked_launch(job.numel, job.num_buckets, job.rows, device_limits(device_id),
                          job.deterministic, variant, out_entries(job), policy,
                          job.token_slot is not None)


def out_entries(job: Job) -> int:
    """Output entries one alignment writes: every row's sorted ids and tile ids."""
    return job.rows * (job.padded_len + job.num_tiles)


def workspace_needs(launch: _dispatch.Launch, num_buckets: int) -> Tuple[int, int]:
    if launch.kind == "cluster":
        return 1, 0  # align_cluster keeps nothing in global scratch
    # Per-chunk offsets of every bucket: deterministic and shared multi-block modes.
    matrix = (launch.grid // launch.ranges) * num_buckets if launch.mode in (0, 2) and \
        launch.kind == "multi" else 0
    if launch.kind == "cooperative" and launch.deterministic and not launch.sorted:
        # per-block counts of the counting blocks, prefixed between two barriers
        matrix = (launch.grid - launch.fill_grid) * num_buckets
    return num_buckets, matrix


def scratch_bytes(numel: int, num_experts: int, block_size: int, *, max_loras=None,
                  deterministic: bool = False, variant=None, pad_sorted_ids: bool = False,
                  limits: _dispatch.DeviceLimits | None = None, device: int = 0,
                  policy: _dispatch.AlignPolicy = _dispatch.DEFAULT_POLICY) -> int:
    """Device memory, in bytes, that one base (or, with ``max_loras``, LoRA) alignment of
    these sizes needs beyond its outputs: the workspace of the stream it runs on,
    ``4 * (5*b + 10 + max(1, m))`` for ``b`` buckets (``max_loras * num_experts``) and ``m``
    per-chunk offsets (``chunks * b`` for the shared-histogram and ordered-rank deterministic
    count + place launches and the ordered-rank deterministic cooperative launch, else 0). A workspace is kept per
    (device, stream) and grows to the largest call made on that stream; an ``AlignPlan``
    holds its own two. ``limits``: the device's (default: those of GPU ``device``)."""
    from ._sizes import MAX_BUCKETS, buffer_sizes

    rows = 1 if max_loras is None else _checks.positive_int("max_loras", max_loras, MAX_BUCKETS)
    P, M = buffer_sizes(numel, num_experts, block_size, pad_sorted_ids)
    if limits is None:
        try:
            limits = device_limits(device)
        except (ImportError, RuntimeError):  # no CuPy, or no GPU it can see
            raise RuntimeError("scratch_bytes needs the device's limits: run it where CuPy "
                               "sees the GPU, or pass limits= (for an H200: "
                               "moe_lora_align._dispatch.DeviceLimits.h200())") from None
    nb = rows * num_experts
    launch = checked_launch(numel, nb, rows, limits, deterministic, variant, rows * (P + M),
                            policy, max_loras is not None)
    b, m = workspace_needs(launch, nb)
    return 4 * workspace_entries(max(b, 1), max(m, 1))


def launch_one(job: Job, launch: _dispatch.Launch, ws: Workspace, stream, device_id: int):
    """Issue one alignment on ``stream`` (no sync, no allocation when ``ws`` is large enough)."""
    ws.ensure(*workspace_needs(launch, job.num_buckets), stream)
    ks = kernels_for(job.topk_ids.dtype, device_id,
                     device_limits(device_id).smem_optin)
    pack(job, launch, ws)
    for key, grid, block, smem, cooperative in _dispatch.launch_kernels(launch):
        launch_kernel(ks, key, grid, block, smem, stream, job, cooperative=cooperative)


def _current(stream):
    """``stream`` as the current stream; free when it already is."""
    import cupy

    if cupy.cuda.get_current_stream().ptr == stream.ptr:
        return contextlib.nullcontext()
    return stream


def launch_pair(base: Job, lora: Job, launch, ws_base: Workspace, ws_lora: Workspace, stream,
                device_id: int):
    """Both alignments in one launch: two blocks (decode sizes, ``launch`` a single-block
    ``Launch``), two clusters (a cluster ``Launch``) or a cooperative launch split between
    them (``CooperativePair``)."""
    ks = kernels_for(base.topk_ids.dtype, device_id,
                     device_limits(device_id).smem_optin)
    if isinstance(launch, _dispatch.CooperativePair):
        ws_base.ensure(*workspace_needs(launch.base, base.num_buckets), stream)
        ws_lora.ensure(*workspace_needs(launch.lora, lora.num_buckets), stream)
        pack(base, launch.base, ws_base)
        pack(lora, launch.lora, ws_lora)
    else:
        ws_base.ensure(1, 0, stream)
        ws_lora.ensure(1, 0, stream)
        pack(base, launch, ws_base, fill_blocks=False)
        pack(lora, launch, ws_lora)
    (key, grid, block, smem, cooperative), = _dispatch.launch_kernels(launch, fused=True)
    launch_kernel(ks, key, grid, block, smem, stream, base, lora, cooperative=cooperative)


def pair_ready(pair, base: Job, lora: Job, ws_base: Workspace, ws_lora: Workspace,
               device_id: int) -> bool:
    """True when the fused launch ``pair`` would allocate nothing and load no kernel."""
    if isinstance(pair, _dispatch.CooperativePair):
        needs = (workspace_needs(pair.base, base.num_buckets),
                 workspace_needs(pair.lora, lora.num_buckets))
    else:
        needs = ((1, 0), (1, 0))
    return (all(ws.buckets >= nb and ws.matrix >= nm
                for ws, (nb, nm) in zip((ws_base, ws_lora), needs))
            and kernels_loaded(base.topk_ids.dtype, device_id,
                               [k[0] for k in _dispatch.launch_kernels(pair, fused=True)]))


_workspaces: dict = {}


def stream_workspace(device_id: int, stream, role: str = "base") -> Workspace:
    """The scratch of one (device, stream, role): calls on one stream reuse it in order."""
    key = (device_id, int(stream.ptr), role)
    ws = _workspaces.get(key)
    if ws is None:
        with _state_lock:
            ws = _workspaces.setdefault(key, Workspace(device_id))
    return ws


CAPTURE_HINT = ("cannot run inside a CUDA graph capture: it would allocate memory or load "
                "kernels; build an moe_lora_align.AlignPlan outside the capture and call it "
                "inside (or pass out= buffers and make one call before capturing)")


def check_capturable(stream, needs_alloc: bool, what: str):
    if stream.is_capturing() and needs_alloc:
        raise RuntimeError(f"{what} {CAPTURE_HINT}")


def _ready(ws: Workspace, launch: _dispatch.Launch, job: Job, device_id: int) -> bool:
    """True when ``launch`` of ``job`` would allocate nothing and load no kernel."""
    nb, nm = workspace_needs(launch, job.num_buckets)
    keys = [k[0] for k in _dispatch.launch_kernels(launch)]
    return ws.buckets >= nb and ws.matrix >= nm and kernels_loaded(job.topk_ids.dtype,
                                                                   device_id, keys)


def run(job: Job, device_id: int, framework: str, *, variant=None, stream=None,
        needs_alloc=False, workspace=None, policy=_dispatch.DEFAULT_POLICY):
    """Launch one alignment on the caller's stream, with the stream's workspace (or the one
    given: an AlignPlan's); returns the workspaces used."""
    import cupy

    from ._interop import caller_stream

    with cupy.cuda.Device(device_id):
        s = caller_stream(framework, device_id, stream)
        launch = plan_launch(job, device_id, variant, policy)
        ws = workspace or stream_workspace(device_id, s)
        check_capturable(s, needs_alloc or not _ready(ws, launch, job, device_id), "this call")
        launch_one(job, launch, ws, s, device_id)
    return [ws]


def choose_streams(base: Job, lora: Job, device_id: int, streams=None, variant=None,
                   policy: _dispatch.AlignPolicy = _dispatch.DEFAULT_POLICY):
    """Pick how base + LoRA run: ``fused`` (one launch: two clusters in the policy's cluster
    range, a base cluster and a cluster a LoRA row where the policy takes that, two blocks
    at decode sizes, else a cooperative launch split between them),
    ``one`` (both on the caller's stream) or ``two`` (forked onto two side streams);
    ``streams`` was checked where the call entered. Returns (mode, fused launch or None)."""
    limits = device_limits(device_id)
    pair = None
    if variant == "cluster" or (variant is None and _dispatch.pair_in_cluster_range(
            base.numel, lora.num_buckets, lora.rows, out_entries(lora), base.deterministic,
            limits, policy)):
        pair = _dispatch.choose_cluster_pair(base.numel, base.num_buckets, lora.num_buckets,
                                             lora.rows, limits,
                                             deterministic=base.deterministic, policy=policy)
    if pair is None and variant in (None, "cluster"):
        pair = _dispatch.choose_cluster_rows_pair(base.numel, base.num_buckets,
                                                  lora.num_buckets, lora.rows, limits,
                                                  deterministic=base.deterministic,
                                                  policy=policy)
    if pair is None and variant in (None, "shared"):
        pair = _dispatch.choose_pair(base.numel, base.num_buckets, lora.num_buckets, lora.rows,
                                     limits, deterministic=base.deterministic,
                                     out_entries=out_entries(lora),
                                     prefer_cooperative=variant is None, policy=policy)
    if pair is None and variant in (None, "cooperative"):
        pair = _dispatch.choose_cooperative_pair(
            base.numel, base.num_buckets, lora.num_buckets, lora.rows, limits,
            base_entries=out_entries(base), lora_entries=out_entries(lora),
            deterministic=base.deterministic, policy=policy)
    if streams == "fused" and pair is None:
        raise ValueError("streams='fused' needs both alignments in one launch: one block "
                         f"each (at most {_dispatch.SINGLE_BLOCK_MAX_ROUTES} routes and a "
                         "shared histogram of every bucket) or one cooperative launch (both "
                         "sides' routes and buckets within its resident blocks) or two "
                         "clusters (sm_90 and newer); use "
                         "streams='two' or None")
    if streams is None:
        streams = "fused" if pair is not None else "two"
    if streams == "fused":
        _dispatch.check_launch(pair, base.numel, [(base.num_buckets, 1),
                                                  (lora.num_buckets, lora.rows)], limits)
    else:
        pair = None
    return streams, pair


def issue_both(mode, pair, base, base_launch, base_ws, lora, lora_launch, lora_ws, caller,
               device_id, sides=None):
    """Enqueue base and LoRA alignment after the work on ``caller`` as ``mode`` says: one
    fused launch, both on ``caller``, or forked onto the two ``sides`` streams and joined."""
    if mode == "fused":
        launch_pair(base, lora, pair, base_ws, lora_ws, caller, device_id)
    elif mode == "one":
        launch_one(lora, lora_launch, lora_ws, caller, device_id)
        launch_one(base, base_launch, base_ws, caller, device_id)
    else:
        sides.run(caller, lambda st: launch_one(lora, lora_launch, lora_ws, st, device_id),
                  lambda st: launch_one(base, base_launch, base_ws, st, device_id))


def run_pair(base: Job, lora: Job, device_id: int, framework: str, *, streams=None,
             variant=None, stream=None, needs_alloc=False, workspaces=None, sides=None,
             policy=_dispatch.DEFAULT_POLICY):
    """Launch base and LoRA alignment together, ordered on the caller's stream, with the
    streams' workspaces (or the two given: an AlignPlan's); returns ``(mode, workspaces
    used, side streams or None)``."""
    import cupy

    from ._interop import caller_stream
    from ._streams import side_streams

    with cupy.cuda.Device(device_id):
        s = caller_stream(framework, device_id, stream)
        mode, pair = choose_streams(base, lora, device_id, streams, variant, policy)
        sides = (sides or side_streams(device_id)) if mode == "two" else None
        first, second = (sides.first, sides.second) if sides else (s, s)
        ws_b, ws_l = workspaces or (stream_workspace(device_id, second, "base"),
                                    stream_workspace(device_id, first, "lora"))
        if mode == "fused":
            lb = ll = pair
            cold = not pair_ready(pair, base, lora, ws_b, ws_l, device_id)
        else:
            lb = plan_launch(base, device_id, variant, policy)
            ll = plan_launch(lora, device_id, variant, policy)
            cold = not (_ready(ws_b, lb, base, device_id) and _ready(ws_l, ll, lora, device_id))
        check_capturable(s, needs_alloc or cold, "this call")
        issue_both(mode, pair, base, lb, ws_b, lora, ll, ws_l, s, device_id, sides)
        return mode, [ws_b, ws_l], sides
