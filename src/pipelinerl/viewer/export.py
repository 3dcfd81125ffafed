"""One view of the viewer as a self-contained HTML file to share: the page itself, with the
view's groups, held-out comparison and health panel embedded (no server, no network, no path
of this machine's)."""

from __future__ import annotations

import base64
import json
from importlib.resources import files
from typing import TYPE_CHECKING, Any

from pipelinerl.viewer.query import EvalQuery, Filters, compare_eval, select_groups

if TYPE_CHECKING:
    from pipelinerl.viewer.panel import PanelCache
    from pipelinerl.viewer.run_data import RunView

# The page's data slot: `null` while served, the view's data in an export.
SLOT = '<script id="pipelinerl-data" type="application/json">null</script>'


def page_html() -> str:
    """The page: one file, its script and style inline (no build step)."""
    return files("pipelinerl.viewer").joinpath("page.html").read_text()


def _embed(data: dict[str, Any]) -> str:
    # `<` escaped so no completion's text can close the script element.
    text = json.dumps(data).replace("<", "\\u003c")
    return SLOT.replace("null", text)


def export_html(view: RunView, f: Filters, eval_q: EvalQuery, panel: PanelCache) -> str:
    """The page with the view of `f` (its one page of groups) and `eval_q` built in."""
    png = panel.png(view) if view.metrics() else b""
    data = {
        # The run directory's name, not its path: where it lies on this machine is neither
        # the reader's business nor of use to them.
        "summary": {**view.summary(), "run_dir": view.run_dir.resolve().name},
        "filters": f.query(),
        "groups": select_groups(view.groups(), f),
        "eval": compare_eval(view.eval_rows(), eval_q),
        "panel": "data:image/png;base64," + base64.b64encode(png).decode() if png else None,
    }
    page = page_html()
    assert SLOT in page, "page.html lost its data slot"
    return page.replace("__POLL_S__", "0").replace(SLOT, _embed(data))
