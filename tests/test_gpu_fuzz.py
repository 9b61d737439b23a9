"""Random cases on the GPU against the NumPy backend (quick mode of scripts/fuzz.py).

``FUZZ_CASES`` cases (default 300) of seed ``FUZZ_SEED`` (default below; both are in the
test ids), in batches. A failure names "seed S case i: <describe>"; rerun that case alone
with ``FUZZ_SEED=S FUZZ_ONLY=i pytest tests/test_gpu_fuzz.py`` or
``python scripts/fuzz.py --seed S --only i``.
"""

import os

import pytest

import fuzz_cases as fc
from gpu_util import cupy, requires_gpu

pytestmark = [requires_gpu, pytest.mark.gpu]

DEFAULT_SEED = 20250611
SEED = int(os.environ.get("FUZZ_SEED", DEFAULT_SEED))
CASES = int(os.environ.get("FUZZ_CASES", 300))
ONLY = os.environ.get("FUZZ_ONLY")
BATCH = 25

if ONLY:
    BATCHES = [[int(x) for x in ONLY.split(",") if x.strip()]]
else:
    BATCHES = [list(range(a, min(a + BATCH, CASES))) for a in range(0, CASES, BATCH)]


@pytest.mark.parametrize("indices", BATCHES,
                         ids=[f"seed{SEED}-cases{b[0]}-{b[-1]}" for b in BATCHES])
def test_fuzz(indices):
    print(f"fuzz seed {SEED}, cases {indices[0]}..{indices[-1]}")
    counts, failures = fc.run_many(SEED, indices, cupy, max_failures=10)
    print(f"run {counts['ok']}, skipped as refused {counts['refused']}, "
          f"failed {counts['failed']}")
    if failures:
        pytest.fail(f"{len(failures)} of {len(indices)} cases failed (seed {SEED}):\n"
                    + "\n".join(fc.failure_line(f) for f in failures), pytrace=False)
