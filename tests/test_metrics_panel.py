"""The metrics panel (metrics.png) and the names the logger gives TensorBoard / W&B."""

import json
from pathlib import Path
from typing import Any

import pytest

from pipelinerl.config import MetricsConfig
from pipelinerl.metrics.logger import MetricsLogger, scalars
from pipelinerl.records import read_rows
from pipelinerl.metrics.plot import panel_figure, plot_run

TITLES = ["success", "ESS and entropy", "lag (steps)", "mismatch and KL(mu||pi)",
          "throughput (tokens/s)", "clipped and truncated", "engine slots and trainer idle",
          "lag by completion length (tokens)"]


def _records(heldout: bool) -> list[dict[str, Any]]:
    out = []
    for step in range(1, 6):
        r: dict[str, Any] = {
            "step": step, "time_s": 2.0 * step, "success": 0.1 * step, "success_ema": 0.08 * step,
            "ess": 0.99, "entropy": 1.5 - 0.1 * step, "lag_mean": 1.5, "lag_max": 3.0,
            "mismatch_abs": 0.01, "mismatch_abs_lag0": 0.001, "mismatch_k3": 0.002,
            "kl_k1": 0.003, "trainer_tokens_per_s": 900.0, "clip_frac": 0.0,
            "completion_truncated_frac": 0.2, "lag_hist": {"0": 10, "1": 20},
            "trainer_wait_frac": 0.3, "trainer_idle_frac": 0.1 * step,
            # long completions only from the third step on
            "by_length": {"1-31": {"sequences": 4, "tokens": 40, "ess": 1.0, "lag_mean": 0.5},
                          **({"128-255": {"sequences": 1, "tokens": 200, "ess": 0.9,
                                          "lag_mean": 2.0 + step}} if step > 2 else {})},
        }
        if step > 1:  # actor stats come from the second step on
            r["actor_tokens_per_s"] = 1800.0
            r["actor_slot_occupancy"], r["actor_slot_time_frac"] = 0.9, 0.6
        out.append(r)
    if heldout:
        # The evaluator's results: records of their own, logged after later steps, at the
        # step and wall-clock of the version evaluated (0 before any update).
        for version in (4, 0, 2):
            out.append({"step": version, "time_s": 2.0 * version, "eval/version": version,
                        "eval/greedy": 0.5 + 0.01 * version,
                        "eval/sampled/pass@1": 0.3 + 0.05 * version})
    return out


def _labels(ax: Any) -> list[str]:
    return [line.get_label() for line in ax.get_lines()]


def test_panel_has_the_expected_subplots_and_curves() -> None:
    fig = panel_figure(_records(heldout=True), title="run")
    titled = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert list(titled) == TITLES
    assert _labels(titled["success"]) == [
        "batch", "batch (EMA)", "held-out (sampled)", "held-out (greedy)"]
    # held-out accuracy: only the evaluated versions, in time order at their wall-clock
    sampled, greedy = titled["success"].get_lines()[2:]
    assert list(sampled.get_xdata()) == [0.0, 4.0, 8.0]
    assert list(sampled.get_ydata()) == pytest.approx([0.3, 0.4, 0.5])
    assert list(greedy.get_xdata()) == [0.0, 4.0, 8.0]
    # entropy on the twin axis of the ESS subplot
    (twin,) = [ax for ax in fig.axes if not ax.get_title()]
    assert twin.get_position().bounds == titled["ESS and entropy"].get_position().bounds
    assert _labels(twin) == ["entropy"]
    assert _labels(titled["mismatch and KL(mu||pi)"]) == [
        "|log pi - log mu|", "same, lag 0", "KL k3", "KL k1"]
    actor, trainer = titled["throughput (tokens/s)"].get_lines()
    assert (actor.get_label(), list(actor.get_xdata())) == ("actor", [4.0, 6.0, 8.0, 10.0])
    assert trainer.get_label() == "trainer"
    assert _labels(titled["lag (steps)"]) == ["mean", "max"]
    assert _labels(titled["engine slots and trainer idle"]) == [
        "slots decoding per engine step", "slot-seconds decoding", "trainer idle (since start)",
        "trainer idle (since last step)"]
    # one curve per length bin seen, shortest first, each at the steps that had the bin
    short, long_ = titled["lag by completion length (tokens)"].get_lines()
    assert (short.get_label(), list(short.get_ydata())) == ("1-31", [0.5] * 5)
    assert (long_.get_label(), list(long_.get_xdata())) == ("128-255", [6.0, 8.0, 10.0])
    assert list(long_.get_ydata()) == [5.0, 6.0, 7.0]
    assert [ax.get_xlabel() for ax in fig.axes if ax.get_xlabel()] == ["wall-clock (s)"] * 2


def test_panel_without_heldout_has_no_heldout_curve() -> None:
    fig = panel_figure(_records(heldout=False))
    success = next(ax for ax in fig.axes if ax.get_title() == "success")
    assert _labels(success) == ["batch", "batch (EMA)"]


def test_plot_run_writes_a_png(tmp_path: Path) -> None:
    out = plot_run(_records(heldout=True), tmp_path / "metrics.png", title="run")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class _FakeWriter:
    def __init__(self) -> None:
        self.scalars: dict[str, float] = {}

    def add_scalar(self, key: str, value: float, step: int) -> None:
        self.scalars[key] = value


def test_lag_histogram_to_jsonl_as_dict_and_to_tensorboard_as_scalars_with_fake_writer(
        tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path, MetricsConfig(tensorboard=False), "run", {})
    logger._tb = writer = _FakeWriter()
    logger.log(3, {"ess": 0.9, "lag_hist": {"0": 5, "2": 7}, "entropy": float("nan")})
    logger._tb = None
    logger.close()
    (record,) = read_rows(tmp_path / "metrics.jsonl")
    assert record == {"step": 3, "ess": 0.9, "lag_hist": {"0": 5, "2": 7}, "entropy": None}
    assert writer.scalars == {"ess": 0.9, "lag_hist/0": 5, "lag_hist/2": 7}
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["lag_hist"]["2"] == 7


def test_scalars_flattens_every_level() -> None:
    assert scalars({"a": 1, "h": {"0": 2, "1": 3}}) == {"a": 1, "h/0": 2, "h/1": 3}
    assert scalars({"by_length": {"1-31": {"ess": 0.9, "lag_mean": 1.0}}}) == {
        "by_length/1-31/ess": 0.9, "by_length/1-31/lag_mean": 1.0}
