"""examples/notebook.ipynb runs top to bottom (its code cells in order, in one namespace; on
the NumPy backend in CI), so it cannot rot."""

import json
from pathlib import Path

NOTEBOOK = Path(__file__).resolve().parent.parent / "examples" / "notebook.ipynb"


def test_notebook_runs_top_to_bottom():
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    namespace = {"__name__": "__notebook__"}
    ran = 0
    for cell in cells:
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), f"{NOTEBOOK.name}[{ran}]", "exec"), namespace)
            ran += 1
    assert ran >= 4
    assert "routes in" in namespace["base"].summary()
