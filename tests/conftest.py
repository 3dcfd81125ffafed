"""Shared fixtures."""

from __future__ import annotations

import shutil
from typing import Iterator

import pytest

from pipelinerl.streams.redis_server import RedisServer, start_redis_server


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One loopback redis-server for the whole session; namespace keys per test (a unique run)."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not on PATH (apt-get install redis-server)")
    # No append-only file: tests that need persistence start their own server.
    with start_redis_server(tmp_path_factory.mktemp("redis"), appendonly=False) as server:
        yield server
