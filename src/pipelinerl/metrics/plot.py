"""Plots a person can look at: success and ESS against wall-clock."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_run(records: list[dict[str, Any]], out: Path, title: str = "") -> Path:
    t = [r["time_s"] for r in records]
    fig, (ax_s, ax_e) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ax_s.plot(t, [r["success"] for r in records], label="success (batch)", alpha=0.35)
    if "success_ema" in records[0]:
        ax_s.plot(t, [r["success_ema"] for r in records], label="success (EMA)")
    ax_s.set_ylabel("success rate")
    ax_s.set_ylim(0, 1)
    ax_s.legend(loc="lower right")
    ax_s.grid(alpha=0.3)
    ax_e.plot(t, [r["ess"] for r in records], color="tab:green")
    ax_e.set_ylabel("ESS")
    ax_e.set_ylim(0, 1.05)
    ax_e.set_xlabel("wall-clock (s)")
    ax_e.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
