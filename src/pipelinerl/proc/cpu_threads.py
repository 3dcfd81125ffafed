"""How many torch threads a CPU build (the warm start) should use while other work may share
the CPUs. Every torch op ends in a barrier across its threads, so one descheduled thread
stalls the whole op: on this 2-core CPU a warm-start step took 0.16 s with 2 threads and 0.23
with 1 when quiet, but 5 s with 2 threads and 0.25 with 1 once another process kept a core
busy. More threads pay only while the CPUs they need stay free."""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections import deque

import torch

logger = logging.getLogger(__name__)


def idle_cpus(window_s: float = 0.3) -> float | None:
    """How many CPUs were idle over a short window (Linux /proc/stat), or None if unknown.
    Measured now rather than read from the load average, which lags by a minute."""

    def snapshot() -> tuple[int, int]:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        return ticks[3] + ticks[4], sum(ticks)  # idle + iowait, total

    try:
        idle0, total0 = snapshot()
        time.sleep(window_s)
        idle1, total1 = snapshot()
    except (OSError, ValueError, IndexError):
        return None
    if total1 == total0:
        return None
    return (idle1 - idle0) / (total1 - total0) * (os.cpu_count() or 1)


def usable_threads(requested: int, what: str) -> int:
    """`requested` threads, fewer when other work keeps CPUs busy now."""
    idle = idle_cpus() if requested > 1 else None
    if idle is None or idle >= requested - 0.25:
        return requested
    threads = max(1, min(requested, int(idle + 0.25)))
    logger.warning("%s: only %.1f CPUs idle, using %d thread(s) instead of %d",
                   what, idle, threads, requested)
    return threads


class ContentionGuard:
    """Watches each step's time per unit of work (a batch's tokens) and drops torch to one
    thread for good once the median of the last `window` steps is `slowdown` times the fastest
    seen: work that started beside this one after `usable_threads` looked (another run's roles,
    a second test) has taken a core. One thread keeps its pace under that load; several would
    run many times slower to the end. Per unit, since batches differ in length (a warm-start
    step took 0.06-0.32 s on a quiet CPU); a median, since single steps still vary (up to 2.3x
    per token, quiet)."""

    def __init__(self, what: str, slowdown: float = 2.0, window: int = 5) -> None:
        self.what = what
        self.slowdown = slowdown
        self.fastest = float("inf")
        self.recent: deque[float] = deque(maxlen=window)
        self.dropped_at: int | None = None  # the step after which it went to one thread
        self._steps = 0

    def step_took(self, seconds: float, work: float) -> None:
        self._steps += 1
        threads = torch.get_num_threads()
        if threads == 1:
            return
        rate = seconds / work
        self.fastest = min(self.fastest, rate)
        self.recent.append(rate)
        if len(self.recent) < self.recent.maxlen:
            return
        typical = statistics.median(self.recent)
        if typical > self.slowdown * self.fastest:
            torch.set_num_threads(1)
            self.dropped_at = self._steps
            logger.warning("%s: the last %d steps took %.1fx the fastest step's time per unit of "
                           "work (median): the CPUs are shared now; going on with 1 thread "
                           "instead of %d", self.what, len(self.recent), typical / self.fastest,
                           threads)
