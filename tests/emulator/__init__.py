"""The alignment kernels on the CPU, for tests without a GPU.

``build`` turns the kernels' CUDA source into C++ for ``cuda_emu.h`` (every thread a fiber,
the blocks of a cooperative or cluster launch resident at once) and compiles it with the
host's C++ compiler into a library cached under ``build/emulator``. ``emulated`` then swaps the driver call at the end of
the package's own launch path (``_launch.launch_kernel``) for the emulator, so the
dispatcher's choice, the workspace layout, the packed ``Problem`` and the order of launches
are the package's; only the kernels run elsewhere. Arrays are NumPy arrays wrapped as
``HostArray`` (what the packing reads of a device array: ``.data.ptr``).

The source changes are mechanical and checked: the one dynamic shared-memory declaration,
each ``__shared__`` variable (placed in the block's arena), and each inline-PTX statement,
which must be one of ``PTX`` (an unknown one fails the build, so a new kernel cannot slip
through untranslated).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from moe_lora_align import _dispatch, _kernels, _launch

HERE = Path(__file__).resolve().parent
PRELUDE = HERE / "cuda_emu.h"
CACHE = Path(os.environ.get("MLA_EMULATOR_CACHE",
                            HERE.parent.parent / "build" / "emulator"))
COMPILER = os.environ.get("CXX", "g++")
# -fno-strict-aliasing: the kernels store int4 into int rows and read ushort counters from
# int scratch, as CUDA allows.
FLAGS = ("-std=c++17", "-O1", "-fno-strict-aliasing", "-fPIC", "-shared", "-w")

# Inline PTX the kernels use -> the emulator's call ({0}, {1}...: outputs, then inputs).
PTX = {
    "mov.u32 %0, %%lanemask_lt;": "{0} = mla_emu::lanemask_lt();",
    "ld.acquire.gpu.global.u32 %0, [%1];": "{0} = mla_emu::load_acquire({1});",
    "mov.u32 %0, %%cluster_ctarank;": "{0} = mla_emu::cluster_ctarank();",
    "barrier.cluster.arrive.aligned;": "mla_emu::cluster_arrive();",
    "barrier.cluster.arrive.relaxed.aligned;": "mla_emu::cluster_arrive();",
    "barrier.cluster.wait.aligned;": "mla_emu::cluster_wait();",
    "mapa.u64 %0, %1, %2;": "{0} = mla_emu::mapa((const void*)({1}), {2});",
    "mov.u64 %0, %%globaltimer;": "{0} = mla_emu::globaltimer();",
    "mov.u32 %0, %%smid;": "{0} = mla_emu::smid();",
}


def compiler_available() -> bool:
    return shutil.which(COMPILER) is not None


def _split_top(text: str, sep: str):
    """``text`` split at ``sep`` outside strings and brackets."""
    parts, depth, cur, quote = [], 0, [], False
    for ch in text:
        if ch == '"':
            quote = not quote
        elif not quote and ch in "([":
            depth += 1
        elif not quote and ch in ")]":
            depth -= 1
        if ch == sep and depth == 0 and not quote:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def _operands(part: str):
    """The expressions of ``"=r"(v), "l"(p)``."""
    return [m.group(1).strip() for op in _split_top(part, ",") if op.strip()
            for m in [re.fullmatch(r'\s*"[^"]*"\s*\((.*)\)\s*', op, re.S)]]


def _translate_asm(source: str) -> str:
    out, at = [], 0
    for m in re.finditer(r"\basm\s*(?:volatile\s*)?\(", source):
        if m.start() < at:
            continue
        depth, i = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(source[i], 0)
            i += 1
        end = source.index(";", i) + 1
        parts = _split_top(source[m.end():i - 1], ":")
        template = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', parts[0]))
        if template not in PTX:
            raise ValueError(f"the emulator does not know this inline PTX: {template!r}")
        operands = [x for part in parts[1:3] for x in _operands(part)]
        out += [source[at:m.start()], PTX[template].format(*operands)]
        at = end
    return "".join(out) + source[at:]


def _translate_shared(source: str) -> str:
    """Each ``__shared__ T a[n], b;`` becomes references into the block's arena."""
    counter = iter(range(1 << 20))

    def one(m):
        indent, decl = m.group(1), m.group(2)
        pieces = _split_top(decl, ",")
        first = re.fullmatch(r"\s*(.*?)\s*\b(\w+)\s*((?:\[[^\]]*\])*)\s*", pieces[0])
        ctype = first.group(1)
        names = [(first.group(2), first.group(3))]
        for piece in pieces[1:]:
            more = re.fullmatch(r"\s*(\w+)\s*((?:\[[^\]]*\])*)\s*", piece)
            names.append((more.group(1), more.group(2)))
        return indent + " ".join(f"auto& {name} = mla_emu::shared_var<{ctype}{dims}>"
                                 f"({next(counter)});" for name, dims in names)

    return re.sub(r"^([ \t]*)__shared__\s+([^;]*);", one, source, flags=re.M)


