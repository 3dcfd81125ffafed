"""Smoke test of the learning-speed benchmark: both schedules run end to end (not timed)."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "learning_speed.py"


def test_quick_mode_runs_pipeline_and_conventional(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| pipeline |" in out.stdout and "| conventional G=2 |" in out.stdout
    assert (tmp_path / "learning_speed.png").stat().st_size > 0
