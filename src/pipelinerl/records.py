"""The run's append-only JSONL records (metrics.jsonl, trained.jsonl, attempts.jsonl): each row
on disk when its write returns, and a row cut by a crash never costs the rows after it.

A crash (or a full disk) may leave a file's last line cut short. An append first ends that
line, so the cut row stays one unparseable line instead of a prefix the next row glues onto;
readers skip such a line with a warning naming the file and line.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import IO, Any

# The run directory's record files (layouts: docs/algorithm.md "Metrics", docs/viewing.md).
METRICS = "metrics.jsonl"
SAMPLES, ROLLED = "samples.jsonl", "samples.1.jsonl"
EVAL_SAMPLES, EVAL_ROLLED = "eval_samples.jsonl", "eval_samples.1.jsonl"

log = logging.getLogger(__name__)


def open_synced(path: Path, mode: str) -> IO[str]:
    """`path`, line-buffered and opened with O_DSYNC: each row is on disk when its write
    returns. A checkpoint counts the rows written before it and is itself fsynced, so after a
    machine crash a resume must find them too (else steps it counts are missing from the file,
    and groups from trained.jsonl). One synchronous write per row (~0.3 ms on a local disk):
    negligible next to an optimizer step."""
    return open(path, mode, buffering=1,
                opener=lambda name, flags: os.open(name, flags | os.O_DSYNC, 0o666))


def open_append(path: Path) -> IO[str]:
    """`path` to append rows to, synced, its last row ended first if a crash cut it."""
    f = open_synced(path, "a+")  # readable too, to look at the last byte
    size = os.fstat(f.fileno()).st_size
    if size and os.pread(f.fileno(), 1, size - 1) != b"\n":
        f.write("\n")
    return f


def open_new(path: Path) -> IO[str]:
    """Create `path` for one launch's records; never append to another launch's file."""
    try:
        return open_synced(path, "x")  # O_EXCL: two trainers cannot both get it
    except FileExistsError:
        raise FileExistsError(
            f"{path} already exists: another launch wrote it. Choose another `name=` or "
            "`output_dir=`, or remove the run directory (`pipelinerl train --overwrite` does)"
        ) from None


def open_resumed(path: Path, resume_step: int | None, attempt: int) -> IO[str]:
    """A new file for a new run; for a resumed one, the file cut back to the rows of steps up to
    `resume_step` (the checkpoint's), then appended to. The rows a crashed attempt wrote after
    its checkpoint describe weights that are gone: they move to `<name>.discarded.jsonl`,
    marked with the attempt that discarded them, so the file has no repeated or skipped step."""
    if resume_step is None:
        return open_new(path)
    rows = read_rows(path) if path.exists() else []
    keep = [row for row in rows if row["step"] <= resume_step]
    gone = [row for row in rows if row["step"] > resume_step]
    if gone:  # on disk before the cut file replaces the one that holds them
        with open_append(path.with_name(path.stem + ".discarded.jsonl")) as f:
            f.writelines(json.dumps({**row, "discarded_by_attempt": attempt}) + "\n"
                         for row in gone)
    tmp = path.with_name(f".{path.name}.tmp")
    with open_synced(tmp, "w") as f:  # on disk before the rename publishes it
        f.writelines(json.dumps(row) + "\n" for row in keep)
    tmp.replace(path)  # atomic: a crash here leaves the old file or the cut one
    return open_synced(path, "a")


def append_row(path: Path, row: dict[str, Any]) -> None:
    """Append one row to `path` and return once it is on disk."""
    with open_append(path) as f:
        f.write(json.dumps(row) + "\n")


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of `path`, in order; a line a crash cut short is skipped with a warning."""
    rows = []
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                log.warning("%s line %d is not a complete JSON row (cut by a crash?): skipped",
                            path, number)
    return rows
