"""The viewer's local web server (aiohttp): the page, and the JSON it reads from the run's
records, read again as they grow. Loopback only unless the user names an address; a request
is answered only when it names this server (its Host, its Origin) and, where one is set, carries
the access token."""

from __future__ import annotations

import asyncio
import ipaddress
import secrets
import socket
from dataclasses import dataclass
from typing import Awaitable, Callable
from urllib.parse import quote

from aiohttp import hdrs, web

from pipelinerl.viewer.export import export_html, page_html
from pipelinerl.viewer.panel import PanelCache
from pipelinerl.viewer.query import (
    EvalQuery,
    Filters,
    QueryError,
    compare_eval,
    select_groups,
)
from pipelinerl.viewer.run_data import RunView

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
VIEW: web.AppKey[RunView] = web.AppKey("view", RunView)
POLL_S: web.AppKey[float] = web.AppKey("poll_s", float)
PANEL: web.AppKey["PanelCache"] = web.AppKey("panel", object)  # type: ignore[arg-type]
ACCESS: web.AppKey["Access"] = web.AppKey("access", object)  # type: ignore[arg-type]

LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})
_ALL_INTERFACES = frozenset({"0.0.0.0", "::", ""})


@dataclass(frozen=True)
class Access:
    """Whom the server answers. A request's Host must name it: a loopback name, the address it
    serves on (or, on every interface, this machine's name or the address the request came
    to), with no port or the one it came to (any port for a loopback name: a tunnel's), so
    that no DNS-rebinding page (a Host of its own)
    reads the run; an Origin header must be the server's own, so that no other local page
    does; and with `token`, every request must carry it."""

    names: frozenset[str]
    token: str | None = None

    @classmethod
    def serving(cls, host: str, token: str | None = None) -> Access:
        names = {*LOOPBACK_NAMES, host.lower()}
        if host in _ALL_INTERFACES:
            names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
        return cls(frozenset(names), token)


@web.middleware
async def _clear_errors(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """A bad query answers 400 with what was wrong, as JSON the page shows."""
    try:
        return await handler(request)
    except QueryError as err:
        return web.json_response({"error": str(err)}, status=400)


def _arrived_at(request: web.Request) -> tuple[str, int]:
    """The address and port the request's connection came to."""
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    return (sockname[0], sockname[1]) if sockname else ("", 0)


def _split_host(header: str) -> tuple[str, str]:
    """A Host header as its name and its ':port' ('' when none); ('', '') when malformed."""
    if header.startswith("["):  # an IPv6 address
        name, closed, rest = header[1:].partition("]")
        return (name, rest) if closed else ("", "")
    name, colon, port = header.partition(":")
    return name, colon + port


def _not_ours(request: web.Request, access: Access) -> str | None:
    """Why the request names another server than this one (its Host or its Origin), or None."""
    address, port = _arrived_at(request)
    host = request.headers.get(hdrs.HOST, "")
    name, rest = _split_host(host)
    # A loopback name with any port: an ssh tunnel's local port may differ from this one, and
    # a rebinding page's Host is its own name, whatever its port.
    any_port = name.lower() in LOOPBACK_NAMES and rest[1:].isdigit()
    if name.lower() not in access.names | {address} or not (
            any_port or rest in ("", f":{port}")):
        return (f"refused: Host {host!r} is not this viewer (it answers "
                f"{', '.join(sorted(access.names - {''}))} on port {port})")
    origin = request.headers.get(hdrs.ORIGIN)
    if origin is not None and origin.lower() != f"http://{host}".lower():
        return f"refused: a page of {origin} may not read this viewer (http://{host})"
    return None


def _token_cookie(port: int) -> str:
    return f"pipelinerl_view_{port}"  # a browser keeps a cookie per host, not per port


def _carries(request: web.Request, token: str, cookie: str) -> bool:
    auth = request.headers.get(hdrs.AUTHORIZATION, "")
    given = (request.query.get("token"), request.cookies.get(cookie),
             auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else None)
    return any(secrets.compare_digest(g.encode(), token.encode()) for g in given if g)


def _refuse(request: web.Request, status: int, reason: str,
            headers: dict[str, str] | None = None) -> web.Response:
    """One line: as JSON where the page reads it (the API), as text elsewhere."""
    if request.path.startswith("/api/"):
        return web.json_response({"error": reason}, status=status, headers=headers)
    return web.Response(status=status, text=reason + "\n", headers=headers)


@web.middleware
async def _guard(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """Every request (page, API, export) checked against the app's `Access`; a token given in
    the query is set as a cookie, which the page's own requests then carry."""
    access = request.app[ACCESS]
    reason = _not_ours(request, access)
    if reason:
        return _refuse(request, 403, reason)
    if access.token is None:
        return await handler(request)
    cookie = _token_cookie(_arrived_at(request)[1])
    if not _carries(request, access.token, cookie):
        return _refuse(request, 401, "refused: this viewer needs its access token (the URL "
                       "it printed, ?token=...; or Authorization: Bearer ...)",
                       {hdrs.WWW_AUTHENTICATE: 'Bearer realm="pipelinerl view"'})
    in_query = "token" in request.query
    if in_query:  # no filter of that name: the handlers never see it
        request = request.clone(rel_url=request.rel_url.with_query(
            [(k, v) for k, v in request.query.items() if k != "token"]))
    resp = await handler(request)
    if in_query:
        resp.set_cookie(cookie, access.token, path="/", httponly=True, samesite="Strict")
    return resp


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


def make_app(view: RunView, poll_s: float = 2.0, host: str = "127.0.0.1",
             token: str | None = None) -> web.Application:
    """The app for a server on `host` (see `Access`)."""
    app = web.Application(middlewares=[_guard, _clear_errors])
    app[VIEW], app[POLL_S], app[PANEL] = view, poll_s, PanelCache()
    app[ACCESS] = Access.serving(host, token)
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
                ready: Callable[[str], None], token: str | None = None) -> None:
    """Serve until cancelled; `ready(url)` once listening (port 0: a free one), the URL with
    `token` when one is asked for."""
    runner = web.AppRunner(make_app(view, poll_s, host, token), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1]
        shown = f"[{host}]" if ":" in host else host
        ready(f"http://{shown}:{bound}/" + (f"?token={quote(token)}" if token else ""))
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
