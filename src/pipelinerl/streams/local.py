"""Serverless stream for processes on one machine: append-only JSONL files, per writer.

Layout: `<root>/<stream>/<writer_id>.jsonl`, and with `segment_bytes` set, the writer rolls on
to `<writer_id>@1.jsonl`, `@2`, ... once a segment reaches that size. Each writer owns its
files (an exclusive lock on `<writer_id>.lock` enforces it), so several actor processes write
one stream without interleaving bytes. The reader merges every writer of the stream, reading
each writer's segments in order, and remembers per writer the segment and byte offset just
past the last record it returned; saving `offsets()` with a checkpoint and reopening with them
resumes without loss or repeats. `trim(offsets)` deletes the whole segments before them.
The writer also keeps its newest record in `<writer_id>.last.json` (replaced atomically with
each write, before the segment can roll): a trim can delete every segment holding it, and a
restarted writer must still learn where its predecessor stopped (`last_record`).
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

from pipelinerl.streams.base import WriterIdInUse, WriterStateLost

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


def segment_name(writer_id: str, segment: int) -> str:
    return f"{writer_id}{_SUFFIX}" if segment == 0 else f"{writer_id}@{segment}{_SUFFIX}"


def parse_segment(name: str) -> tuple[str, int] | None:
    """(writer_id, segment) of a segment file's name; None for any other file."""
    if not name.endswith(_SUFFIX):
        return None
    writer_id, _, segment = name[: -len(_SUFFIX)].partition("@")
    if segment and not segment.isdigit():
        return None
    return writer_id, int(segment or 0)


def _segments(directory: Path, writer_id: str) -> list[int]:
    """The writer's segment numbers present, in order."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    parsed = [parse_segment(n) for n in names]
    return sorted(p[1] for p in parsed if p is not None and p[0] == writer_id)


class LocalStreamWriter:
    def __init__(self, root: str | Path, stream: str, writer_id: str, fsync: bool = False,
                 segment_bytes: int = 0) -> None:
        """`segment_bytes`: roll on to a new segment file past this size (0: one file), so
        that the reader's `trim` can delete what a checkpoint no longer needs."""
        _check_name("stream", stream)
        _check_name("writer_id", writer_id)
        self.dir = Path(root) / stream
        self.writer_id = writer_id
        self.dir.mkdir(parents=True, exist_ok=True)
        self._fsync = fsync
        self._segment_bytes = segment_bytes
        self._lock = open(self.dir / f"{writer_id}.lock", "a+b")
        try:
            fcntl.flock(self._lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise WriterIdInUse(
                f"writer {writer_id!r} of stream {stream!r} is already open (here or in another "
                f"process) in {self.dir}; give each writer a distinct writer_id"
            ) from None
        self.segment = max(_segments(self.dir, writer_id), default=0)
        self._open_segment()
        # A crash mid-write leaves a torn last line. Terminating it makes it one unparseable
        # line that readers skip, rather than a prefix our next record would glue onto. The
        # file is never rewritten: truncating it could race with a reader mid-read.
        size = os.fstat(self._file.fileno()).st_size
        if size and os.pread(self._file.fileno(), 1, size - 1) != b"\n":
            self._append(b"\n")

    @property
    def path(self) -> Path:
        return self.dir / segment_name(self.writer_id, self.segment)

    def _open_segment(self) -> None:
        self._file = open(self.path, "a+b")  # readable too, to inspect a torn tail

    @property
    def _tail_path(self) -> Path:
        return self.dir / f"{self.writer_id}.last.json"

    def write(self, record: dict[str, Any]) -> None:
        line = _encode(record)
        self._append(line, tail=line)

    def last_record(self) -> dict[str, Any] | None:
        """The newest complete record this writer id wrote (an earlier process's too): how a
        restarted writer learns where its predecessor stopped. A torn tail is passed over.
        The segments' newest record if they hold one (the kept copy can lag it by a crash
        between the two writes), else the kept copy (the segments holding it were trimmed)."""
        segments = _segments(self.dir, self.writer_id)
        for segment in reversed(segments):
            with open(self.dir / segment_name(self.writer_id, segment), "rb") as f:
                record = _last_record(f.fileno())
            if record is not None:
                return record
        try:
            return json.loads(self._tail_path.read_bytes())
        except FileNotFoundError:
            if max(segments, default=0) > 0:  # it rolled, so it wrote
                raise WriterStateLost(
                    f"writer {self.writer_id!r} wrote {self.dir} segments up to "
                    f"{max(segments)}, but its last record ({self._tail_path.name}) is gone") from None
            return None

    def write_many(self, records: Iterable[dict[str, Any]]) -> None:
        lines = [_encode(r) for r in records]
        if lines:
            self._append(b"".join(lines), tail=lines[-1])

    def _append(self, data: bytes, tail: bytes | None = None) -> None:
        """`tail`: the last record of `data`, kept apart (before the segment may roll)."""
        self._file.write(data)
        self._file.flush()  # in the OS page cache now: a crash of this process loses nothing
        if self._fsync:
            os.fsync(self._file.fileno())  # survives a machine crash too
        if tail is not None:
            self._keep_tail(tail)
        if self._segment_bytes and self._file.tell() >= self._segment_bytes:
            # The next segment appears only after this one's last record is written: a
            # reader that sees it knows this one is complete.
            self._close_segment()
            self.segment += 1
            self._open_segment()

    def _keep_tail(self, line: bytes) -> None:
        tmp = self._tail_path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(line)
            if self._fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, self._tail_path)  # atomic: a reader sees the old record or the new

    def _close_segment(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())  # once, so a clean shutdown is durable without fsync
        self._file.close()

    def stop_retrying(self) -> None:
        """Nothing to do: a local write has no server to wait for."""

    def close(self) -> None:
        if not self._file.closed:
            self._close_segment()
        if not self._lock.closed:
            self._lock.close()  # releases the lock

    def __enter__(self) -> "LocalStreamWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _last_record(fd: int) -> dict[str, Any] | None:
    end = os.fstat(fd).st_size
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