def translate(source: str) -> str:
    """The kernels' CUDA source as C++ for ``cuda_emu.h``."""
    source, n = re.subn(r"^extern __shared__[^\n]*\bdynamic_smem\[\];", "", source,
                        flags=re.M)
    if n != 1:
        raise ValueError("expected one extern __shared__ dynamic_smem declaration")
    return _translate_shared(_translate_asm(source))


def _arity(name: str) -> int:
    return 2 if "_pair" in name.split("<")[0] else 1  # align_*_pair and align_tiny_pair_filled


def unit(source: str, dtypes) -> str:
    """The whole C++ translation unit: prelude, kernels, and a table of every instance."""
    names = sorted({n for d in dtypes for n in _kernels.kernel_names(d).values()})
    lines = [f'#include "{PRELUDE}"', translate(source), "namespace {"]
    for i, name in enumerate(names):
        args = ", ".join(f"*static_cast<const Problem*>(a[{k}])" for k in range(_arity(name)))
        lines.append(f"void k{i}(const void* const* a) {{ {name}({args}); }}")
    lines.append("struct Entry { const char* name; void (*fn)(const void* const*); };")
    lines.append("const Entry entries[] = {")
    lines += [f'  {{"{name}", k{i}}},' for i, name in enumerate(names)]
    lines.append("};\n}  // namespace")
    lines.append(r'''
extern "C" int mla_emu_launch(const char* name, unsigned grid, unsigned block,
                              unsigned long long smem, const void* const* args,
                              int cluster_blocks, unsigned long long seed,
                              unsigned preempt, int skew, int all_resident, char* err,
                              int errlen) {
  for (const Entry& e : entries) {
    if (std::strcmp(e.name, name) != 0) continue;
    std::string why;
    try {
      why = mla_emu::run(e.fn, args, grid, block, smem, cluster_blocks, seed, preempt,
                         skew != 0, all_resident != 0);
    } catch (const std::exception& ex) {
      why = std::string("emulator: ") + ex.what();
    }
    std::snprintf(err, errlen, "%s", why.c_str());
    return why.empty() ? 0 : 1;
  }
  std::snprintf(err, errlen, "no kernel %s", name);
  return 2;
}''')
    return "\n".join(lines) + "\n"


RACECHECK_FLAGS = ("-fsanitize=thread", "-DMLA_EMU_RACECHECK")


def build(source_dir=None, dtypes=(np.int32,), racecheck=False) -> Path:
    """Compile the kernels of ``source_dir`` (default: the package's) for the emulator; the
    library is cached by the hash of everything that went into it. ``racecheck``: every
    load and store goes through a check for shared-memory hazards (cuda_emu.h), about 3 x
    slower."""
    flags = FLAGS + (RACECHECK_FLAGS if racecheck else ())
    root = Path(source_dir) if source_dir else _kernels.kernel_dir()
    text = unit(_kernels.inline_source(root), dtypes)
    digest = hashlib.sha256((text + PRELUDE.read_text() + " ".join(flags)).encode())
    lib = CACHE / f"kernels_{digest.hexdigest()[:16]}.so"
    if not lib.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        cpp = lib.with_suffix(".cpp")
        cpp.write_text(text)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        if racecheck:  # instrumented, but linked without the sanitizer's runtime
            obj = lib.with_suffix(f".{os.getpid()}.o")
            subprocess.run([COMPILER, *flags, "-c", "-o", str(obj), str(cpp)], check=True)
            subprocess.run([COMPILER, "-shared", "-o", str(tmp), str(obj)], check=True)
            obj.unlink()
        else:
            subprocess.run([COMPILER, *flags, "-o", str(tmp), str(cpp)], check=True)
        os.replace(tmp, lib)
    return lib


