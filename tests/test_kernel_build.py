"""Kernel builds are values: an experiment compiles other sources or options through
``_kernels.use_build`` and gets the package's build back the same way (no GPU needed)."""

import shutil

from moe_lora_align import _call, _kernels


def test_use_build_switches_sources_and_back(tmp_path):
    default = _kernels.current_build()
    assert default == _kernels.KernelBuild()
    copy = tmp_path / "kernels"
    shutil.copytree(_kernels.kernel_dir(), copy)
    (copy / "align_kernels.cu").write_text("// an experiment\n" +
                                          (copy / "align_kernels.cu").read_text())
    try:
        _kernels.use_build(_kernels.KernelBuild(source_dir=copy, options=("-DMLA_PROBE",)))
        assert _kernels.source().startswith("// an experiment")
        assert _kernels.current_build().options == ("-DMLA_PROBE",)
    finally:
        _kernels.use_build(default)
    assert not _kernels.source().startswith("// an experiment")


def test_prepared_calls_of_another_build_are_not_replayed():
    """An experiment that switches builds must time the new build's kernels, not replay the
    launches a call recorded under the old one."""
    def prepared():
        return _call.Prepared("cupy", 0, jobs=(), slots=(), launches=(), mode=None,
                              sides=None, workspaces=(), out_layout=None, spans=())

    default = _kernels.current_build()
    before = prepared()
    assert before.current()
    try:
        _kernels.use_build(_kernels.KernelBuild(options=("-DMLA_PROBE",)))
        assert not before.current()
        during = prepared()
        assert during.current()
    finally:
        _kernels.use_build(default)
    assert before.current() and not during.current()


def test_earlier_sources_offer_only_the_kernels_they_define(tmp_path):
    """Sources of an earlier commit (without align_tiny_filled and its pair) load and plan
    without them; the package's own sources define every kernel name."""
    import numpy as np

    default = _kernels.current_build()
    assert _kernels.defined_kernel_names(np.int32) == _kernels.kernel_names(np.int32)
    copy = tmp_path / "kernels"
    shutil.copytree(_kernels.kernel_dir(), copy)
    block = copy / "one_block.cuh"
    block.write_text(block.read_text().replace("align_tiny_filled(", "earlier_a(")
                     .replace("align_tiny_pair_filled(", "earlier_b("))
    try:
        _kernels.use_build(_kernels.KernelBuild(source_dir=copy))
        names = _kernels.defined_kernel_names(np.int32)
        gone = set(_kernels.kernel_names(np.int32)) - set(names)
        assert gone == {(k, det) for k in ("tiny_filled", "tiny_pair_filled")
                        for det in (False, True)}
        assert ("tiny", False) in names and ("tiny_pair", True) in names
    finally:
        _kernels.use_build(default)
