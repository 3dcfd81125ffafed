"""Two runs started at once, in threads: a barrier releases their calls together, and a
recorder counts the builds they made and how many ran at the same time."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Callable, TypeVar

T = TypeVar("T")


def run_at_once(call: Callable[[], T], n: int = 2, timeout_s: float = 20) -> list[T]:
    """`call()` from `n` threads (named run0, run1, ...) released together; their results."""
    start = threading.Barrier(n)
    results: list[T] = []

    def run() -> None:
        start.wait()
        results.append(call())

    threads = [threading.Thread(target=run, name=f"run{i}") for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout_s)
    return results


class Builds:
    """What a fake build records: which thread built, and the most builds at once."""

    def __init__(self) -> None:
        self.by: list[str] = []
        self.now = 0
        self.most_at_once = 0

    @contextmanager
    def one(self) -> Iterator[None]:
        self.now += 1
        self.most_at_once = max(self.most_at_once, self.now)
        yield
        self.by.append(threading.current_thread().name)
        self.now -= 1
