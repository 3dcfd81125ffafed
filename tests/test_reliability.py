"""Faults, end to end through the CLI: a killed actor is restarted, a killed trainer's run
resumes with `--resume`, and `pipelinerl audit` finds nothing lost or duplicated."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "arithmetic.yaml"
AUDIT_LINE = re.compile(r"^published (\d+) trained (\d+) dropped (\d+) lost (\d+) duplicated (\d+)$",
                        re.M)


def _args(tmp_path: Path, cache: Path, name: str, *extra: str) -> list[str]:
    return [f"name={name}", f"output_dir={tmp_path / 'runs'}",
            f"warmstart.cache_dir={cache}", "warmstart.steps=20",
            "eval.enabled=false", "engine.capacity=16", "actor.group_size=4",
            "trainer.batch_size=16", "trainer.sample_timeout_s=120", "metrics.progress=false",
            "metrics.plot=false", *extra]


def _train(args: list[str], *flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pipelinerl.cli", "train", str(EXAMPLE), *args,
                             *flags], stderr=subprocess.PIPE, text=True, start_new_session=True)


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def _wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout_s: float = 240,
                   poll_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout_s
    while max(_steps(run_dir), default=0) < step:
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, f"step {step} not reached in {timeout_s:.0f} s"
        time.sleep(poll_s)


def _pid_of(pattern: str) -> int:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    assert len(out) == 1, f"{pattern}: {out}"
    return int(out[0])


def _audit(run_dir: Path) -> tuple[int, list[int], str]:
    out = subprocess.run([sys.executable, "-m", "pipelinerl.cli", "audit", str(run_dir)],
                         capture_output=True, text=True, timeout=120)
    match = AUDIT_LINE.search(out.stdout)
    assert match, out.stdout + out.stderr
    return out.returncode, [int(x) for x in match.groups()], out.stdout


def _kill_an_actor_and_finish(args: list[str], run_dir: Path, actor_id: int,
                              steps: int, at_once: bool = False) -> tuple[str, int, int, int]:
    """SIGKILL actor `actor_id` after step 3 (`at_once`: within ~10 ms of its record); the run
    finishes with every step once and the audit finds nothing lost or duplicated. The
    launcher's stderr and (published, trained, dropped)."""
    proc = _train(args)
    pattern = f"actor {run_dir}/config.yaml --actor-id {actor_id}"
    if at_once:
        _wait_for_step(proc, run_dir, 1)
        pid = _pid_of(pattern)
        _wait_for_step(proc, run_dir, 3, poll_s=0.01)
    else:
        _wait_for_step(proc, run_dir, 3)
        pid = _pid_of(pattern)
    os.kill(pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert f"actor_{actor_id} died (exit code -9); restarting it" in err
    assert _steps(run_dir) == list(range(1, steps + 1))
    code, (published, trained, dropped, lost, duplicated), text = _audit(run_dir)
    assert (lost, duplicated, code) == (0, 0, 0), text
    assert trained == steps * 4
    return err, published, trained, dropped


def test_a_killed_actor_is_restarted_and_nothing_is_lost(tmp_path: Path,
                                                         warm_cache: Path) -> None:
    args = _args(tmp_path, warm_cache, "actor-kill", "trainer.max_steps=12", "actor.max_lag=1")
    run_dir = tmp_path / "runs" / "actor-kill"
    err, published, trained, dropped = _kill_an_actor_and_finish(args, run_dir, 0, 12)
    assert "killed by signal 9 (SIGKILL)" in err or "actor_0" in err
    assert published >= trained + dropped
    # The new process continued the old one's count: the group ids never repeat.
    records = [json.loads(line) for line in
               next((run_dir / "streams").rglob("actor_0.jsonl")).read_text().splitlines()]
    ids = [r["group_id"] for r in records if not r.get("heartbeat")]
    assert len(ids) == len(set(ids))


def test_a_killed_actor_is_restarted_over_broadcast_and_nothing_is_lost(tmp_path: Path,
                                                                        warm_cache: Path) -> None:
    """The weight group is formed again to take the restarted actor (on main a dead actor
    ended a broadcast run)."""
    args = _args(tmp_path, warm_cache, "bcast-kill", "trainer.max_steps=10", "actor.num_actors=2",
                 "sync.backend=broadcast")
    run_dir = tmp_path / "runs" / "bcast-kill"
    err, *_ = _kill_an_actor_and_finish(args, run_dir, 1, 10)
    assert "formed again (epoch 1)" in err  # the trainer's log


def test_the_only_actor_killed_over_broadcast_while_the_trainer_waits_is_restarted(
        tmp_path: Path, warm_cache: Path) -> None:
    """Issue 37, D1: one actor over broadcast, SIGKILLed while the trainer waits for its
    samples. On main the restart waited in its constructor for the trainer to form the weight
    group again, which it did only inside its next publish, which needed that actor's samples:
    no step after the kill, and the launcher failed after about 2 x sync.timeout_s. With
    actor.max_lag=0 the actor starts step 4's groups only once it holds step 3's weights
    (published before step 3 is logged), and with engine.capacity=4 they take a while: the kill
    lands while the trainer waits for them."""
    args = _args(tmp_path, warm_cache, "bcast-one", "trainer.max_steps=5", "actor.max_lag=0",
                 "engine.capacity=4", "sync.backend=broadcast", "sync.timeout_s=30")
    run_dir = tmp_path / "runs" / "bcast-one"
    err, *_ = _kill_an_actor_and_finish(args, run_dir, 0, 5, at_once=True)
    assert "a restarted actor waits for weights: publishing version 3" in err  # the trainer's log


def test_a_killed_trainer_resumes_from_its_checkpoint_with_contiguous_steps(tmp_path: Path,
                                                                            warm_cache: Path) -> None:
    # Segments of 16 KB (a few groups each), so checkpoints delete the stream's old ones.
    args = _args(tmp_path, warm_cache, "trainer-kill", "trainer.max_steps=14",
                 "trainer.checkpoint_every_steps=4", "stream.segment_mb=0.016")
    run_dir = tmp_path / "runs" / "trainer-kill"
    proc = _train(args)
    _wait_for_step(proc, run_dir, 6)
    os.kill(_pid_of(f"pipelinerl.cli trainer {run_dir}/config.yaml"), signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "--resume" in err  # the command that continues the run
    crashed_at = max(_steps(run_dir))
    assert crashed_at >= 6

    resumed = _train(args, "--resume")
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    steps = _steps(run_dir)
    assert steps == list(range(1, 15))  # no repeated, no skipped step
    discarded = run_dir / "metrics.discarded.jsonl"
    if crashed_at > 4 * (crashed_at // 4):  # rows after the last checkpoint moved aside
        assert {json.loads(line)["discarded_by_attempt"] for line in discarded.read_text().splitlines()} == {1}
    code, (published, trained, dropped, lost, duplicated), text = _audit(run_dir)
    assert (lost, duplicated, code) == (0, 0, 0), text
    assert trained == 14 * 4
    assert (run_dir / "logs" / "attempt0").is_dir()
    assert "no longer in the stream (deleted after checkpoints" in text
    segments = [p.name for p in (run_dir / "streams").rglob("rollouts/*.jsonl")]
    assert "actor_0.jsonl" not in segments  # the first segment went after a checkpoint


def test_a_redis_server_restart_mid_run_is_survived(tmp_path: Path,
                                                    warm_cache: Path) -> None:
    args = _args(tmp_path, warm_cache, "redis-kill", "trainer.max_steps=10",
                 "stream.backend=redis")
    run_dir = tmp_path / "runs" / "redis-kill"
    proc = _train(args)
    _wait_for_step(proc, run_dir, 3)
    from pipelinerl.config import load_config

    port = load_config(run_dir / "config.yaml").stream.redis_url.rsplit(":", 1)[1].split("/")[0]
    os.kill(_pid_of(f"redis-server 127.0.0.1:{port}"), signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "redis-server exited (code -9); restarting it" in err
    assert _steps(run_dir) == list(range(1, 11))
    code, (published, trained, dropped, lost, duplicated), text = _audit(run_dir)
    assert (lost, duplicated, code) == (0, 0, 0), text
    assert trained == 10 * 4


def test_a_finished_redis_run_extended_with_resume_loses_and_repeats_nothing(tmp_path: Path,
                                                                             warm_cache: Path) -> None:
    """docs/reliability.md's way to extend a run: each resumed actor continues its predecessor
    (group ids, claim, weights), whether or not the final checkpoint's trim reached the
    predecessor's last record (tests/test_streams.py shows the case where it does)."""
    args = _args(tmp_path, warm_cache, "extend", "trainer.max_steps=4", "stream.backend=redis")
    run_dir = tmp_path / "runs" / "extend"
    first = _train(args)
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    extended = _train([*args, "trainer.max_steps=8"], "--resume")
    _, err = extended.communicate(timeout=300)
    assert extended.returncode == 0, err
    assert _steps(run_dir) == list(range(1, 9))
    assert "actor 0 continues after" in (run_dir / "logs" / "actor_0.log").read_text()
    code, (published, trained, dropped, lost, duplicated), text = _audit(run_dir)
    assert (lost, duplicated, code) == (0, 0, 0), text
    assert trained == 8 * 4


def test_sigint_at_random_moments_always_stops_the_run_cleanly(tmp_path: Path) -> None:
    """Wherever Ctrl-C lands once the interpreter runs our code (imports, warm-start, spawning,
    supervising, a role's first step), it exits with 130 within the stop grace and leaves no
    process. Before that, in the interpreter's own start-up (about 0.15 s here, measured by
    sending SIGINT at fixed delays), Python's default handling applies (docs/reliability.md)."""
    import random

    rng = random.Random(20261123)
    # Half in the imports (0.3-2.5 s), where a KeyboardInterrupt raised inside torch's or
    # transformers' import aborted the process or became another error (2 in 40 before).
    delays = [*(rng.uniform(0.3, 2.5) for _ in range(4)), *(rng.uniform(2.5, 12.0) for _ in range(4))]
    for trial, delay in enumerate(delays):
        name = f"sigint-{trial}"
        # Its own cache: a Ctrl-C may then land in the warm start.
        proc = _train(_args(tmp_path, tmp_path / "cache", name, "trainer.max_steps=100000"))
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"trial {trial}: the launcher did not exit within 60 s")
        assert code == 130, f"trial {trial} ({delay:.2f} s): exit code {code}: {proc.stderr.read()[-2000:]}"
        leftover = subprocess.run(["pgrep", "-f", str(tmp_path / "runs" / name)],
                                  capture_output=True, text=True)
        assert leftover.stdout.strip() == "", f"trial {trial}: left {leftover.stdout}"


# Installed into every process of the run through PYTHONPATH: trainer rank FAKE_FAIL_RANK
# raises in its second micro-batch's loss, between the DDP forward and the backward, while the
# other rank waits in the backward's all-reduce for it. With FAKE_TEARDOWN_S, the failing frame
# also holds an object whose teardown blocks that long: what a traceback keeps alive past
# `destroy_process_group` (the DDP model, its process group) is torn down only as the process
# exits, and such a teardown may wait for the other ranks (an NCCL communicator, a collective in
# flight; gloo's, here, returns at once); it must not keep the failed rank from exiting.
_FAIL_MID_STEP = """
import os

if os.environ.get("RANK") == os.environ.get("FAKE_FAIL_RANK"):
    import time
    import pipelinerl.rl.step as step

    class _BlockingTeardown:
        def __del__(self):
            time.sleep(float(os.environ["FAKE_TEARDOWN_S"]))

    _loss, _calls = step._policy_loss, []

    def _failing_loss(*args, **kwargs):
        _calls.append(1)
        if len(_calls) == 2:
            held = _BlockingTeardown() if os.environ.get("FAKE_TEARDOWN_S") else None
            raise RuntimeError("injected failure in the middle of a training step")
        return _loss(*args, **kwargs)

    step._policy_loss = _failing_loss
"""


@pytest.mark.parametrize("teardown_s", [None, 600], ids=["error", "error-blocking-teardown"])
def test_a_trainer_rank_failing_mid_step_ends_the_run_with_its_error(
        tmp_path: Path, warm_cache: Path, monkeypatch: pytest.MonkeyPatch,
        teardown_s: int | None) -> None:
    """2 DDP ranks; rank 1 raises mid-step. The run ends soon after with exit code 1, the
    launcher shows rank 1's error (rank 0 only sees its peer gone: on main the launcher showed
    rank 0's 'Connection closed by peer' alone), and no process is left. A failed rank leaves
    once its error is written, whatever its traceback keeps alive (on main, a teardown that
    blocks held the rank, and the other rank in its all-reduce, for the collective timeout)."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(_FAIL_MID_STEP)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(tmp_path / "site"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("FAKE_FAIL_RANK", "1")
    if teardown_s is not None:
        monkeypatch.setenv("FAKE_TEARDOWN_S", str(teardown_s))
    run_dir = tmp_path / "runs" / "rank-fails"
    proc = _train(_args(tmp_path, warm_cache, "rank-fails", "trainer.max_steps=5",
                        "trainer.num_procs=2"))
    error_file = run_dir / "logs" / "trainer_rank1.error"
    try:
        deadline = time.monotonic() + 300
        while not error_file.exists() and proc.poll() is None:
            assert time.monotonic() < deadline, "rank 1 did not fail within 300 s"
            time.sleep(0.2)
        failed_at = time.monotonic()
        try:
            _, err = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            raise AssertionError("the run did not end within 90 s of rank 1's failure") from None
        ended_s = time.monotonic() - failed_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        # A hung rank (its own session, under torchrun's): killed, after being named below.
        left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True,
                              text=True).stdout.split()
        for pid in left:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert not left, f"processes left running: {left}"
    assert proc.returncode == 1, err
    # The launcher's report (the ranks' own output, torchrun's, comes before it).
    report = err.partition("trainer failed with exit code 1:")[2]
    assert "injected failure in the middle of a training step" in report, err[-3000:]
    print(f"the run ended {ended_s:.1f} s after rank 1's failure")
