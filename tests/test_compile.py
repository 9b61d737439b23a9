"""Every kernel instantiation compiles with NVRTC, without a GPU, as the package compiles it:
alone. For the id types of FULL_CHECK_DTYPES, machine code for sm_80 and sm_90, unspilled, with
no stack and within the static shared memory the dispatcher keeps; for the others, NVRTC's
front end.

Uses cuda.core's Program and NVRTC's bindings (no device needed), the same source text and
name expressions the package hands to CuPy at run time.
"""

import functools
import io
import multiprocessing
import os
import re
import struct
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest

from moe_lora_align import _dispatch, _kernels

cuda_core = pytest.importorskip("cuda.core", reason="cuda-core (the test extra) is not installed")
pytestmark = pytest.mark.nvrtc

ARCHS = ("sm_80", "sm_90")
DTYPES = sorted(_kernels.CTYPES, key=str)
# The id types whose kernels get the machine-code checks on both architectures. An id type
# changes only a route's load and its widening to 64 bits (align_common.cuh's load_route).
# Compiled for all eight (r61), 38 of the 40 kernels used the same registers for every type on
# each architecture; the other two differed by one register, and int8 or int64 had the most
# each time. __launch_bounds__(1024) caps a thread at 64 registers, and some kernels sit at
# it, so those two are checked, and int32, which the engines pass. The other types' kernels
# go through NVRTC's front end, which instantiates and checks every template: 3 s for all
# five, against 100 s of a core for the machine code of one type on both architectures.
# Set MLA_COMPILE_EVERY_ID_TYPE=1 to give every type the machine-code checks.
FULL_CHECK_DTYPES = (DTYPES if os.environ.get("MLA_COMPILE_EVERY_ID_TYPE") == "1"
                     else [np.dtype(np.int8), np.dtype(np.int32), np.dtype(np.int64)])
_PROPS = re.compile(
    r"Function properties for (\S+)\n.*?(\d+) bytes stack frame, (\d+) bytes spill stores, "
    r"(\d+) bytes spill loads", re.S)


@functools.lru_cache(maxsize=None)
def _compile(arch, names):
    from cuda.core import Program, ProgramOptions

    opts = ProgramOptions(arch=arch, std="c++17", ptxas_options=["-v"])
    prog = Program(_kernels.source(), "c++", options=opts)
    log = io.StringIO()
    obj = prog.compile("cubin", name_expressions=list(names), logs=log)
    return obj, log.getvalue()


def _compile_alone(job):
    """One kernel as the package builds it, an NVRTC program of its own: (arch, name) in,
    (its name expressions or None, cubin bytes, compile log) out."""
    arch, name = job
    obj, log = _compile(arch, (name,))
    mapping = getattr(obj, "symbol_mapping", None)
    return (None if mapping is None else sorted(mapping)), bytes(obj.code), log


# Worker processes for the compiles (one NVRTC program at a time in each): at most this many,
# since each holds a compile's memory.
MAX_COMPILE_WORKERS = 8


def _kernels_of(dtypes):
    """The name expressions of every kernel of these id types, sorted."""
    return sorted({n for d in dtypes for n in _kernels.kernel_names(d).values()})


@functools.lru_cache(maxsize=None)
def _every_kernel_alone(arch):
    """{name: _compile_alone's result} for every kernel of FULL_CHECK_DTYPES, compiled in
    worker processes, a core each, so the compile tests take their time once over the cores."""
    names = _kernels_of(FULL_CHECK_DTYPES)
    jobs = [(arch, n) for n in names]
    workers = min(len(os.sched_getaffinity(0)), MAX_COMPILE_WORKERS)
    if workers <= 1:
        return dict(zip(names, map(_compile_alone, jobs)))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        return dict(zip(names, pool.map(_compile_alone, jobs)))


def _front_end_log(names):
    """One program of these kernels through NVRTC's front end (NVVM IR for link-time
    optimisation: every template instantiated and checked, nothing optimised or assembled):
    NVRTC's log, empty when it compiled. Through NVRTC's bindings, since cuda.core asks the
    driver whether it could load what it built."""
    from cuda.bindings import nvrtc

    _, prog = nvrtc.nvrtcCreateProgram(_kernels.source().encode(), b"kernels.cu", 0, [], [])
    try:
        for name in names:
            nvrtc.nvrtcAddNameExpression(prog, name.encode())
        opts = [b"-arch=compute_90", b"-dlto", *(o.encode() for o in _kernels.COMPILE_OPTIONS)]
        result, = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if result == nvrtc.nvrtcResult.NVRTC_SUCCESS:
            return ""
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        return f"{getattr(result, 'name', result)}\n{log.decode(errors='replace')}"
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def test_every_other_id_type_compiles():
    """The id types past FULL_CHECK_DTYPES: every kernel instantiates and compiles."""
    names = _kernels_of(d for d in DTYPES if d not in FULL_CHECK_DTYPES)
    if not names:
        pytest.skip("MLA_COMPILE_EVERY_ID_TYPE=1: every id type gets the machine-code checks")
    assert _front_end_log(names) == ""


