"""AlignPlan: alignment for fixed maximum sizes, everything prepared once, safe to capture.

Building a plan compiles and loads the kernels, sets their shared-memory attributes, creates the
side streams and events, and allocates outputs and scratch for the largest call. A call with
inputs up to those sizes then only packs arguments and enqueues kernels: no allocation, no host
synchronisation, no device-attribute query. That is what a CUDA graph capture needs.
"""

from __future__ import annotations

import numpy as np

from . import _checks, _interop
from ._kernels import kernels_for
from ._launch import (MAP_AFTER, MAP_BEFORE, MAP_NONE, Job, Workspace, checked_launch,
                      choose_streams, device_limits, device_memory, issue_both, launch_one, record_launches,
                      replay_launches, set_input_pointers, workspace_needs)
from ._dispatch import VARIANTS
from ._sizes import MAX_BUCKETS, buffer_sizes
from ._streams import side_streams
from .api import STREAM_MODES, Alignment, LoraAlignment


def _gpu_available() -> bool:
    from . import gpu_available

    return gpu_available()


def _on_device(device_id):
    """A context that makes ``device_id`` current, free when it already is."""
    import contextlib

    import cupy

    if cupy.cuda.runtime.getDevice() == device_id:
        return contextlib.nullcontext()
    return cupy.cuda.Device(device_id)


