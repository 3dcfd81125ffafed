"""Faults of docs/reliability.md's table that no other file shows: a full disk under a
checkpoint, a redis reply lost after the write was stored, a resume that changes what a run
is, a config typo through the CLI, and (slow, through the CLI) the evaluator or the launcher
killed with SIGKILL, and a killed trainer under --auto-resume."""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from test_checkpoint import _groups, _NoTokenizer, _source, _trainer, _weights
from test_reliability import EXAMPLE, _audit, _pid_of, _train

from pipelinerl.config import load_config
from pipelinerl.run.checkpoint import latest_checkpoint, read_state
from pipelinerl.streams import open_reader, open_writer

# ---- the disk fills while a checkpoint is written --------------------------------------------


def _disk_full(path: object) -> None:
    """Half a file, then what write(2) says on a full file system."""
    Path(str(path)).write_bytes(b"\0" * 100)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


class _FullDiskTokenizer:
    def save_pretrained(self, path: str) -> None:
        _disk_full(Path(path) / "tokenizer.json")


@pytest.mark.parametrize("fills_at", ["tokenizer", "trainer.pt"])
def test_a_full_disk_during_a_checkpoint_leaves_the_previous_one_and_the_stream_it_needs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fills_at: str) -> None:
    def publish(seed: int) -> None:  # one record per segment file: a trim deletes it whole
        with open_writer("local", stream="rollouts", writer_id="actor_0", root=tmp_path,
                         segment_bytes=1) as w:
            for g in _groups(seed, n_groups=2):
                w.write(g.to_dict())

    trainer = _trainer(tmp_path)
    trainer.source = _source(tmp_path)
    publish(0)
    trainer.train_step(trainer.source.take(2, step=0))
    trainer.save_checkpoint(_NoTokenizer())
    expected = _weights(trainer)
    publish(1)
    trainer.train_step(trainer.source.take(2, step=1))
    segments = sorted(p.name for p in (tmp_path / "rollouts").glob("*.jsonl"))

    if fills_at == "trainer.pt":
        monkeypatch.setattr(torch, "save", lambda obj, f, *a, **kw: _disk_full(f))
    tokenizer = _FullDiskTokenizer() if fills_at == "tokenizer" else _NoTokenizer()
    with pytest.raises(OSError) as err:
        trainer.save_checkpoint(tokenizer)  # the trainer fails with the error: nothing hidden
    assert err.value.errno == errno.ENOSPC
    monkeypatch.undo()

    run_dir = trainer.cfg.run_dir
    # No partial copy is left to fill the disk further, and step 1's checkpoint is the newest.
    assert os.listdir(run_dir / "checkpoints") == ["step_00000001"]
    checkpoint = latest_checkpoint(run_dir)
    resumed = _trainer(tmp_path, "attempt=1")
    resumed.resume(checkpoint)
    assert resumed.step == 1
    for name, value in _weights(resumed).items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)
    # The failed save trimmed nothing: the groups of step 2 are read again from its offsets.
    assert sorted(p.name for p in (tmp_path / "rollouts").glob("*.jsonl")) == segments
    offsets = read_state(checkpoint)["source"]["offsets"]
    with open_reader("local", stream="rollouts", root=tmp_path, offsets=offsets) as again:
        assert [r["group_id"] for r in again.read(10, timeout_s=0.5)] == ["s1-g0", "s1-g1"]
    # Space freed: the next save of the same trainer succeeds and trims.
    trainer.save_checkpoint(_NoTokenizer())
    assert latest_checkpoint(run_dir).name == "step_00000002"
    assert len(list((tmp_path / "rollouts").glob("*.jsonl"))) < len(segments)


# ---- the run's redis-server: a reply lost after the write was stored -------------------------


@pytest.mark.redis
def test_a_redis_write_retried_after_its_reply_was_lost_is_stored_once(
        redis_server, monkeypatch: pytest.MonkeyPatch) -> None:
    import redis

    loc = {"url": redis_server.url, "run": f"lost-reply-{time.time_ns()}", "stream": "s"}
    real = redis.connection.AbstractConnection.read_response
    lost = []

    def read_response(self, *args, **kwargs):
        reply = real(self, *args, **kwargs)  # the server executed the command...
        if armed and not lost:
            lost.append(reply)
            raise redis.exceptions.ConnectionError("connection reset")  # ...its reply is lost
        return reply

    armed = False
    with open_writer("redis", writer_id="a", **loc) as w:
        w.write({"i": 0})
        monkeypatch.setattr(redis.connection.AbstractConnection, "read_response", read_response)
        armed = True
        w.write({"i": 1})  # retried by the client after the "lost" reply
        armed = False
        w.write({"i": 2})
    monkeypatch.undo()
    assert lost == [1]  # the first try stored it
    with open_reader("redis", **loc) as r:
        assert [x["i"] for x in r.read(10, timeout_s=0.5)] == [0, 1, 2]


