"""scripts/bounds.py's host-side parts: the emptied build, the traffic, the targets and the
span read from probe stamps (the timings themselves need the GPU machine)."""

import re

import numpy as np
import pytest

from moe_lora_align import _kernels
from moe_lora_align._sizes import buffer_sizes
from test_experiment_runs import _load_script


@pytest.fixture(scope="module")
def bounds():
    return _load_script("bounds")


def _kernel_bodies(text):
    """Each __global__ function's text from its name to the first statement of its body."""
    return re.findall(r"__global__\s+void\b[^{};]*\)\s*\{\s*[^;]*;", text)


def test_every_kernel_returns_at_once_and_nothing_else_changes(bounds):
    text = _kernels.inline_source(_kernels.kernel_dir())
    empty = bounds.empty_source(text)
    kernels = text.count("__global__")
    assert kernels >= 14
    bodies = _kernel_bodies(empty)
    assert len(bodies) == kernels
    assert all(body.rstrip().endswith("{ return;") for body in bodies), bodies
    undone = re.sub(r"(__global__\s+void\b[^{};]*\)\s*\{) return;", r"\1", empty)
    assert undone == text


@pytest.mark.nvrtc
def test_the_emptied_build_compiles(bounds, tmp_path):
    cuda_core = pytest.importorskip("cuda.core")
    build = bounds.empty_build(tmp_path)
    assert build.options == _kernels.current_build().options
    names = list(_kernels.kernel_names(np.int32).values())
    program = cuda_core.Program(_kernels.inline_source(tmp_path), "c++",
                                options=cuda_core.ProgramOptions(arch="sm_90", std="c++17"))
    assert bytes(program.compile("cubin", name_expressions=names).code)


def test_traffic_counts_routes_slots_and_every_output_entry(bounds):
    P, M = buffer_sizes(256 * 8, 256, 16)
    assert bounds.traffic_bytes(("base", 256, 256, 8, 16, None)) == 4 * (2048 + P + M + 1)
    P, M = buffer_sizes(16 * 8, 256, 16)
    assert bounds.traffic_bytes(("lora det", 16, 256, 8, 16, 16)) == \
        4 * (128 + 16 + 16 * (P + M + 1))


def test_targets_are_issue_18s(bounds):
    assert bounds.target_of(("base", 256, 256, 8, 16, None), {}) == 4.1
    assert bounds.target_of(("base", 64, 256, 8, 16, None), {}) == 2.3
    assert bounds.target_of(("lora", 16384, 256, 8, 64, 16), {}) == 12.0
    graph = {str(("base", 256, 256, 8, 16, None)): 4.0}
    assert bounds.target_of(("base det", 256, 256, 8, 16, None), graph) == pytest.approx(5.2)
    assert bounds.target_of(("lora det", 16, 256, 8, 16, 16), graph) is None
    # every case has a target, or is the default case beside a deterministic one
    graph = {str(c): 1.0 for c in bounds.CASES}
    beside = {str((" ".join(f for f in c[0].split() if f != "det"),) + c[1:])
              for c in bounds.CASES if "det" in c[0].split()}
    for case in bounds.CASES:
        assert bounds.target_of(case, graph) is not None or str(case) in beside, case


def test_span_reads_the_slowest_block_in_the_order_it_ran(bounds):
    stamps = np.zeros((8, 160, 8, 2), np.int64)
    # slot 3 (cooperative), two blocks: block 1 ends last; its stages out of number order
    for block, entry_ns, cycles in ((0, 1000, [0, 100, 300, 0, 500]),
                                    (1, 1200, [0, 200, 900, 0, 1000])):
        for s, c in enumerate(cycles):
            if s == 0 or c:
                stamps[3, block, s] = (5000 + c, entry_ns + c)
    stamps[3, 1, 7] = (5000 + 400, 1200 + 400)   # stage 7 passed between 1 and 2
    got = bounds.span(stamps, {3: ["entry", "a", "b", "c", "d", "e", "f", "g"]})
    assert got["span_ns"] == 1200 + 1000 - 1000
    assert (got["slowest_slot"], got["slowest_block"]) == (3, 1)
    assert (got["largest_stage"], got["largest_stage_cycles"]) == ("b", 500)
    assert got["slowest_block_cycles"] == 1000
    assert bounds.span(np.zeros((8, 160, 8, 2), np.int64), {}) == {"span_ns": None}


def test_main_writes_a_row_a_case(bounds, tmp_path, monkeypatch):
    """main's flow with the GPU parts stood in for: every case gets its figures, its target
    and a verdict, and the kernels' build is the package's again afterwards."""
    import sys
    import types
    from unittest import mock

    import importlib
    bench = importlib.import_module("moe_lora_align.bench")  # the module main imports from

    stamps = np.zeros((8, 160, 8, 2), np.int64)
    stamps[0, 0, :3] = [(1000, 5000), (1400, 5200), (2600, 5800)]
    probe = types.SimpleNamespace(
        KERNEL={0: "single"}, STAGES={0: ["entry", "rows+fill", "claim"]},
        make_call=lambda case, stream: (lambda: None), probe_run=lambda fn, stream: stamps,
        reload_kernels=lambda options: None)
    monkeypatch.setitem(sys.modules, "stage_probe", probe)
    monkeypatch.setitem(sys.modules, "cupy", mock.MagicMock(name="cupy"))
    figures = iter(range(1, 1000))
    monkeypatch.setattr(bench, "graph_us", lambda fn, stream: float(next(figures)))
    builds = []
    monkeypatch.setattr(_kernels, "use_build", builds.append)
    built = _kernels.current_build()
    assert bounds.main(["--out", str(tmp_path), "--cases",
                        "('base', 256, 256|('base det', 256, 256"]) == 0
    assert builds[-1] == built and builds[0].source_dir is not None
    text = (tmp_path / "bounds.txt").read_text().splitlines()
    # figures in turn: graph 1 and 2, fills 3 and 4, emptied 5 and 6, probe builds 7 and 8
    assert len(text) == 4 and text[1].endswith("claim 1200c of 1600c met")
    assert text[2].endswith("MISS")  # 2.0 against 1.3 x 1.0
    import json
    rows = json.loads((tmp_path / "bounds.json").read_text())
    det = rows[str(("base det", 256, 256, 8, 16, None))]
    default = rows[str(("base", 256, 256, 8, 16, None))]
    assert det["target_us"] == pytest.approx(1.3 * default["graph_us"])
    assert default["target_us"] == 4.1 and default["span_ns"] == 800
    assert default["work_us"] == default["graph_us"] - default["empty_us"]
    with pytest.raises(SystemExit):
        bounds.main(["--out", str(tmp_path), "--cases", "('nothing'"])


def test_skewed_cases_set_their_target_against_the_skewed_default(bounds):
    """A skewed row has no target of its own (issue 18 set them for uniform routing); its
    deterministic row's is 1.3 times the skewed default's figure."""
    assert bounds.target_of(("base skewed", 256, 256, 8, 16, None), {}) is None
    graph = {str(("lora skewed", 256, 256, 8, 16, 16)): 8.0,
             str(("lora", 256, 256, 8, 16, 16)): 7.0}
    assert bounds.target_of(("lora det skewed", 256, 256, 8, 16, 16), graph) == \
        pytest.approx(10.4)
    every = {str(c) for c in bounds.CASES}
    for op, T, E, K, B, L in bounds.CASES:  # every deterministic case has its default beside
        kind, *flags = op.split()
        if "det" in flags:
            rest = " ".join([kind] + [f for f in flags if f != "det"])
            assert str((rest, T, E, K, B, L)) in every
