"""The run's health panel a person reads at a glance, every curve against wall-clock."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from pipelinerl.types import LENGTH_LABELS  # noqa: E402

# Panel titles, in reading order (left to right, top to bottom).
PANELS = (
    "success",
    "ESS and entropy",
    "lag (steps)",
    "mismatch and KL(mu||pi)",
    "throughput (tokens/s)",
    "clipped and truncated",
    "engine slots and trainer idle",
    "lag by completion length (tokens)",
)


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(time_s, value) of the records that hold `key` (actor stats and held-out accuracy come
    only on some steps; JSONL null stands for a non-finite value)."""
    pts = sorted((r["time_s"], r[key]) for r in records
                 if r.get(key) is not None and r.get("time_s") is not None)
    return [t for t, _ in pts], [v for _, v in pts]


def _by_length(records: list[dict[str, Any]], label: str, field: str) -> list[dict[str, Any]]:
    """Records of `field` of length bin `label` (the step's `by_length`), as flat records."""
    return [{"time_s": r.get("time_s"), field: b[label][field]} for r in records
            if label in (b := r.get("by_length") or {})]


def _plot(ax: Axes, records: list[dict[str, Any]], key: str, label: str, **style: Any) -> bool:
    t, y = _series(records, key)
    if t:
        ax.plot(t, y, label=label, **style)
    return bool(t)


def _success(ax: Axes, records: list[dict[str, Any]]) -> None:
    _plot(ax, records, "success", "batch", alpha=0.35)
    _plot(ax, records, "success_ema", "batch (EMA)")
    _plot(ax, records, "eval/sampled/pass@1", "held-out (sampled)", marker="o", color="tab:red")
    _plot(ax, records, "eval/greedy", "held-out (greedy)", marker="s", color="tab:brown")
    ax.set_ylim(0, 1)
    ax.legend(loc="lower right", fontsize="small")


def _ess_entropy(ax: Axes, records: list[dict[str, Any]]) -> None:
    _plot(ax, records, "ess", "ESS", color="tab:green")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("ESS", color="tab:green")
    right = ax.twinx()
    _plot(right, records, "entropy", "entropy", color="tab:purple")
    right.set_ylabel("entropy (nats/token)", color="tab:purple")


def _lag(ax: Axes, records: list[dict[str, Any]]) -> None:
    _plot(ax, records, "lag_mean", "mean")
    _plot(ax, records, "lag_max", "max", alpha=0.6)
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper right", fontsize="small")


def _mismatch_kl(ax: Axes, records: list[dict[str, Any]]) -> None:
    _plot(ax, records, "mismatch_abs", "|log pi - log mu|")
    _plot(ax, records, "mismatch_abs_lag0", "same, lag 0", alpha=0.6)
    _plot(ax, records, "mismatch_k3", "KL k3")
    _plot(ax, records, "kl_k1", "KL k1", alpha=0.6)
    _plot(ax, records, "kl_ref", "KL(pi||ref) k3", ls="--")  # with trainer.loss.kl_coef > 0
    ax.legend(loc="upper right", fontsize="small")


def _throughput(ax: Axes, records: list[dict[str, Any]]) -> None:
    _plot(ax, records, "actor_tokens_per_s", "actor")
    _plot(ax, records, "trainer_tokens_per_s", "trainer")
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right", fontsize="small")


def _clipped(ax: Axes, records: list[dict[str, Any]]) -> None:
    _plot(ax, records, "clip_frac", "tokens clipped")
    _plot(ax, records, "completion_truncated_frac", "completions cut at max_new_tokens")
    ax.set_ylim(0, 1)
    ax.legend(loc="upper right", fontsize="small")


def _utilisation(ax: Axes, records: list[dict[str, Any]]) -> None:
    _plot(ax, records, "actor_slot_occupancy", "slots decoding per engine step")
    _plot(ax, records, "actor_slot_time_frac", "slot-seconds decoding")
    _plot(ax, records, "trainer_wait_frac", "trainer idle (since start)")
    _plot(ax, records, "trainer_idle_frac", "trainer idle (since last step)", alpha=0.35)
    ax.set_ylim(0, 1.05)
    ax.legend(loc="lower right", fontsize="small")


def _length_labels(records: list[dict[str, Any]]) -> list[str]:
    """The length bins of the records' `by_length`, shortest first."""
    seen = {label for r in records for label in r.get("by_length") or {}}
    return [label for label in LENGTH_LABELS if label in seen]


def _lag_by_length(ax: Axes, records: list[dict[str, Any]]) -> None:
    for label in _length_labels(records):
        _plot(ax, _by_length(records, label, "lag_mean"), "lag_mean", label)
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper right", fontsize="small", ncol=2)


def panel_figure(records: list[dict[str, Any]], title: str = "") -> Figure:
    """The panel of a run's metrics.jsonl records: one subplot per entry of `PANELS`."""
    fig, axes = plt.subplots(4, 2, figsize=(11, 12), sharex=True)
    draw = (_success, _ess_entropy, _lag, _mismatch_kl, _throughput, _clipped, _utilisation,
            _lag_by_length)
    for ax, name, fn in zip(axes.flat, PANELS, draw):
        fn(ax, records)
        ax.set_title(name)
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("wall-clock (s)")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_run(records: list[dict[str, Any]], out: Path, title: str = "") -> Path:
    """Write the panel (`panel_figure`) to `out` as a PNG; returns `out`."""
    fig = panel_figure(records, title)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
