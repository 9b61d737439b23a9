"""Every script in scripts/ imports, with CuPy replaced by a stand-in: a renamed helper or a
broken import shows here, on the host, and not as lost time on the GPU machine."""

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
