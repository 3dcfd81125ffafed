"""Checkpoints and resume: exact continuation, atomicity, the metrics cut, admission counts."""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
from tiny_models import VOCAB, tiny_hf_model

from pipelinerl.config import MetricsConfig, load_config
from pipelinerl.metrics.logger import MetricsLogger
from pipelinerl.records import open_append, open_resumed, read_rows
from pipelinerl.rl.batches import BatchSource
from pipelinerl.roles.trainer import Trainer
from pipelinerl.run.attempts import (
    ATTEMPTS_FILE,
    read_resumes,
    record_resume,
    valid_upto,
)
from pipelinerl.run.checkpoint import (
    CheckpointDue,
    complete_checkpoints,
    latest_checkpoint,
    read_state,
)
from pipelinerl.streams import open_reader, open_writer
from pipelinerl.sync import ShmWeightReceiver, ShmWeightSender
from pipelinerl.types import Group, Sample


class _NoTokenizer:
    """Stands in for a tokenizer: a checkpoint saves one beside the weights."""

    def save_pretrained(self, path: str) -> None:
        Path(path, "tokenizer.json").write_text("{}")


def _groups(seed: int, n_groups: int = 2, group_size: int = 4, version: int = 0) -> list[Group]:
    rng = random.Random(seed)
    groups = []
    for g in range(n_groups):
        samples = []
        for i in range(group_size):
            n = rng.randint(2, 6)
            samples.append(Sample(prompt_ids=[rng.randrange(VOCAB) for _ in range(3)],
                                  token_ids=[rng.randrange(VOCAB) for _ in range(n)],
                                  logprobs=[-rng.uniform(0.5, 3.0) for _ in range(n)],
                                  versions=[version] * n, reward=float(i % 2), success=bool(i % 2),
                                  finish_reason="stop", group_id=f"s{seed}-g{g}", actor_id=g % 2))
        groups.append(Group(f"s{seed}-g{g}", "p", samples, actor_id=g % 2))
    return groups


def _trainer(tmp_path: Path, *overrides: str) -> Trainer:
    cfg = load_config(overrides=["model.path=unused", f"output_dir={tmp_path}", "name=r",
                                 "trainer.batch_size=8", "actor.group_size=4",
                                 "trainer.lr_schedule=cosine", "trainer.warmup_steps=2",
                                 "trainer.max_steps=10", *overrides])
    return Trainer(cfg, tiny_hf_model("qwen2", seed=1).train(), source=None, sender=None)


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_the_step_after_a_resume_equals_the_uninterrupted_step(tmp_path: Path) -> None:
    first = _trainer(tmp_path)
    for seed in range(3):
        first.train_step(_groups(seed))
    path = first.save_checkpoint(_NoTokenizer())
    first.train_step(_groups(99))  # the uninterrupted process's next step
    expected = _weights(first)

    resumed = _trainer(tmp_path, "attempt=1")
    resumed.resume(path)
    assert resumed.step == 3 and resumed.samples_trained == 24
    assert resumed.scheduler.last_epoch == first.scheduler.last_epoch - 1
    resumed.train_step(_groups(99))
    for name, value in _weights(resumed).items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6, msg=name)
    # Adam's moments came back too: a fresh optimizer's step would differ.
    fresh = _trainer(tmp_path, "attempt=1")
    fresh.model.load_state_dict(_weights_at(path))
    fresh.train_step(_groups(99))
    assert any(not torch.allclose(v, expected[k], atol=1e-6) for k, v in _weights(fresh).items())


def _weights_at(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights = load_file(path / "model" / "model.safetensors")
    weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])  # tied
    return weights


def test_half_written_and_incomplete_checkpoints_are_never_loaded(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, "trainer.checkpoint_keep=2")
    run_dir = trainer.cfg.run_dir
    for seed in range(3):
        trainer.train_step(_groups(seed))
        trainer.save_checkpoint(_NoTokenizer())
    # Only the newest 2 are kept.
    assert [p.name for p in complete_checkpoints(run_dir)] == ["step_00000002", "step_00000003"]
    # A save killed mid-write leaves a .tmp directory; a directory without state.json is not
    # one the trainer wrote completely either.
    (run_dir / "checkpoints" / ".step_00000004.tmp" / "model").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_00000005" / "model").mkdir(parents=True)
    assert latest_checkpoint(run_dir).name == "step_00000003"
    assert read_state(latest_checkpoint(run_dir))["step"] == 3
    trainer.train_step(_groups(4))
    trainer.save_checkpoint(_NoTokenizer())  # and the next save removes the leftover
    assert not (run_dir / "checkpoints" / ".step_00000004.tmp").exists()