class Emulator:
    """A compiled kernel library; ``launch`` runs one kernel to completion."""

    def __init__(self, lib: Path):
        self.lib = ctypes.CDLL(str(lib))
        self.lib.mla_emu_launch.restype = ctypes.c_int
        self.lib.mla_emu_launch.argtypes = [
            ctypes.c_char_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_ulonglong,
            ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_ulonglong, ctypes.c_uint,
            ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        self.launched = []  # (kernel name, grid, block) of every launch, in order

    def launch(self, name: str, grid: int, block: int, smem: int, packed, *, cluster=1,
               seed=0, preempt=0, skew=True, cooperative=False) -> None:
        """``cooperative`` (or a cluster): every block resident at once; else the blocks run
        in slots of about 16K threads, each slot taking the next block when its own is
        done."""
        args = (ctypes.c_void_p * len(packed))(*[p.ctypes.data for p in packed])
        err = ctypes.create_string_buffer(512)
        rc = self.lib.mla_emu_launch(name.encode(), grid, block, smem, args, cluster, seed,
                                     preempt, int(skew), int(cooperative or cluster > 1), err,
                                     len(err))
        self.launched.append((name, grid, block))
        if rc != 0:
            raise RuntimeError(f"{name} <<<{grid}, {block}, {smem}>>>: {err.value.decode()}")


class HostArray:
    """A NumPy array as the package's launch path reads a device array."""

    def __init__(self, a: np.ndarray):
        self.a = a
        self.data = SimpleNamespace(ptr=a.ctypes.data)
        self.shape, self.dtype, self.size = a.shape, a.dtype, a.size

    def __getitem__(self, index):
        return HostArray(self.a[index])


def host_array(a):
    return None if a is None else HostArray(np.ascontiguousarray(a))


SCRATCH_GUARD = 64          # poisoned int32 entries on each side of a workspace
SCRATCH_POISON = -5555


class HostWorkspace(_launch.Workspace):
    """A workspace in NumPy memory (the package's layout, ``Workspace._carve``), with
    poisoned guard zones on both sides that ``check`` reads."""

    def __init__(self):
        super().__init__(device_id=0)
        self.whole = None

    def _grow(self, num_buckets, matrix_entries, stream):
        nb, nm = max(num_buckets, self.buckets, 1), max(matrix_entries, self.matrix, 1)
        n = _launch.workspace_entries(nb, nm)
        self.whole = np.full(n + 2 * SCRATCH_GUARD, SCRATCH_POISON, np.int32)
        self.whole[SCRATCH_GUARD:SCRATCH_GUARD + n] = 0
        self._carve(HostArray(self.whole[SCRATCH_GUARD:SCRATCH_GUARD + n]), nb, nm)
        return self

    def check(self):
        """The guard zones intact, and the scratch as the next call needs it: the counts and
        the ticket back at zero (the cooperative kernel keeps its own count buffers and
        control words, which it cleans up itself on its next call)."""
        if self.whole is None:
            return
        if not ((self.whole[:SCRATCH_GUARD] == SCRATCH_POISON).all()
                and (self.whole[-SCRATCH_GUARD:] == SCRATCH_POISON).all()):
            raise AssertionError("a kernel wrote outside its workspace")
        for name in ("counts", "ticket"):
            left = getattr(self, name).a
            if left.any():
                raise AssertionError(f"a kernel left {np.count_nonzero(left)} nonzero entries "
                                     f"in the workspace's {name}")


# An H200's shared memory and features on a few SMs: the cooperative grids stay small.
LIMITS = _dispatch.DeviceLimits(sm_count=4, smem_optin=232448, cooperative=True,
                                clusters=True)


@contextlib.contextmanager
def emulated(emu: Emulator, limits=LIMITS, seed=0, preempt=None, skew=True):
    """The package's launch path with the emulator in place of the driver. ``preempt``: the
    chance in 1000 of a switch at an atomic, a fence or an ``__ldcg`` (default: 250 for odd
    seeds, none for even ones)."""
    if preempt is None:
        preempt = 250 if seed % 2 else 0
    names = {}

    def kernels_for(dtype, device_id, smem_optin):
        return SimpleNamespace(names=names.setdefault(np.dtype(dtype).str,
                                                      _kernels.kernel_names(dtype)))

    def launch_kernel(ks, key, grid, block, smem, stream, *jobs, cooperative=False):
        name = ks.names[key]
        cluster = _dispatch.CLUSTER_BLOCKS if key[0].startswith("cluster") else 1
        emu.launch(name, grid, block, smem, [j.packed for j in jobs], cluster=cluster,
                   seed=seed + len(emu.launched), preempt=preempt, skew=skew,
                   cooperative=cooperative)

    saved = (_launch.kernels_for, _launch.launch_kernel, _launch.device_limits)
    _launch.kernels_for, _launch.launch_kernel = kernels_for, launch_kernel
    _launch.device_limits = lambda device_id: limits
    try:
        yield
    finally:
        _launch.kernels_for, _launch.launch_kernel, _launch.device_limits = saved


_ARRAYS = ("topk_ids", "token_slot", "lora_ids", "adapter_enabled", "expert_map",
           "sorted_ids", "expert_ids", "num_post_pad", "scatter_idx")


def device_job(job: _launch.Job) -> _launch.Job:
    """``job`` (a host call's, from ``_call.prepare``) with its arrays as ``HostArray``: the
    kernels write straight into the caller's NumPy buffers."""
    fields = {}
    for name in _ARRAYS:
        a = getattr(job, name)
        if a is not None and not a.flags.c_contiguous:
            raise ValueError(f"{name} must be contiguous: the kernels write through its address")
        fields[name] = None if a is None else HostArray(a)
    return dataclasses.replace(job, **fields)


def run(emu: Emulator, job: _launch.Job, *, variant=None, policy=_dispatch.DEFAULT_POLICY,
        workspace=None, seed=0, limits=LIMITS) -> _dispatch.Launch:
    """One alignment through the package's ``launch_one``; returns the launch it ran."""
    job = device_job(job)
    workspace = workspace or HostWorkspace()
    with emulated(emu, limits, seed):
        launch = _launch.plan_launch(job, 0, variant, policy)
        _launch.launch_one(job, launch, workspace, None, 0)
    workspace.check()
    return launch


def run_pair(emu: Emulator, base: _launch.Job, lora: _launch.Job, *, streams=None,
             variant=None, policy=_dispatch.DEFAULT_POLICY, workspaces=None, seed=0,
             limits=LIMITS):
    """Base and LoRA through the package's ``choose_streams`` and ``issue_both``; two side
    streams become one (the same launches in order). Returns (mode, fused launch or None)."""
    base, lora = device_job(base), device_job(lora)
    ws_base, ws_lora = workspaces or (HostWorkspace(), HostWorkspace())
    with emulated(emu, limits, seed):
        mode, pair = _launch.choose_streams(base, lora, 0, streams, variant, policy)
        if mode == "fused":
            lb = ll = pair
        else:
            lb = _launch.plan_launch(base, 0, variant, policy)
            ll = _launch.plan_launch(lora, 0, variant, policy)
        _launch.issue_both("fused" if mode == "fused" else "one", pair, base, lb, ws_base,
                           lora, ll, ws_lora, None, 0)
    ws_base.check()
    ws_lora.check()
    return mode, pair
