"""Kernel sources and the per-device cache of compiled kernels and their handles.

The CUDA sources live in ``kernels/`` at the top of the repository; a wheel carries them as
``moe_lora_align/kernels``. The header is inlined before compiling so CuPy's on-disk cache key
covers every line that is compiled.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

import numpy as np

from ._dispatch import COOP_PAIR_MODES, SMEM_SLACK

MAIN_SOURCE = "align_kernels.cu"

# C++ spelling of every accepted topk_ids dtype.
CTYPES = {
    np.dtype(np.int8): "signed char",
    np.dtype(np.int16): "short",
    np.dtype(np.int32): "int",
    np.dtype(np.int64): "long long",
    np.dtype(np.uint8): "unsigned char",
    np.dtype(np.uint16): "unsigned short",
    np.dtype(np.uint32): "unsigned int",
    np.dtype(np.uint64): "unsigned long long",
}


def kernel_dir() -> Path:
    """Where the ``.cu``/``.cuh`` sources are: inside the wheel, else the source checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernels", here.parent / "kernels"):
        if (candidate / MAIN_SOURCE).is_file():
            return candidate
    raise FileNotFoundError(
        f"CUDA sources not found next to {here} (looked for kernels/{MAIN_SOURCE}); "
        "reinstall moe_lora_align"
    )


COMPILE_OPTIONS = ("-std=c++17",)


@dataclass(frozen=True)
class KernelBuild:
    """What the kernels are compiled from: the sources (None: the package's) and the NVRTC
    options. Experiments (other sources, ``-DMLA_PROBE``) make their own and hand it to
    ``use_build``; nothing else changes this module's state."""
    source_dir: Optional[Path] = None
    options: Tuple[str, ...] = COMPILE_OPTIONS


_build = KernelBuild()


def current_build() -> KernelBuild:
    return _build


def use_build(build: KernelBuild) -> None:
    """Compile and load the kernels from ``build`` from now on. The loaded ones are dropped,
    and prepared calls recorded with another build take the full path again
    (``_call.Prepared.current``): they would replay that build's kernels."""
    global _build
    with _load_lock:
        _build = build
        _loaded.clear()
        source.cache_clear()


def loaded_sets():
    """The kernel sets loaded so far (scripts read their modules and attributes)."""
    return list(_loaded.values())


@functools.lru_cache(maxsize=None)
def source() -> str:
    """The kernels' source (the current build's) with local ``#include "..."`` lines
    inlined (once each)."""
    return inline_source(_build.source_dir or kernel_dir())


