"""Benchmarks: each script's `--quick` mode runs to the end and prints its table; the shared
RESULTS.md helper rewrites only its own section."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import _results


def test_write_section_replaces_only_its_block(tmp_path: Path) -> None:
    path = tmp_path / "RESULTS.md"
    path.write_text("# Results\n\nhand-written intro\n")
    _results.write_section("a", "first A", path)
    _results.write_section("b", "only B", path)
    _results.write_section("a", "second A \\1 $x", path)  # regex-special text stays literal
    text = path.read_text()
    assert text.startswith("# Results\n\nhand-written intro\n")
    assert "first A" not in text
    assert "<!-- a:start -->\nsecond A \\1 $x\n<!-- a:end -->" in text
    assert "<!-- b:start -->\nonly B\n<!-- b:end -->" in text
    assert text.index("a:start") < text.index("b:start")  # replaced in place, not re-appended


def test_write_section_creates_the_file(tmp_path: Path) -> None:
    path = tmp_path / "new.md"
    _results.write_section("x", "body", path)
    assert path.read_text().count("<!-- x:start -->") == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "section", "table_header"),
    [
        ("engine.py", "engine", "| model | params | torch engine tok/s"),
        ("trainer.py", "trainer", "| model | params | path | tok/s"),
        ("weight_sync.py", "weight_sync", "| params | MB | channel"),
        ("weight_sync.py --cast", "weight_sync_cast", "| params | channel | MB sent and held"),
        # The heavier ones (seconds of verifiers, tools, SmolLM2 itself) are benchmark runs of
        # their own: `make test-bench` (docs/testing.md), not in CI.
        pytest.param("scoring.py", "scoring", "| verifier | verifier processes",
                     marks=pytest.mark.bench),
        pytest.param("tools.py", "tools", "| tool | ms/call (median) | p95",
                     marks=pytest.mark.bench),
        # SmolLM2, prepared into the user cache (tests/test_real_model.py does it too).
        pytest.param("real_model.py", "real_model", "| max new tokens | dtype | torch engine tok/s",
                     marks=pytest.mark.bench),
        pytest.param("endpoint.py", "endpoint", "| repeat | in-process tok/s | endpoint tok/s",
                     marks=pytest.mark.bench),
    ],
)
def test_quick_mode(tmp_path: Path, script: str, section: str, table_header: str) -> None:
    if script in ("real_model.py", "endpoint.py"):
        from pipelinerl.models.sources import prepare

        prepare("smollm2")
    results = BENCHMARKS / "RESULTS.md"
    before = results.read_text() if results.exists() else None
    out = tmp_path / "RESULTS.md"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    name, *options = script.split()
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / name), *options, "--quick", "--out", str(out)],
        check=False, capture_output=True, text=True, env=env, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert table_header in proc.stdout
    assert f"<!-- {section}:start -->" in out.read_text()
    # Quick mode never touches the committed results.
    assert (results.read_text() if results.exists() else None) == before


@pytest.mark.bench
def test_drain_quick_runs_the_long_chains_example_in_two_modes(tmp_path: Path) -> None:
    """examples/long_chains.yaml through the CLI (shrunk: a few small steps), pipeline and
    conventional: the section's tables come from their metrics."""
    results = BENCHMARKS / "RESULTS.md"
    before = results.read_text()
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "drain.py"), "--quick", "--out", str(tmp_path),
         "--modes", "pipeline", "conventional G=1"],
        check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    section = (tmp_path / "RESULTS.md").read_text()
    for mode in ("pipeline", "conventional G=1"):
        # a row per mode in each table, with the share of its trained sequences by length
        assert section.count(f"| {mode} |") >= 2
    assert "| mode | length | share of trained sequences | lag mean | ESS |" in section
    assert results.read_text() == before


@pytest.mark.bench
def test_soak_quick_samples_every_role_and_the_run_directory(tmp_path: Path) -> None:
    results = BENCHMARKS / "RESULTS.md"
    before = results.read_text()
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "soak.py"), "--quick", "--minutes", "0.75",
         "--every-s", "2", "--out", str(tmp_path)],
        check=False, capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for row in ("| trainer |", "| actor_0 |", "| streams (MB) |"):  # verdicts need a long run
        assert row in proc.stdout, proc.stdout
    # Checkpoints every 20 steps with 50 KB segments: the first segment is gone by the end.
    rollouts = next((tmp_path / "soak" / "streams").glob("*/rollouts"))
    assert not (rollouts / "actor_0.jsonl").exists() and list(rollouts.glob("actor_0@*.jsonl"))
    assert (tmp_path / "soak.png").stat().st_size > 0
    assert results.read_text() == before  # a smoke is never recorded


@pytest.mark.slow
def test_gpu_benchmark_runs_on_the_cpu_with_any_capacities(tmp_path: Path) -> None:
    """benchmarks/gpu.py's engine check at a capacity outside its defaults (a KeyError before:
    its workloads were drawn for the defaults only), and its training-step profile, on the CPU
    with --quick shapes."""
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu.py"), "--device", "cpu", "--quick", "--checks", "2,7",
         "--capacities", "12", "--no-hf", "--out", str(tmp_path)],
        check=False, capture_output=True, text=True, timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and "FAILED" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert "capacity_12" in proc.stdout and "capacity_8" not in proc.stdout
    assert "greedy_same_tokens 1" in proc.stdout  # eager both ways on the CPU: the same tokens
    assert "step_ms" in proc.stdout and (tmp_path / "step_profile.txt").exists()
