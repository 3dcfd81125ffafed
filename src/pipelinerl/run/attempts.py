"""The run's attempt history: which step each attempt resumed from.

It lives in `attempts.jsonl` in the run directory, appended to (and fsynced) as each resumed
attempt starts, not in a checkpoint: an attempt that dies before its first checkpoint must
still be known to the next one, or the groups made with the weights it published (and lost)
would be trained as if they belonged to the run's history (docs/reliability.md).
"""

from __future__ import annotations

from pathlib import Path

from pipelinerl.records import append_row, read_rows

ATTEMPTS_FILE = "attempts.jsonl"


def record_resume(run_dir: Path, attempt: int, step: int) -> list[tuple[int, int]]:
    """Record that `attempt` resumed from `step`; every resume of the run so far, in order."""
    append_row(Path(run_dir) / ATTEMPTS_FILE, {"attempt": attempt, "resumed_from_step": step})
    return read_resumes(run_dir)


def read_resumes(run_dir: Path) -> list[tuple[int, int]]:
    """(attempt, the step it resumed from) per resume recorded. A line cut short by a crash
    while it was written is skipped: its attempt never ran."""
    path = Path(run_dir) / ATTEMPTS_FILE
    if not path.exists():
        return []
    return [(int(row["attempt"]), int(row["resumed_from_step"])) for row in read_rows(path)]


def valid_upto(resumes: list[tuple[int, int]]) -> dict[int, int]:
    """Per earlier attempt, the newest version still in the run's history: the lowest step
    any later attempt resumed from (a later resume may go back further than an earlier)."""
    return {a: min(step for b, step in resumes if b > a) for a, _ in [(0, 0), *resumes]
            if any(b > a for b, _ in resumes)}
