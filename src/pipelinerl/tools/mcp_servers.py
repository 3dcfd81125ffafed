"""MCP servers through the official SDK (`mcp` 2.x): stdio servers started by the role,
streamable-HTTP servers by URL.

Each session is held open by an asyncio task of its own (the SDK's transports are anyio task
groups: a session is entered and left in one task), and calls go to it from any task. A
`rollout` server gives each rollout a session of its own, opened at its first call and closed
when the rollout ends: over stdio that is a server process of its own, over HTTP its own
initialize handshake (so its own `Mcp-Session-Id`), so a stateful tool keeps one episode's
state and never sees another's. At most `max_sessions` are open per server; a rollout beyond
waits for one. A `shared` server has one session for every rollout. A session whose server
died is opened again at the next call (`restarts`), the call that found it dead failing.
The initialize handshake is used (`mode="legacy"`): the 2026 protocol's stateless requests
carry no session for a stateful server to keep.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

from pipelinerl.config import McpServerConfig
from pipelinerl.tools.specs import ToolSpec

log = logging.getLogger(__name__)

STOP_S = 10.0  # the SDK ends a stdio server by closing its stdin, then terminates it after 2 s


class ServerDied(Exception):
    """The server's connection ended under a call."""


@dataclass
class _Session:
    client: Any  # mcp.client.Client, entered
    task: asyncio.Task
    closing: asyncio.Event
    dead: bool = False  # its connection ended under a call

    @property
    def alive(self) -> bool:
        return not (self.dead or self.task.done())


def _client(cfg: McpServerConfig, timeout_s: float) -> Any:
    from mcp.client import Client
    from mcp.client.stdio import StdioServerParameters, stdio_client

    if cfg.url:
        return Client(cfg.url, mode="legacy", read_timeout_seconds=timeout_s)
    params = StdioServerParameters(command=cfg.command[0], args=cfg.command[1:],
                                   env={**os.environ, **cfg.env})
    return Client(stdio_client(params, errlog=_errlog()), mode="legacy",
                  read_timeout_seconds=timeout_s)


def _errlog() -> Any:
    """Where a stdio server's stderr goes: the role's, or the process's own when that was
    replaced by something without a file descriptor (a server needs one)."""
    try:
        sys.stderr.fileno()
        return sys.stderr
    except (AttributeError, OSError, ValueError):
        return sys.__stderr__


