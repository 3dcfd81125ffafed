"""A free TCP port for a server this process is about to start (redis, torch.distributed)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free now; another process could take it before it is bound, a
    race every launcher that picks ports this way accepts."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
