"""The benchmark's command line without a GPU: output flags it cannot honour are an error,
and saved results can be printed and drawn."""

import json

import pytest

import moe_lora_align as mla
from moe_lora_align import bench


def test_output_flags_without_a_gpu_are_an_error(tmp_path, capsys):
    if mla.gpu_available():
        pytest.skip("a GPU is here")
    assert bench.main(["--quick", "--json", str(tmp_path / "x.json")]) == 2
    assert "need GPU figures" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_saved_results_print_without_a_gpu(tmp_path, capsys):
    row = dict(op="base", tokens=1, num_experts=64, topk=8, block_size=16, routing="uniform",
               graph_us=2.8, eager_us=6.0, baseline_eager_us=900.0, floor_us=0.9,
               eager={"plan": 6.0, "cupy_out": 11.0}, host={"plan": 5.0, "cupy_out": 10.0})
    saved = tmp_path / "bench.json"
    saved.write_text(json.dumps({"versions": {"device": "test"}, "results": [row]}))
    assert bench.main(["--from-json", str(saved), "--table", str(tmp_path / "t.txt")]) == 0
    out = capsys.readouterr().out
    assert "2.80" in out and "11.00" in out
    assert (tmp_path / "t.txt").read_text().startswith("op")


def test_benchmark_check_accepts_free_order_and_catches_swaps():
    import numpy as np

    rng = np.random.default_rng(0)
    ids = bench.routing(rng, 64, 8, 64, "uniform")
    mapping, lora_ids, _ = bench.lora_inputs(rng, 64, 4)
    ref = mla.moe_lora_align_block_size(ids, mapping, 16, 64, 4, lora_ids=lora_ids)
    starts = bench._starts(ids, 64, 16, 4, mapping)
    got = [np.array(x) for x in ref]
    got[0][0][:2] = got[0][0][:2][::-1]                      # order inside a segment: free
    bench.check_against_numpy([x.reshape(-1) for x in got], ref, lambda: starts)  # flat too
    last = int(starts[0][-2])                                 # a route of the last expert
    got[0][0][0], got[0][0][last] = got[0][0][last], got[0][0][0]
    with pytest.raises(AssertionError, match="sorted_token_ids"):
        bench.check_against_numpy(got, ref, lambda: starts)


def test_eager_targets_check_caps_at_decode_and_the_plan_everywhere():
    from moe_lora_align import bench

    row = lambda op, T, **eager: dict(op=op, tokens=T, num_experts=64, eager=eager)  # noqa
    results = [row("base", 1, plan=6.0, cupy_out=9.9, cupy_alloc=14.1),   # cap 14 missed
               row("base", 4096, plan=9.0, cupy_out=13.5, torch_alloc=23.0),  # 9 + 4 missed
               row("lora", 16, plan=8.0, cupy_out=12.9, torch_out=15.0),  # caps + 3: met
               row("pair", 256, plan=9.0, cupy_alloc=20.0),                  # 9 + 8 + 3: met
               dict(op="base", tokens=1, num_experts=64)]                    # no eager run
    checked, misses = bench.eager_target_misses(results)
    assert checked == 7
    assert misses == ["base T=1 E=64 uniform cupy_alloc 14.10 > decode cap 14",
                      "base T=4096 E=64 uniform cupy_out 13.50 > plan 9.00 + 4"]


