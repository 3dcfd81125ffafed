"""Python functions offered as tools in the tests (`tools.functions: [tool_kit.functions:...]`)."""

from __future__ import annotations

import os
import time

TABLE = {"apple": "7421", "pear": "1187", "plum": "5530"}


def lookup(key: str) -> str:
    """The code of a fruit (apple, pear, plum).

    Unknown fruits have no code."""
    return TABLE.get(key, "unknown")


def add(a: int, b: int = 0) -> int:
    """Add two integers."""
    return a + b


def clock() -> str:
    """The time now, in nanoseconds: never the same twice."""
    return str(time.time_ns())


def boom() -> str:
    """Raise."""
    raise ValueError("boom went the tool")


def stall(seconds: float) -> str:
    """Sleep, then answer."""
    time.sleep(seconds)
    return "awake"


def crash() -> str:
    """Kill the worker process that runs it."""
    os._exit(5)
