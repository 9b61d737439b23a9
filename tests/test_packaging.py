"""The wheel carries the CUDA sources, and an installed wheel finds them (no GPU needed)."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    pytest.importorskip("setuptools")
    pytest.importorskip("wheel", reason="the wheel package (test extra) builds the wheel")
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "-w", str(out), str(ROOT)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wheels = list(out.glob("moe_lora_align-*.whl"))
    assert len(wheels) == 1
    return wheels[0]


def test_wheel_carries_kernels_and_data(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    kernels = sorted(p.name for p in (ROOT / "kernels").iterdir() if p.suffix in (".cu", ".cuh"))
    assert kernels, "no CUDA sources in kernels/"
    for name in kernels:
        assert f"moe_lora_align/kernels/{name}" in names
    assert "moe_lora_align/data/anchors_h200.json" in names


def test_installed_wheel_finds_its_sources(wheel, tmp_path):
    target = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index",
                           "--target", str(target), str(wheel)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    code = ("import moe_lora_align._kernels as k; print(k.kernel_dir()); "
            "assert 'struct Problem' in k.source()")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stdout + run.stderr
    assert Path(run.stdout.strip()).is_relative_to(target)


def test_checkout_finds_its_sources():
    from moe_lora_align import _kernels

    found = _kernels.kernel_dir()
    assert (found / _kernels.MAIN_SOURCE).is_file()


def test_wheel_carries_licence_and_types(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "moe_lora_align/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(meta).decode()
    assert "License-Expression: Apache-2.0" in text


def test_sdist_carries_what_its_tests_need(tmp_path):
    pytest.importorskip("setuptools")
    code = ("import sys; from setuptools import build_meta; "
            "print(build_meta.build_sdist(sys.argv[1]))")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                          text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import tarfile

    sdist = tmp_path / proc.stdout.strip().splitlines()[-1]
    names = {n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
    for path in ("LICENSE", "CHANGELOG.md", "tests/gpu_util.py", "tests/fuzz_cases.py",
                 "kernels/align_kernels.cu", "moe_lora_align/py.typed",
                 "examples/quickstart.py"):
        assert path in names, path
    tests = {p.name for p in (ROOT / "tests").glob("*.py")}
    assert tests <= {n.split("/")[-1] for n in names if n.startswith("tests/")}
