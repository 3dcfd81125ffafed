"""benchmarks/step_cost.py: the decode-step cost against the sequences decoding."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import step_cost  # noqa: E402


def test_the_line_splits_a_step_into_its_fixed_part_and_a_part_per_sequence() -> None:
    fixed, per_sequence = step_cost.linear_fit({1: 1.3, 8: 2.0, 64: 7.6})
    assert fixed == pytest.approx(1.2) and per_sequence == pytest.approx(0.1)


def test_the_engine_pays_only_for_the_sequences_it_decodes() -> None:
    """The real engine on the long_chains starting model: a step over 64 sequences costs
    more than one over a single sequence (an engine that decoded every slot whatever their
    state would cost the same: ratio ~1), and the report gives a token's cost against a full
    engine's. The ratio is ~3 on this CPU quiet and ~2 beside two busy loops (the fixed
    part, Python per step, suffers most from a shared core), so the bound is 1.5."""
    cost = step_cost.measure([1, 64], steps=10, reps=3)
    assert cost[64] > 1.5 * cost[1] > 0
    text = step_cost.report(cost, (0.0, 0.0, 0.0), steps=10, reps=3)
    assert f"| 64 | 100% | {cost[64]:.2f} | 1.00 |" in text
    assert f"| 1 | 2% | {cost[1]:.2f} |" in text and "| 64x |" in text