def test_the_front_end_check_reports_an_id_type_that_does_not_compile():
    log = _front_end_log(["align_single<signed char, true>", "align_single<float3, true>"])
    assert "float3" in log and "error" in log


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", FULL_CHECK_DTYPES, ids=str)
def test_every_kernel_compiles_alone_without_spills(arch, dtype):
    """Each kernel as the package builds it: an NVRTC program of its own."""
    built = _every_kernel_alone(arch)
    for name in _kernels.kernel_names(dtype).values():
        mangled, _, log = built[name]
        if mangled is not None:
            assert set(mangled) == {name}
        if "ptxas info" not in log:
            pytest.skip("this cuda.core build returned no ptxas log: spills not checked")
        props = _PROPS.findall(log)
        assert len(props) == 1, log
        for fn, stack, spill_st, spill_ld in props:
            assert (int(spill_st), int(spill_ld)) == (0, 0), f"{fn} spills on {arch}:\n{log}"
            assert int(stack) == 0, f"{fn} uses a {stack}-byte stack frame on {arch}"
        # static shared memory within what the dispatcher keeps for it (the package refuses
        # to load a kernel past it: _kernels.KernelSet)
        for smem in re.findall(r"(\d+) bytes smem", log):
            assert int(smem) <= _dispatch.SMEM_SLACK, f"{name}: {smem} bytes static smem on {arch}"


def _sections(cubin: bytes) -> dict:
    """An ELF64 file's sections by name: their bytes (no bytes for NOBITS sections)."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    entsize, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * entsize)
               for i in range(count)]
    names_at = headers[names_index][4]
    out = {}
    for name_off, kind, _, _, offset, size, *_ in headers:
        start = names_at + name_off
        name = cubin[start:cubin.index(b"\0", start)].decode()
        out[name] = b"" if kind == 8 else cubin[offset:offset + size]
    return out


def test_a_kernel_compiled_alone_is_the_same_machine_code():
    """The package compiles each kernel alone (a first call waits for its own kernels only).
    Its machine code is byte for byte what one program of every kernel gives; the kernels'
    attribute sections differ only in symbol numbers."""
    names = tuple(_kernels.kernel_names(np.int32).values())
    whole = _sections(bytes(_compile("sm_90", names)[0].code))
    built = _every_kernel_alone("sm_90")
    for name in names:
        alone = _sections(built[name][1])
        texts = [s for s in alone if s.startswith(".text.")]
        assert len(texts) == 1, (name, texts)
        assert alone[texts[0]] == whole[texts[0]], f"{name}: other machine code alone"
        info = ".nv.info." + texts[0][len(".text."):]
        assert _attributes(alone[info]) == _attributes(whole[info]), name


PARAM_CBANK = 0x0A  # its value starts with the symbol number of the parameter bank


def _attributes(info: bytes) -> list:
    """A kernel's .nv.info records as (attribute, value), symbol numbers left out. A record
    is a four-byte header (form, attribute, a 16-bit value or, form 4, the length of the
    value that follows)."""
    out, i = [], 0
    while i < len(info):
        form, attr = info[i], info[i + 1]
        if form == 0x04:  # a length and that many bytes
            size, = struct.unpack_from("<H", info, i + 2)
            value, i = info[i + 4:i + 4 + size], i + 4 + size
        else:  # the value in the header's last two bytes
            value, i = info[i + 2:i + 4], i + 4
        out.append((attr, value[4:] if attr == PARAM_CBANK else value))
    assert i == len(info), "records do not end where the section does"
    return out


def test_source_inlines_its_header():
    src = _kernels.source()
    assert '#include "' not in src
    assert "struct Problem" in src


def test_problem_struct_matches_the_header():
    """The packed argument struct of _launch mirrors kernels/align_common.cuh field by field."""
    from moe_lora_align._launch import PROBLEM_DTYPE

    header = (_kernels.kernel_dir() / "align_common.cuh").read_text()
    body = header[header.index("struct Problem {"):]
    body = body[: body.index("};")]
    fields = re.findall(r"^\s*([\w\s\*]+?)\s*\b(\w+);", body, re.M)
    names = [n for _, n in fields]
    assert names == list(PROBLEM_DTYPE.names)
    for ctype, name in fields:
        size = PROBLEM_DTYPE.fields[name][0].itemsize
        assert size == (8 if "*" in ctype else 4), (name, ctype)
    assert PROBLEM_DTYPE.itemsize % 8 == 0
    assert np.dtype(PROBLEM_DTYPE).isalignedstruct


def test_division_magic_is_exact():
    from moe_lora_align._launch import division_magic

    rng = np.random.default_rng(0)
    divisors = list(range(1, 300)) + [2**31 - 1, 2**20 + 7] + rng.integers(1, 2**31, 200).tolist()
    for d in divisors:
        m, s = division_magic(int(d))
        assert 0 < m < 2**32
        n = np.concatenate([[0, 1, d - 1, d, d + 1, 2**31 - 1],
                            rng.integers(0, 2**31, 64)]).astype(object)
        n = n[n < 2**31]
        assert all((int(x) * m) >> s == int(x) // int(d) for x in n)