class _WriterChain:
    """One writer's segments, read in order: the next segment is opened once it exists, after
    the current one is read to its end (it is complete by then, see LocalStreamWriter)."""

    def __init__(self, directory: Path, writer_id: str, segment: int, offset: int) -> None:
        self.dir, self.writer_id, self.segment = directory, writer_id, segment
        self.file = _WriterFile(directory / segment_name(writer_id, segment), offset)

    def has_record(self) -> bool:
        while not self.file.has_record():
            following = self.dir / segment_name(self.writer_id, self.segment + 1)
            if not following.exists():
                return False
            if self.file.has_record():  # written before the next segment appeared
                return True
            self.file.close()
            self.segment += 1
            self.file = _WriterFile(following, 0)
        return True

    def offset(self) -> int | list[int]:
        """Where the next record starts: a byte offset in segment 0, else [segment, offset]."""
        return self.file.consumed if self.segment == 0 else [self.segment, self.file.consumed]


def _position(saved: int | list[int]) -> tuple[int, int]:
    return (0, saved) if isinstance(saved, int) else (int(saved[0]), int(saved[1]))


class LocalStreamReader:
    def __init__(
        self, root: str | Path, stream: str, offsets: dict[str, Any] | None = None
    ) -> None:
        _check_name("stream", stream)
        self.dir = Path(root) / stream
        self._saved = dict(offsets or {})  # for writers whose file appears later
        for writer_id in self._saved:
            _check_name("writer_id", writer_id)
        self._writers: dict[str, _WriterChain] = {}
        self._next = 0  # round-robin start, so a busy writer cannot starve the others

    def _discover(self) -> None:
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return
        found: dict[str, list[int]] = {}
        for name in names:
            parsed = parse_segment(name)
            if parsed is not None and parsed[0] not in self._writers:
                found.setdefault(parsed[0], []).append(parsed[1])
        for writer_id, segments in found.items():
            segment, offset = _position(self._saved.get(writer_id, [min(segments), 0]))
            if not (self.dir / segment_name(writer_id, segment)).exists():
                continue  # not written yet, or (saved segment > 0) a race with its creation
            self._writers[writer_id] = _WriterChain(self.dir, writer_id, segment, offset)

    def _take(self, max_count: int) -> list[dict[str, Any]]:
        self._discover()
        writers = sorted(self._writers.values(), key=lambda w: w.writer_id)
        if not writers:
            return []
        start = self._next % len(writers)
        writers = writers[start:] + writers[:start]
        self._next += 1
        out: list[dict[str, Any]] = []
        live = [w for w in writers if w.has_record()]
        # Interleave one record per writer per pass; each writer's own order is kept.
        while live and len(out) < max_count:
            for w in live:
                if len(out) == max_count:
                    break
                out.append(w.file.pop())
            live = [w for w in live if w.has_record()]
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

    def offsets(self) -> dict[str, Any]:
        """Per writer id, where its next record starts: the byte offset just past the last
        record returned (in segment 0), or [segment, offset]. JSON-serialisable."""
        out = dict(self._saved)
        out.update({writer_id: w.offset() for writer_id, w in self._writers.items()})
        return out

    def trim(self, offsets: dict[str, Any]) -> int:
        """Delete every segment wholly before `offsets` (from a durable checkpoint): per
        writer, the segments below the saved one. Returns how many records were deleted."""
        deleted = 0
        for writer_id, saved in offsets.items():
            segment, _ = _position(saved)
            for old in _segments(self.dir, writer_id):
                if old >= segment:
                    break
                path = self.dir / segment_name(writer_id, old)
                deleted += path.read_bytes().count(b"\n")
                path.unlink()
        return deleted

    def close(self) -> None:
        self._saved = self.offsets()  # offsets() stays valid after close
        for w in self._writers.values():
            w.file.close()
        self._writers.clear()

    def __enter__(self) -> "LocalStreamReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
