"""The run's health panel (metrics/plot.py's figure) as PNG bytes, for the served page and
the exported one."""

from __future__ import annotations

import io
import threading
from typing import Any

from pipelinerl.viewer.run_data import RunView


class PanelCache:
    """The health panel (metrics/plot.py's figure) as PNG bytes, drawn again only when
    metrics.jsonl changed; one drawing at a time (pyplot is not thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: tuple[int | None, int] | None = None
        self._png = b""

    def png(self, view: RunView) -> bytes:
        key = view.metrics_mark
        with self._lock:
            if key != self._key:
                self._png, self._key = _draw_panel(view.metrics(), view.name), key
            return self._png


def _draw_panel(records: list[dict[str, Any]], title: str) -> bytes:
    import matplotlib.pyplot as plt

    from pipelinerl.metrics.plot import panel_figure

    fig = panel_figure(records, title)
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=72)
    plt.close(fig)
    return out.getvalue()
