"""Every script in scripts/ imports, with CuPy replaced by a stand-in: a renamed helper or a
broken import shows here, on the host, and not as lost time on the GPU machine. And the
host-side helper that builds a candidate's kernels for an A/B line works."""

import importlib.util
import sys
from pathlib import Path
from unittest import mock

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.mark.parametrize("path", sorted(SCRIPTS.glob("*.py")), ids=lambda p: p.name)
def test_script_imports(path, monkeypatch):
    fake = mock.MagicMock(name="cupy")
    for name in ("cupy", "cupy.cuda", "cupyx", "cupyx.profiler"):
        monkeypatch.setitem(sys.modules, name, fake)
    monkeypatch.syspath_prepend(str(SCRIPTS))  # the scripts import each other
    for sibling in [m for m in sys.modules if (SCRIPTS / f"{m}.py").exists()]:
        monkeypatch.delitem(sys.modules, sibling)  # imported afresh, against the stand-in
    if path.name == "cubin_digest.py":
        pytest.importorskip("cuda.core", reason="cuda-core (the test extra) is not installed")
    spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.__doc__, f"{path.name} says nothing of what it is for"


def test_variant_kernels_builds_a_candidate_and_refuses_heads_own(tmp_path):
    """scripts/variant_kernels.sh applies a diff to HEAD in a scratch worktree and copies its
    kernels/ out; a diff that leaves the kernels as they are is refused (exit 3), since its
    A/B would time main against itself."""
    import difflib
    import shutil
    import subprocess

    root = SCRIPTS.parent
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("needs git and a checkout")
    head = subprocess.run(["git", "-C", str(root), "show", "HEAD:kernels/order.cuh"],
                          capture_output=True, text=True, check=True).stdout
    lines = head.splitlines(keepends=True)
    patch = tmp_path / "candidate.diff"
    patch.write_text("".join(difflib.unified_diff(
        lines, lines + ["// a candidate\n"], "a/kernels/order.cuh", "b/kernels/order.cuh")))
    script = str(SCRIPTS / "variant_kernels.sh")
    worktrees = ["git", "-C", str(root), "worktree", "list"]
    before = subprocess.run(worktrees, capture_output=True, text=True, check=True).stdout
    dest = tmp_path / "v"
    run = subprocess.run(["bash", script, str(dest), str(patch)], cwd=root,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert (dest / "kernels" / "order.cuh").read_text() == head + "// a candidate\n"
    empty = tmp_path / "empty.diff"  # a new file outside kernels/
    empty.write_text("--- /dev/null\n+++ b/not_kernels.txt\n@@ -0,0 +1 @@\n+b\n")
    run = subprocess.run(["bash", script, str(tmp_path / "w"), str(empty)], cwd=root,
                         capture_output=True, text=True)
    assert run.returncode == 3, run.stderr
    assert not (tmp_path / "w").exists()
    after = subprocess.run(worktrees, capture_output=True, text=True, check=True).stdout
    assert after == before  # the scratch worktrees are gone
