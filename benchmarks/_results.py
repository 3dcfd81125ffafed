"""Shared by the benchmark scripts: the machine description and the sections of RESULTS.md.

Each script owns one section, delimited by `<!-- name:start -->` / `<!-- name:end -->`, and
rewrites only that block, so scripts (and hand-written sections) never clobber each other.
"""

from __future__ import annotations

import datetime
import gzip
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from pipelinerl.metrics.tables import markdown_table

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
ROOT = Path(__file__).resolve().parents[1]


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
    """This process's command line, an argument naming a path outside the checkout (a run
    directory) written as OUT: a record names no path of the machine that made it."""
    def portable_arg(arg: str) -> str:
        outside = os.path.isabs(arg) and not Path(arg).resolve().is_relative_to(ROOT)
        return "OUT" if outside else arg

    return "python " + shlex.join([os.path.relpath(sys.argv[0]),
                                   *map(portable_arg, sys.argv[1:])])


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A markdown table ending in a newline, to be joined with the section's other text."""
    return markdown_table(headers, rows) + "\n"


def train(args: list[str], what: str) -> dict[str, Any]:
    """`pipelinerl train ARGS` from the checkout's root, its output kept from the console;
    exits naming `what` and the end of its stderr if it fails. Returns the run's record: when
    it started, the load then, its wall-clock seconds."""
    print("$ pipelinerl train", " ".join(args), flush=True)
    record: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M"),
                              "load_at_start": [round(x, 2) for x in load_average()]}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pipelinerl.cli", "train", *args], cwd=ROOT,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed:\n{proc.stderr[-3000:]}")
    record["wall_s"] = round(time.monotonic() - t0)
    return record


def keep_run(run_dir: Path, records: Path, name: str, record: dict[str, Any] | None = None,
             jsonl: tuple[str, ...] = ("metrics",), panel: bool = False) -> None:
    """Copy a finished run's records into `records` as it ends: `<name>.config.yaml`, each
    of its `jsonl` files gzipped (`<name>.metrics.jsonl.gz`, ...), its health panel
    (`<name>.png`) with `panel`, and `record` as `<name>.run.json`."""
    records.mkdir(parents=True, exist_ok=True)
    config = (run_dir / "config.yaml").read_text()
    (records / f"{name}.config.yaml").write_text(portable(config, run_dir.parent))
    for stem in jsonl:
        with (run_dir / f"{stem}.jsonl").open("rb") as src, \
                gzip.open(records / f"{name}.{stem}.jsonl.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
    if panel and (run_dir / "metrics.png").exists():
        shutil.copy(run_dir / "metrics.png", records / f"{name}.png")
    if record is not None:
        (records / f"{name}.run.json").write_text(json.dumps(record) + "\n")


def portable(config: str, output_dir: Path) -> str:
    """A run's resolved config without this machine's paths: its output directory (a
    temporary one) as `<output_dir>`, the home directory (the prepared-model cache) as `~`."""
    return config.replace(str(output_dir), "<output_dir>").replace(str(Path.home()), "~")


def kept_rows(records: Path, name: str) -> list[dict[str, Any]]:
    """The metrics.jsonl rows `keep_run` kept for `name`."""
    with gzip.open(records / f"{name}.metrics.jsonl.gz", "rt") as f:
        return [json.loads(line) for line in f if line.strip()]
