"""Digest of every kernel module as NVRTC builds it (no GPU needed: cuda-core, the test extra).

    python scripts/cubin_digest.py > before.txt; (edit kernels/); python scripts/cubin_digest.py | diff before.txt -

Equal digests for every dtype and architecture mean a kernel edit (a split, a helper that
replaces repeated lines) changed no instruction, so no GPU round is needed to trust it.
"""

import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cuda.core import Program, ProgramOptions  # noqa: E402

from moe_lora_align import _kernels  # noqa: E402


def main():
    for arch in ("sm_80", "sm_90"):
        for dtype in sorted(_kernels.CTYPES, key=str):
            names = list(_kernels.kernel_names(dtype).values())
            program = Program(_kernels.source(), "c++",
                              options=ProgramOptions(arch=arch, std="c++17"))
            cubin = bytes(program.compile("cubin", name_expressions=names).code)
            print(arch, dtype, hashlib.sha256(cubin).hexdigest()[:16], flush=True)


if __name__ == "__main__":
    main()
