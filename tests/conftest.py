"""Shared fixtures."""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
from pathlib import Path
from typing import Iterator

import pytest
import torch

from pipelinerl.streams.redis_server import RedisServer, start_redis_server

if os.environ.get("PYTEST_XDIST_WORKER"):
    # The workers share the cores, one each: a test computes on one thread (one that needs
    # more sets it), and so does what it spawns without choosing (the launcher gives each
    # role its own). torch's default, a thread per core in each worker, oversubscribed them:
    # SmolLM2's greedy check took 53-130 s beside the other worker, 14 s on one thread.
    torch.set_num_threads(1)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, "1")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One loopback redis-server for the whole session; namespace keys per test (a unique run).
    Without a redis-server binary the tests using it fail, naming the fix (`make test`
    installs it): a Redis test never counts as passed without a real server."""
    # No append-only file: tests that need persistence start their own server.
    with start_redis_server(tmp_path_factory.mktemp("redis"), appendonly=False) as server:
        yield server


@pytest.fixture(scope="session")
def warm_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One warm-start cache for the session's runs, shared by the xdist workers (their base
    temp directories' parent): each warm-started model is built once per cache key, a run
    needing one being built waits on its lock (pipelinerl.proc.cache.building) and reuses it, as
    a user's runs do. Tests of the warm start itself, or of a Ctrl-C during it, keep their own."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = root / "warmstart-cache"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def tiny_smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random model with SmolLM2-135M-Instruct's tokenizer and template, one per worker
    (tiny_models.tiny_smollm2): an example's end-to-end run in seconds, not minutes."""
    from tiny_models import tiny_smollm2

    return tiny_smollm2(tmp_path_factory.mktemp("tiny-smollm2"))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Kill the child processes a test left running, and fail the run naming them: a hung
    non-daemon child (a rank stuck in a collective) would otherwise keep pytest from exiting,
    since multiprocessing joins such children at exit, and hold CI until its time limit. A
    non-daemon thread still running cannot be killed: it is named, so that a run which then
    never exits says why (one about to end is harmless, hence no failure)."""
    left = multiprocessing.active_children()
    for child in left:
        child.kill()
        child.join()
    threads = [t for t in threading.enumerate()
               if t is not threading.main_thread() and not t.daemon]
    if left:
        names = ", ".join(f"{c.name} (pid {c.pid})" for c in left)
        print(f"\nchild processes left running by the tests, killed: {names}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if threads:
        names = ", ".join(t.name for t in threads)
        print(f"\nthreads left running by the tests (pytest exits once they end): {names}",
              file=sys.stderr)
