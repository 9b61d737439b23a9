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
