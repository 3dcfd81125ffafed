"""The user's cache directory for what pipelinerl builds once and reuses across runs (the
warm-started demo models, dequantized GGUF models, downloaded model wheels)."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)


def user_cache(sub: str) -> Path:
    """`sub` in $PIPELINERL_CACHE, else $XDG_CACHE_HOME/pipelinerl, else ~/.cache/pipelinerl:
    the same from every working directory, so a run started elsewhere finds what is cached."""
    if root := os.environ.get("PIPELINERL_CACHE"):
        return Path(root).expanduser().absolute() / sub
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    # The XDG spec says to ignore a relative XDG_CACHE_HOME.
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "pipelinerl" / sub


@contextmanager
def building(entry: Path) -> Iterator[None]:
    """Held while `entry` is built: an exclusive lock (a file under the cache's locks/, named
    after the entry's path), so that two runs or `pipelinerl prepare`s started at once build
    it one after the other, the second finding it done, rather than both writing the same
    files. The kernel drops the lock of a killed builder."""
    locks = user_cache("locks")
    locks.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(str(entry.absolute()).encode()).hexdigest()[:16]
    with (locks / f"{entry.name}-{key}.lock").open("w") as lock:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process building %s", entry)
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        yield
