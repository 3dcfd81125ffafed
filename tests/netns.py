"""Machines for tests: network namespaces on one bridge, each a host with an address of its own.

Needs root and iproute2; `lan` skips the test, naming why, where namespaces cannot be made. All
traffic stays inside the namespaces made here (10.200.x.0/24) and on their loopbacks. In each
namespace the host name maps to loopback, as Debian's /etc/hosts has it.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
SRC = str(Path(__file__).resolve().parents[1] / "src")


@dataclass(frozen=True)
class Lan:
    """Host i is namespace `names[i]` at `addrs[i]` on interface `ifnames[i]`; host 0 holds the
    bridge the others' veth pairs hang on."""

    names: tuple[str, ...]
    addrs: tuple[str, ...]
    ifnames: tuple[str, ...]

    def popen(self, host: int, argv: list[str], env: dict[str, str] | None = None,
              **kwargs: object) -> subprocess.Popen:
        """`argv` on host `host`, in a session of its own (its process group is its children
        too), with `env` over a copy of ours less any interface variable."""
        full = {k: v for k, v in os.environ.items() if k not in IFNAME_VARS}
        full["PYTHONPATH"] = os.pathsep.join(filter(None, [SRC, full.get("PYTHONPATH")]))
        full.update(env or {})
        return subprocess.Popen(["ip", "netns", "exec", self.names[host], *argv], env=full,
                                start_new_session=True, **kwargs)  # type: ignore[call-overload]

    def python(self, host: int, args: list[str], env: dict[str, str] | None = None,
               **kwargs: object) -> subprocess.Popen:
        return self.popen(host, [sys.executable, *args], env, **kwargs)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _check_can_make_namespaces() -> None:
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's `ip` to make network namespaces")
    if os.geteuid() != 0:
        pytest.skip("needs root to make network namespaces")


def _add_namespace(name: str) -> None:
    try:
        _ip("netns", "add", name)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot make a network namespace: {e.stderr.decode().strip()}")
    # `ip netns exec` mounts /etc/netns/<ns>/hosts over /etc/hosts.
    hosts = Path("/etc/netns") / name / "hosts"
    hosts.parent.mkdir(parents=True, exist_ok=True)
    hosts.write_text(f"127.0.0.1 localhost\n127.0.1.1 {os.uname().nodename}\n")
    _ip("-n", name, "link", "set", "lo", "up")


@contextmanager
def lan(n_hosts: int) -> Iterator[Lan]:
    """`n_hosts` namespaces on one Ethernet segment (a bridge in host 0), removed afterwards."""
    _check_can_make_namespaces()
    tag = uuid.uuid4().hex[:6]
    subnet = random.randint(1, 254)  # its own per test: a stray address never meets another's
    names = tuple(f"plm-{tag}-{i}" for i in range(n_hosts))
    addrs = tuple(f"10.200.{subnet}.{i + 1}" for i in range(n_hosts))
    bridge = f"plb{tag}"
    ifnames = (bridge, *(f"plv{tag}{i}" for i in range(1, n_hosts)))
    made: list[str] = []
    try:
        for name in names:
            _add_namespace(name)
            made.append(name)
        _ip("-n", names[0], "link", "add", bridge, "type", "bridge")
        _ip("-n", names[0], "link", "set", bridge, "up")
        for i in range(1, n_hosts):
            port = f"plp{tag}{i}"  # the bridge's end of host i's cable
            _ip("link", "add", port, "netns", names[0], "type", "veth",
                "peer", "name", ifnames[i], "netns", names[i])
            _ip("-n", names[0], "link", "set", port, "master", bridge, "up")
        for name, ifname, addr in zip(names, ifnames, addrs, strict=True):
            _ip("-n", name, "addr", "add", f"{addr}/24", "dev", ifname)
            _ip("-n", name, "link", "set", ifname, "up")
        yield Lan(names, addrs, ifnames)
    finally:
        for name in made:  # veth pairs and the bridge go with their namespaces
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
            shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
