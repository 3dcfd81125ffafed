"""Data streams between roles. Backends: `local` (JSONL files, no server) and `redis`.

Callers pass every location they have (`root` for local, `url`, `run` and `timeout_s` for
redis); each backend uses its own and ignores the rest, so one call site serves both. A reader's
`offsets()` go into the trainer checkpoint; `open_reader(..., offsets=saved)` resumes there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipelinerl.streams.local import LocalStreamReader, LocalStreamWriter
from pipelinerl.streams.redis_server import RedisServer, start_redis_server
from pipelinerl.streams.redis_stream import (
    DEFAULT_TIMEOUT_S,
    RedisStreamReader,
    RedisStreamWriter,
    StreamConnectionError,
)

BACKENDS = ("local", "redis")

Writer = LocalStreamWriter | RedisStreamWriter
Reader = LocalStreamReader | RedisStreamReader

__all__ = [
    "BACKENDS",
    "LocalStreamReader",
    "LocalStreamWriter",
    "Reader",
    "RedisServer",
    "RedisStreamReader",
    "RedisStreamWriter",
    "StreamConnectionError",
    "Writer",
    "open_reader",
    "open_writer",
    "start_redis_server",
]


def _unknown(backend: str) -> ValueError:
    return ValueError(f"unknown stream backend {backend!r}; known: {', '.join(BACKENDS)}")


def _missing(backend: str, what: str) -> ValueError:
    return ValueError(f"stream backend {backend!r} needs {what}")


def open_writer(
    backend: str,
    *,
    stream: str,
    writer_id: str,
    root: str | Path | None = None,
    url: str | None = None,
    run: str | None = None,
    fsync: bool = False,
    segment_bytes: int = 0,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Writer:
    """A writer of `stream`; `writer_id` must be unique among its concurrent writers.

    `fsync` (local only) syncs every write to disk; redis durability is the server's own.
    `segment_bytes` (local only): roll on to a new segment file past this size (0: never).
    `timeout_s` (redis only): how long one operation may wait on a server that does not answer.
    """
    if backend == "local":
        if root is None:
            raise _missing(backend, "root (a directory)")
        return LocalStreamWriter(root, stream, writer_id, fsync=fsync, segment_bytes=segment_bytes)
    if backend == "redis":
        if not url or not run:  # "" is how the config spells unset
            raise _missing(backend, "url and run (the key namespace)")
        return RedisStreamWriter(url, run, stream, writer_id, timeout_s)
    raise _unknown(backend)


def open_reader(
    backend: str,
    *,
    stream: str,
    root: str | Path | None = None,
    url: str | None = None,
    run: str | None = None,
    offsets: dict[str, Any] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Reader:
    """A reader of every record of `stream` after `offsets` (None: from the beginning)."""
    if backend == "local":
        if root is None:
            raise _missing(backend, "root (a directory)")
        return LocalStreamReader(root, stream, offsets)
    if backend == "redis":
        if not url or not run:  # "" is how the config spells unset
            raise _missing(backend, "url and run (the key namespace)")
        return RedisStreamReader(url, run, stream, offsets, timeout_s)
    raise _unknown(backend)
