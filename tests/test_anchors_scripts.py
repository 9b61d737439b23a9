"""scripts/anchors_compare.py (issue 18's 3 % rule) and anchors_replay.py's inputs, on the
host: the rows over the slack are named, another card's runs are refused, and the replay's
inputs are the anchors' (K distinct experts a token, the used slots then -1)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"script_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


anchors_compare = _load("anchors_compare")
anchors_replay = _load("anchors_replay")


def _run(device, rows):
    return {"versions": {"device": device},
            "results": [dict(op=op, tokens=T, num_experts=E, topk=K, block_size=B,
                             max_loras=L, graph_us=us) for op, T, E, K, B, L, us in rows]}


BASE_ROWS = [("base", 256, 256, 8, 16, None, 4.00), ("lora", 16, 256, 8, 16, 16, 5.00)]


def test_rows_past_the_slack_are_named():
    baseline = _run("H100", BASE_ROWS)
    now = _run("H100", [BASE_ROWS[0][:-1] + (4.10,), BASE_ROWS[1][:-1] + (5.20,)])
    text, over = anchors_compare.compare(now, baseline["results"], "graph_us", 0.03)
    assert over
    assert "2 of 2 baseline rows timed" in text and "1 more than 3% slower" in text
    assert "16   256   8   16  16  5.20 vs 5.00 (1.040x)" in text


def test_within_the_slack_passes():
    baseline = _run("H100", BASE_ROWS)
    now = _run("H100", [r[:-1] + (r[-1] * 1.02,) for r in BASE_ROWS])
    assert not anchors_compare.compare(now, baseline["results"], "graph_us", 0.03)[1]


def test_runs_from_two_cards_are_refused(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_run("NVIDIA H100 80GB HBM3", BASE_ROWS)))
    b.write_text(json.dumps(_run("NVIDIA H200", BASE_ROWS)))
    done = subprocess.run([sys.executable, str(SCRIPTS / "anchors_compare.py"), str(a),
                           "--against", str(b)], capture_output=True, text=True)
    assert done.returncode != 0 and "different devices" in done.stderr


@pytest.mark.parametrize("row", [
    {"op": "base", "tokens": 64, "num_experts": 256, "topk": 8, "block_size": 16},
    {"op": "lora", "tokens": 256, "num_experts": 64, "topk": 6, "block_size": 16,
     "max_loras": 4}])
def test_replay_inputs_are_the_anchors(row):
    ids, mapping, lora_ids, enabled = anchors_replay.inputs(row)
    assert ids.shape == (row["tokens"], row["topk"]) and ids.dtype == np.int32
    assert all(len(set(r)) == row["topk"] for r in ids.tolist())  # distinct experts
    assert ids.min() >= 0 and ids.max() < row["num_experts"]
    if "max_loras" in row:
        L = row["max_loras"]
        used = np.unique(mapping)
        assert lora_ids.shape == (L + 1,) and enabled.shape == (L + 1,) and enabled.all()
        assert np.array_equal(lora_ids[:used.size], used) and (lora_ids[used.size:] == -1).all()
    else:
        assert mapping is None and lora_ids is None