@pytest.mark.redis
def test_a_redis_write_many_retried_after_a_reply_was_lost_is_stored_once(
        redis_server, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pipeline's retry sends its whole batch again (its failed execute emptied it): the
    records the first try stored are skipped as this writer's own, not taken for another
    writer's, and none is stored twice."""
    import redis

    loc = {"url": redis_server.url, "run": f"lost-pipeline-reply-{time.time_ns()}", "stream": "s"}
    real = redis.connection.AbstractConnection.read_response
    lost = []

    def read_response(self, *args, **kwargs):
        reply = real(self, *args, **kwargs)
        if reply == 1 and not lost:  # the first record's "stored" (the rest are stored too)...
            lost.append(reply)
            raise redis.exceptions.ConnectionError("connection reset")  # ...its reply is lost
        return reply

    with open_writer("redis", writer_id="a", **loc) as w:
        monkeypatch.setattr(redis.connection.AbstractConnection, "read_response", read_response)
        w.write_many({"i": i} for i in range(3))
        monkeypatch.undo()
        w.write({"i": 3})
    assert lost == [1]
    with open_reader("redis", **loc) as r:
        assert [x["i"] for x in r.read(10, timeout_s=0.5)] == [0, 1, 2, 3]


# ---- refused at start ------------------------------------------------------------------------


def test_a_resume_that_changes_the_model_task_or_batch_shape_is_refused_naming_each_key(
        tmp_path: Path) -> None:
    from pipelinerl.roles.launch import prepare_resume, prepare_run

    base = [f"output_dir={tmp_path}", "name=r", f"model.path={tmp_path / 'model'}",
            "trainer.batch_size=16", "actor.group_size=4"]
    with pytest.raises(SystemExit, match="holds no run.*start it without --resume"):
        prepare_resume(load_config(EXAMPLE, base))
    run_dir = prepare_run(load_config(EXAMPLE, base), overwrite=False).run_dir
    (run_dir / "logs" / "trainer.log").write_text("attempt 0\n")
    saved = (run_dir / "config.yaml").read_text()
    with pytest.raises(SystemExit) as refusal:
        prepare_resume(load_config(EXAMPLE, [*base, "trainer.batch_size=32",
                                             f"model.path={tmp_path / 'other'}",
                                             "task.params.max_terms=5"]))
    message = str(refusal.value)
    assert "trainer.batch_size: 16 then, 32 now" in message
    assert f"model.path: '{tmp_path / 'model'}' then, '{tmp_path / 'other'}' now" in message
    assert "task: " in message and "max_terms" in message
    # Refused before anything moved: the run is as it was.
    assert (run_dir / "config.yaml").read_text() == saved
    assert (run_dir / "logs" / "trainer.log").exists()
    # What may change does: the run continues as attempt 1.
    cfg = prepare_resume(load_config(EXAMPLE, [*base, "trainer.max_steps=7", "trainer.lr=1e-5"]))
    assert cfg.attempt == 1 and load_config(run_dir / "config.yaml").trainer.max_steps == 7


def test_a_config_typo_or_a_wrong_type_is_refused_by_the_cli_naming_every_key(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from pipelinerl.cli import main

    config = tmp_path / "run.yaml"
    config.write_text(f"output_dir: {tmp_path / 'runs'}\ntrainer:\n  lrr: 1.0e-4\n"
                      "actor:\n  max_lag: two\n")
    assert main(["train", str(config), "enigne.capacity=8"]) == 2
    err = capsys.readouterr().err
    assert "trainer.lrr: unknown key (value 0.0001)" in err
    assert "actor.max_lag: value 'two'" in err and "integer" in err
    assert "enigne" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()  # nothing was started


# ---- through the CLI: kill -9 of the evaluator, of the launcher, of the trainer ------------


def _args(tmp_path: Path, cache: Path, name: str, *extra: str) -> list[str]:
    return [f"name={name}", f"output_dir={tmp_path / 'runs'}", f"warmstart.cache_dir={cache}",
            "warmstart.steps=20", "eval.enabled=false", "engine.capacity=16",
            "actor.group_size=4", "trainer.batch_size=16", "trainer.sample_timeout_s=120",
            "metrics.progress=false", "metrics.plot=false", *extra]


# Held-out evaluation every 2 steps, on a few problems.
EVAL = ("eval.enabled=true", "eval.num_problems=16", "eval.every_steps=2", "eval.every_s=0",
        "eval.temperature=0")


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r["step"] for r in rows if "eval/version" not in r]


def _evaluated(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r["eval/version"] for r in rows if "eval/version" in r]


def _wait_for(proc: subprocess.Popen, done, what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, f"no {what} in {timeout_s:.0f} s"
        time.sleep(0.2)


def _resumed_in_full(args: list[str], run_dir: Path, max_steps: int) -> None:
    """`--resume` finishes the run: every step once, nothing lost or trained twice."""
    resumed = _train(args, "--resume")
    _, err = resumed.communicate(timeout=400)
    assert resumed.returncode == 0, err[-4000:]
    assert _steps(run_dir) == list(range(1, max_steps + 1))
    code, (published, trained, dropped, lost, duplicated), text = _audit(run_dir)
    assert (lost, duplicated, code) == (0, 0, 0), text
    assert trained == max_steps * 4


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_evaluator_is_restarted_and_the_run_finishes(
        tmp_path: Path, warm_cache: Path) -> None:
    """The evaluator holds nothing the run needs: restarted like an actor, it evaluates the
    newest weights (before: its death ended the run, and --auto-resume did not resume it)."""
    args = _args(tmp_path, warm_cache, "eval-kill", "trainer.max_steps=30",
                 "trainer.checkpoint_every_steps=2", *EVAL)
    run_dir = tmp_path / "runs" / "eval-kill"
    proc = _train(args)
    log = run_dir / "logs" / "evaluator.log"
    _wait_for(proc, lambda: (log.exists() and "evaluated version" in log.read_text()
                             and max(_steps(run_dir), default=0) >= 2), "evaluation and step 2")
    before = _evaluated(run_dir)
    os.kill(_pid_of(f"evaluator {run_dir}/config.yaml"), signal.SIGKILL)
    _, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-4000:]
    assert "evaluator died (exit code -9); restarting it" in err
    assert _steps(run_dir) == list(range(1, 31))
    evaluated = _evaluated(run_dir)
    assert evaluated[-1] == 30  # the new evaluator evaluated the final weights
    assert len(evaluated) > len(before) and len(set(evaluated)) == len(evaluated)  # none twice


def _descendants(pid: int) -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process(pid).children(recursive=True)]


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_launcher_leaves_no_process_of_its_run_and_resume_finishes_it(
        tmp_path: Path, warm_cache: Path) -> None:
    """Every kind of process a run has: trainer, actor (and its verifier workers), evaluator,
    the run's redis-server. They get SIGTERM when the launcher dies (PR_SET_PDEATHSIG)."""
    args = _args(tmp_path, warm_cache, "launcher-kill", "trainer.max_steps=30",
                 "trainer.checkpoint_every_steps=2", "stream.backend=redis", *EVAL)
    run_dir = tmp_path / "runs" / "launcher-kill"
    proc = _train(args)
    _wait_for(proc, lambda: max(_steps(run_dir), default=0) >= 2, "step 2")
    time.sleep(random.Random(25).uniform(0.0, 1.0))  # a few steps on (0.1-0.2 s each here)
    run = _descendants(proc.pid)
    names = {" ".join(psutil_cmd(pid)) for pid in run}
    for role in ("trainer", "actor", "evaluator", "redis-server"):
        assert any(role in n for n in names), (role, names)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    # The roles inherited its stderr: read it, so that none blocks writing to a full pipe.
    threading.Thread(target=proc.stderr.read, daemon=True).start()
    # Without PR_SET_PDEATHSIG every one of them ran on (tried once, with it disabled).
    deadline = time.monotonic() + 10
    while [pid for pid in run if _alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [" ".join(psutil_cmd(pid)) for pid in run if _alive(pid)]
    for pid in run:  # whatever outlived the bound, so that it cannot outlive the test
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    assert left == [], f"left running 10 s after the launcher died: {left}"
    # Each role cleaned up as it stopped: the trainer's weights left no file in /dev/shm.
    assert not list(Path("/dev/shm").glob("pipelinerl-launcher-kill-*")), "weights file left"
    assert max(_steps(run_dir)) < 30
    _resumed_in_full(args, run_dir, 30)


def psutil_cmd(pid: int) -> list[str]:
    import psutil

    try:
        return psutil.Process(pid).cmdline()
    except psutil.NoSuchProcess:
        return []


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_trainer_under_auto_resume_is_resumed_by_the_launcher(
        tmp_path: Path, warm_cache: Path) -> None:
    args = _args(tmp_path, warm_cache, "auto", "trainer.max_steps=40",
                 "trainer.checkpoint_every_steps=3")
    run_dir = tmp_path / "runs" / "auto"
    proc = _train(args, "--auto-resume")
    _wait_for(proc, lambda: max(_steps(run_dir), default=0) >= 4, "step 4")
    os.kill(_pid_of(f"pipelinerl.cli trainer {run_dir}/config.yaml"), signal.SIGKILL)
    _, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-4000:]
    assert ("the trainer died: resuming the run from its newest checkpoint (restart 1 of "
            "trainer.max_restarts=3)") in err
    assert load_config(run_dir / "config.yaml").attempt == 1
    assert _steps(run_dir) == list(range(1, 41))
    code, (published, trained, dropped, lost, duplicated), text = _audit(run_dir)
    assert (lost, duplicated, code) == (0, 0, 0), text
    assert trained == 40 * 4
