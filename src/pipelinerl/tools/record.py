"""Every tool call and its reply, recorded; recorded replies taken instead of calling.

Each role appends its calls to `<run_dir>/tool_replies/<role>.jsonl` as their replies come
back (a torn last line, from a crash, is skipped when read). A call is keyed by its rollout's
request id, the model turn and its index in the turn: in deterministic mode these are the same
on every run of a config (docs/determinism.md), so a resume takes the replies recorded before
the crash, and a rerun takes a finished run's (`tools.replay_from`, `pipelinerl train
--replay-tools RUN_DIR`). A recorded reply is taken only for the same call (name and
arguments); any other is called, counted as `tool_replay_misses`.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

DIRNAME = "tool_replies"


def call_key(request_id: str, turn: int, index: int) -> str:
    return f"{request_id}/{turn}/{index}"


def read_records(path: Path) -> dict[str, dict[str, Any]]:
    records: dict[str, dict[str, Any]] = {}
    if not path.is_file():
        return records
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # the line a crash cut
        if isinstance(record, dict) and isinstance(record.get("key"), str):
            records[record["key"]] = record
    return records


class ToolLog:
    def __init__(self, run_dir: Path | None, role: str, replay: list[Path]) -> None:
        """`run_dir`: where this role's calls are appended (None: nowhere); `replay`: run
        directories whose recorded replies are taken."""
        self.path = None if run_dir is None else Path(run_dir) / DIRNAME / f"{role}.jsonl"
        self.recorded: dict[str, dict[str, Any]] = {}
        for directory in replay:
            self.recorded.update(read_records(Path(directory) / DIRNAME / f"{role}.jsonl"))
        self.misses = 0
        self.replayed = 0
        self._lock = threading.Lock()
        self._file = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")

    def recorded_reply(self, key: str, name: str, arguments: dict[str, Any]
                       ) -> dict[str, Any] | None:
        record = self.recorded.get(key)
        if record is None:
            if self.recorded:
                self.misses += 1
            return None
        if record.get("name") != name or record.get("arguments") != arguments:
            self.misses += 1
            log.warning("tool call %s differs from its recording (%s%s, recorded %s%s): "
                        "calling it", key, name, arguments, record.get("name"),
                        record.get("arguments"))
            return None
        self.replayed += 1
        return record

    def append(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        line = json.dumps(record, ensure_ascii=False)
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
