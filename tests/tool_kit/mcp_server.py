"""An MCP server for the tests (the official SDK's MCPServer), run as
`python mcp_server.py MODE [PORT]`:

- `stdio` / `http PORT`: the tools below, over stdio or streamable HTTP on 127.0.0.1:PORT;
- `empty`: a stdio server that lists no tools;
- `mute`: a process that never answers (its initialize hangs).

`count` keeps a counter per MCP session (over HTTP by `Mcp-Session-Id`; over stdio the process
is the session); `die` kills the server mid-call; `sleep` hangs past any deadline.
"""

from __future__ import annotations

import os
import sys
import time
from collections import defaultdict

from mcp.server.mcpserver import Context, MCPServer

TABLE = {"apple": "7421", "pear": "1187", "plum": "5530"}
counts: defaultdict[str, int] = defaultdict(int)


def build(with_tools: bool = True) -> MCPServer:
    server = MCPServer("pipelinerl-test")
    if not with_tools:
        return server

    @server.tool()
    def lookup(key: str) -> str:
        """The code of a fruit (apple, pear, plum)."""
        return TABLE.get(key, "unknown")

    @server.tool()
    def count(ctx: Context, by: int = 1) -> int:
        """Add `by` to this session's counter and return it."""
        request = ctx.request_context.request  # HTTP: the Starlette request
        session = "process" if request is None else request.headers.get("mcp-session-id", "")
        counts[session] += by
        return counts[session]

    @server.tool()
    def die() -> str:
        """End the server process."""
        os._exit(3)

    @server.tool()
    def sleep(seconds: float) -> str:
        """Sleep, then answer."""
        time.sleep(seconds)
        return "awake"

    @server.tool()
    def fail() -> str:
        """Raise."""
        raise RuntimeError("this tool always fails")

    return server


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "mute":
        time.sleep(3600)
    elif mode == "http":
        build().run(transport="streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        build(with_tools=mode != "empty").run()
