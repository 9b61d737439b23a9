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
