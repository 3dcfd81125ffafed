"""The tools of one role's process: Python functions in worker processes, MCP servers, and
each call run under its deadline on an event loop of the host's own.

A call gets one of these outcomes (counted per tool in the actor's metrics):
`ok`; `tool_error` (the tool raised, or said it failed); `tool_timeout` (past
`tools.timeout_s`: a function's worker is killed, an MCP call abandoned); `tool_server_restart`
(its MCP server died under the call; the next call starts it again). A call that could not be
run (`tool_bad_call`, `tool_over_limit`) is decided before it reaches the host
(`pipelinerl.tools.replies`).

Functions run in `workers` spawned processes (pebble), each loading every function by its
import path once: a function that hangs is killed with its worker, one that crashes its
process fails as `tool_error`. They are stateless across calls (two calls of one rollout may
run in two workers): keep state in an MCP server with `session: rollout`.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar

from pebble import ProcessExpired

from pipelinerl.config import ToolsConfig
from pipelinerl.proc.plugins import import_object
from pipelinerl.proc.workers import retire, spawn_pool
from pipelinerl.tools.mcp_servers import McpServer, ServerDied
from pipelinerl.tools.specs import ToolCall, ToolSpec, function_spec

T = TypeVar("T")

_worker_functions: dict[str, Callable[..., Any]] = {}


def load_function(path: str) -> Callable[..., Any]:
    fn = import_object(path, f"tools.functions {path!r}")
    if not callable(fn):
        raise ValueError(f"tools.functions {path!r} is a {type(fn).__name__}, not callable")
    return fn


def _load_functions(paths: list[str]) -> None:
    for path in paths:
        fn = load_function(path)
        _worker_functions[fn.__name__] = fn


def _run_function(name: str, arguments: dict[str, Any]) -> str:
    result = _worker_functions[name](**arguments)
    return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False,
                                                              default=str)


@dataclass(frozen=True)
class CallResult:
    text: str
    outcome: str  # ok / tool_error / tool_timeout / tool_server_restart
    latency_s: float


class ToolHost:
    def __init__(self, cfg: ToolsConfig, workers: int = 2) -> None:
        self.cfg = cfg
        self.workers = workers
        self.specs: dict[str, ToolSpec] = {}
        self._functions: list[str] = []
        self._servers: dict[str, McpServer] = {}  # by tool name
        self._pool = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tools",
                                        daemon=True)
        self._thread.start()
        try:
            self.run(self._start(), timeout_s=cfg.timeout_s * (len(cfg.mcp) + 1) + 30)
        except BaseException:
            self.close()
            raise

    def run(self, coro: Awaitable[T], timeout_s: float | None = None) -> T:
        """Run `coro` on the host's loop from another thread and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def submit(self, coro: Awaitable[T]) -> "asyncio.Future[T]":
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _start(self) -> None:
        for path in self.cfg.functions:
            spec = function_spec(load_function(path), f"function:{path}")
            self._add(spec)
            self._functions.append(path)
        for server_cfg in self.cfg.mcp:
            server = McpServer(server_cfg, self.cfg.timeout_s)
            for spec in await server.list_tools():
                self._add(spec)
                self._servers[spec.name] = server
        if self._functions:
            self._pool = spawn_pool(self.workers, _load_functions, self._functions)

    def _add(self, spec: ToolSpec) -> None:
        if spec.name in self.specs:
            raise ValueError(f"two tools are named {spec.name!r}: {self.specs[spec.name].source}"
                             f" and {spec.source}; a name must be unique")
        self.specs[spec.name] = spec

    @property
    def servers(self) -> list[McpServer]:
        return list({id(s): s for s in self._servers.values()}.values())

    def restarts(self) -> int:
        return sum(s.restarts for s in self.servers)

    async def call(self, key: str, call: ToolCall) -> CallResult:
        """Run one call (its name known, its arguments checked) for rollout `key`."""
        started = time.monotonic()
        try:
            if call.name in self._servers:
                text, failed = await self._servers[call.name].call(key, call.name,
                                                                   call.arguments)
                outcome = "tool_error" if failed else "ok"
            else:
                text, outcome = await self._call_function(call), "ok"
        except (asyncio.TimeoutError, FutureTimeout, TimeoutError):
            text, outcome = f"error: the tool took longer than {self.cfg.timeout_s:g} s", \
                "tool_timeout"
        except ServerDied as e:
            text, outcome = f"error: the tool's server died ({e})", "tool_server_restart"
        except (BrokenProcessPool, ProcessExpired) as e:
            text, outcome = f"error: the tool's process died ({e})", "tool_error"
        except Exception as e:  # noqa: BLE001 - a user's tool may raise anything
            text, outcome = f"error: {type(e).__name__}: {e}", "tool_error"
        return CallResult(text, outcome, time.monotonic() - started)

    async def _call_function(self, call: ToolCall) -> str:
        assert self._pool is not None
        if not self._pool.active:  # broken by a worker that died
            retire(self._pool)
            self._pool = spawn_pool(self.workers, _load_functions, self._functions)
        future = self._pool.schedule(_run_function, (call.name, call.arguments),
                                     timeout=self.cfg.timeout_s)
        return await asyncio.wrap_future(future)

    def end(self, key: str) -> None:
        """Rollout `key` ended: its sessions close (in the background)."""
        for server in self.servers:
            self.submit(server.end(key))

    def close(self) -> None:
        if self._loop.is_running():
            try:
                self.run(self._close(), timeout_s=self.cfg.timeout_s + 10)
            except Exception:  # noqa: BLE001 - closing is best effort
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        if self._pool is not None:
            retire(self._pool)
            self._pool = None

    async def _close(self) -> None:
        for server in self.servers:
            await server.close()
