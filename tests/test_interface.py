"""The weight group's network interface (sync/netaddr.py): chosen where the host name resolves
to loopback, across two network namespaces joined by a veth pair (issue 45, failure 1).

The namespace tests need root and iproute2; elsewhere they are skipped with the reason. Their
traffic stays inside the namespaces they create (10.200.x.0/24) and on 127.0.0.1.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from netns import _check_can_make_namespaces

from pipelinerl.sync.netaddr import (
    choose_interface,
    interface_addresses,
    route_interface,
)

_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


# ---- on this machine -----------------------------------------------------------------------


def test_broadcast_interface_on_loopback_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in _IFNAME_VARS:
        monkeypatch.delenv(var, raising=False)
    choice = choose_interface("127.0.0.1", "gloo")
    assert choice.interface is None and "loopback" in choice.reason
    assert choose_interface("localhost", "nccl").interface is None


def test_broadcast_interface_variables_and_key_take_precedence(
        monkeypatch: pytest.MonkeyPatch) -> None:
    lo = route_interface("127.0.0.1")
    assert "127.0.0.1" in {str(a) for a in interface_addresses()[lo]}
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert choose_interface("127.0.0.1", "gloo", configured=lo).interface == lo
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", lo)  # the user's variable: left to torch
    choice = choose_interface("127.0.0.1", "gloo", configured=lo)
    assert choice.interface is None and "GLOO_SOCKET_IFNAME" in choice.reason


def test_broadcast_interface_unknown_key_fails_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    with pytest.raises(RuntimeError, match="sync.interface=nosuchif0: no such interface"):
        choose_interface("127.0.0.1", "gloo", configured="nosuchif0")


# ---- NCCL reads NCCL_SOCKET_IFNAME once, at the process's first NCCL communicator ----------
# No CUDA here: torch.distributed's calls are stand-ins, which record the order of events.


@pytest.fixture
def no_ifname_vars(monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither variable set, and what the test's code sets removed after it."""
    for var in _IFNAME_VARS:
        monkeypatch.setenv(var, "")  # recorded, so that undoing restores the variable's state
        monkeypatch.delenv(var)


