"""Every kernel instantiation compiles with NVRTC for sm_80 and sm_90, without a GPU, unspilled.

Uses cuda.core's Program (no device needed), the same source text and name expressions the
package hands to CuPy at run time.
"""

import io
import re

import numpy as np
import pytest

from moe_lora_align import _kernels

cuda_core = pytest.importorskip("cuda.core", reason="cuda-core (the test extra) is not installed")
pytestmark = pytest.mark.nvrtc

ARCHS = ("sm_80", "sm_90")
DTYPES = sorted(_kernels.CTYPES, key=str)
_PROPS = re.compile(
    r"Function properties for (\S+)\n.*?(\d+) bytes stack frame, (\d+) bytes spill stores, "
    r"(\d+) bytes spill loads", re.S)


def _compile(arch, names):
    from cuda.core import Program, ProgramOptions

    opts = ProgramOptions(arch=arch, std="c++17", ptxas_options=["-v"])
    prog = Program(_kernels.source(), "c++", options=opts)
    log = io.StringIO()
    obj = prog.compile("cubin", name_expressions=list(names), logs=log)
    return obj, log.getvalue()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_kernel_compiles_without_spills(arch, dtype):
    names = _kernels.kernel_names(dtype)
    obj, log = _compile(arch, names.values())
    mangled = obj.symbol_mapping if hasattr(obj, "symbol_mapping") else None
    if mangled is not None:
        assert set(mangled) == set(names.values())
    if "ptxas info" not in log:
        pytest.skip("this cuda.core build returned no ptxas log: spills not checked")
    props = _PROPS.findall(log)
    assert len(props) == len(names), log
    for fn, stack, spill_st, spill_ld in props:
        assert (int(spill_st), int(spill_ld)) == (0, 0), f"{fn} spills on {arch}:\n{log}"
        assert int(stack) == 0, f"{fn} uses a {stack}-byte stack frame on {arch}"


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
