"""Serverless stream for processes on one machine: append-only JSONL files, one per writer.

Layout: `<root>/<stream>/<writer_id>.jsonl`. Each writer owns its file (an exclusive lock
enforces it), so several actor processes write one stream without interleaving bytes. The
reader merges every writer file of the stream and remembers, per file, the byte offset just
past the last record it returned; saving `offsets()` with a checkpoint and reopening with them
resumes without loss or repeats.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import time
from collections import deque
from pathlib import Path
from typing import Any, Iterable

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
_SUFFIX = ".jsonl"
_CHUNK = 1 << 20  # bytes read per file per fill; bounds memory on a large backlog
_MIN_SLEEP_S = 0.001
_MAX_SLEEP_S = 0.02  # latency bound once idle; keeps an idle reader near 0% CPU


def _check_name(kind: str, name: str) -> None:
    if not _NAME_RE.match(name) or name in (".", ".."):
        raise ValueError(f"{kind} {name!r} must match {_NAME_RE.pattern} (it names a path)")


def _encode(record: dict[str, Any]) -> bytes:
    # json.dumps escapes control characters, so a record never contains a raw newline. NaN and
    # +-inf are kept (Python's JSON dialect): a -inf log-prob must round-trip, not crash an actor.
    return json.dumps(record, separators=(",", ":")).encode() + b"\n"


class LocalStreamWriter:
    def __init__(self, root: str | Path, stream: str, writer_id: str, fsync: bool = False) -> None:
        _check_name("stream", stream)
        _check_name("writer_id", writer_id)
        self.path = Path(root) / stream / f"{writer_id}{_SUFFIX}"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fsync = fsync
        self._file = open(self.path, "a+b")  # readable too, to inspect a torn tail
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise RuntimeError(
                f"writer {writer_id!r} of stream {stream!r} is already open (here or in another "
                f"process) at {self.path}; give each writer a distinct writer_id"
            ) from None
        # A crash mid-write leaves a torn last line. Terminating it makes it one unparseable
        # line that readers skip, rather than a prefix our next record would glue onto. The
        # file is never rewritten: truncating it could race with a reader mid-read.
        size = os.fstat(self._file.fileno()).st_size
        if size and os.pread(self._file.fileno(), 1, size - 1) != b"\n":
            self._append(b"\n")

    def write(self, record: dict[str, Any]) -> None:
        self._append(_encode(record))

    def last_record(self) -> dict[str, Any] | None:
        """The newest complete record in this writer's file (an earlier process's too): how a
        restarted writer learns where its predecessor stopped. A torn tail is passed over."""
        fd, end = self._file.fileno(), os.fstat(self._file.fileno()).st_size
        tail = b""
        while end > 0:
            start = max(0, end - _CHUNK)
            tail = os.pread(fd, end - start, start) + tail
            end = start
            lines = tail.split(b"\n")
            # lines[0] may be cut at the chunk's start unless the file starts there.
            for line in reversed(lines if end == 0 else lines[1:]):
                if not line.strip():
                    continue
                try:
                    return json.loads(line)
                except json.JSONDecodeError:  # a torn line: the record before it counts
                    continue
            tail = lines[0]
        return None

    def write_many(self, records: Iterable[dict[str, Any]]) -> None:
        data = b"".join(_encode(r) for r in records)
        if data:
            self._append(data)

    def _append(self, data: bytes) -> None:
        self._file.write(data)
        self._file.flush()  # in the OS page cache now: a crash of this process loses nothing
        if self._fsync:
            os.fsync(self._file.fileno())  # survives a machine crash too

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())  # once, so a clean shutdown is durable without fsync
            self._file.close()  # releases the lock

    def __enter__(self) -> "LocalStreamWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _WriterFile:
    """Read side of one writer's file: complete lines are parsed, a partial tail is held back."""

    def __init__(self, path: Path, offset: int) -> None:
        self.path = path
        self._file = open(path, "rb")
        size = os.fstat(self._file.fileno()).st_size
        if offset > size:
            raise ValueError(f"saved offset {offset} is past the end of {path} ({size} bytes)")
        if offset > 0 and os.pread(self._file.fileno(), 1, offset - 1) != b"\n":
            raise ValueError(f"saved offset {offset} of {path} is not at a record boundary")
        self._file.seek(offset)
        self.consumed = offset  # just past the last record returned to the caller
        self._read_pos = offset
        self._tail: list[bytes] = []  # bytes after the last newline read so far
        self._records: deque[tuple[int, dict[str, Any]]] = deque()  # (end offset, record)

    def has_record(self) -> bool:
        """True if a complete record is available, reading more of the file if needed."""
        while not self._records:
            data = self._file.read(_CHUNK)
            if not data:
                return False
            self._read_pos += len(data)
            if b"\n" not in data:  # a record longer than a chunk: keep gathering its parts
                self._tail.append(data)
                continue
            buf = b"".join(self._tail) + data
            cut = buf.rfind(b"\n") + 1
            self._tail = [buf[cut:]]
            pos = self._read_pos - len(buf)  # file offset of buf[0]
            for line in buf[:cut].split(b"\n")[:-1]:
                pos += len(line) + 1
                try:
                    self._records.append((pos, json.loads(line)))
                except json.JSONDecodeError as e:
                    # Only a writer that crashed mid-write (see LocalStreamWriter) or a foreign
                    # write leaves such a line; its record was never fully written.
                    log.warning(
                        "skipping unparseable line in %s ending at byte %d: %s", self.path, pos, e
                    )
        return True

    def pop(self) -> dict[str, Any]:
        self.consumed, record = self._records.popleft()
        return record

    def close(self) -> None:
        self._file.close()


