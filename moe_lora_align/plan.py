"""AlignPlan: alignment for fixed maximum sizes, everything prepared once, safe to capture.

Building a plan compiles and loads the kernels, sets their shared-memory attributes, creates the
side streams and events, and allocates outputs and scratch for the largest call. A call with
inputs up to those sizes then only packs arguments and enqueues kernels: no allocation, no host
synchronisation, no device-attribute query. That is what a CUDA graph capture needs.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union, overload

import numpy as np

from . import _call, _checks, _interop
from ._call import STREAM_MODES
from ._dispatch import DEFAULT_POLICY, VARIANTS, AlignPolicy
from ._kernels import kernels_for
from ._launch import (MAP_BEFORE, MAP_NONE, Workspace, checked_launch, device_limits,
                      device_memory, workspace_needs)
from ._sizes import MAX_BUCKETS, buffer_sizes
from ._streams import side_streams
from .api import (Alignment, Array, LoraAlignment, Streams, Variant, _base_result,
                  _pair_result)


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
        policy: the dispatcher's tuning (``AlignPolicy``); default: the H200-measured one.

    Calling the plan returns views of its own buffers: the next call overwrites them. Rows of
    LoRA slots that a call does not process read as the empty alignment.

    A call goes the public functions' way (``_call``) with the plan's buffers as ``out=`` and
    its own workspaces. A call with CuPy or PyTorch arrays whose shapes, strides, dtypes and
    device match an earlier call's (same ``streams``, same stream) replays that call's
    launches: its checks passed for exactly these properties, so only the input pointers are
    rewritten before the same kernels go to the driver again. Its results are views of the
    plan's buffers, so one plan serves one host thread at a time.
    """

    def __init__(self, max_tokens: int, topk: int, num_experts: int, block_size: int, *,
                 max_loras: Optional[int] = None, dtype: Any = np.int32,
                 device: Optional[int] = None, pad_sorted_ids: bool = False,
                 ignore_invalid_experts: bool = False, deterministic: bool = False,
                 variant: Variant = None, streams: Streams = None,
                 policy: Optional[AlignPolicy] = None) -> None:
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
        if policy is not None and not isinstance(policy, AlignPolicy):
            raise TypeError(f"policy must be an AlignPolicy or None, got {type(policy).__name__}")
        self.policy = policy or DEFAULT_POLICY
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
            # Every kernel, compiled side by side: a call inside a capture loads none.
            kernels_for(self.dtype, self.device_id, self.limits.smem_optin).load_all()
            self._base_out = (cupy.empty(self.max_padded, np.int32),
                              cupy.empty(self.max_tiles, np.int32), cupy.empty(1, np.int32))
            self._base_ws = Workspace(self.device_id)
            self._view_cache: dict = {}
            self._prepared: dict = {}
            if self.max_loras is not None:
                self._lora_out = (cupy.empty(rows * self.max_padded, np.int32),
                                  cupy.empty(rows * self.max_tiles, np.int32),
                                  cupy.empty(rows, np.int32))
                self._lora_ws = Workspace(self.device_id)
                self._sides = side_streams(self.device_id)
            # Scratch for the largest call; every smaller call needs no more (see dispatcher).
            for numel in sorted({0, 1, max_numel}):
                self._grow_workspaces(numel)

    # ---- sizes -----------------------------------------------------------------------------
    def _grow_workspaces(self, numel):
        """Size the workspaces for calls of ``numel`` routes (the dispatcher's choices)."""
        P, M = buffer_sizes(numel, self.num_experts, self.block_size, self.pad_sorted_ids)
        E = self.num_experts
        base = checked_launch(numel, E, 1, self.limits, self.deterministic, self.variant,
                              P + M, self.policy)
        self._base_ws.ensure(*workspace_needs(base, E))
        if self.max_loras is not None:
            nb = self.max_loras * E
            lora = checked_launch(numel, nb, self.max_loras, self.limits, self.deterministic,
                                  self.variant, self.max_loras * (P + M), self.policy,
                                  lora=True)
            self._lora_ws.ensure(*workspace_needs(lora, nb))

    # ---- calls: the public functions' path, with the plan's buffers and workspaces -------
    # For type checkers only: a call with a mapping (a plan with max_loras) gets the pair.
    @overload
    def __call__(self, topk_ids: Array, token_lora_mapping: None = None, *,
                 lora_ids: Optional[Array] = ..., adapter_enabled: Optional[Array] = ...,
                 expert_map: Optional[Array] = ..., stream: Any = ...,
                 streams: Streams = ...) -> Alignment: ...

    @overload
    def __call__(self, topk_ids: Array, token_lora_mapping: Array, *,
                 lora_ids: Optional[Array] = ..., adapter_enabled: Optional[Array] = ...,
                 expert_map: Optional[Array] = ..., stream: Any = ...,
                 streams: Streams = ...) -> Tuple[Alignment, LoraAlignment]: ...

    def __call__(self, topk_ids: Array, token_lora_mapping: Optional[Array] = None, *,
                 lora_ids: Optional[Array] = None, adapter_enabled: Optional[Array] = None,
                 expert_map: Optional[Array] = None, stream: Any = None,
                 streams: Streams = None
                 ) -> Union[Alignment, Tuple[Alignment, LoraAlignment]]:
        """Align one batch; returns ``Alignment`` or, with ``max_loras``, ``(Alignment,
        LoraAlignment)``, as views of the plan's buffers, ordered on ``stream`` (default:
        the current stream of the input's framework)."""
        if self.max_loras is None:
            token_lora_mapping = lora_ids = adapter_enabled = None
        inputs = (topk_ids, token_lora_mapping, lora_ids, adapter_enabled, expert_map)
        streams = self.streams if streams is None else streams
        found = _call.properties(inputs)
        if found is not None:
            props, ptrs, kind = found
            device = props[0][4] if props[0] is not None else None
            if device == self.device_id and _call.current_device() == device:
                sp = _call.stream_pointer(kind, device, stream)
                prep = _call.lookup(self._prepared, (streams, props, sp))
                if prep is not None:
                    prep.run(ptrs, None, sp)
                    return prep.answer
        return self._full_call(inputs, streams, stream)

    def _full_call(self, inputs, streams, stream):
        topk_ids, token_lora_mapping, lora_ids, adapter_enabled, expert_map = inputs
        streams = _checks.option("streams", streams, STREAM_MODES)
        if topk_ids is None:
            raise TypeError("topk_ids is required: a [tokens, topk] integer array")
        where, framework = _interop.classify({"topk_ids": topk_ids})
        if where != _interop.DEVICE:
            raise ValueError("AlignPlan runs on the GPU: pass device arrays (CuPy, PyTorch "
                             "CUDA or JAX GPU); use the public functions for host arrays")
        ids = _interop.to_native(topk_ids, where)
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
        if int(ids.data.device_id) != self.device_id:
            raise ValueError(f"inputs are on GPU {int(ids.data.device_id)} but the plan was "
                             f"built for GPU {self.device_id}")
        if self.max_loras is not None and token_lora_mapping is None:
            raise TypeError("token_lora_mapping is required: the plan has max_loras set")
        base_out, lora_out, answered = self._views(T * K, framework)
        calls = [_call.prepare(topk_ids, self.block_size, self.num_experts, rows=1,
                               expert_map=expert_map,
                               map_mode=_call.map_mode(expert_map, self.ignore_invalid_experts),
                               pad_sorted_ids=self.pad_sorted_ids,
                               deterministic=self.deterministic, out=base_out,
                               fill_unprocessed=True, plan_outputs=True, stream=stream)]
        if self.max_loras is not None:
            calls.append(_call.prepare(
                topk_ids, self.block_size, self.num_experts, rows=self.max_loras,
                token_lora_mapping=token_lora_mapping, lora_ids=lora_ids,
                adapter_enabled=adapter_enabled, expert_map=expert_map,
                map_mode=MAP_NONE if expert_map is None else MAP_BEFORE,
                pad_sorted_ids=self.pad_sorted_ids, deterministic=self.deterministic,
                out=lora_out, lora=True, fill_unprocessed=True, plan_outputs=True,
                stream=stream))
        with _on_device(self.device_id):
            if len(calls) == 1:
                launched = _call.launch_calls(calls, None, self.variant, stream,
                                              workspaces=self._base_ws, policy=self.policy)
            else:
                launched = _call.launch_calls(calls, streams, self.variant, stream,
                                              workspaces=(self._base_ws, self._lora_ws),
                                              sides=self._sides, policy=self.policy)
        _interop.torch_written(answered)
        _call._note_kinds(*inputs)
        found = _call.properties(inputs)
        if found is not None:
            props, ptrs, kind = found
            sp = _call.stream_pointer(kind, self.device_id, stream)
            if sp is not None:
                outs = list(base_out) + list(lora_out or ())
                prep = _call.build_prepared(calls, launched, ptrs, kind, sp,
                                            fixed=([int(x.data.ptr) for x in outs], answered))
                if prep is not None:
                    prep.answer = self._result(answered)
                    _call.keep(self._prepared, (streams, props, sp), prep)
        return self._result(answered)

    def _views(self, numel, framework):
        """The plan's outputs for calls of ``numel`` routes: views of its buffers (CuPy, for
        the kernels) and the same views in ``framework`` (the answer), made once."""
        key = (numel, framework)
        views = self._view_cache.get(key)
        if views is None:
            P, M = buffer_sizes(numel, self.num_experts, self.block_size, self.pad_sorted_ids)
            s, e, n = self._base_out
            base = (s[:P], e[:M], n)
            lora = None
            if self.max_loras is not None:
                rows = self.max_loras
                s, e, n = self._lora_out
                lora = (s[:rows * P].reshape(rows, P), e[:rows * M].reshape(rows, M), n)
            answered = tuple(x if framework == "cupy" else _interop.from_native(x, framework)
                             for x in base + (lora or ()))
            views = self._view_cache[key] = (base, lora, answered)
        return views

    def _result(self, outputs):
        return _base_result(outputs) if self.max_loras is None else _pair_result(outputs)
