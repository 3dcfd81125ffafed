"""Issue 45, failure 2: a role waiting in native code for its weight group (an actor gone
while the group forms) still stops when asked, and never waits past its timeout.

Real processes, real torch.distributed, 127.0.0.1 only. The trainer is the real CLI role
(`pipelinerl trainer`) whose setup is cut down to `open_weight_sender`, where it hung; this
test plays its one actor, which joins the rendezvous (`e0/peer/1`) and then never builds the
group, so the trainer waits inside `ProcessGroupGloo(...)`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from pipelinerl.proc.ports import free_port
from pipelinerl.streams.redis_server import start_redis_server
from pipelinerl.sync.broadcast import _bounded

_ROLE = """
import sys
import pipelinerl.roles.trainer
from pipelinerl.cli import run
from pipelinerl.roles.wiring import open_weight_sender

pipelinerl.roles.trainer.run_trainer = open_weight_sender  # the trainer's setup, up to its weight group
sys.argv = ["pipelinerl", "trainer", *sys.argv[1:]]
run()
"""


def _start_trainer(tmp_path: Path, timeout_s: float) -> tuple[subprocess.Popen, dist.TCPStore]:
    """The trainer role, waiting in its group's constructor for an actor that is gone."""
    config = tmp_path / "config.yaml"
    config.write_text("name: t\nmodel:\n  preset: tiny\neval:\n  enabled: false\n")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", _ROLE, str(config), f"output_dir={tmp_path}", "run_id=r1",
         "sync.backend=broadcast", f"sync.init_method=tcp://127.0.0.1:{port}",
         f"sync.timeout_s={timeout_s}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # The actor: joins the rendezvous once the trainer hosts the store, then builds nothing.
    deadline = time.monotonic() + 120  # the role's imports, on a loaded machine
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        try:
            store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=1))
            store.wait(["e0/peer/0"], timedelta(seconds=10))
            break
        except dist.DistError:
            time.sleep(0.2)
    store.set("e0/peer/1", "-1")
    time.sleep(1.0)  # the trainer polls the rendezvous every 10 ms: it is in the constructor
    assert proc.poll() is None, proc.communicate()[0]
    return proc, store


def test_a_native_call_past_its_timeout_is_abandoned_with_the_given_error() -> None:
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="^the group did not form$"):
        _bounded(lambda: time.sleep(30), 0.2, "the group did not form")
    assert time.monotonic() - t0 < 0.2 + 3


def test_a_native_call_s_own_error_reaches_the_caller() -> None:
    def fail() -> None:
        raise dist.DistError("wait timeout, keys: /pg0/0/1")

    with pytest.raises(dist.DistError, match="keys: /pg0/0/1"):
        _bounded(fail, 5, "unused")


def test_the_trainer_whose_actor_left_during_group_formation_fails_within_the_timeout(
        tmp_path: Path) -> None:
    proc, store = _start_trainer(tmp_path, timeout_s=3)
    t0 = time.monotonic()
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 1, out
    assert time.monotonic() - t0 < 3 + 5, out
    assert ("trainer (rank 0): the weight-sync group (epoch 0: the trainer and 1 actor(s)) did "
            "not form within 3.0 s (sync.timeout_s)") in out, out
    del store


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 130), (signal.SIGINT, 130)])
def test_a_stop_signal_stops_the_trainer_waiting_for_its_group_at_once(
        tmp_path: Path, sig: signal.Signals, code: int) -> None:
    # sync.timeout_s 60: before the fix the signal waited for the constructor to give up (60 s).
    # A role stopped by either signal exits 130 today (cli._run_role), here as everywhere.
    proc, store = _start_trainer(tmp_path, timeout_s=60)
    t0 = time.monotonic()
    proc.send_signal(sig)
    try:
        out = proc.communicate(timeout=30)[0]
    finally:
        proc.kill()
    assert time.monotonic() - t0 < 5, out
    assert proc.returncode == code, out
    assert "Traceback" not in out, out
    del store


# ---- an actor waiting for the trainer's go (a receiver's store wait) ------------------------

_ACTOR_ROLE = """
import sys, time, torch
import pipelinerl.roles.actor
from pipelinerl.cli import run
from pipelinerl.roles.wiring import open_weight_receiver

def wait_for_go(cfg, actor_id):  # the actor's setup, up to its first weight update
    receiver = open_weight_receiver(cfg, actor_id)
    while receiver.poll() is None:
        time.sleep(0.01)
    print("receiving", flush=True)
    receiver.receive_into({"w": torch.zeros(3)})

pipelinerl.roles.actor.run_actor = wait_for_go
sys.argv = ["pipelinerl", "actor", *sys.argv[1:]]
run()
"""

# The trainer publishes version 1 and waits (60 s) for actor 1, which joined and never polls.
_TRAINER = """
import sys, torch
from pipelinerl.sync import BroadcastWeightSender
s = BroadcastWeightSender(sys.argv[1], n_actors=2, timeout_s=60)
s.publish({"w": torch.ones(3)}, 1)
"""

