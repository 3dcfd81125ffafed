"""A run directory's records as the viewer reads them: samples.jsonl, eval_samples.jsonl and
metrics.jsonl (and their rolled files), read again only as they grow, checked line by line
against the layout of docs/viewing.md. What cannot be shown is said in `notes`, never raised."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from pipelinerl.records import EVAL_ROLLED, EVAL_SAMPLES, METRICS, ROLLED, SAMPLES

_NOTES_PER_FILE = 3  # skipped lines named one by one; past that, counted


class ViewerError(Exception):
    """A run directory the viewer cannot open; the message says what is wrong."""


class _Row(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Tokens(_Row):
    text: list[str]
    version: list[int]
    lag: list[int | None]
    engine_logprob: list[float | None]
    trainer_logprob: list[float | None]
    importance_weight: list[float | None]
    mask: list[int]


class _ToolCall(_Row):
    """One call of a tool-using rollout (pipelinerl.tools.replies): the page shows it at its
    model turn; the fields it needs are checked, the rest (key, replayed, ...) optional."""

    turn: int
    name: str
    outcome: str
    reply: str
    arguments: Any = None
    latency_s: float | None = None
    replayed: bool | None = None


class _Sample(_Row):
    completion: str
    reward: float | None
    finish_reason: str
    length: int
    tokens: _Tokens
    tool_calls: list[_ToolCall] | None = None


class _Group(_Row):
    step: int
    version: int
    group_id: str
    problem: str
    samples: list[_Sample]
    dropped: str | None = None


class _Attempt(_Row):
    completion: str
    reward: float | None
    finish_reason: str | None
    length: int
    tool_calls: list[_ToolCall] | None = None


class _EvalLine(_Row):
    version: int
    mode: str
    problem_id: str
    problem: str
    attempts: list[_Attempt]


class _Metrics(_Row):
    step: int


def _first_error(err: ValidationError) -> str:
    e = err.errors()[0]
    where = ".".join(str(p) for p in e["loc"]) or "the line"
    return f"{where}: {e['msg']}"


class Tail:
    """One JSONL file, read from where the last read stopped. Only complete lines are read: a
    last line without its newline waits (the run may be writing it; a crash may have cut it).
    A file replaced (rolled, cut back by a resume) or shrunk is read again from its start."""

    def __init__(self, path: Path, layout: type[_Row]) -> None:
        self.path, self.layout = path, layout
        self.rows: list[dict[str, Any]] = []
        self.skipped: list[str] = []  # why each skipped line was skipped
        self.partial = False  # the file ends in a line without its newline
        self._inode: int | None = None
        self._offset = 0
        self._lines = 0

    @property
    def mark(self) -> tuple[int | None, int]:
        """Changes whenever the rows do."""
        return self._inode, self._offset

    def refresh(self) -> None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            self._reset(None)
            return
        if st.st_ino != self._inode or st.st_size < self._offset:
            self._reset(st.st_ino)
        if st.st_size == self._offset:
            return
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read(st.st_size - self._offset)
        complete = data[:data.rfind(b"\n") + 1]
        self.partial = len(complete) < len(data)
        self._offset += len(complete)
        for line in complete.splitlines():
            self._lines += 1
            if line.strip():
                self._parse(line)

    def _parse(self, line: bytes) -> None:
        name = f"{self.path.name} line {self._lines}"
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            self.skipped.append(f"{name} is not JSON (cut by a crash?)")
            return
        try:
            self.layout.model_validate(row)
        except ValidationError as err:
            self.skipped.append(f"{name} is not a record this pipelinerl reads "
                                f"({_first_error(err)}; written by another version?)")
            return
        self.rows.append(row)

    def _reset(self, inode: int | None) -> None:
        self.rows, self.skipped, self.partial = [], [], False
        self._inode, self._offset, self._lines = inode, 0, 0

    def notes(self) -> list[str]:
        out = self.skipped[:_NOTES_PER_FILE]
        if len(self.skipped) > _NOTES_PER_FILE:
            out.append(f"{self.path.name}: {len(self.skipped) - _NOTES_PER_FILE} more lines "
                       "skipped")
        if self.partial:
            out.append(f"{self.path.name} ends in an incomplete line (being written, or cut by "
                       "a crash): not shown")
        return out


def _check_run_dir(run_dir: Path) -> None:
    if not run_dir.is_dir():
        raise ViewerError(f"{run_dir}: no such directory")
    known = ("config.yaml", SAMPLES, ROLLED, EVAL_SAMPLES, EVAL_ROLLED, METRICS)
    if any((run_dir / name).exists() for name in known):
        return
    runs = sorted(p for p in run_dir.iterdir()
                  if p.is_dir() and any((p / name).exists() for name in known))
    hint = (f"; run directories in it: {', '.join(str(p) for p in runs[:5])}" if runs else
            " (a run directory is output_dir/name, e.g. runs/arithmetic)")
    raise ViewerError(f"{run_dir} is not a pipelinerl run directory: it holds none of "
                      f"{', '.join(known)}{hint}")


def _run_name(run_dir: Path) -> str:
    try:
        name = yaml.safe_load((run_dir / "config.yaml").read_text()).get("name")
    except (OSError, yaml.YAMLError, AttributeError):
        name = None
    return str(name) if name else run_dir.name


class RunView:
    """The records of one run directory, as of the last `refresh` (thread-safe)."""

    def __init__(self, run_dir: Path) -> None:
        run_dir = Path(run_dir)
        _check_run_dir(run_dir)
        self.run_dir = run_dir
        self.name = _run_name(run_dir)
        # Rolled files first: a roll moves the older lines there before the new file starts.
        self._samples = [Tail(run_dir / ROLLED, _Group), Tail(run_dir / SAMPLES, _Group)]
        self._evals = [Tail(run_dir / EVAL_ROLLED, _EvalLine),
                       Tail(run_dir / EVAL_SAMPLES, _EvalLine)]
        self._metrics = Tail(run_dir / METRICS, _Metrics)
        self._lock = threading.Lock()
        self._summary: dict[str, Any] | None = None  # of the fingerprint it holds
        self.refresh()

    def _tails(self) -> list[Tail]:
        return [*self._samples, *self._evals, self._metrics]

    def refresh(self) -> str:
        """Read what the files gained; returns the fingerprint (changes when any row does)."""
        with self._lock:
            for tail in self._tails():
                tail.refresh()
            return self.fingerprint

    @property
    def fingerprint(self) -> str:
        return "-".join(f"{ino or 0}.{off}" for ino, off in (t.mark for t in self._tails()))

    @property
    def metrics_mark(self) -> tuple[int | None, int]:
        return self._metrics.mark

    def groups(self) -> list[dict[str, Any]]:
        with self._lock:
            return [row for tail in self._samples for row in tail.rows]

    def eval_rows(self) -> list[dict[str, Any]]:
        with self._lock:
            return [row for tail in self._evals for row in tail.rows]

    def metrics(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._metrics.rows)

    def notes(self) -> list[str]:
        with self._lock:
            notes = [n for tail in self._tails() for n in tail.notes()]
            has_samples = any(t.path.exists() for t in self._samples)
        if not has_samples:
            notes.insert(0, f"no {SAMPLES} yet: the run has not trained a step, or it was "
                            "made with metrics.samples_per_step=0 or by a pipelinerl before "
                            "sample records (then only held-out results and the health panel)")
        return notes

    def summary(self) -> dict[str, Any]:
        """What the page's controls offer: steps, versions, reasons, eval versions, notes;
        made again only when the records changed (the page asks every few seconds)."""
        if self._summary is None or self._summary["fingerprint"] != self.fingerprint:
            self._summary = self._summarise()
        return self._summary

    def _summarise(self) -> dict[str, Any]:
        fingerprint = self.fingerprint  # before reading: a later change makes it stale, not lost
        groups, evals = self.groups(), self.eval_rows()
        samples = [s for g in groups for s in g["samples"]]
        lags = [lag for s in samples for lag in s["tokens"]["lag"] if lag is not None]
        return {
            "name": self.name,
            "run_dir": os.fspath(self.run_dir.resolve()),
            "fingerprint": fingerprint,
            "groups": len(groups),
            "steps": sorted({g["step"] for g in groups}),
            "finish_reasons": sorted({s["finish_reason"] for s in samples}),
            "tool_outcomes": sorted({c["outcome"] for s in samples
                                     for c in s.get("tool_calls") or ()}),
            "dropped_reasons": sorted({g["dropped"] for g in groups if g.get("dropped")}),
            "max_lag": max(lags, default=0),
            "eval_versions": sorted({r["version"] for r in evals}),
            "eval_modes": sorted({r["mode"] for r in evals}),
            "metrics_rows": len(self.metrics()),
            "notes": self.notes(),
        }