class AlignPlan:
    """Preallocated base (and optionally LoRA) alignment on one GPU.

    Args:
        max_tokens: the most tokens a call may pass (``T``).
        topk: routes per token (``K``); every call must use this ``K``.
        num_experts, block_size, pad_sorted_ids: as for ``moe_align_block_size``.
        max_loras: adapter slots; ``None`` plans the base alignment only.
        dtype: the ``topk_ids`` dtype every call uses (default int32).
        device: CUDA device id (default: the current device).
        ignore_invalid_experts: base alignment's expert-map mode (LoRA always maps before).
        deterministic, variant: as for the public functions.
        streams: how base and LoRA run (``"fused"``, ``"one"``, ``"two"`` or ``None`` to
            let the dispatcher pick per size); see ``align_moe_and_lora``.

    Calling the plan returns views of its own buffers: the next call overwrites them. Rows of
    LoRA slots that a call does not process read as the empty alignment.

    A call with CuPy arrays whose shapes, strides, dtypes and devices match an earlier call's
    (and the same ``streams``) replays that call's launches: its checks passed for exactly
    these properties, so only the input pointers are rewritten before the same kernels go to
    the driver again. A plan is not thread-safe.
    """

    def __init__(self, max_tokens, topk, num_experts, block_size, *, max_loras=None,
                 dtype=np.int32, device=None, pad_sorted_ids=False,
                 ignore_invalid_experts=False, deterministic=False, variant=None,
                 streams=None):
        # Every argument is checked before any device is touched.
        self.max_tokens = _checks.positive_int("max_tokens", max_tokens)
        self.topk = _checks.positive_int("topk", topk)
        self.num_experts = _checks.positive_int("num_experts", num_experts)
        self.block_size = _checks.positive_int("block_size", block_size)
        self.max_loras = None if max_loras is None else _checks.positive_int(
            "max_loras", max_loras, MAX_BUCKETS)
        _checks.check_buckets(self.num_experts, self.max_loras or 1)
        try:
            self.dtype = np.dtype(dtype)
        except TypeError:
            raise TypeError(f"dtype must be an integer dtype of topk_ids, got {dtype!r}") from None
        if self.dtype not in _checks.ID_DTYPES:
            raise TypeError(f"dtype must be an integer dtype of topk_ids, got {self.dtype}")
        self.pad_sorted_ids = _checks.flag("pad_sorted_ids", pad_sorted_ids)
        self.ignore_invalid_experts = _checks.flag("ignore_invalid_experts",
                                                   ignore_invalid_experts)
        self.deterministic = _checks.flag("deterministic", deterministic)
        self.variant = _checks.option("variant", variant, VARIANTS)
        self.streams = _checks.option("streams", streams, STREAM_MODES)
        if device is not None:
            device = _checks.integer("device", device, 0, 2**31 - 1)
        rows = self.max_loras or 1
        max_numel = self.max_tokens * self.topk
        _checks.check_sizes(max_numel, rows, 0, 0, 0)
        self.max_padded, self.max_tiles = buffer_sizes(max_numel, num_experts, block_size,
                                                       pad_sorted_ids)
        _checks.check_sizes(max_numel, rows, self.max_padded, self.max_tiles, block_size)
        if not _gpu_available():
            raise RuntimeError("AlignPlan needs CuPy and a CUDA GPU, and none is available "
                               "here; the public functions (moe_align_block_size, ...) run "
                               "NumPy arrays on the host backend")
        import cupy

        if device is not None and device >= cupy.cuda.runtime.getDeviceCount():
            raise ValueError(f"device must be a CUDA device id below "
                             f"{cupy.cuda.runtime.getDeviceCount()}, got {device}")
        self._cupy_array = cupy.ndarray
        self._runtime = cupy.cuda.runtime
        self.device_id = cupy.cuda.Device(device).id if device is not None else \
            cupy.cuda.Device().id
        nbytes = 4 * (rows + 1) * (self.max_padded + self.max_tiles + 1)
        _checks.check_memory(nbytes, device_memory(self.device_id), "GPU")

        with cupy.cuda.Device(self.device_id):
            self.limits = device_limits(self.device_id)
            kernels_for(self.dtype, self.device_id, self.limits.smem_optin)
            self._base_out = (cupy.empty(self.max_padded, np.int32),
                              cupy.empty(self.max_tiles, np.int32), cupy.empty(1, np.int32))
            self._base_ws = Workspace(self.device_id)
            self._launches = {}
            self._jobs_cache = {}
            self._stream_choice = {}
            self._replays = {}
            if self.max_loras is not None:
                self._lora_out = (cupy.empty(rows * self.max_padded, np.int32),
                                  cupy.empty(rows * self.max_tiles, np.int32),
                                  cupy.empty(rows, np.int32))
                self._lora_ws = Workspace(self.device_id)
                self._sides = side_streams(self.device_id)
            # Scratch for the largest call; every smaller call needs no more (see dispatcher).
            for numel in sorted({0, 1, max_numel}):
                self._geometry(numel)

    # ---- sizes -----------------------------------------------------------------------------
    def _geometry(self, numel):
        """Launch decisions of one size, cached; grows the workspaces when first seen."""
        g = self._launches.get(numel)
        if g is not None:
            return g
        grown_from = self._generations()
        P, M = buffer_sizes(numel, self.num_experts, self.block_size, self.pad_sorted_ids)
        E = self.num_experts
        base = checked_launch(numel, E, 1, self.limits, self.deterministic, self.variant,
                              P + M)
        self._base_ws.ensure(*workspace_needs(base, E))
        lora = None
        if self.max_loras is not None:
            nb = self.max_loras * E
            lora = checked_launch(numel, nb, self.max_loras, self.limits, self.deterministic,
                                  self.variant, self.max_loras * (P + M))
            self._lora_ws.ensure(*workspace_needs(lora, nb))
        g = self._launches[numel] = (P, M, base, lora)
        if self._generations() != grown_from:
            self._replays.clear()  # a workspace grew: recorded arguments point at the old one
        return g

    def _generations(self):
        return (self._base_ws.generation,
                self._lora_ws.generation if self.max_loras is not None else 0)

    # ---- calls -----------------------------------------------------------------------------
    def _inputs(self, topk_ids, token_lora_mapping, lora_ids, adapter_enabled, expert_map):
        named = {"topk_ids": topk_ids, "token_lora_mapping": token_lora_mapping,
                 "lora_ids": lora_ids, "adapter_enabled": adapter_enabled,
                 "expert_map": expert_map}
        if all(x is None or type(x) is self._cupy_array for x in named.values()):
            framework, native = "cupy", named  # the common case, without the interop walk
        else:
            where, framework = _interop.classify(named)
            if where != _interop.DEVICE:
                raise ValueError("AlignPlan runs on the GPU: pass device arrays (CuPy, "
                                 "PyTorch CUDA or JAX GPU); use the public functions for "
                                 "host arrays")
            native = {k: _interop.to_native(v, where) for k, v in named.items()}
        dev = _checks.check_same_device(native)
        if dev != self.device_id:
            raise ValueError(f"inputs are on GPU {dev} but the plan was built for GPU "
                             f"{self.device_id}")
        ids = native["topk_ids"]
        _checks.check_topk_ids(ids)
        T, K = int(ids.shape[0]), int(ids.shape[1])
        if np.dtype(ids.dtype) != self.dtype:
            raise TypeError(f"topk_ids is {np.dtype(ids.dtype)} but the plan was built for "
                            f"{self.dtype}")
        if K != self.topk:
            raise ValueError(f"topk_ids has {K} routes per token but the plan was built for "
                             f"topk={self.topk}")
        if T > self.max_tokens:
            raise ValueError(f"topk_ids has {T} tokens, more than the plan's max_tokens="
                             f"{self.max_tokens}: build a larger AlignPlan")
        if not ids.flags.c_contiguous:
            raise ValueError("topk_ids must be C-contiguous")
        if native["expert_map"] is not None:
            _checks.check_int32_vector("expert_map", native["expert_map"], self.num_experts,
                                       exact=True)
        if self.max_loras is not None:
            if native["token_lora_mapping"] is None:
                raise ValueError("token_lora_mapping is required: the plan has max_loras set")
            _checks.check_int32_vector("token_lora_mapping", native["token_lora_mapping"], T,
                                       exact=True)
            _checks.check_int32_vector("lora_ids", native["lora_ids"], self.max_loras + 1)
            _checks.check_int32_vector("adapter_enabled", native["adapter_enabled"],
                                       self.max_loras + 1)
        return framework, native, T * K

    def _jobs(self, native, numel):
        """The two jobs of one size, built once and cached (outputs are fixed views); each
        call only points them at its inputs. A plan is therefore not thread-safe."""
        cached = self._jobs_cache.get(numel)
        if cached is None:
            cached = self._jobs_cache[numel] = self._build_jobs(numel)
        base, base_launch, lora, lora_launch = cached
        ids = native["topk_ids"].reshape(-1)
        emap = native["expert_map"]
        base.topk_ids, base.expert_map = ids, emap
        base.map_mode = MAP_NONE if emap is None else (
            MAP_BEFORE if self.ignore_invalid_experts else MAP_AFTER)
        if lora is not None:
            lora.topk_ids, lora.expert_map = ids, emap
            lora.map_mode = MAP_NONE if emap is None else MAP_BEFORE  # LoRA always maps first
            lora.token_slot = native["token_lora_mapping"]
            lora.lora_ids, lora.adapter_enabled = native["lora_ids"], native["adapter_enabled"]
        return base, base_launch, lora, lora_launch

    def _build_jobs(self, numel):
        P, M, base_launch, lora_launch = self._geometry(numel)
        s, e, n = self._base_out
        common = dict(topk_ids=None, numel=numel, topk=self.topk, num_experts=self.num_experts,
                      block_size=self.block_size, padded_len=P, num_tiles=M,
                      sorted_pitch=P, expert_pitch=M, fill_unprocessed=True,
                      deterministic=self.deterministic)
        base = Job(rows=1, sorted_ids=s[:P], expert_ids=e[:M], num_post_pad=n, **common)
        base.result = Alignment(base.sorted_ids, base.expert_ids, base.num_post_pad)
        lora = None
        if self.max_loras is not None:
            rows = self.max_loras
            s, e, n = self._lora_out
            lora = Job(rows=rows, sorted_ids=s[:rows * P].reshape(rows, P),
                       expert_ids=e[:rows * M].reshape(rows, M), num_post_pad=n, **common)
            lora.result = LoraAlignment(lora.sorted_ids, lora.expert_ids, lora.num_post_pad)
        return base, base_launch, lora, lora_launch

    def __call__(self, topk_ids, token_lora_mapping=None, *, lora_ids=None,
                 adapter_enabled=None, expert_map=None, stream=None, streams=None):
        """Align one batch; returns ``Alignment`` or, with ``max_loras``, ``(Alignment,
        LoraAlignment)``, as views of the plan's buffers, ordered on ``stream`` (default:
        the current stream of the input's framework)."""
        inputs = (topk_ids, token_lora_mapping, lora_ids, adapter_enabled, expert_map)
        key = self._replay_key(inputs, streams)
        replay = self._replays.get(key) if key is not None else None
        if replay is not None and self._runtime.getDevice() == self.device_id:
            return self._replay(replay, inputs, stream)
        framework, native, numel = self._inputs(*inputs)
        base, base_launch, lora, lora_launch = self._jobs(native, numel)
        with _on_device(self.device_id):
            s = _interop.caller_stream(framework, self.device_id, stream)
            with record_launches() as recorded:
                if lora is None:
                    launch_one(base, base_launch, self._base_ws, s, self.device_id)
                else:
                    self._run_both(base, base_launch, lora, lora_launch, s,
                                   streams if streams is not None else self.streams)
        out = base.result
        if framework != "cupy":
            out = Alignment(*(_interop.from_native(x, framework) for x in out))
        result = out
        if lora is not None:
            lora_out = lora.result
            if framework != "cupy":
                lora_out = LoraAlignment(*(_interop.from_native(x, framework)
                                           for x in lora_out))
            result = (out, lora_out)
        if key is not None:
            self._keep_replay(key, recorded, s, lora, result)
        return result

    # ---- replays of earlier calls ----------------------------------------------------------
    def _replay_key(self, inputs, streams):
        """What a call's checks and launches depend on, or None when an input is not a CuPy
        array (then the call takes the full path)."""
        key = [streams]
        for x in inputs:
            if x is None:
                key.append(None)
            elif type(x) is self._cupy_array:
                key.append((x.shape, x.strides, x.dtype, x.data.device_id))
            else:
                return None
        return tuple(key)

    def _keep_replay(self, key, recorded, stream, lora, result):
        """Keep a call's launches for replay when every one went straight to the driver on
        the caller's stream (not forked onto the side streams, not CuPy's own call)."""
        if not recorded or any(r is None or r.stream_ptr != stream.ptr for r in recorded):
            return
        packed = {}
        for r in recorded:
            for job, job_packed, _, _ in r.held:
                packed[id(job_packed)] = (job_packed, job is lora)
        if len(self._replays) >= 4096:
            self._replays.clear()
        self._replays[key] = (tuple(recorded), tuple(packed.values()), result)

    def _replay(self, replay, inputs, stream):
        launches, packed, result = replay
        ids, mapping, lora_ids, enabled, emap = (0 if x is None else x.data.ptr for x in inputs)
        for job_packed, is_lora in packed:
            if is_lora:
                set_input_pointers(job_packed, ids, mapping, lora_ids, enabled, emap)
            else:
                set_input_pointers(job_packed, ids, 0, 0, 0, emap)
        replay_launches(launches, _interop.caller_stream("cupy", self.device_id, stream).ptr)
        return result

    def _run_both(self, base, base_launch, lora, lora_launch, caller, streams):
        key = (base.numel, streams)
        choice = self._stream_choice.get(key)
        if choice is None:
            choice = self._stream_choice[key] = choose_streams(base, lora, self.device_id,
                                                               streams, self.variant)
        mode, pair = choice
        issue_both(mode, pair, base, base_launch, self._base_ws, lora, lora_launch,
                   self._lora_ws, caller, self.device_id, self._sides)
        return mode