def test_nccl_socket_ifname_is_set_before_the_trainers_nccl_group_forms(
        monkeypatch: pytest.MonkeyPatch, no_ifname_vars: None) -> None:
    """A multi-rank CUDA trainer's own group forms first (init_distributed, then DDP): the
    weight group's interface is set before it. Before, the weight sender set it later, when
    NCCL had taken its own choice for the process."""
    import torch
    import torch.distributed as dist

    from pipelinerl.rl.process_group import init_distributed

    lo = route_interface("127.0.0.1")
    seen: dict[str, str | None] = {}
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **_: seen.setdefault(backend, os.environ.get(
                            "NCCL_SOCKET_IFNAME")))
    monkeypatch.setattr(torch.cuda, "set_device", lambda _: None)
    for var, value in (("WORLD_SIZE", "2"), ("RANK", "0"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(var, value)
    assert init_distributed("cuda", timeout_s=10, weight_store="tcp://127.0.0.1:29500",
                            interface=lo) == (0, 2, "cuda:0")
    assert seen == {"nccl": lo}


def test_a_weight_group_after_an_nccl_group_warns_and_does_not_log_the_interface_as_chosen(
        monkeypatch: pytest.MonkeyPatch, no_ifname_vars: None,
        caplog: pytest.LogCaptureFixture) -> None:
    """An NCCL group of the process formed before the weight channel: setting the variable
    would change nothing, so it is left unset, a warning names the fix, and the log names
    NCCL's own choice. Before, the channel set it and logged `weight group interface lo`."""
    import logging

    import torch.distributed as dist

    from pipelinerl.sync.broadcast import _Channel

    lo = route_interface("127.0.0.1")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *_: "nccl")
    with caplog.at_level(logging.INFO, logger="pipelinerl.sync.broadcast"):
        channel = _Channel("tcp://127.0.0.1:29500", 0, 2, "cuda", 10.0, None, lo)
    assert channel.interface is None and "NCCL_SOCKET_IFNAME" not in os.environ
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and f"set NCCL_SOCKET_IFNAME={lo}" in warned[0], warned
    assert f"weight group interface {lo} " not in caplog.text
    assert "weight group interface left to torch (NCCL keeps the one it chose" in caplog.text


# ---- across network namespaces -------------------------------------------------------------


@dataclass(frozen=True)
class _Pair:
    """Two namespaces joined by a veth pair: `a` holds `a_if` at `a_ip`, `b` holds `b_if`."""

    a: str
    b: str
    a_if: str
    b_if: str
    a_ip: str
    b_ip: str


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def netns_pair() -> Iterator[_Pair]:
    _check_can_make_namespaces()
    tag = uuid.uuid4().hex[:6]
    x = random.randint(1, 254)  # a subnet of its own per test: concurrent runs do not clash
    pair = _Pair(f"plt-{tag}-a", f"plt-{tag}-b", f"plv{tag}a", f"plv{tag}b",
                 f"10.200.{x}.1", f"10.200.{x}.2")
    made: list[str] = []
    try:
        for ns in (pair.a, pair.b):
            try:
                _ip("netns", "add", ns)
            except subprocess.CalledProcessError as e:
                pytest.skip(f"cannot make a network namespace: {e.stderr.decode().strip()}")
            made.append(ns)
            # `ip netns exec` mounts /etc/netns/<ns>/hosts over /etc/hosts: the host name maps
            # to loopback as Debian's /etc/hosts has it, whatever this machine's says.
            hosts = Path("/etc/netns") / ns / "hosts"
            hosts.parent.mkdir(parents=True)
            hosts.write_text(f"127.0.0.1 localhost\n127.0.1.1 {os.uname().nodename}\n")
        _ip("link", "add", pair.a_if, "netns", pair.a, "type", "veth",
            "peer", "name", pair.b_if, "netns", pair.b)
        for ns, ifname, addr in ((pair.a, pair.a_if, pair.a_ip), (pair.b, pair.b_if, pair.b_ip)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", ifname)
            _ip("-n", ns, "link", "set", ifname, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield pair
    finally:
        for ns in made:  # the veth pair goes with its namespaces
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)


def _in_ns(ns: str, code: str) -> subprocess.Popen[str]:
    """`python -c code` in namespace `ns`, with no interface variable set."""
    env = {k: v for k, v in os.environ.items() if k not in _IFNAME_VARS}
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c",
                             textwrap.dedent(code)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _output(p: subprocess.Popen[str], timeout: float = 120) -> str:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"timed out; stdout: {out}\nstderr: {err}") from None
    assert p.returncode == 0, f"exit {p.returncode}; stdout: {out}\nstderr: {err}"
    return out


def test_broadcast_interface_is_the_veth_that_routes_to_the_store(netns_pair: _Pair) -> None:
    out = _output(_in_ns(netns_pair.b, f"""
        import socket
        from pipelinerl.sync.netaddr import choose_interface, route_interface
        print(socket.gethostbyname(socket.gethostname()))
        print(route_interface("{netns_pair.a_ip}"), route_interface("127.0.0.1"))
        for host in ("{netns_pair.a_ip}", "{netns_pair.b_ip}", "127.0.0.1"):
            print(choose_interface(host, "gloo").interface)
        try:  # no route leaves the namespace: nothing to choose, a clear stop
            choose_interface("10.201.0.1", "nccl")
        except RuntimeError as e:
            print(e)
    """)).splitlines()
    assert out[0] == "127.0.1.1"  # what gloo would advertise by default
    assert out[1].split() == [netns_pair.b_if, "lo"]
    # The peer's store, its own (a trainer hosting it) and one on loopback.
    assert out[2:5] == [netns_pair.b_if, netns_pair.b_if, "None"]
    assert "no route to the weight store's host 10.201.0.1" in out[5]
    for name in ("sync.interface", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        assert name in out[5]


_SENDER = """
    import logging, torch
    from pipelinerl.sync import BroadcastWeightSender
    logging.basicConfig(level=logging.INFO)
    s = BroadcastWeightSender("tcp://{ip}:29531", n_actors=1, timeout_s=30,
                              rendezvous_timeout_s=60)
    s.publish({{"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}}, 1)
    s.close()
    print("sent", s.interface)
"""

_RECEIVER = """
    import logging, time, torch
    from pipelinerl.sync import BroadcastWeightReceiver
    logging.basicConfig(level=logging.INFO)
    r = BroadcastWeightReceiver("tcp://{ip}:29531", 0, 1, timeout_s=30, rendezvous_timeout_s=60)
    deadline = time.monotonic() + 60
    while r.poll() is None:
        assert time.monotonic() < deadline, "version 1 never announced"
        time.sleep(0.01)
    w = torch.zeros(3, 4)
    assert r.receive_into({{"w": w}}) == 1
    while not r.closed:
        r.poll()
        time.sleep(0.01)
    r.close()
    print("received", w.flatten().tolist(), r.interface)
"""


@pytest.mark.slow
def test_broadcast_weights_cross_namespaces_with_no_interface_variable(
        netns_pair: _Pair) -> None:
    """The regression test of issue 45's failure 1: with the host name on loopback, gloo
    advertised 127.0.0.1 and the actor died in connectFullMesh."""
    sender = _in_ns(netns_pair.a, _SENDER.format(ip=netns_pair.a_ip))
    receiver = _in_ns(netns_pair.b, _RECEIVER.format(ip=netns_pair.a_ip))
    try:
        got = _output(receiver)
        sent = _output(sender)
    finally:
        for p in (sender, receiver):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert sent.split() == ["sent", netns_pair.a_if]
    assert got.startswith(f"received {[float(i) for i in range(12)]}")
    assert got.split()[-1] == netns_pair.b_if


def test_the_sync_interface_key_reaches_the_roles_weight_channels(monkeypatch: pytest.MonkeyPatch) -> None:
    """`sync.interface` from the config (the CLI's override) reaches the trainer's sender and an
    actor's receiver: an interface that does not exist stops both at start, naming the key."""
    from pipelinerl.config import load_config
    from pipelinerl.roles.wiring import open_weight_receiver, open_weight_sender

    for name in _IFNAME_VARS:
        monkeypatch.delenv(name, raising=False)
    cfg = load_config(overrides=["model.path=unused", "sync.backend=broadcast",
                                 "sync.init_method=tcp://127.0.0.1:1", "sync.interface=nosuch0",
                                 "run_id=t"])
    with pytest.raises(RuntimeError, match="sync.interface=nosuch0"):
        open_weight_sender(cfg)
    with pytest.raises(RuntimeError, match="sync.interface=nosuch0"):
        open_weight_receiver(cfg, actor_id=0)