def test_graph_targets_of_issue_18_and_the_deterministic_ratio():
    def row(op, T, E, graph, det=None, slots=None, routing="uniform"):
        return {"op": op, "tokens": T, "num_experts": E, "max_loras": slots, "routing": routing,
                "graph_us": graph, "deterministic_graph_us": det}

    results = [row("base", 16, 64, 2.2), row("base", 64, 512, 2.4),      # decode: <= 2.3
               row("base", 1024, 512, 6.4, det=8.4),                      # mid band, det 1.31x
               row("lora", 16, 256, 3.9, slots=16), row("lora", 1, 64, 3.1, slots=4),
               row("lora", 16384, 256, 11.9, det=15.4, slots=16),
               row("base", 16384, 256, 9.0, routing="skewed"),            # no target skewed
               row("base", 4096, 256, 7.0), {"op": "pair", "tokens": 1}]  # no target
    checked, misses = bench.graph_target_misses(results)
    assert checked == 8
    assert misses == ["base T=64 E=512 uniform graph 2.40 > 2.3",
                      "base T=1024 E=512 uniform deterministic 8.40 = 1.31 x default > 1.3",
                      "lora T=1 E=64 L=4 uniform graph 3.10 > 3.0"]
    assert bench.graph_target(row("lora", 256, 256, 1.0, slots=16)) == 9.0
    assert bench.graph_target(row("lora", 16, 256, 1.0, slots=8)) is None


def test_eager_cells_keep_the_best_pass_and_every_pass_is_kept():
    from moe_lora_align import bench

    row = {"op": "base", "eager": {"plan": 8.0, "cupy_out": 12.0},
           "host": {"plan": 7.9, "cupy_out": 11.9}, "eager_us": 8.0}
    bench.keep_best(row, {"plan": 9.0, "cupy_out": 10.0}, {"plan": 8.9, "cupy_out": 9.9})
    bench.keep_best(row, {"plan": 7.0, "cupy_out": 11.0}, {"plan": 6.9, "cupy_out": 10.9})
    assert row["eager"] == {"plan": 7.0, "cupy_out": 10.0} and row["eager_us"] == 7.0
    assert row["host"] == {"plan": 6.9, "cupy_out": 9.9}
    assert [p["cupy_out"] for p in row["eager_passes"]] == [12.0, 10.0, 11.0]
    pair = {"op": "pair", "eager": {"plan": 9.0}, "host": {"plan": 9.0}}
    bench.keep_best(pair, {"plan": 8.5}, {"plan": 8.4})
    assert pair["auto_eager_us"] == 8.5


@pytest.mark.parametrize("op", ["base", "lora", "pair"])
def test_new_shape_paths_take_a_new_token_count_each_call(op, monkeypatch):
    """The eager table's "_new" paths: every call a token count the calls before it did not
    have (more than the prepared calls keep), checked against NumPy first. Run here with NumPy
    arrays in CuPy's place (the host backend)."""
    import sys
    import types

    import numpy as np

    fake = types.ModuleType("cupy")
    fake.asarray = np.asarray
    fake.cuda = types.SimpleNamespace(Device=lambda: types.SimpleNamespace(
        synchronize=lambda: None))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    fns = {}
    assert bench.each_call_a_new_shape(op, 3, 2, 8, 4, 2, fns, None) == ("cupy_new",)
    lengths = []
    for _ in range(bench.NEW_SHAPES + 2):
        got = fns["cupy_new"]()
        sorted_ids = (got[0] if op == "pair" else got).sorted_token_ids
        lengths.append(sorted_ids.shape[-1])
    numels = [3 * 2 + n * 2 for n in range(bench.NEW_SHAPES)]
    assert lengths == [mla.buffer_sizes(n, 8, 4)[0] for n in numels + numels[:2]]
    assert bench.NEW_SHAPES > mla._call.CACHE_SIZE


def test_cases_matching_selects_by_the_printed_tuple():
    from moe_lora_align.bench import cases_matching
    cases = [("base", 16, 256, 8, 16, None), ("lora", 16, 256, 8, 16, 16),
             ("base det", 256, 256, 8, 16, None)]
    assert cases_matching(cases, "") == cases == cases_matching(cases, None)
    assert cases_matching(cases, "('lora'") == [cases[1]]
    assert cases_matching(cases, "('base', 16,|det") == [cases[0], cases[2]]
    assert cases_matching(cases, "('pair'") == []
