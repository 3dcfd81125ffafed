"""Shared by the benchmark scripts: the machine description and the sections of RESULTS.md.

Each script owns one section, delimited by `<!-- name:start -->` / `<!-- name:end -->`, and
rewrites only that block, so scripts (and hand-written sections) never clobber each other.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import shlex
import sys
import time
from pathlib import Path

import torch

from pipelinerl.metrics.tables import markdown_table

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def results_file(out: Path | None) -> Path:
    """benchmarks/RESULTS.md, or RESULTS.md in the directory `out` (a smoke run's)."""
    if out is None:
        return RESULTS
    out.mkdir(parents=True, exist_ok=True)
    return out / "RESULTS.md"


def write_section(name: str, markdown: str, path: Path = RESULTS) -> None:
    """Replace the block of section `name` in `path` with `markdown`, or append it."""
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise ValueError(f"section name {name!r} must be letters, digits, '_' or '-'")
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{markdown.strip()}\n{end}"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        # A function replacement, so backslashes in the markdown are not read as escapes.
        text = pattern.sub(lambda _: block, text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


class Timer:
    """Wall and CPU time since creation. CPU time (this process, one thread) is what the work
    cost; wall time adds the waits for a core when other jobs load the machine."""

    def __init__(self) -> None:
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()

    def elapsed(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall0, time.process_time() - self.cpu0


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


def environment(load_at_start: tuple[float, float, float] | None,
                command: str | None = None) -> str:
    """Markdown lines: command (default: this process's), machine, torch, date, and the load
    average seen at start (None: the figures come from runs made earlier, whose load this
    command did not see)."""
    cores = os.cpu_count() or 0
    if load_at_start is None:
        load_line = "- load average: not this command's (it reports runs made earlier)\n"
    else:
        # More runnable work than the benchmark's own single thread means other jobs competed.
        busy = load_at_start[0] > 1.0
        note = " (other work was running: figures are lower and noisier than on a quiet machine)" if busy else ""
        load = ", ".join(f"{x:.2f}" for x in load_at_start)
        load_line = f"- load average at start (1/5/15 min): {load}{note}\n"
    if command is None:
        command = this_command()
    return (
        f"- command: `{command}`\n"
        f"- machine: {cpu_model()}, {cores} cores; torch {torch.__version__}, python "
        f"{platform.python_version()}; 1 torch thread per process\n"
        f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}\n"
        + load_line
    )


def this_command() -> str:
    return "python " + shlex.join([os.path.relpath(sys.argv[0]), *sys.argv[1:]])


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A markdown table ending in a newline, to be joined with the section's other text."""
    return markdown_table(headers, rows) + "\n"
