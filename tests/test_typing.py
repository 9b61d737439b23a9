"""The package ships py.typed, so mypy must pass on it, and the public types must be precise
enough for users (``base, lora = plan(ids, mapping)`` and ``s, e, n =
moe_align_block_size(...)`` type-check). No GPU needed."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mypy")

ROOT = Path(__file__).resolve().parent.parent
FLAGS = ["--ignore-missing-imports", "--check-untyped-defs", "--no-error-summary"]

# Each `# type: ignore` marks a line that must fail: with warn-unused-ignores, a line that
# type-checks after all (an overload returning Any, say) is reported.
USER_CODE = '''\
# mypy: warn-unused-ignores
from typing import Optional, Tuple, Union

import numpy as np

from moe_lora_align import (Alignment, AlignmentWithScatter, AlignPlan, LoraAlignment,
                            moe_align_block_size)


def use(plan: AlignPlan, ids: np.ndarray, mapping: np.ndarray,
        maybe: Optional[np.ndarray]) -> None:
    b: Alignment = plan(ids)
    base, lora = plan(ids, mapping)
    b2: Alignment = base
    lo: LoraAlignment = lora
    pair: Tuple[Alignment, LoraAlignment] = plan(ids, mapping, lora_ids=mapping, stream=None)
    either: Union[Alignment, Tuple[Alignment, LoraAlignment]] = plan(ids, maybe)
    wrong: Alignment = plan(ids, mapping)  # type: ignore[assignment]
    wrong_pair: Tuple[Alignment, LoraAlignment] = plan(ids)  # type: ignore[assignment]


def align(ids: np.ndarray, flag: bool) -> None:
    sorted_ids, expert_ids, num_tokens_post_pad = moe_align_block_size(ids, 16, 64)
    scattered: AlignmentWithScatter = moe_align_block_size(ids, 16, 64,
                                                           return_scatter_idx=True)
    index = scattered.scatter_idx
    some: Union[Alignment, AlignmentWithScatter] = moe_align_block_size(
        ids, 16, 64, return_scatter_idx=flag)
    no_scatter = moe_align_block_size(ids, 16, 64).scatter_idx  # type: ignore[attr-defined]
'''


def mypy(cache, *targets):
    return subprocess.run([sys.executable, "-m", "mypy", *FLAGS, "--cache-dir", str(cache),
                           *map(str, targets)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("mypy_cache")


def test_package_type_checks(cache):
    run = mypy(cache, "moe_lora_align")
    assert run.returncode == 0, run.stdout + run.stderr


def test_user_code_type_checks(cache, tmp_path):
    snippet = tmp_path / "user_code.py"
    snippet.write_text(USER_CODE)
    run = mypy(cache, snippet)
    assert run.returncode == 0, run.stdout + run.stderr
