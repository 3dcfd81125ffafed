"""Start a private `redis-server` for one run: loopback only, data and log in the run dir."""

from __future__ import annotations

import atexit
import ipaddress
import shutil
import subprocess
import time
from pathlib import Path
from typing import Callable

import redis

from pipelinerl.proc.ports import free_port

_LOG_NAME = "redis.log"


class RedisServer:
    """A running `redis-server` subprocess; `stop()` (or leaving a `with` block) ends it."""

    def __init__(self, proc: subprocess.Popen[bytes], host: str, port: int, dir: Path) -> None:
        self.proc = proc
        self.host = host
        self.port = port
        self.dir = dir
        self.log_path = dir / _LOG_NAME
        self.url = f"redis://{host}:{port}/0"
        atexit.register(self.stop)  # no orphaned server if the caller forgets to stop it

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM makes redis flush its append-only file before exiting."""
        atexit.unregister(self.stop)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "RedisServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log written)"


def _ready(url: str, pid: int) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=1.0)
    try:
        info = client.info()
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
        return False
    finally:
        client.close()
    # The pid check rules out another server already on this port. PING would answer while
    # the append-only file is still loading, when data commands are refused.
    return info["process_id"] == pid and info["loading"] == 0


def start_redis_server(
    dir: str | Path,
    *,
    port: int = 0,
    bind: str = "127.0.0.1",
    appendonly: bool = True,
    binary: str = "redis-server",
    startup_timeout_s: float = 10.0,
    preexec_fn: Callable[[], None] | None = None,
) -> RedisServer:
    """Start `redis-server` on `bind:port` (port 0: a free one) and wait until it serves.

    `preexec_fn` runs in the child before redis starts (the launcher ties the server's life to
    its own with it).

    With `appendonly` (the default) every write goes to an append-only file in `dir`, synced
    before the write is acknowledged (appendfsync always: a record a writer saw stored
    survives even a kill -9 of the server; the run writes a few records a second), so
    restarting the server in the same `dir` brings back the stream; without it nothing is
    persisted.
    """
    if not ipaddress.ip_address(bind).is_loopback:
        # No password is set, so the server must not be reachable from other machines. A
        # multi-machine run uses a managed redis with auth and passes its URL instead.
        raise ValueError(f"bind={bind!r} is not a loopback address; pass a redis URL instead")
    exe = shutil.which(binary)
    if exe is None:
        raise FileNotFoundError(
            f"{binary!r} not found on PATH: install it (Debian/Ubuntu: apt-get install "
            "redis-server) or pass the URL of a running redis server"
        )
    data_dir = Path(dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    # A free port picked here can be taken before redis binds it; then try another.
    for _ in range(1 if port else 3):
        chosen = port or free_port(bind)
        server = _launch(exe, data_dir, bind, chosen, appendonly, startup_timeout_s, preexec_fn)
        if server is not None:
            return server
    raise RuntimeError(
        f"redis-server could not bind {bind}:{chosen}; log {data_dir / _LOG_NAME}:\n"
        + _log_tail(data_dir / _LOG_NAME)
    )


def _launch(
    exe: str, data_dir: Path, bind: str, port: int, appendonly: bool, startup_timeout_s: float,
    preexec_fn: Callable[[], None] | None,
) -> RedisServer | None:
    """The started server, or None if its port was taken; raises on any other failure."""
    log_path = data_dir / _LOG_NAME
    log_start = log_path.stat().st_size if log_path.exists() else 0
    args = [
        exe,
        "--port", str(port),
        "--bind", bind,
        "--protected-mode", "yes",
        "--dir", str(data_dir),
        "--logfile", str(log_path),
        "--daemonize", "no",
        "--save", "",  # no RDB snapshots: the append-only file (if on) is the persistence
        "--appendonly", "yes" if appendonly else "no",
        "--appendfsync", "always",
    ]  # fmt: skip
    # Early failures (a bad option) go to stderr before redis opens its log: append them there.
    with open(log_path, "ab") as log:
        # A session of its own: a terminal's Ctrl-C must not stop the server before the roles
        # that write their last records to it (the owner stops it last).
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                start_new_session=True, preexec_fn=preexec_fn)
    server = RedisServer(proc, bind if ":" not in bind else f"[{bind}]", port, data_dir)
    deadline = time.monotonic() + startup_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            server.stop()
            with open(log_path, "rb") as log:
                log.seek(log_start)
                if b"Address already in use" in log.read():
                    return None
            raise RuntimeError(
                f"redis-server exited with code {proc.returncode} on start; "
                f"log {log_path}:\n{_log_tail(log_path)}"
            )
        if _ready(server.url, proc.pid):
            return server
        time.sleep(0.02)
    server.stop()
    raise RuntimeError(
        f"redis-server did not answer on {server.url} within {startup_timeout_s:.0f}s; "
        f"log {log_path}:\n{_log_tail(log_path)}"
    )
