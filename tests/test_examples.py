"""The examples run (the frameworks an environment lacks are skipped by the script itself)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_frameworks_example_runs():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "frameworks.py")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "torch" in run.stdout and "jax" in run.stdout
