"""`pipelinerl view RUN_DIR`: serve the viewer on 127.0.0.1 (another address only when named),
or with `--export FILE` write one view as a self-contained HTML file and exit."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import secrets
import sys
from pathlib import Path
from typing import Any, Sequence

TOKEN_ENV = "PIPELINERL_VIEW_TOKEN"
# --poll-s is written into the page's script as its timer: inf or nan break the script, a
# value past the browser's timer (~24.8 days) fires it without pause, and under 0.1 s the page
# asks the server all the time. An hour is plenty for "live"; 0 turns polling off.
POLL_S_MIN, POLL_S_MAX = 0.1, 3600.0


class _PollSeconds(argparse.Action):
    """--poll-s, checked as it is parsed: its value is written into the page's script."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 value: Any, option_string: str | Sequence[Any] | None = None) -> None:
        try:
            seconds = float(value)
        except ValueError:
            seconds = math.nan
        if not (seconds == 0 or POLL_S_MIN <= seconds <= POLL_S_MAX):  # nan: neither
            parser.exit(2, f"{parser.prog}: --poll-s {value}: expected 0 (no live update) or "
                           f"seconds from {POLL_S_MIN:g} to {POLL_S_MAX:g}\n")
        setattr(namespace, self.dest, seconds)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="the run directory (output_dir/name), live or copied")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to serve on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8765, help="port (0: a free one)")
    p.add_argument("--poll-s", action=_PollSeconds, default=2.0,
                   help=f"seconds between the page's checks for new records, {POLL_S_MIN:g} to "
                        f"{POLL_S_MAX:g} (0: no live update)")
    p.add_argument("--token", default=None,
                   help=f"access token every request must carry (default ${TOKEN_ENV}; with a "
                        "--host beyond loopback and neither, a random one): printed in the URL")
    p.add_argument("--export", metavar="FILE", default=None,
                   help="write the view as one self-contained HTML file instead of serving")
    p.add_argument("--filter", action="append", default=[], metavar="KEY=VALUE",
                   help="with --export: the view's filters (step_min, reward_max, finish, "
                        "problem, kind, ...) and held-out versions (a, b, mode); repeatable")


def main(args: argparse.Namespace) -> int:
    """0 when served until stopped or exported; 2 on a run directory or option it cannot use."""
    from pipelinerl.viewer.run_data import RunView, ViewerError

    try:
        view = RunView(Path(args.run_dir))
        if args.export:
            return _export(view, args.filter, Path(args.export))
        return _serve(view, args.host, args.port, args.poll_s,
                      _access_token(args.token, args.host))
    except (ViewerError, ValueError, OSError) as err:
        print(f"pipelinerl view: {err}", file=sys.stderr)
        return 2


def _export(view, filters: list[str], out: Path) -> int:
    from pipelinerl.viewer.export import export_html
    from pipelinerl.viewer.panel import PanelCache
    from pipelinerl.viewer.query import EvalQuery, Filters

    query = {}
    for item in filters:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--filter {item!r}: expected KEY=VALUE, e.g. reward_max=0")
        query[key.strip()] = value.strip()
    eval_q = EvalQuery.from_query({k: query.pop(k) for k in ("a", "b", "mode") if k in query})
    html = export_html(view, Filters.from_query(query), eval_q, PanelCache())
    out.write_text(html)
    print(f"wrote {out} ({len(html.encode()) / 1e6:.1f} MB)")
    return 0


def _access_token(given: str | None, host: str) -> str | None:
    """--token, else $PIPELINERL_VIEW_TOKEN, else a fresh one when serving beyond loopback;
    none on loopback (its Host check keeps other sites' pages out)."""
    from pipelinerl.viewer.server import is_loopback

    token = given or os.environ.get(TOKEN_ENV)
    if token or is_loopback(host):
        return token or None
    return secrets.token_urlsafe(24)


def _serve(view, host: str, port: int, poll_s: float, token: str | None) -> int:
    from pipelinerl.viewer.server import is_loopback, serve

    if not is_loopback(host):
        print(f"pipelinerl view: serving on {host}: anyone who can reach it and holds the URL's "
              "token can read this run's samples", file=sys.stderr)

    def ready(url: str) -> None:
        print(f"pipelinerl view: {view.name} at {url} (Ctrl-C stops)", flush=True)

    try:
        asyncio.run(serve(view, host, port, poll_s, ready, token))
    except KeyboardInterrupt:
        return 0
    except OSError as err:  # the port taken, the address not this machine's
        raise OSError(f"cannot serve on {host}:{port}: {err.strerror or err} (--port 0 picks "
                      "a free port)") from err
    return 0