class LocalStreamReader:
    def __init__(
        self, root: str | Path, stream: str, offsets: dict[str, int] | None = None
    ) -> None:
        _check_name("stream", stream)
        self.dir = Path(root) / stream
        self._saved = dict(offsets or {})  # for writers whose file appears later
        for writer_id in self._saved:
            _check_name("writer_id", writer_id)
        self._files: dict[str, _WriterFile] = {}
        self._next = 0  # round-robin start, so a busy writer cannot starve the others

    def _discover(self) -> None:
        try:
            entries = os.scandir(self.dir)
        except FileNotFoundError:
            return
        with entries:
            for entry in entries:
                if not entry.name.endswith(_SUFFIX):
                    continue
                writer_id = entry.name[: -len(_SUFFIX)]
                if writer_id not in self._files:
                    self._files[writer_id] = _WriterFile(
                        Path(entry.path), self._saved.get(writer_id, 0)
                    )

    def _take(self, max_count: int) -> list[dict[str, Any]]:
        self._discover()
        files = sorted(self._files.values(), key=lambda f: f.path.name)
        if not files:
            return []
        start = self._next % len(files)
        files = files[start:] + files[:start]
        self._next += 1
        out: list[dict[str, Any]] = []
        live = [f for f in files if f.has_record()]
        # Interleave one record per writer per pass; each writer's own order is kept.
        while live and len(out) < max_count:
            for f in live:
                if len(out) == max_count:
                    break
                out.append(f.pop())
            live = [f for f in live if f.has_record()]
        return out

    def read(self, max_count: int, timeout_s: float) -> list[dict[str, Any]]:
        """Up to `max_count` records; waits at most `timeout_s` for the first one."""
        if max_count <= 0:
            return []
        deadline = time.monotonic() + timeout_s
        sleep_s = _MIN_SLEEP_S
        while True:
            records = self._take(max_count)
            remaining = deadline - time.monotonic()
            if records or remaining <= 0:
                return records
            time.sleep(min(sleep_s, remaining))
            sleep_s = min(sleep_s * 2, _MAX_SLEEP_S)

    def offsets(self) -> dict[str, int]:
        """Per writer id, the byte offset just past the last record returned."""
        out = dict(self._saved)
        out.update({writer_id: f.consumed for writer_id, f in self._files.items()})
        return out

    def close(self) -> None:
        self._saved = self.offsets()  # offsets() stays valid after close
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> "LocalStreamReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
