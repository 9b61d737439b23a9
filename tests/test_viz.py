"""Summaries and pictures of an alignment (host arrays; the contract's worked examples)."""

import numpy as np
import pytest

import moe_lora_align as mla
from moe_lora_align import viz

IDS = np.array([[1, 3], [0, 1], [3, 1], [5, -1]], np.int32)
LORA_IDS = np.array([[0, 2], [1, 2], [2, 0], [0, 1]], np.int32)
MAPPING = np.array([1, -1, 1, 0], np.int32)


def test_base_summary_counts_routes_tiles_and_padding():
    res = mla.moe_align_block_size(IDS, 4, 4)
    assert viz.row_stats(res) == [dict(total=12, routes=6, tiles=3, experts=3, padding=0.5)]
    assert res.summary() == ("Alignment: 6 routes in 3 tiles of 3 experts, 12 entries with "
                             "padding (50.0 %)")
    assert "<table>" in res._repr_html_()


def test_lora_summary_per_slot():
    res = mla.moe_lora_align_block_size(LORA_IDS, MAPPING, 2, 3, 2,
                                        lora_ids=np.array([-1, 0, 1], np.int32))
    stats = viz.row_stats(res)
    assert [s["routes"] for s in stats] == [2, 4] and [s["total"] for s in stats] == [4, 4]
    assert "2 of 2 slots hold routes; 6 routes in 4 tiles" in res.summary()


def test_results_still_unpack_like_tuples():
    s, e, n = mla.moe_align_block_size(IDS, 4, 4)
    assert int(n[0]) == 12


def test_draw():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    ax = viz.draw(mla.moe_align_block_size(IDS, 4, 4))
    assert len(ax.patches) == 2 * 3  # three tiles: routes and padding
