"""The trainer's side of held-out evaluation: read the evaluator's results from the run's
`eval` stream and log them to metrics.jsonl (pipelinerl.roles.evaluator is the evaluator role)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger(__name__)

EVAL_PREFIX = "eval/"


class EvalResults:
    """Reads the evaluator's results and logs them to metrics.jsonl: each at the step of the
    version evaluated (its `step`) and the wall-clock time that version was made (its
    `time_s`), so held-out accuracy plots against time like every other curve."""

    def __init__(self, reader: Any, log_fn: Callable[[int, dict[str, Any]], None],
                 attempt: int = 0, hold: bool = False) -> None:
        self.reader = reader
        self.log_fn = log_fn
        self.attempt = attempt  # results of a crashed attempt's evaluator are not this one's
        self.version_time: dict[int, float] = {0: 0.0}
        self.final_logged = False
        # Deterministic mode: results are logged after the last step, by version (the
        # evaluator's schedule): among the step rows they would land on the clock. A version's
        # result is the same in every attempt, so an earlier attempt's stands (a resumed run
        # does not make the versions before its checkpoint again).
        self.hold = hold
        self.held: dict[int, dict[str, Any]] = {}
        self.staged: set[int] = set()  # versions the evaluator holds (deterministic mode)

    def made(self, version: int, time_s: float) -> None:
        self.version_time[version] = time_s

    def drain(self, timeout_s: float = 0.0) -> int:
        """Log the results that came (or hold them); how many records came."""
        records = self.reader.read(max_count=64, timeout_s=timeout_s)
        for record in records:
            own = record.pop("attempt", 0) == self.attempt
            version = int(record.pop("version"))
            if record.pop("staged", False):
                if own:
                    self.staged.add(version)
                continue
            final = bool(record.pop("final", False))
            self.final_logged |= own and final
            if not record:  # only the end marker of a version already logged
                continue
            if self.hold:  # any attempt's
                self.held.setdefault(version, record)
            elif own:
                self.log_fn(version, self._row(version, record))
        return len(records)

    def _row(self, version: int, record: dict[str, Any]) -> dict[str, Any]:
        return {"time_s": self.version_time.get(version), **record,
                f"{EVAL_PREFIX}version": version}

    def await_staged(self, version: int, timeout_s: float) -> None:
        """Until the evaluator says it holds `version` (deterministic mode)."""
        deadline = time.monotonic() + timeout_s
        while version not in self.staged:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the evaluator did not take version {version} within "
                                   f"sync.timeout_s={timeout_s:.0f} s; see logs/evaluator.log")
            self.drain(timeout_s=0.05)

    def wait_final(self, timeout_s: float) -> bool:
        """Log results until the final one came; False if no result came for `timeout_s`
        (deferred evaluation sends many, one by one)."""
        deadline = time.monotonic() + timeout_s
        while not self.final_logged and time.monotonic() < deadline:
            if self.drain(timeout_s=0.5):
                deadline = time.monotonic() + timeout_s
        for version in sorted(self.held):
            self.log_fn(version, self._row(version, self.held[version]))
        self.held.clear()
        if not self.final_logged:
            log.warning("no result of the evaluator came for eval.final_timeout_s=%.0f s before "
                        "its final one; see logs/evaluator.log", timeout_s)
        return self.final_logged


def logged_versions(metrics_path: Path) -> set[int]:
    """The versions whose results `metrics_path` holds (the trainer may be appending to it)."""
    if not metrics_path.exists():
        return set()
    key = f"{EVAL_PREFIX}version"
    with metrics_path.open() as f:  # only whole rows: the last may be half-written
        rows = [json.loads(line) for line in f if key in line and line.endswith("\n")]
    return {int(row[key]) for row in rows if key in row}


def step_times(metrics_path: Path) -> dict[int, float]:
    """When each optimizer step's weights were made (`time_s` of its row in `metrics_path`)."""
    if not metrics_path.exists():
        return {}
    with metrics_path.open() as f:
        rows = [json.loads(line) for line in f if '"loss"' in line and line.endswith("\n")]
    return {int(r["step"]): r["time_s"] for r in rows if "loss" in r and "time_s" in r}