_IDLE_ACTOR = """
import sys, time
from pipelinerl.sync import BroadcastWeightReceiver
r = BroadcastWeightReceiver(sys.argv[1], 1, 2, timeout_s=60)
time.sleep(120)
"""


def _actor_waiting_for_go(tmp_path: Path, timeout_s: float) -> tuple[subprocess.Popen, list]:
    """Actor 0 (the real CLI role, cut to its receiver) ready for version 1, in `_await_go`:
    the trainer holds the go back while it waits for actor 1."""
    init = f"tcp://127.0.0.1:{free_port()}"
    others = [subprocess.Popen([sys.executable, "-c", code, init], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL) for code in (_TRAINER, _IDLE_ACTOR)]
    config = tmp_path / "config.yaml"
    config.write_text("name: t\nmodel:\n  preset: tiny\neval:\n  enabled: false\n")
    actor = subprocess.Popen(
        [sys.executable, "-c", _ACTOR_ROLE, str(config), f"output_dir={tmp_path}", "run_id=r1",
         "--actor-id", "0", "sync.backend=broadcast", f"sync.init_method={init}",
         "actor.num_actors=2", f"sync.timeout_s={timeout_s}", "engine.device=cpu"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert actor.stdout is not None
    for line in actor.stdout:  # the role's imports and the group's formation, on a loaded machine
        if line.startswith("receiving"):
            break
    time.sleep(0.5)  # into receive_into's wait for the go
    assert actor.poll() is None, actor.communicate()[0]
    return actor, others


@pytest.fixture
def stray() -> Iterator[list[subprocess.Popen]]:
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def test_an_actor_waiting_for_the_go_fails_within_its_timeout(
        tmp_path: Path, stray: list[subprocess.Popen]) -> None:
    actor, others = _actor_waiting_for_go(tmp_path, timeout_s=3)
    stray += [actor, *others]
    t0 = time.monotonic()
    out = actor.communicate(timeout=60)[0]
    assert actor.returncode == 1, out
    assert time.monotonic() - t0 < 3 + 3, out
    assert ("actor 0 (rank 1): the trainer (rank 0) did not start the broadcast of version 1 "
            "within 3.0 s (sync.timeout_s)") in out, out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_stops_an_actor_waiting_for_the_go_at_once(
        tmp_path: Path, stray: list[subprocess.Popen], sig: signal.Signals) -> None:
    # sync.timeout_s 60: before the fix the signal waited in the store's wait for 60 s.
    actor, others = _actor_waiting_for_go(tmp_path, timeout_s=60)
    stray += [actor, *others]
    t0 = time.monotonic()
    actor.send_signal(sig)
    out = actor.communicate(timeout=30)[0]
    assert time.monotonic() - t0 < 5, out
    assert actor.returncode == 130, out
    assert "Traceback" not in out, out


# ---- a trainer rank waiting for the others (the trainer's process group) --------------------

_TRAINER_RANK = """
import sys
import pipelinerl.roles.trainer
from pipelinerl.cli import run
from pipelinerl.rl.process_group import init_distributed

timeout_s = float(sys.argv.pop())
# The trainer's setup, up to its process group.
pipelinerl.roles.trainer.run_trainer = lambda cfg: init_distributed("cpu", timeout_s=timeout_s)
sys.argv = ["pipelinerl", "trainer", *sys.argv[1:]]
run()
"""


def _rank1_alone(tmp_path: Path, timeout_s: float) -> subprocess.Popen:
    """Trainer rank 1 of 2 (as torchrun starts it), whose rank 0 never comes: rank 1 waits
    in the process group's rendezvous."""
    config = tmp_path / "config.yaml"
    config.write_text("name: t\nmodel:\n  preset: tiny\neval:\n  enabled: false\n")
    env = {**os.environ, "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    proc = subprocess.Popen([sys.executable, "-c", _TRAINER_RANK, str(config),
                             f"output_dir={tmp_path}", "run_id=r1", str(timeout_s)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120  # the role's imports, on a loaded machine
    while not (tmp_path / "t" / "logs").exists():  # _run_role made it: the role runs
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.1)
    time.sleep(1.0)
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_stops_a_trainer_rank_waiting_for_its_process_group(
        tmp_path: Path, stray: list[subprocess.Popen], sig: signal.Signals) -> None:
    proc = _rank1_alone(tmp_path, timeout_s=120)
    stray.append(proc)
    t0 = time.monotonic()
    proc.send_signal(sig)
    out = proc.communicate(timeout=30)[0]
    assert time.monotonic() - t0 < 5, out
    assert proc.returncode == 130, out
    assert "Traceback" not in out, out


def test_a_trainer_rank_waiting_for_its_process_group_fails_within_the_timeout(
        tmp_path: Path, stray: list[subprocess.Popen]) -> None:
    proc = _rank1_alone(tmp_path, timeout_s=4)  # its wait began at least 1 s ago
    stray.append(proc)
    t0 = time.monotonic()
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 1, out
    assert ("trainer rank 1: the trainer's gloo process group (2 ranks) did not form within "
            "4.0 s") in out, out
    assert time.monotonic() - t0 < 4 + 2 + 2, out  # the bound, then _bounded's grace


# ---- a trainer rank waiting for rank 0's groups (the step's collective) ----------------------

_RANK1_SHARING = """
import sys
import pipelinerl.roles.trainer
from pipelinerl.cli import run
from pipelinerl.rl.process_group import init_distributed, share_groups

def wait_for_groups(cfg):  # a non-zero rank's step, up to rank 0's groups
    rank, world, _ = init_distributed("cpu", timeout_s=120)
    print("sharing", flush=True)
    share_groups(None, rank, world)

pipelinerl.roles.trainer.run_trainer = wait_for_groups
sys.argv = ["pipelinerl", "trainer", *sys.argv[1:]]
run()
"""

# Rank 0 joins the group, then waits for samples that never come: it never broadcasts.
_RANK0_WAITING = """
import time
import torch.distributed as dist
dist.init_process_group("gloo")
time.sleep(120)
"""


def test_a_stop_signal_stops_a_trainer_rank_waiting_for_rank_0s_groups(
        tmp_path: Path, stray: list[subprocess.Popen]) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("name: t\nmodel:\n  preset: tiny\neval:\n  enabled: false\n")
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    rank0 = subprocess.Popen([sys.executable, "-c", _RANK0_WAITING], env={**env, "RANK": "0"},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rank1 = subprocess.Popen([sys.executable, "-c", _RANK1_SHARING, str(config),
                              f"output_dir={tmp_path}", "run_id=r1"],
                             env={**env, "RANK": "1", "LOCAL_RANK": "1"},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stray += [rank0, rank1]
    assert rank1.stdout is not None
    for line in rank1.stdout:  # the role's imports and the group's formation
        if line.startswith("sharing"):
            break
    time.sleep(1.0)  # into the broadcast of rank 0's groups
    assert rank1.poll() is None, rank1.communicate()[0]
    t0 = time.monotonic()
    rank1.send_signal(signal.SIGTERM)
    out = rank1.communicate(timeout=30)[0]
    assert time.monotonic() - t0 < 5, out
    assert rank1.returncode == 130, out
    assert "Traceback" not in out, out


# ---- a reader waiting on a Redis stream --------------------------------------------------

_READER = """
import sys
from pipelinerl.proc.stop_signals import install_role_signal_handlers
from pipelinerl.streams.redis_stream import RedisStreamReader, RedisStreamWriter

install_role_signal_handlers()  # as every role has them (cli._run_role)
reader = RedisStreamReader(sys.argv[1], "t:r1", "rollouts")
writer = RedisStreamWriter(sys.argv[1], "t:r1", "rollouts", "a")
print("reading", flush=True)
try:
    if sys.argv[3] == "write":  # the test stalls the server before this lands
        import time; time.sleep(1.0); writer.write({"i": 0})
    print(reader.read(10, timeout_s=float(sys.argv[2])), flush=True)
except KeyboardInterrupt:
    sys.exit(130)
"""


def _reader(url: str, timeout_s: float, then: str = "read") -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _READER, url, str(timeout_s), then],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline() == "reading\n", proc.communicate()[0]
    time.sleep(0.5)  # into XREAD BLOCK
    return proc


@pytest.mark.parametrize(("stalled", "then"), [(False, "read"), (True, "read"), (True, "write")],
                         ids=["empty stream", "server stopped", "write to a stopped server"])
def test_a_stop_signal_stops_a_redis_stream_read_or_write_at_once(
        tmp_path: Path, stray: list[subprocess.Popen], stalled: bool, then: str) -> None:
    """A read blocked on an empty stream, or a read or write on a server that stopped
    answering (SIGSTOP: a hung host), with 60 s to wait: SIGTERM ends it at once."""
    with start_redis_server(tmp_path, appendonly=False) as server:
        proc = _reader(server.url, timeout_s=60, then=then)
        stray.append(proc)
        if stalled:
            server.proc.send_signal(signal.SIGSTOP)
        if then == "write":
            time.sleep(1.5)  # the write (1 s after "reading") waits for its reply
        try:
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            out = proc.communicate(timeout=30)[0]
        finally:
            server.proc.send_signal(signal.SIGCONT)
    assert time.monotonic() - t0 < 3, out
    assert proc.returncode == 130, out


def test_a_redis_stream_read_returns_at_its_timeout(tmp_path: Path,
                                                    stray: list[subprocess.Popen]) -> None:
    with start_redis_server(tmp_path, appendonly=False) as server:
        proc = _reader(server.url, timeout_s=2)
        stray.append(proc)
        t0 = time.monotonic()
        out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0 and out.strip() == "[]", out
    assert 1.5 < time.monotonic() - t0 < 2 + 2, out
