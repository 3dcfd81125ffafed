"""What a tool call costs a rollout: one call's round trip through the tools host, for a
Python function (a worker process), an MCP server over stdio (a process of the run's own)
and one over streamable HTTP (on 127.0.0.1), measured in the same run; and what opening a
rollout's own session costs (`session: rollout`: a process per rollout over stdio, a
handshake over HTTP). The tool is the same lookup everywhere (microseconds of work), so the
figures are the transport's. Writes the "tools" section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from _results import environment, load_average, table, write_section  # noqa: E402

from pipelinerl.config import McpServerConfig, ToolsConfig  # noqa: E402
from pipelinerl.tools.host import ToolHost  # noqa: E402
from pipelinerl.tools.specs import ToolCall  # noqa: E402

SERVER = [sys.executable, str(ROOT / "tests" / "tool_kit" / "mcp_server.py")]
CALL = ToolCall("lookup", {"key": "pear"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(port: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"no server on 127.0.0.1:{port}")


def call_ms(host: ToolHost, calls: int, key: str = "shared") -> list[float]:
    """Each call's round trip, ms, the first (the session's opening) left out."""
    host.run(host.call(key, CALL))
    out = []
    for _ in range(calls):
        started = time.perf_counter()
        result = host.run(host.call(key, CALL))
        out.append(1000 * (time.perf_counter() - started))
        assert result.outcome == "ok", result
    return out


def open_ms(host: ToolHost, sessions: int) -> list[float]:
    """A new rollout's first call (its session opened), ms."""
    out = []
    for i in range(sessions):
        started = time.perf_counter()
        assert host.run(host.call(f"r{i}", CALL)).outcome == "ok"
        out.append(1000 * (time.perf_counter() - started))
        host.end(f"r{i}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--sessions", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="a few calls (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.calls, args.sessions = 20, 2
    load = load_average()
    port = _free_port()
    http = subprocess.Popen([*SERVER, "http", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        _wait_for(port)
        url = f"http://127.0.0.1:{port}/mcp"
        hosts = {
            "Python function (worker process)": ToolsConfig(
                functions=["tool_kit.functions:lookup"]),
            "MCP stdio, session: shared": ToolsConfig(mcp=[McpServerConfig(
                name="s", command=[*SERVER, "stdio"], session="shared")], timeout_s=60),
            "MCP streamable HTTP, session: shared": ToolsConfig(mcp=[McpServerConfig(
                name="h", url=url, session="shared")], timeout_s=60),
        }
        rows = []
        for name, cfg in hosts.items():
            host = ToolHost(cfg)
            try:
                ms = call_ms(host, args.calls)
            finally:
                host.close()
            rows.append([name, f"**{statistics.median(ms):.2f}**",
                         f"{statistics.quantiles(ms, n=20)[-1]:.2f}", "-"])
        for name, cfg in (("MCP stdio, session: rollout", McpServerConfig(
                name="s", command=[*SERVER, "stdio"])),
                ("MCP streamable HTTP, session: rollout", McpServerConfig(name="h", url=url))):
            host = ToolHost(ToolsConfig(mcp=[cfg], timeout_s=60))
            try:
                opened = open_ms(host, args.sessions)
                ms = call_ms(host, args.calls, key="one rollout")
            finally:
                host.close()
            rows.append([name, f"**{statistics.median(ms):.2f}**",
                         f"{statistics.quantiles(ms, n=20)[-1]:.2f}",
                         f"{statistics.median(opened):.0f}"])
    finally:
        http.kill()
        http.wait()
    text = ("## Tools: what a call costs (`benchmarks/tools.py`)\n\n" + environment(load)
            + f"\n{args.calls} calls of a lookup one after another from one rollout (the "
            "host's event loop, as the actor makes them), after its first; ms are one call's "
            "round trip from the actor's thread. 'opening' = a new rollout's first call, its "
            f"session opened (median of {args.sessions}).\n\n"
            + table(["tool", "ms/call (median)", "p95", "opening a rollout's session, ms"],
                    rows))
    write_section("tools", text, *([args.out] if args.out else []))  # --out: a file
    print(text)


if __name__ == "__main__":
    main()