def test_a_save_interrupted_mid_write_leaves_the_previous_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = _trainer(tmp_path)
    trainer.train_step(_groups(0))
    trainer.save_checkpoint(_NoTokenizer())
    trainer.train_step(_groups(1))

    def killed(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        trainer.save_checkpoint(_NoTokenizer())
    assert [p.name for p in (trainer.cfg.run_dir / "checkpoints").iterdir()] == ["step_00000001"]


class _Crash(BaseException):
    """The process dies here."""


def test_a_save_replacing_its_step_leaves_it_loadable_whenever_it_is_cut_short(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same step saved again (keep=1: no older checkpoint to fall back on), killed before
    each rename or delete in turn, and each time on top of what the previous kill left."""
    trainer = _trainer(tmp_path, "trainer.checkpoint_keep=1")
    trainer.train_step(_groups(0))
    trainer.save_checkpoint(_NoTokenizer())
    expected = _weights(trainer)
    run_dir = trainer.cfg.run_dir
    for crash_at in itertools.count():
        done = [0]

        def dies_at_crash(real: Callable[..., object]) -> Callable[..., object]:
            def op(*args: object, **kwargs: object) -> object:
                if done[0] == crash_at:
                    raise _Crash
                done[0] += 1
                return real(*args, **kwargs)
            return op

        monkeypatch.setattr(Path, "rename", dies_at_crash(Path.rename))
        monkeypatch.setattr(shutil, "rmtree", dies_at_crash(shutil.rmtree))
        try:
            trainer.save_checkpoint(_NoTokenizer())
            crashed = False
        except _Crash:
            crashed = True
        monkeypatch.undo()
        path = latest_checkpoint(run_dir)
        assert path is not None, f"no checkpoint after a crash at operation {crash_at}"
        resumed = _trainer(tmp_path, "attempt=1")
        resumed.resume(path)
        assert resumed.step == 1
        for name, value in _weights(resumed).items():
            torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)
        if not crashed:
            break
    # The save that ran to the end cleared what the crashes left.
    assert os.listdir(run_dir / "checkpoints") == ["step_00000001"]


def test_checkpoint_due_by_steps_or_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr("pipelinerl.run.checkpoint.time.monotonic", lambda: clock[0])
    due = CheckpointDue(every_steps=5, every_s=60.0, step=10)
    assert not due(10) and not due(14) and due(15)
    due.done(15)
    clock[0] += 61
    assert due(16) and not due(15)
    assert not CheckpointDue(0, 0.0)(1000)  # both off: only the final checkpoint


def test_resume_cuts_the_metrics_after_the_checkpoint_and_keeps_them_aside(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "time_s": s} for s in range(1, 8)] + [{"step": 3, "eval/version": 3}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with open_resumed(path, resume_step=5, attempt=1) as f:
        f.write(json.dumps({"step": 6, "time_s": 6.5}) + "\n")
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 3, 6]
    aside = [json.loads(line) for line in (tmp_path / "metrics.discarded.jsonl").read_text().splitlines()]
    assert [r["step"] for r in aside] == [6, 7] and {r["discarded_by_attempt"] for r in aside} == {1}
    with pytest.raises(FileExistsError):
        open_resumed(path, resume_step=None, attempt=0)  # a new run never appends


def _synced(f: object) -> bool:
    """Every write reaches the disk before it returns (O_DSYNC)."""
    return bool(fcntl.fcntl(f.fileno(), fcntl.F_GETFL) & os.O_DSYNC)


def test_metrics_and_trained_rows_are_on_disk_once_written(tmp_path: Path) -> None:
    """A checkpoint (fsynced) counts the rows written before it: after a machine crash they
    must be there too, in a new run's files and in a resumed run's."""
    logger = MetricsLogger(tmp_path, MetricsConfig(), "r", {})
    assert _synced(logger._file)
    logger.log(1, {"time_s": 1.0})
    logger.close()
    with open_resumed(tmp_path / "trained.jsonl", resume_step=None, attempt=0) as f:
        assert _synced(f)
    resumed = MetricsLogger(tmp_path, MetricsConfig(), "r", {}, resume_step=1, attempt=1)
    assert _synced(resumed._file)
    resumed.close()


def test_a_resume_recorded_after_a_cut_attempts_line_is_kept(tmp_path: Path) -> None:
    """A crash cut attempt 2's line: the next resume starts on a fresh line, so valid_upto
    still knows it (before, it was glued to the cut line and read back as nothing)."""
    record_resume(tmp_path, 1, 5)
    with (tmp_path / ATTEMPTS_FILE).open("a") as f:
        f.write('{"attempt": 2, "resumed_fr')
    assert record_resume(tmp_path, 3, 10) == [(1, 5), (3, 10)]
    assert valid_upto(read_resumes(tmp_path)) == {0: 5, 1: 10}


def test_a_cut_row_in_the_run_records_is_skipped_with_a_warning_and_costs_no_other(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A cut trained.jsonl/metrics.jsonl row (machine crash mid-write): the resume reads every
    whole row around it (before, json.loads raised and the run could not resume)."""
    path = tmp_path / "trained.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "trai\n{"step": 3}\n{"step": 4, "tr')
    with open_resumed(path, resume_step=3, attempt=1) as f:
        f.write(json.dumps({"step": 4}) + "\n")
    assert [row["step"] for row in read_rows(path)] == [1, 3, 4]
    assert "trained.jsonl line 2 is not a complete JSON row" in caplog.text
    with open_append(path) as f:  # an intact file gets no empty line
        f.write(json.dumps({"step": 5}) + "\n")
    assert path.read_text().count("\n\n") == 0


def test_valid_versions_per_attempt_after_resumes() -> None:
    assert valid_upto([]) == {}
    assert valid_upto([(1, 40)]) == {0: 40}
    # Attempt 2 resumed from an older checkpoint than attempt 1 did.
    assert valid_upto([(1, 40), (2, 30)]) == {0: 30, 1: 30}


def _source(tmp_path: Path, offsets: dict | None = None, max_lag: int = 2) -> BatchSource:
    reader = open_reader("local", stream="rollouts", root=tmp_path, offsets=offsets)
    return BatchSource(reader, group_size=4, max_lag=max_lag, timeout_s=5.0)


def test_drops_give_places_back_and_the_source_survives_a_checkpoint(tmp_path: Path) -> None:
    with open_writer("local", stream="rollouts", writer_id="actor_0", root=tmp_path) as w:
        for g in _groups(0, n_groups=2, version=0) + _groups(1, n_groups=4, version=5):
            w.write(g.to_dict())
        w.write({"group_id": "bad", "actor_id": 1})  # malformed, but whose place is known
    source = _source(tmp_path)
    # At step 5 the version-0 groups are 5 steps stale (max_lag 2): dropped, places back; the
    # malformed record is dropped as it is read.
    batch = source.take(2, step=5)
    assert [g.group_id for g in batch] == ["s1-g0", "s1-g1"]
    assert source.dropped == {"stale": 2, "malformed": 1}
    assert source.given_back == {0: 1, 1: 2}
    snapshot = json.loads(json.dumps(source.snapshot()))  # as state.json holds it
    assert [g["group_id"] for g in snapshot["buffered"]] == ["s1-g2", "s1-g3"]

    # Reopened at the checkpoint's offsets: what was read and not trained comes back, once.
    again = _source(tmp_path, snapshot["offsets"])
    again.restore(snapshot)
    assert [g.group_id for g in again.take(2, step=5)] == ["s1-g2", "s1-g3"]
    again.timeout_s = 0.3
    with pytest.raises(TimeoutError):
        again.take(1, step=5)
    assert again.dropped == {"stale": 2, "malformed": 1} and again.given_back == {0: 1, 1: 2}


@pytest.mark.parametrize("mode", ["mode=pipeline", "mode=conventional"])
def test_a_wait_for_groups_ends_when_max_time_s_runs_out(tmp_path: Path, mode: str) -> None:
    """trainer.max_time_s was checked only between steps: a trainer waiting for a batch (a
    conventional round, slow actors) overran it by the whole wait, up to sample_timeout_s.
    Now the wait ends at the budget, and the groups already read wait in the checkpoint."""
    with open_writer("local", stream="rollouts", writer_id="actor_0", root=tmp_path) as w:
        w.write(_groups(0, n_groups=1)[0].to_dict())
    trainer = Trainer(load_config(overrides=[
        "model.path=unused", f"output_dir={tmp_path}", "name=r", "trainer.batch_size=8",
        "actor.group_size=4", "trainer.max_time_s=1", mode]),
        tiny_hf_model("qwen2", seed=1).train(), source=_source(tmp_path), sender=None)
    trainer.source.timeout_s = 60.0  # the source alone would wait this long, then raise
    assert next(trainer.batches()) is None
    assert 1.0 < time.monotonic() - trainer.started_at < 10.0
    assert [g["group_id"] for g in trainer.source.snapshot()["buffered"]] == ["s0-g0"]


def test_a_run_that_ends_before_its_first_step_publishes_no_final_weights(tmp_path: Path) -> None:
    """trainer.max_time_s ran out before the first step, eval on: the trainer said its final
    weights were published and the evaluator waited for a version that never came (found by
    benchmarks/gpu.py check 8 --quick: killed after 260 s)."""
    cfg = load_config(overrides=["model.path=unused", f"output_dir={tmp_path}", "name=r",
                                 "trainer.batch_size=8", "actor.group_size=4"])
    sender = ShmWeightSender(f"final-{tmp_path.name}", shm_dir=tmp_path)
    receiver = ShmWeightReceiver(f"final-{tmp_path.name}", shm_dir=tmp_path)
    try:
        trainer = Trainer(cfg, tiny_hf_model("qwen2", seed=1).train(), source=None, sender=sender)
        assert trainer.publish_final() is False and receiver.poll() is None
        trainer.step = 1  # one step taken: its weights go out
        assert trainer.publish_final() is True and receiver.poll() == 1
    finally:
        receiver.close()
        sender.close()


def test_groups_made_with_weights_lost_in_a_crash_are_dropped_whatever_the_step(tmp_path: Path) -> None:
    lost = _groups(0, n_groups=1, version=42)[0]  # attempt 0 published 42 after checkpoint 40
    kept = _groups(1, n_groups=1, version=40)[0]
    new = _groups(2, n_groups=1, version=43)[0]
    new.attempt = 1
    with open_writer("local", stream="rollouts", writer_id="actor_0", root=tmp_path) as w:
        for g in (lost, kept, new):
            w.write(g.to_dict())
    source = _source(tmp_path, max_lag=8)
    source.valid_upto = valid_upto([(1, 40)])
    # At step 44 version 42 is not even stale: only its attempt tells it apart.
    assert [g.group_id for g in source.take(2, step=44)] == ["s1-g0", "s2-g0"]
    assert source.dropped == {"after_checkpoint": 1} and source.given_back == {0: 1}


def test_a_trainer_waiting_for_groups_tells_a_blocked_actor_from_a_dead_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr("pipelinerl.rl.batches.time.monotonic", lambda: clock[0])
    source = _source(tmp_path)
    with open_writer("local", stream="rollouts", writer_id="actor_1", root=tmp_path) as w:
        w.write(_groups(0, n_groups=1, version=0)[0].to_dict() | {"actor_id": 1})
    source._pull()
    clock[0] += 45.0  # actor 1's group came 45 s ago, and nothing since
    with open_writer("local", stream="rollouts", writer_id="actor_0", root=tmp_path) as w:
        w.write({"heartbeat": True, "actor_id": 0, "version": 3, "in_flight": 0, "claimed": 24,
                 "limit": 24, "waiting_for_weights": False, "blocked": True})
    source._pull()
    assert len(source.buffer) == 1  # a heartbeat is no group
    report = source.actors_report(step=9)
    assert "actor 0: alive but blocked by the staleness bound (it holds weights of version 3 " \
           "at trainer step 9" in report
    assert "actor 1: silent for 45 s, so dead or hung" in report
    assert BatchSource(_ListReaderEmpty(), 4, 2, 5.0).actors_report(1).startswith("No actor has")


class _ListReaderEmpty:
    def read(self, max_count: int, timeout_s: float) -> list:
        return []


def test_an_attempt_that_died_before_its_first_checkpoint_is_known_to_the_next(tmp_path: Path) -> None:
    """Attempt 1 resumes from step 2, publishes versions 3 and 4 and dies before it writes a
    checkpoint; attempt 2 resumes from the same checkpoint, which knows nothing of attempt 1.
    Attempt 1's groups must still be dropped (before attempts.jsonl they were trained)."""
    first = _trainer(tmp_path)
    for seed in range(2):
        first.train_step(_groups(seed))
    path = first.save_checkpoint(_NoTokenizer())

    def resumed(attempt: int) -> Trainer:
        cfg = _trainer(tmp_path, f"attempt={attempt}").cfg
        trainer = Trainer(cfg, tiny_hf_model("qwen2", seed=1).train(), source=_source(tmp_path),
                          sender=None)
        trainer.resume(path)
        return trainer

    resumed(1)  # ...and dies before its first checkpoint
    second = resumed(2)
    assert second.source.valid_upto == {0: 2, 1: 2}
    lost = _groups(5, n_groups=1, version=3)[0]
    lost.attempt = 1
    kept = _groups(6, n_groups=1, version=2)[0]
    kept.attempt = 1
    with open_writer("local", stream="rollouts", writer_id="actor_0", root=tmp_path) as w:
        for g in (lost, kept):
            w.write(g.to_dict())
    assert [g.group_id for g in second.source.take(1, step=3)] == ["s6-g0"]
    assert second.source.dropped == {"after_checkpoint": 1}


def _checkpoint_choice(rank: int, world: int, run_dir: str) -> str:
    """Rank 1 lists the directory through a stale cache: it misses the newest checkpoint."""
    import pipelinerl.run.checkpoint as checkpoint

    if rank == 1:
        listing = checkpoint.complete_checkpoints
        checkpoint.complete_checkpoints = lambda d: listing(d)[:-1]
    return checkpoint.agreed_latest_checkpoint(Path(run_dir)).name


def test_every_rank_resumes_from_rank_0s_newest_checkpoint(tmp_path: Path) -> None:
    from ranks import run_ranks

    trainer = _trainer(tmp_path)
    for seed in range(2):
        trainer.train_step(_groups(seed))
        trainer.save_checkpoint(_NoTokenizer())
    # Each rank listing the directory itself (as run_trainer did) would resume rank 1 at step 1.
    assert run_ranks(2, _checkpoint_choice, str(trainer.cfg.run_dir)) == ["step_00000002"] * 2


def test_a_resume_with_more_steps_or_another_lr_continues_the_lr_without_a_jump(tmp_path: Path) -> None:
    """On main, a raised max_steps re-stretched the cosine decay from its start (the lr jumped
    up) and a changed trainer.lr was overwritten by the checkpoint's, silently."""
    first = _trainer(tmp_path)  # cosine, 2 warm-up steps, max_steps 10, lr 1e-4
    for seed in range(5):
        first.train_step(_groups(seed))
    path = first.save_checkpoint(_NoTokenizer())
    at_checkpoint = first.optimizer.param_groups[0]["lr"]  # the lr of step 5 (0-based)

    longer = _trainer(tmp_path, "attempt=1", "trainer.max_steps=20")
    longer.resume(path)
    assert longer.optimizer.param_groups[0]["lr"] == pytest.approx(at_checkpoint, rel=1e-12)
    lrs = []
    for seed in range(5, 20):
        longer.train_step(_groups(seed))
        lrs.append(longer.optimizer.param_groups[0]["lr"])
    assert all(a > b for a, b in zip([at_checkpoint, *lrs], lrs[:-1]))  # decays, never jumps
    assert lrs[-1] == pytest.approx(0.0, abs=1e-15)  # reaches 0 at the new max_steps

    other_lr = _trainer(tmp_path, "attempt=2", "trainer.lr=3e-4")
    other_lr.resume(path)
    assert other_lr.optimizer.param_groups[0]["lr"] == pytest.approx(3 * at_checkpoint, rel=1e-9)


def test_a_resume_switching_to_a_constant_lr_keeps_the_lr_it_reached(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Review D3: cosine at factor < 1 resumed as constant jumped to the full trainer.lr while
    the log said it continued from that factor."""
    first = _trainer(tmp_path)  # cosine, 2 warm-up steps, max_steps 10, lr 1e-4
    for seed in range(5):
        first.train_step(_groups(seed))
    path = first.save_checkpoint(_NoTokenizer())
    at_checkpoint = first.optimizer.param_groups[0]["lr"]
    assert at_checkpoint < 0.9e-4
    constant = _trainer(tmp_path, "attempt=1", "trainer.lr_schedule=constant")
    constant.resume(path)
    for seed in range(5, 8):
        constant.train_step(_groups(seed))
        assert constant.optimizer.param_groups[0]["lr"] == pytest.approx(at_checkpoint, rel=1e-12)
    factor = at_checkpoint / 1e-4
    assert f"cosine to step 10 -> constant to step 10 from step 5, at lr factor {factor:.4g}" in caplog.text


def test_extending_a_run_whose_lr_decayed_to_0_is_refused_naming_the_way_out(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    first = _trainer(tmp_path, "trainer.lr_schedule=linear", "trainer.max_steps=3")
    for seed in range(3):
        first.train_step(_groups(seed))
    path = first.save_checkpoint(_NoTokenizer())
    with pytest.raises(ValueError, match="reached 0 at step 3.*trainer.lr_schedule=constant"):
        _trainer(tmp_path, "attempt=1", "trainer.lr_schedule=linear",
                 "trainer.max_steps=6").resume(path)
    constant = _trainer(tmp_path, "attempt=2", "trainer.lr_schedule=constant", "trainer.max_steps=6")
    constant.resume(path)
    assert constant.optimizer.param_groups[0]["lr"] == pytest.approx(1e-4)
    assert "at lr factor 1 (it had reached 0)" in caplog.text
