"""The viewer's local web server (aiohttp): the page, and the JSON it reads from the run's
records, read again as they grow. Loopback only unless the user names an address."""

from __future__ import annotations

import asyncio
import io
import ipaddress
import threading
from typing import Any, Awaitable, Callable

from aiohttp import web

from pipelinerl.viewer.export import export_html, page_html
from pipelinerl.viewer.query import EvalQuery, Filters, QueryError, compare_eval, select_groups
from pipelinerl.viewer.run_data import RunView

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
VIEW: web.AppKey[RunView] = web.AppKey("view", RunView)
POLL_S: web.AppKey[float] = web.AppKey("poll_s", float)
PANEL: web.AppKey["PanelCache"] = web.AppKey("panel", object)  # type: ignore[arg-type]


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


@web.middleware
async def _clear_errors(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """A bad query answers 400 with what was wrong, as JSON the page shows."""
    try:
        return await handler(request)
    except QueryError as err:
        return web.json_response({"error": str(err)}, status=400)


async def _fresh(request: web.Request) -> RunView:
    view = request.app[VIEW]
    await asyncio.to_thread(view.refresh)
    return view


async def _page(request: web.Request) -> web.Response:
    html = page_html().replace("__POLL_S__", str(request.app[POLL_S]))
    return web.Response(text=html, content_type="text/html")


async def _summary(request: web.Request) -> web.Response:
    view = await _fresh(request)
    return web.json_response(await asyncio.to_thread(view.summary))


async def _groups(request: web.Request) -> web.Response:
    f = Filters.from_query(request.query)
    view = await _fresh(request)
    return web.json_response(select_groups(view.groups(), f))


async def _eval(request: web.Request) -> web.Response:
    q = EvalQuery.from_query(request.query)
    view = await _fresh(request)
    return web.json_response(compare_eval(view.eval_rows(), q))


async def _panel(request: web.Request) -> web.Response:
    view = await _fresh(request)
    if not view.metrics():
        return web.json_response({"error": "no metrics.jsonl rows yet"}, status=404)
    png = await asyncio.to_thread(request.app[PANEL].png, view)
    return web.Response(body=png, content_type="image/png",
                        headers={"Cache-Control": "no-store"})


async def _export(request: web.Request) -> web.Response:
    query = dict(request.query)
    eval_q = EvalQuery.from_query({k: query.pop(k) for k in ("a", "b", "mode") if k in query})
    f = Filters.from_query(query)
    view = await _fresh(request)
    html = await asyncio.to_thread(export_html, view, f, eval_q, request.app[PANEL])
    name = f"{view.name}-view.html"
    return web.Response(text=html, content_type="text/html",
                        headers={"Content-Disposition": f'attachment; filename="{name}"'})


async def _no_icon(request: web.Request) -> web.Response:
    return web.Response(status=204)  # browsers ask; a 404 would log an error in the console


def make_app(view: RunView, poll_s: float = 2.0) -> web.Application:
    app = web.Application(middlewares=[_clear_errors])
    app[VIEW], app[POLL_S], app[PANEL] = view, poll_s, PanelCache()
    app.router.add_get("/", _page)
    app.router.add_get("/api/summary", _summary)
    app.router.add_get("/api/groups", _groups)
    app.router.add_get("/api/eval", _eval)
    app.router.add_get("/api/panel.png", _panel)
    app.router.add_get("/export.html", _export)
    app.router.add_get("/favicon.ico", _no_icon)
    return app


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: not known to be loopback
        return False


async def serve(view: RunView, host: str, port: int, poll_s: float,
                ready: Callable[[str], None]) -> None:
    """Serve until cancelled; `ready(url)` once listening (port 0: a free one)."""
    runner = web.AppRunner(make_app(view, poll_s), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1]
        shown = f"[{host}]" if ":" in host else host
        ready(f"http://{shown}:{bound}/")
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
