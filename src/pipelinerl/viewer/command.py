"""`pipelinerl view RUN_DIR`: serve the viewer on 127.0.0.1 (another address only when named),
or with `--export FILE` write one view as a self-contained HTML file and exit."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="the run directory (output_dir/name), live or copied")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to serve on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8765, help="port (0: a free one)")
    p.add_argument("--poll-s", type=float, default=2.0,
                   help="seconds between the page's checks for new records (0: no live update)")
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
        return _serve(view, args.host, args.port, args.poll_s)
    except (ViewerError, ValueError, OSError) as err:
        print(f"pipelinerl view: {err}", file=sys.stderr)
        return 2


def _export(view, filters: list[str], out: Path) -> int:
    from pipelinerl.viewer.export import export_html
    from pipelinerl.viewer.query import EvalQuery, Filters
    from pipelinerl.viewer.server import PanelCache

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


def _serve(view, host: str, port: int, poll_s: float) -> int:
    from pipelinerl.viewer.server import is_loopback, serve

    if not is_loopback(host):
        print(f"pipelinerl view: serving on {host}: anyone who can reach it can read this run's "
              "samples", file=sys.stderr)

    def ready(url: str) -> None:
        print(f"pipelinerl view: {view.name} at {url} (Ctrl-C stops)", flush=True)

    try:
        asyncio.run(serve(view, host, port, poll_s, ready))
    except KeyboardInterrupt:
        return 0
    except OSError as err:  # the port taken, the address not this machine's
        raise OSError(f"cannot serve on {host}:{port}: {err.strerror or err} (--port 0 picks "
                      "a free port)") from err
    return 0
