"""Answers due on the decode clock: in deterministic mode a worker's answer (a group's
scores, an environment's reply) is taken a fixed number of decode steps after it was asked
for, never when the wall clock happens to deliver it (docs/determinism.md)."""

from __future__ import annotations

from collections import deque


class DueQueue:
    """Keys waiting for a worker's answer (groups for their scores, rollouts for an
    environment's reply), in the order they were sent, each due `delay` decode steps after."""

    def __init__(self, delay: int) -> None:
        self.delay = delay
        self._waiting: deque[tuple[str, int]] = deque()  # (key, decode step due)

    def expect(self, key: str, decode_steps: int) -> None:
        self._waiting.append((key, decode_steps + self.delay))

    def pop_due(self, decode_steps: int, idle: bool) -> str | None:
        """The oldest key if it is due at `decode_steps` (any is when `idle`: nothing to decode,
        so the decode clock stands), else None. One at a time: a version the actor loads after
        a group may stop it from publishing the next (a snapshot's drain)."""
        if self._waiting and (idle or self._waiting[0][1] <= decode_steps):
            return self._waiting.popleft()[0]
        return None

    def entries(self) -> list[tuple[str, int]]:
        """(key, decode step due), oldest first: an actor snapshot's part."""
        return list(self._waiting)

    def restore(self, entries: list[tuple[str, int]]) -> None:
        self._waiting = deque(entries)
