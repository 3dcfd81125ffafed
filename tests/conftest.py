"""Shared fixtures."""

from __future__ import annotations

import os
import shutil
from typing import Iterator

import pytest

from pipelinerl.streams.redis_server import RedisServer, start_redis_server


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One loopback redis-server for the whole session; namespace keys per test (a unique run)."""
    if shutil.which("redis-server") is None:
        # `make test` installs it first, so in CI a missing binary is a broken setup, not a skip.
        message = "redis-server binary not on PATH (apt-get install redis-server, or `make test`)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    # No append-only file: tests that need persistence start their own server.
    with start_redis_server(tmp_path_factory.mktemp("redis"), appendonly=False) as server:
        yield server
