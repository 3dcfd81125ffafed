"""Streams carry JSON records one way between roles (rollouts: actor -> trainer)."""

from __future__ import annotations

from typing import Any, Protocol


class WriterStateLost(RuntimeError):
    """A writer's stream shows it wrote before, but its last record is gone: a restarted
    writer cannot know where its predecessor stopped, and must not guess."""


class WriterIdInUse(RuntimeError):
    """Another live writer has the same writer id (a restarted role whose predecessor still
    runs): their records would collide, so the write fails rather than lose one of them."""


class StreamWriter(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def stop_retrying(self) -> None:
        """Writes from here on fail at once if the stream's server is gone, with no retries."""
        ...

    def last_record(self) -> dict[str, Any] | None:
        """The newest record this writer id wrote (an earlier process's too), kept where no
        trim reaches it; None if it never wrote one. Raises WriterStateLost if it did but the
        record is gone."""
        ...

    def close(self) -> None: ...


class StreamReader(Protocol):
    def read(self, max_count: int, timeout_s: float) -> list[dict[str, Any]]:
        """Up to `max_count` records in order; waits at most `timeout_s` for the first one."""
        ...

    def close(self) -> None: ...
