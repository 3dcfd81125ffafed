"""Runs that share a name stay apart: streams per run id, no foreign groups, no shared files."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest
import torch

from pipelinerl.config import Config, load_config
from pipelinerl.metrics.logger import MetricsLogger
from pipelinerl.rl.batches import BatchSource
from pipelinerl.roles.launch import launch, prepare_run
from pipelinerl.roles.wiring import (
    check_run_id_unused,
    open_control_reader,
    open_control_writer,
    open_rollout_reader,
    open_rollout_writer,
    open_weight_receiver,
    open_weight_sender,
    write_stop_unwinding,
)
from pipelinerl.types import Group, Sample

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "arithmetic.yaml"


def _cfg(tmp_path: Path, backend: str, run_id: str, redis_url: str = "") -> Config:
    return load_config(None, [
        "name=same", f"output_dir={tmp_path / 'runs'}", f"run_id={run_id}",
        f"stream.backend={backend}", f"stream.redis_url={redis_url}",
    ])


@pytest.fixture(params=["local", pytest.param("redis", marks=pytest.mark.redis)])
def two_runs(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Config, Config]:
    url = request.getfixturevalue("redis_server").url if request.param == "redis" else ""
    suffix = uuid.uuid4().hex[:8]  # the session's redis outlives one test
    return (_cfg(tmp_path, request.param, f"first-{suffix}", url),
            _cfg(tmp_path, request.param, f"second-{suffix}", url))


def _group(group_id: str, versions: list[int]) -> Group:
    sample = Sample(prompt_ids=[1], token_ids=[2] * len(versions), logprobs=[-1.0] * len(versions),
                    versions=versions, reward=1.0, success=True, finish_reason="stop",
                    group_id=group_id)
    return Group(group_id=group_id, prompt="p", samples=[sample])


def test_a_second_run_with_the_same_name_reads_none_of_the_first_runs_records(two_runs):
    first, second = two_runs
    with open_rollout_writer(first, actor_id=0) as w:
        w.write(_group("a0-g0", [0]).to_dict())
    with open_control_writer(first) as w:
        w.write({"type": "stop", "step": 4})
    with open_rollout_reader(second) as rollouts, open_control_reader(second) as control:
        assert rollouts.read(10, timeout_s=0.1) == []
        assert control.read(10, timeout_s=0.1) == []
    with open_rollout_reader(first) as rollouts:  # the first run's records are still there
        assert [r["group_id"] for r in rollouts.read(10, timeout_s=0.5)] == ["a0-g0"]


def test_a_trainer_refuses_a_run_id_that_already_finished(two_runs):
    first, second = two_runs
    check_run_id_unused(first)  # nothing written yet
    with open_control_writer(first) as w:
        w.write({"type": "stop", "step": 4})
    with pytest.raises(RuntimeError, match="run_id"):
        check_run_id_unused(first)
    check_run_id_unused(second)


class _ListReader:
    """A stream reader over a fixed list of records (in place of the real stream)."""

    def __init__(self, records: list[dict]) -> None:
        self.records = records

    def read(self, max_count: int, timeout_s: float) -> list[dict]:
        out, self.records = self.records[:max_count], self.records[max_count:]
        return out

    def close(self) -> None:
        pass


def test_batch_source_drops_and_counts_groups_with_negative_lag_from_a_fake_stream():
    # At step 2 no token can come from weights newer than version 2: such a group belongs to
    # another run (a stream reused by mistake), however small its lag looks.
    records = [_group("old", [0, 7]).to_dict(), _group("mine", [1, 2]).to_dict()]
    source = BatchSource(_ListReader(records), group_size=1, max_lag=4, timeout_s=5.0)
    assert [g.group_id for g in source.take(1, step=2)] == ["mine"]
    assert source.dropped["negative_lag"] == 1
    assert source.take_dropped_ids() == {"negative_lag": ["old"]}


def test_batch_source_without_a_lag_bound_still_drops_negative_lag_from_a_fake_stream():
    records = [_group("old", [3]).to_dict(), _group("mine", [0]).to_dict()]
    source = BatchSource(_ListReader(records), group_size=1, max_lag=None, timeout_s=5.0)
    assert [g.group_id for g in source.take(1, step=0)] == ["mine"]
    assert source.dropped["negative_lag"] == 1


def test_batch_source_that_gets_only_unusable_groups_stops_with_their_count():
    """Before, any arrival reset the timeout: a trainer fed another run's groups dropped them
    as negative lag for ever (seen: 50,000 of them, no step) instead of failing."""

    class _Endless:
        def read(self, max_count: int, timeout_s: float) -> list[dict]:
            return [_group(f"x{i}", [6]).to_dict() for i in range(max_count)]

        def close(self) -> None:
            pass

    source = BatchSource(_Endless(), group_size=1, max_lag=4, timeout_s=0.2)
    with pytest.raises(TimeoutError, match=r"no usable rollout .* dropped meanwhile.*negative_lag"):
        source.take(1, step=0)
    assert source.dropped["negative_lag"] > 0


def test_weights_a_killed_launch_left_in_shared_memory_never_reach_the_next(tmp_path: Path):
    """A killed trainer leaves its /dev/shm file; a new launch of the same name in the same
    directory read it before (its actors generated with the old run's version 6)."""
    first = _cfg(tmp_path, "local", f"first-{uuid.uuid4().hex[:8]}")
    second = _cfg(tmp_path, "local", f"second-{uuid.uuid4().hex[:8]}")
    killed = open_weight_sender(first)
    killed.publish({"w": torch.ones(3)}, 6)  # never closed, as after SIGKILL
    receiver = open_weight_receiver(second, actor_id=0)
    try:
        assert receiver.poll() is None
    finally:
        receiver.close()
        killed.close()


def test_a_resumed_attempt_removes_the_weights_file_its_crashed_attempt_left(tmp_path: Path):
    from pipelinerl.roles.wiring import _channel_id
    from pipelinerl.sync.shm import shm_path

    cfg = _cfg(tmp_path, "local", f"r-{uuid.uuid4().hex[:8]}")
    crashed = open_weight_sender(cfg)
    crashed.publish({"w": torch.ones(3)}, 6)
    left = shm_path(_channel_id(cfg))
    assert left.exists()
    cfg.attempt = 1
    resumed = open_weight_sender(cfg)
    try:
        assert not left.exists()
    finally:
        resumed.close()
        crashed.close()  # its file is gone already: nothing to unlink, nothing raised


@pytest.mark.redis
def test_a_trainer_unwinding_after_its_redis_died_skips_the_stop_record_at_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from pipelinerl.streams import start_redis_server

    server = start_redis_server(tmp_path / "redis", appendonly=False)
    cfg = _cfg(tmp_path, "redis", "r", server.url)
    control = open_control_writer(cfg)
    server.stop()  # as when the launcher died: PR_SET_PDEATHSIG stops it beside the trainer
    write_stop_unwinding(control, cfg, step=3)  # one try, then on with the trainer's cleanup
    assert "no stop record written" in caplog.text and server.url.split("//")[1] in caplog.text
    control.close()


def test_metrics_file_of_another_launch_is_never_appended_to(tmp_path: Path):
    cfg = load_config(None, [f"output_dir={tmp_path}"])
    cfg.run_dir.mkdir(parents=True)
    MetricsLogger(cfg.run_dir, cfg.metrics, cfg.name, {}).close()
    with pytest.raises(FileExistsError, match="metrics.jsonl"):
        MetricsLogger(cfg.run_dir, cfg.metrics, cfg.name, {})


def test_each_launch_gets_a_fresh_run_id_in_its_config(tmp_path: Path):
    overrides = [f"output_dir={tmp_path}", f"model.path={tmp_path}"]
    ids = []
    for _ in range(2):
        cfg = prepare_run(load_config(None, overrides), overwrite=True)
        saved = load_config(cfg.run_dir / "config.yaml")
        assert saved.run_id == cfg.run_id != ""
        ids.append(saved.run_id)
    assert ids[0] != ids[1]
    given = prepare_run(load_config(None, [*overrides, "run_id=mine"]), overwrite=True)
    assert given.run_id == "mine"


@pytest.mark.parametrize("role", ["trainer", "actor"])
def test_a_role_started_by_hand_needs_a_run_id(tmp_path: Path, role: str, capsys):
    from pipelinerl.cli import main

    config = tmp_path / "run.yaml"
    config.write_text(f"output_dir: {tmp_path}\nmodel: {{path: {tmp_path / 'no-model'}}}\n")
    assert main([role, str(config)]) == 2
    assert "run_id" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.redis
def test_two_runs_with_the_same_name_back_to_back_on_one_redis_train_only_their_own_groups(
    tmp_path: Path, warm_cache: Path, redis_server
):
    overrides = [
        "name=again", f"output_dir={tmp_path / 'runs'}",
        f"warmstart.cache_dir={warm_cache}", "warmstart.steps=20", "eval.enabled=false",
        "engine.capacity=16",
        "trainer.batch_size=16", "trainer.max_steps=3", "trainer.sample_timeout_s=30",
        "metrics.progress=false", "metrics.plot=false", "stream.backend=redis",
        f"stream.redis_url={redis_server.url}",
        "stream.keep_all=true",  # the stream is read below: no trimming after checkpoints
    ]
    run_dir = tmp_path / "runs" / "again"
    assert launch(load_config(EXAMPLE, [*overrides, "actor.group_size=2"])) == 0
    shutil.copy(run_dir / "config.yaml", tmp_path / "first.yaml")
    # The multi-node recipe's re-run: same name, same redis, the run directory replaced; its
    # groups are of 4, so a group of the first run (2) would show as malformed.
    assert launch(load_config(EXAMPLE, [*overrides, "actor.group_size=4"]), overwrite=True) == 0

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert not any(k.startswith("dropped_") for m in metrics for k in m)
    first, second = load_config(tmp_path / "first.yaml"), load_config(run_dir / "config.yaml")
    assert first.run_id != second.run_id
    with open_rollout_reader(second) as reader:
        published = [Group.from_dict(r) for r in reader.read(1000, timeout_s=1.0)
                     if not r.get("heartbeat")]
    assert published and all(len(g.samples) == 4 for g in published)
    audit = [json.loads(line) for line in (run_dir / "trained.jsonl").read_text().splitlines()]
    trained = [gid for a in audit for gid in a["trained"]]
    assert [a["step"] for a in audit] == [1, 2, 3] and len(trained) == 3 * 4
    assert set(trained) <= {g.group_id for g in published}
    with open_control_reader(second) as control:
        stops = [r for r in control.read(10, timeout_s=0.5) if r["type"] == "stop"]
        assert stops == [{"type": "stop", "attempt": 0, "step": 3, "final_published": False}]