class McpServer:
    def __init__(self, cfg: McpServerConfig, timeout_s: float) -> None:
        self.cfg = cfg
        self.timeout_s = timeout_s
        self.restarts = 0
        self._shared: _Session | None = None
        self._sessions: dict[str, _Session] = {}
        self._slots = asyncio.Semaphore(cfg.max_sessions)

    @property
    def what(self) -> str:
        return f"tools.mcp server {self.cfg.name!r} ({self.cfg.url or ' '.join(self.cfg.command)})"

    async def _open(self) -> _Session:
        ready: asyncio.Future = asyncio.get_running_loop().create_future()
        closing = asyncio.Event()

        async def hold() -> None:
            try:
                async with _client(self.cfg, self.timeout_s) as client:
                    ready.set_result(client)
                    await closing.wait()
            except BaseException as e:  # noqa: BLE001 - whatever ended it ends the session
                if not ready.done():
                    ready.set_exception(e)
                elif not isinstance(e, asyncio.CancelledError):
                    log.debug("%s: a session ended: %r", self.what, e)

        task = asyncio.create_task(hold())
        try:
            client = await asyncio.wait_for(asyncio.shield(ready), self.timeout_s)
        except BaseException:
            closing.set()
            task.cancel()
            # Let the transport's clean-up run: a stdio server that never answered is ended
            # (stdin closed, then terminated), not left behind.
            await asyncio.wait({task}, timeout=STOP_S)
            raise
        return _Session(client, task, closing)

    async def list_tools(self) -> list[ToolSpec]:
        """The server's tools (its start checked): refused in one line naming the server
        when it does not start, answers nothing within the deadline, or lists none."""
        try:
            session = await self._open()
        except asyncio.TimeoutError:
            raise RuntimeError(f"{self.what} answered nothing within tools.timeout_s="
                               f"{self.timeout_s:g} s") from None
        except Exception as e:  # noqa: BLE001 - a transport fails in many ways
            raise RuntimeError(f"{self.what} did not start: {_reason(e)}") from None
        try:
            listed = await asyncio.wait_for(session.client.list_tools(), self.timeout_s)
        except asyncio.TimeoutError:
            raise RuntimeError(f"{self.what} did not answer tools/list within "
                               f"tools.timeout_s={self.timeout_s:g} s") from None
        finally:
            if self.cfg.session == "rollout":
                await self._close(session)
        if self.cfg.session == "shared":
            self._shared = session
        if not listed.tools:
            raise RuntimeError(f"{self.what} lists no tools")
        return [ToolSpec(t.name, t.description or "", dict(t.input_schema),
                         f"mcp:{self.cfg.name}") for t in listed.tools]

    async def _session(self, key: str) -> _Session:
        if self.cfg.session == "shared":
            if self._shared is None or not self._shared.alive:
                if self._shared is not None:
                    self.restarts += 1
                    await self._close(self._shared)
                self._shared = await self._open()
            return self._shared
        session = self._sessions.get(key)
        if session is not None and not session.alive:
            self.restarts += 1
            await self._release(key)
            session = None
        if session is None:
            await self._slots.acquire()
            try:
                session = await self._open()
            except BaseException:
                self._slots.release()
                raise
            self._sessions[key] = session
        return session

    async def call(self, key: str, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        """The reply's text and whether the tool said it failed; raises ServerDied when the
        connection ended under the call, TimeoutError past the deadline."""
        session = await self._session(key)
        try:
            result = await asyncio.wait_for(session.client.call_tool(name, arguments),
                                            self.timeout_s)
        except asyncio.TimeoutError:
            raise
        except Exception as e:  # noqa: BLE001 - a dead transport raises many kinds
            if session.alive and not _is_closed(e):
                raise
            session.dead = True  # the next call opens a new session (a new process)
            raise ServerDied(_reason(e)) from None
        return _text(result), bool(result.is_error)

    async def end(self, key: str) -> None:
        """The rollout ended: its session closes."""
        if key in self._sessions:
            await self._release(key)

    async def _release(self, key: str) -> None:
        session = self._sessions.pop(key)
        self._slots.release()
        await self._close(session)

    async def _close(self, session: _Session) -> None:
        session.closing.set()
        try:
            await asyncio.wait_for(asyncio.shield(session.task), self.timeout_s)
        except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - closing is best effort
            session.task.cancel()

    async def close(self) -> None:
        for key in list(self._sessions):
            await self._release(key)
        if self._shared is not None:
            await self._close(self._shared)
            self._shared = None

    @property
    def open_sessions(self) -> int:
        return len(self._sessions) + (self._shared is not None)


def _text(result: Any) -> str:
    """A CallToolResult as text: its text parts, else its structured content as JSON."""
    import json

    parts = [c.text for c in result.content if getattr(c, "type", "") == "text"]
    if parts:
        return "\n".join(parts)
    if result.structured_content is not None:
        return json.dumps(result.structured_content, ensure_ascii=False)
    kinds = sorted({getattr(c, "type", "?") for c in result.content})
    return f"(a reply of {', '.join(kinds)} content, not text)" if kinds else ""


def _is_closed(e: BaseException) -> bool:
    import anyio

    text = str(e).lower()
    return (isinstance(e, (anyio.ClosedResourceError, anyio.BrokenResourceError,
                           anyio.EndOfStream, ConnectionError, EOFError))
            or "connection closed" in text or "closed" in text and "stream" in text)


def _reason(e: BaseException) -> str:
    """The innermost useful message of an exception (the SDK wraps them in groups)."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return f"{type(e).__name__}: {e}"