def inline_source(root: Path) -> str:
    """The source in ``root`` with local ``#include "..."`` lines inlined (once each)."""
    seen = set()

    def expand(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        text = (root / name).read_text()
        return re.sub(r'^#include "([^"]+)"\s*$', lambda m: expand(m.group(1)), text, flags=re.M)

    return expand(MAIN_SOURCE)


def kernel_names(dtype) -> dict:
    """Name expression of every kernel instantiation for one topk_ids dtype."""
    t = CTYPES[np.dtype(dtype)]
    names: dict = {}
    for det in (False, True):
        d = "true" if det else "false"
        names[("single", det)] = f"align_single<{t}, {d}>"
        names[("pair", det)] = f"align_pair<{t}, {d}>"
        names[("tiny", det)] = f"align_tiny<{t}, {d}>"
        names[("tiny_pair", det)] = f"align_tiny_pair<{t}, {d}>"
        names[("tiny_filled", det)] = f"align_tiny_filled<{t}, {d}>"
        names[("tiny_pair_filled", det)] = f"align_tiny_pair_filled<{t}, {d}>"
        names[("tiny_staged", det)] = f"align_tiny_staged<{t}, {d}>"
        names[("tiny_rows", det)] = f"align_tiny_rows<{t}, {d}>"
        names[("tiny_rows_pair", det)] = f"align_tiny_rows_pair<{t}, {d}>"
        names[("cluster", det)] = f"align_cluster<{t}, {d}>"
        names[("cluster_pair", det)] = f"align_cluster_pair<{t}, {d}>"
        names[("cluster_rows", det)] = f"align_cluster_rows<{t}, {d}>"
        names[("cluster_rows_pair", det)] = f"align_cluster_rows_pair<{t}, {d}>"
    for mode in (0, 1, 2):  # MODE_*
        names[("count", mode)] = f"align_count<{t}, {mode}>"
        names[("place", mode)] = f"align_place<{t}, {mode}>"
    for coop in (0, 1, 2, 3):  # COOP_FREE, COOP_ORDERED, COOP_SORTED, COOP_SORTED_RUNS
        names[("cooperative", coop)] = f"align_cooperative<{t}, {coop}>"
    for modes in COOP_PAIR_MODES:  # (base, LoRA) DET arguments
        names[("cooperative_pair", modes)] = f"align_cooperative_pair<{t}, {modes[0]}, {modes[1]}>"
    names[("order", False)] = f"align_order<{t}>"
    names[("tiny_chunked", True)] = f"align_tiny_chunked<{t}>"
    return names


def defined_kernel_names(dtype) -> dict:
    """``kernel_names(dtype)`` less the kernels the current build's sources do not define: an
    experiment's earlier sources (``KernelBuild.source_dir``) may predate some, and a plan
    loads every kernel there is."""
    text = source()
    return {key: name for key, name in kernel_names(dtype).items()
            if re.search(r"\b%s\s*\(" % name.split("<")[0], text)}


class KernelSet:
    """The kernels of one dtype on one device. Each compiles as its own NVRTC program (or comes
    from CuPy's disk cache) and loads on first use, so a first call waits only for the
    kernels its launch runs. A kernel compiled alone has the same machine code as in one
    module of all of them (tests/test_compile.py checks)."""

    def __init__(self, dtype, device_id: int, smem_optin: int):
        self.names = defined_kernel_names(dtype)
        self.device_id = device_id
        self.smem_optin = smem_optin
        self.kernels: dict = {}  # key -> loaded RawKernel
        self.handles: dict = {}  # key -> CUfunction, for the direct launch (launch_kernel)
        self.modules: dict = {}  # key -> RawModule (scripts/stage_probe.py: probe buffers)
        self._locks = {key: threading.Lock() for key in self.names}

    def __getitem__(self, key):
        k = self.kernels.get(key)
        return k if k is not None else self._load(key)

    def handle(self, key) -> int:
        """The kernel's CUfunction (loading it first); 0 where CuPy exposes none."""
        h = self.handles.get(key)
        if h is None:
            self._load(key)
            h = self.handles[key]
        return h

    def loaded(self, keys) -> bool:
        return all(key in self.kernels for key in keys)

    def load_all(self, keys=None) -> None:
        """Load ``keys`` (default: every kernel), compiling the missing ones side by side:
        NVRTC runs without the GIL."""
        missing = [key for key in (self.names if keys is None else keys)
                   if key not in self.kernels]
        if len(missing) <= 1:
            for key in missing:
                self._load(key)
            return
        workers = min(len(missing), os.cpu_count() or 1)
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            list(pool.map(self._load, missing))  # re-raises a compile error here

    def _load(self, key):
        with self._locks[key]:  # one compile per kernel however many threads ask at once
            k = self.kernels.get(key)
            if k is not None:
                return k
            if _first_load_done.is_set():
                return self._compile_and_load(key)
            with _first_load_lock:
                k = self._compile_and_load(key)
                _first_load_done.set()
                return k

    def _compile_and_load(self, key):
        import cupy

        name = self.names[key]
        with cupy.cuda.Device(self.device_id):
            module = cupy.RawModule(code=source(), options=_build.options,
                                    name_expressions=[name])
            k = module.get_function(name)
            # The dispatcher gives a kernel at most smem_optin - SMEM_SLACK dynamic bytes;
            # the opt-in limit covers static shared memory too.
            if k.shared_size_bytes > SMEM_SLACK:
                raise RuntimeError(
                    f"{name} has {k.shared_size_bytes} bytes of static shared memory, "
                    f"more than the {SMEM_SLACK} the dispatcher keeps for it")
            k.max_dynamic_shared_size_bytes = self.smem_optin - k.shared_size_bytes
        try:
            handle = int(k.kernel.ptr)
        except AttributeError:  # a CuPy without RawKernel.kernel: CuPy's own launch
            handle = 0
        self.modules[key] = module
        self.handles[key] = handle
        self.kernels[key] = k  # last: a kernel in here is ready to launch
        return k


# NVRTC opens its builtins library during the first compile of a process, and first compiles
# on several threads at once can fail to open it ("failed to open libnvrtc-builtins", seen
# with NVRTC 13.0 on this project's CPU host, two runs in three). So the process's first load
# runs alone, and the others, side by side, after it.
_first_load_lock = threading.Lock()
_first_load_done = threading.Event()


_loaded: dict = {}
_load_lock = threading.Lock()


def kernels_for(dtype, device_id: int, smem_optin: int) -> KernelSet:
    """The kernel set of ``dtype`` on ``device_id`` (its kernels load on first use)."""
    key = (np.dtype(dtype).str, device_id)
    ks = _loaded.get(key)
    if ks is None:
        with _load_lock:
            ks = _loaded.get(key)
            if ks is None:
                ks = _loaded[key] = KernelSet(dtype, device_id, smem_optin)
    return ks


def kernels_loaded(dtype, device_id: int, keys) -> bool:
    """True when every kernel in ``keys`` of ``dtype`` is loaded on ``device_id``."""
    ks = _loaded.get((np.dtype(dtype).str, device_id))
    return ks is not None and ks.loaded(keys)
