"""Streams carry JSON records one way between roles (rollouts: actor -> trainer)."""

from __future__ import annotations

from typing import Any, Protocol


class StreamWriter(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class StreamReader(Protocol):
    def read(self, max_count: int, timeout_s: float) -> list[dict[str, Any]]:
        """Up to `max_count` records in order; waits at most `timeout_s` for the first one."""
        ...

    def close(self) -> None: ...
