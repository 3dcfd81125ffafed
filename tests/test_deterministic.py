"""Deterministic mode (deterministic.enabled, docs/determinism.md): two launched runs of one
config replay bit for bit; the actor's logical clocks against the trainer's own rules; the
free-running actor left as it was; settings not yet replayed refused naming their key."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from fake_tasks import FakeTask
from test_actor import FakeEngine, FakeReceiver, ListWriter, decode, encode, stop_after
from test_reliability import _pid_of, _train, _wait_for_step
from test_schedule import _ListReader

from pipelinerl.config import Config, ConfigError, load_config
from pipelinerl.models.hf import load_model
from pipelinerl.models.prompts import Codec
from pipelinerl.rl.batches import BatchSource, oldest_version
from pipelinerl.roles.actor import Actor, Streams
from pipelinerl.roles.launch import check_task, launch
from pipelinerl.roles.wiring import open_rollout_reader
from pipelinerl.rollouts.admission import MemoryLedger
from pipelinerl.rollouts.due import DueQueue
from pipelinerl.run.checkpoint import CheckpointDue
from pipelinerl.run.eval_results import EvalResults
from pipelinerl.run.replay import (
    WALL_CLOCK_FIELDS,
    MergedReader,
    MergedView,
    PublishedLog,
    ResumePoint,
    SupersededFilter,
    TrainerMirror,
    check_deterministic_task,
    checkpoint_to_protect,
    choose_resume_point,
    evaluated_versions,
    paired_checkpoint,
    read_snapshot,
    record_evaluated,
    request_seed,
    snapshot_path,
    superseded_after,
    weights_sha256,
    write_snapshot,
)
from pipelinerl.run.samples import read_eval_samples
from pipelinerl.tasks import make_train_task
from pipelinerl.types import Group, Sample

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "arithmetic.yaml"
CALCULATOR = EXAMPLE.with_name("calculator.yaml")


# ---- two runs, the same bits ------------------------------------------------------------------


def _run(tmp_path: Path, cache: Path, name: str, *extra: str, example: Path = EXAMPLE
         ) -> Config:
    """A short deterministic run of `example` (`extra`: overrides on top); the config its
    roles read."""
    cfg = load_config(example, [
        f"name={name}", f"output_dir={tmp_path / 'runs'}", f"warmstart.cache_dir={cache}",
        "warmstart.steps=20", "eval.enabled=false", "engine.capacity=16",
        "actor.group_size=4", "actor.max_lag=2", "actor.max_restarts=0",
        "trainer.batch_size=16", "trainer.max_steps=4", "trainer.max_time_s=0",
        "trainer.sample_timeout_s=120", "stream.keep_all=true",
        "metrics.progress=false", "metrics.plot=false", "metrics.samples_per_step=-1",
        "deterministic.enabled=true", "deterministic.lag_groups=2",
        # Weights move even where every reward of a group is equal (a 20-step warm start
        # rarely solves a problem): the entropy bonus has a gradient of its own.
        "trainer.loss.entropy_coef=0.01",
        "task.params={min_terms: 2, max_terms: 2, max_operand: 3}", *extra,
    ])
    assert launch(cfg) == 0
    return load_config(cfg.run_dir / "config.yaml")


def _rollouts(cfg: Config) -> list[dict[str, Any]]:
    """The actors' groups as the trainer reads them (any stream backend), their clock-measured
    stats left out."""
    reader = open_rollout_reader(cfg)
    records: list[dict[str, Any]] = []
    while batch := reader.read(1000, 0.0):
        records.extend(batch)
    reader.close()
    groups = [g for g in records if not g.get("heartbeat")]
    for g in groups:
        g["actor_stats"] = {k: v for k, v in g["actor_stats"].items()
                            if f"actor_{k}" not in WALL_CLOCK_FIELDS}
    return groups


def _assert_replayed(first: Config, second: Config, in_stream_order: bool = True
                     ) -> list[dict[str, Any]]:
    """The pair's rollouts (`in_stream_order`: in the stream's order too), samples, trained
    groups, metrics (but the wall-clock fields) and final weights hash are equal; returns the
    first run's groups."""
    groups = _rollouts(first)
    if in_stream_order:
        assert groups == _rollouts(second)  # tokens, versions, engine log-probs, rewards, order
    for name in ("samples.jsonl", "trained.jsonl"):
        assert (first.run_dir / name).read_text() == (second.run_dir / name).read_text()
    assert _metrics(first.run_dir) == _metrics(second.run_dir)
    steps = [r for r in _metrics(first.run_dir) if "eval/version" not in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["grad_norm"] > 0 for r in steps)
    digest = (first.run_dir / "weights.sha256").read_text().strip()
    assert digest == (second.run_dir / "weights.sha256").read_text().strip()
    return groups


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in WALL_CLOCK_FIELDS} for row in rows]


def test_two_runs_of_one_config_replay_bit_for_bit(tmp_path, warm_cache):
    first, second = (_run(tmp_path, warm_cache, name) for name in ("first", "second"))
    groups = _assert_replayed(first, second)
    digest = (first.run_dir / "weights.sha256").read_text().strip()
    final = load_model(first.run_dir / "final", dtype=torch.float32, device="cpu")
    assert digest == weights_sha256(final.state_dict())
    # Still a pipeline: weights landed in the middle of generations, so some completions
    # hold tokens of two versions, and groups were trained with lag.
    versions = [set(s["versions"]) for g in groups for s in g["samples"]]
    assert any(len(v) > 1 for v in versions)
    assert max(r["lag_max"] for r in _metrics(first.run_dir)) >= 1
    assert _metrics(first.run_dir)[-1]["actor_weight_updates"] >= 2
    # Nothing past the trainer's last step: when the stop record arrives is timing.
    trained = [json.loads(line)
               for line in (first.run_dir / "trained.jsonl").read_text().splitlines()]
    assert len(groups) == sum(len(r["trained"]) + sum(map(len, r["dropped"].values()))
                              for r in trained)


def test_two_actors_replay_whatever_order_their_groups_reach_the_stream(
        tmp_path, warm_cache, redis_server):
    # Each actor's groups reach the stream when its timing says; the trainer takes them
    # round-robin by seq, and each actor's clock follows the trainer through the other's log.
    # One run through the local stream, one through redis: the same run.
    first = _run(tmp_path, warm_cache, "first", "actor.num_actors=2")
    second = _run(tmp_path, warm_cache, "second", "actor.num_actors=2", "stream.backend=redis",
                  f"stream.redis_url={redis_server.url}")
    by_actor = lambda cfg: sorted(_rollouts(cfg), key=lambda g: (g["actor_id"], g["seq"]))  # noqa: E731
    assert by_actor(first) == by_actor(second)
    groups = _assert_replayed(first, second, in_stream_order=False)
    trained = [json.loads(line)
               for line in (first.run_dir / "trained.jsonl").read_text().splitlines()]
    ids = [gid for row in trained for gid in row["trained"]]
    by_id = {g["group_id"]: g for g in groups}
    assert [(by_id[i]["seq"], by_id[i]["actor_id"]) for i in ids] == \
        sorted((by_id[i]["seq"], by_id[i]["actor_id"]) for i in ids)  # round-robin
    assert {by_id[i]["actor_id"] for i in ids} == {0, 1}
    assert any(len(set(s["versions"])) > 1 for g in groups for s in g["samples"])
    # Nothing past the trainer's last step from either actor.
    assert len(groups) == sum(len(r["trained"]) + sum(map(len, r["dropped"].values()))
                              for r in trained)


def test_a_redis_stream_replays_as_the_local_one(tmp_path, warm_cache, redis_server):
    # One actor writes one redis stream in order and the trainer XREADs it in that order:
    # the same groups, in the same order, as through the local stream.
    redis = ("stream.backend=redis", f"stream.redis_url={redis_server.url}")
    first, second = (_run(tmp_path, warm_cache, name, *redis) for name in ("first", "second"))
    groups = _assert_replayed(first, second)
    assert len(groups) >= 4 * 4  # all of them, read back from the server


def test_broadcast_weights_replay_as_shared_memory_ones(tmp_path, warm_cache):
    # The trainer's publish of version v waits in the weight group until the actor takes it,
    # which it does at the same logical point as from shared memory.
    first, second = (_run(tmp_path, warm_cache, name, "sync.backend=broadcast")
                     for name in ("first", "second"))
    _assert_replayed(first, second)


def test_the_evaluator_replays_the_versions_its_schedule_names(tmp_path, warm_cache):
    # Greedy and sampled passes of 8 held-out problems at versions 0, 2 and 4 (the final):
    # exactly those, whichever arrive while a pass runs, with the same results.
    evaluated = ("eval.enabled=true", "eval.every_s=0", "eval.every_steps=2",
                 "eval.num_problems=8", "eval.temperature=1.0")
    first, second = (_run(tmp_path, warm_cache, name, *evaluated)
                     for name in ("first", "second"))
    _assert_replayed(first, second)
    evals = [r for r in _metrics(first.run_dir) if "eval/version" in r]
    assert [r["eval/version"] for r in evals] == [0, 2, 4]
    assert all("eval/greedy" in r and "eval/sampled/pass@1" in r for r in evals)
    rows = read_eval_samples(first.run_dir)
    assert rows == read_eval_samples(second.run_dir)
    assert sorted({r["version"] for r in rows}) == [0, 2, 4]
    # Deferred to the run's end, the same versions give the same results: each attempt
    # samples from its own generator, whichever passes came before.
    deferred = _run(tmp_path, warm_cache, "deferred", *evaluated, "eval.deferred=true")
    assert _metrics(deferred.run_dir) == _metrics(first.run_dir)


def test_two_ddp_ranks_replay(tmp_path, warm_cache):
    # Rank 0 reads the stream and shares each step's groups in a fixed split; gloo's
    # all-reduce sums the gradients in a fixed order.
    first, second = (_run(tmp_path, warm_cache, name, "trainer.num_procs=2")
                     for name in ("first", "second"))
    _assert_replayed(first, second)


def test_a_multi_turn_environment_replays(tmp_path, warm_cache):
    # The calculator's replies are applied one decode step after their turn, in turn order,
    # whenever its worker answers: the batch changes at the same steps on every run.
    tool = ("task.params={tool_demo_prob: 1.0, min_terms: 2, max_terms: 2, max_operand: 3}",
            "warmstart.steps=150", "actor.env_workers=2")
    first, second = (_run(tmp_path, warm_cache, name, *tool, example=CALCULATOR)
                     for name in ("first", "second"))
    groups = _assert_replayed(first, second)
    masks = [s["model_mask"] for g in groups for s in g["samples"] if s["model_mask"]]
    assert any(not all(mask) for mask in masks)  # the tool answered inside completions
    assert _metrics(first.run_dir)[-1]["actor_env_calls"] > 0


# ---- the trainer mirror, the score queue, the seeds -------------------------------------------


def _group(gid: str, oldest: int, newest: int = 0) -> Group:
    samples = [Sample([1], [2, 3], [-0.1, -0.2], [oldest, max(oldest, newest)], 1.0, True,
                      "stop", gid) for _ in range(2)]
    return Group(gid, "p", samples)


@pytest.mark.parametrize("seed", range(5))
def test_the_mirror_predicts_the_trainers_batches_and_drops(seed):
    rng = random.Random(seed)
    per_step, max_lag = 3, 2
    mirror = TrainerMirror(per_step, max_lag, publish_every=1, max_steps=100)
    groups, kept, dropped = [], [], []
    for i in range(60):
        step = mirror.usable // per_step
        group = _group(f"g{i}", rng.randint(max(0, step - max_lag - 2), step), newest=step)
        groups.append(group)
        before = mirror.usable
        mirror.add(oldest_version(group))
        (kept if mirror.usable > before else dropped).append(group.group_id)
    assert mirror.dropped == len(dropped) > 0
    source = BatchSource(_ListReader([g.to_dict() for g in groups]), group_size=2,
                         max_lag=max_lag, timeout_s=1.0)
    steps = mirror.usable // per_step
    trained = [g.group_id for step in range(steps) for g in source.take(per_step, step)]
    assert trained == kept[:steps * per_step]
    # The trainer looked at the groups up to the last it trained: the mirror's drops among them.
    looked_at = {g.group_id for g in groups[:[g.group_id for g in groups].index(trained[-1])]}
    assert source.dropped == {"stale": len(looked_at & set(dropped))}


def test_versions_fall_due_after_the_groups_that_train_them_and_the_lag():
    mirror = TrainerMirror(per_step=2, max_lag=None, publish_every=2, max_steps=5)
    view = MergedView(mirror, actor_id=0, num_actors=1, lag_groups=1, logs={})
    due, done = [], []
    for i in range(10):
        view.publish(i + 1, 0)
        assert view.catch_up(i + 1, should_stop=lambda: False)
        due.append(mirror.version_due())
        done.append(view.complete or not view.trains(i + 2, should_stop=lambda: False))
    # Version 2 (published every 2 steps of 2 groups) once 2 * 2 + 1 groups are in; 4 at 9.
    assert due == [0, 0, 0, 0, 2, 2, 2, 2, 4, 4]
    assert done == [False] * 9 + [True]  # 5 steps of 2 groups: the 11th is not taken
    assert view.complete and not mirror.done()  # the mirror is one group behind


def _all_due(queue: DueQueue, decode_steps: int, idle: bool) -> list[str]:
    keys = []
    while (key := queue.pop_due(decode_steps, idle)) is not None:
        keys.append(key)
    return keys


def test_scores_come_in_send_order_at_their_step_or_all_when_idle():
    queue = DueQueue(delay=3)
    queue.expect("a", 0)
    queue.expect("b", 1)
    queue.expect("c", 5)
    assert _all_due(queue, 2, idle=False) == []
    assert _all_due(queue, 4, idle=False) == ["a", "b"]
    assert queue.entries() == [("c", 8)]
    assert _all_due(queue, 4, idle=True) == ["c"]


def test_request_seeds_differ_by_group_attempt_and_seed_and_repeat():
    seeds = {request_seed(s, g, a) for s in (0, 1) for g in ("a0-g0", "a0-g1") for a in (0, 1)}
    assert len(seeds) == 8 and all(0 <= x < 2**63 for x in seeds)
    assert request_seed(7, "a0-g3", 2) == request_seed(7, "a0-g3", 2)


# ---- the actor: free-running untouched, deterministic at its logical points -------------------


class _WeightEngine(FakeEngine):
    """A fake engine that takes weights and remembers each request's sampler seed."""

    def __init__(self) -> None:
        super().__init__(capacity=4, length=3)
        self.seeds: list[int | None] = []

    def add_request(self, request) -> None:
        self.seeds.append(request.params.seed)
        super().add_request(request)

    def receive_weights(self, receive) -> int:
        self.version = receive({})
        return self.version


def _actor(deterministic: bool, lag_groups: int = 0, writer: Any = None,
           published: list[int] | None = None, groups: int = 4) -> tuple[Actor, _WeightEngine]:
    """An actor that stops once it published `groups` groups (a deterministic one would then
    wait for a version the fake trainer never publishes)."""
    cfg = Config(trainer={"batch_size": 4}, engine={"max_new_tokens": 8, "max_seq_len": 40},
                 actor={"group_size": 2, "max_lag": 1, "verifier_workers": 1,
                        "max_restarts": 0},
                 deterministic={"enabled": deterministic, "lag_groups": lag_groups})
    engine = _WeightEngine()
    # By default the trainer is "ahead": version 1 waits in the channel from the start.
    writer = writer or ListWriter()
    done = lambda: sum(not r.get("heartbeat") for r in writer.records) >= groups  # noqa: E731
    streams = Streams(writer, FakeReceiver(published or [1]), MemoryLedger(),
                      stop_after(30, also=done))
    actor = Actor(cfg, engine, FakeTask(), Codec(encode, decode, encode, stop_ids=(0,)), streams)
    return actor, engine


def test_free_running_takes_weights_on_arrival_and_the_engines_draws():
    actor, engine = _actor(deterministic=False)
    actor.run(max_groups=4)
    assert set(engine.seeds) == {None}
    # Loaded before the first group started: every token is of version 1.
    assert {v for g in actor.streams.writer.records for s in g["samples"]
            for v in s["versions"]} == {1}


def test_deterministic_takes_weights_once_the_trainer_could_have_made_them():
    actor, engine = _actor(deterministic=True)
    actor.run(max_groups=4)
    records = actor.streams.writer.records
    # Version 1 trains on the first 2 groups: they, and every group started before they were
    # published, are of version 0; the actor then loaded it and later groups are of version 1.
    first_two = {v for g in records[:2] for s in g["samples"] for v in s["versions"]}
    assert first_two == {0} and engine.version == 1
    assert 1 in {v for g in records[2:] for s in g["samples"] for v in s["versions"]}
    assert engine.seeds == [request_seed(0, f"a0-g{i // 2}", i % 2)
                            for i in range(len(engine.seeds))]


class _InstantTrainer(ListWriter):
    """The fastest trainer there can be: it publishes version v the moment the v * 2-th
    group is written (2 groups a step, none stale; `start`: groups it had before), and notes
    the engine's version then."""

    def __init__(self, engine_version: Any, start: int = 0) -> None:
        super().__init__()
        self.published = [start // 2]
        self.start = start
        self.engine_version = engine_version
        self.versions_at_write: list[int] = []

    def write(self, record: dict[str, Any]) -> None:
        super().write(record)
        if not record.get("heartbeat"):
            self.versions_at_write.append(self.engine_version())
            self.published[0] = (self.start + len(self.records)) // 2


def test_a_trainer_that_is_never_behind_never_overtakes_the_logical_clock():
    # Groups of one admission finish in the same decode step and are published in one turn:
    # the version each makes due is loaded before the next is published, so the channel
    # never holds a newer version than the one the actor waits for (which it refuses).
    engine_box: list[_WeightEngine] = []
    trainer = _InstantTrainer(lambda: engine_box[0].version)
    actor, engine = _actor(True, lag_groups=1, writer=trainer, published=trainer.published,
                           groups=12)
    engine_box.append(engine)
    actor.run(max_groups=12)
    assert len(trainer.records) == 12
    # Version v is due once 2 v + 1 groups are published: group n (1-based) is written
    # holding the version due after n - 1 groups.
    assert trainer.versions_at_write == [max(n - 2, 0) // 2 for n in range(1, 13)]


# ---- snapshots and resume points --------------------------------------------------------------


class _SeededEngine(_WeightEngine):
    """Each request's tokens and length follow from its sampler seed, as a real engine's draws
    do: an actor that restores the wrong seeds, group ids or data publishes other groups."""

    def __init__(self) -> None:
        super().__init__()
        self._capacity = 6  # 3 groups at once: groups finish out of order
        self._seed_of: dict[str, int] = {}

    def add_request(self, request) -> None:
        self._seed_of[request.request_id] = request.params.seed
        super().add_request(request)

    def length_of(self, request_id: str) -> int:
        return 2 + self._seed_of[request_id] % 5

    def step(self):
        return [replace(out, token_ids=[1 + self._seed_of[out.request_id] % 9] * len(out.token_ids))
                for out in super().step()]


def _snapshotting_actor(run_dir: Path, start_groups: int = 0
                        ) -> tuple[Actor, _InstantTrainer]:
    """A deterministic actor (2 groups a step) snapshotting every 2 versions, its groups read
    by an instant trainer that has already taken `start_groups` of them."""
    cfg = Config(output_dir=str(run_dir.parent), name=run_dir.name,
                 trainer={"batch_size": 4, "checkpoint_every_steps": 2},
                 engine={"max_new_tokens": 8, "max_seq_len": 40},
                 actor={"group_size": 2, "max_lag": 1, "verifier_workers": 1,
                        "max_restarts": 0},
                 deterministic={"enabled": True, "lag_groups": 1, "score_delay_steps": 2})
    engine_box: list[_SeededEngine] = []
    trainer = _InstantTrainer(lambda: engine_box[0].version, start_groups)
    engine = _SeededEngine()
    engine_box.append(engine)
    streams = Streams(trainer, FakeReceiver(trainer.published), MemoryLedger(), stop_after(60))
    task = make_train_task("arithmetic", {}, 0.0)
    actor = Actor(cfg, engine, task, Codec(encode, decode, encode, stop_ids=(0,)), streams)
    return actor, trainer


def _logical(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**r, "actor_stats": {k: v for k, v in r["actor_stats"].items()
                                  if f"actor_{k}" not in WALL_CLOCK_FIELDS}} for r in records]


def test_an_actor_resumed_from_a_snapshot_publishes_what_the_uninterrupted_one_did(tmp_path):
    whole, trainer = _snapshotting_actor(tmp_path / "run")
    whole.run(max_groups=20)
    snapshots = sorted((tmp_path / "run" / "replay" / "actor_0").glob("step_*.pkl"))
    assert [p.name for p in snapshots][-2:] == ["step_00000006.pkl", "step_00000008.pkl"]
    state = read_snapshot(snapshots[-2])
    # Taken with the engine empty, some groups waiting for their scores (held by the drain).
    assert state["version"] == 6 and state["groups"] and state["score_queue"]
    assert state["published"] == 6 * 2 + 1  # version 6 falls due at 2 x 6 + lag_groups groups

    resumed, again = _snapshotting_actor(tmp_path / "resumed", state["published"])
    again.published[0] = state["version"]  # what a trainer resumed from step 6 publishes first
    resumed.run(max_groups=20, resume=state)
    assert _logical(again.records) == _logical(trainer.records[state["published"]:])
    assert len(again.records) == 20 - state["published"]
    # The counters go on: actor_* metrics equal too.
    assert again.records[-1]["actor_stats"]["weight_updates"] == \
        trainer.records[-1]["actor_stats"]["weight_updates"]


def test_resume_points_pair_a_checkpoint_with_the_actors_snapshot_at_its_step(tmp_path):
    run_dir = tmp_path / "run"
    assert choose_resume_point(run_dir, 1) == ResumePoint(1, 0, (0,), None, None)  # nothing yet
    for step in (2, 4, 6):  # checkpoints of steps 2, 4, 6; snapshots of versions 2 and 4
        (run_dir / "checkpoints" / f"step_{step:08d}").mkdir(parents=True)
        (run_dir / "checkpoints" / f"step_{step:08d}" / "state.json").write_text(
            json.dumps({"step": step}))
    for step, seq in ((2, 9), (4, 18)):
        write_snapshot(run_dir, 0, step, {"published": seq})
    point = choose_resume_point(run_dir, 1)
    assert (point.step, point.seqs) == (4, (18,)) and point.checkpoint.endswith("step_00000004")
    assert read_snapshot(point.snapshots[0]) == {"published": 18}
    write_snapshot(run_dir, 0, 6, {"published": 27})
    assert paired_checkpoint(run_dir).name == "step_00000006"


def test_a_snapshot_stays_while_its_checkpoint_does_and_while_the_actor_is_ahead(tmp_path):
    # The trainer kept checkpoints 2 (the newest one a resume could use: the evaluator lags),
    # 6 and 8 of 2, 4, 6, 8; the actor, ahead, snapshots versions 10 and 12 before their
    # checkpoints exist. Snapshot 4 pairs with nothing any more; 2, 6 and 8 still pair.
    run_dir = tmp_path / "run"
    for step in (2, 6, 8):
        (run_dir / "checkpoints" / f"step_{step:08d}").mkdir(parents=True)
        (run_dir / "checkpoints" / f"step_{step:08d}" / "state.json").write_text(
            json.dumps({"step": step}))
    for step in (2, 4, 6, 8, 10, 12):
        write_snapshot(run_dir, 0, step, {"published": 9 * step})
    kept = sorted(int(p.stem.removeprefix("step_"))
                  for p in snapshot_path(run_dir, 0, 0).parent.glob("step_*.pkl"))
    assert kept == [2, 6, 8, 10, 12]
    every_2 = lambda version: version % 2 == 0  # noqa: E731
    for version in (0, 2):
        record_evaluated(run_dir, version, attempt=0)
    assert choose_resume_point(run_dir, 1, eval_due_at=every_2).step == 2


def test_a_resume_point_has_every_scheduled_evaluation_up_to_its_step_done(tmp_path):
    # Evaluations at versions 0, 2, 4, ...; checkpoints and snapshots at 2, 4 and 6. The
    # crashed evaluator had evaluated 0 and 2 and held 4 without evaluating it: 4 and 6 are
    # no resume points, for version 4's weights would be gone.
    run_dir = tmp_path / "run"
    for step, seq in ((2, 9), (4, 18), (6, 27)):
        (run_dir / "checkpoints" / f"step_{step:08d}").mkdir(parents=True)
        (run_dir / "checkpoints" / f"step_{step:08d}" / "state.json").write_text(
            json.dumps({"step": step}))
        write_snapshot(run_dir, 0, step, {"published": seq})
    every_2 = lambda version: version % 2 == 0  # noqa: E731
    assert choose_resume_point(run_dir, 1, eval_due_at=every_2).step == 0  # nothing evaluated
    for version in (0, 2):
        record_evaluated(run_dir, version, attempt=0)
    assert choose_resume_point(run_dir, 1, eval_due_at=every_2).step == 2
    assert choose_resume_point(run_dir, 1, eval_due_at=lambda v: v % 7 == 0).step == 6
    assert choose_resume_point(run_dir, 1).step == 6  # no evaluation: the newest
    record_evaluated(run_dir, 4, attempt=1)
    assert paired_checkpoint(run_dir, eval_due_at=every_2).name == "step_00000004"
    assert evaluated_versions(run_dir) == {0, 2, 4}


def test_the_trainer_keeps_a_checkpoint_whose_evaluations_may_still_come(tmp_path):
    """An evaluator lagging more than checkpoint_keep checkpoints: no checkpoint is a resume
    point yet, and keeping none (the newest usable, None) let the trainer prune step 2's while
    its evaluations were on their way, and the actor its snapshot; a crash then resumed the
    run from its start (CI, the two-actor crash test). The oldest with every snapshot is kept
    until a newer one is usable."""
    run_dir = tmp_path / "run"
    for step in (2, 4, 6):
        (run_dir / "checkpoints" / f"step_{step:08d}").mkdir(parents=True)
        (run_dir / "checkpoints" / f"step_{step:08d}" / "state.json").write_text(
            json.dumps({"step": step}))
        for actor in (0, 1):
            write_snapshot(run_dir, actor, step, {"published": step})
    every_2 = lambda version: version % 2 == 0  # noqa: E731
    assert paired_checkpoint(run_dir, 2, every_2) is None
    assert checkpoint_to_protect(run_dir, 2, every_2).name == "step_00000002"
    for version in (0, 2, 4):
        record_evaluated(run_dir, version, attempt=0)
    assert checkpoint_to_protect(run_dir, 2, every_2).name == "step_00000004"
    assert checkpoint_to_protect(run_dir, 2) == paired_checkpoint(run_dir, 2)  # no evaluation


class _Records:
    """An eval stream's records, read once."""

    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.records = records

    def read(self, max_count: int, timeout_s: float) -> list[dict[str, Any]]:
        out, self.records = self.records[:max_count], self.records[max_count:]
        return out


def test_the_trainer_logs_one_result_per_version_of_any_attempt_by_version():
    # Attempt 0 evaluated versions 0, 2 and 4 and died; attempt 1 resumed at step 4, its
    # evaluator evaluating 4 again (the same result: the same weights), then 6 and the final 8.
    result = lambda v, attempt, **extra: {"version": v, "attempt": attempt,  # noqa: E731
                                          "eval/greedy": v / 10, **extra}
    records = [result(0, 0), {"version": 2, "attempt": 0, "staged": True}, result(2, 0),
               result(4, 0), {"version": 6, "attempt": 1, "staged": True}, result(6, 1),
               result(4, 1, **{"eval/duration_s": 9.0}), result(8, 1, final=True)]
    logged: list[tuple[int, dict[str, Any]]] = []
    evals = EvalResults(_Records(records), lambda v, row: logged.append((v, row)), attempt=1,
                        hold=True)
    assert evals.wait_final(timeout_s=5.0)
    assert [v for v, _ in logged] == [0, 2, 4, 6, 8]
    assert [row["eval/greedy"] for _, row in logged] == [0.0, 0.2, 0.4, 0.6, 0.8]
    assert "eval/duration_s" not in logged[2][1]  # the first result of version 4 stands
    assert evals.staged == {6}  # an earlier attempt's evaluator held versions for its trainer


def test_groups_a_later_attempt_published_again_are_left_out(tmp_path):
    # Two actors. Attempt 1 resumed after 10 and 9 groups, attempt 2 after 14 and 13 (from
    # attempt 1's snapshots), attempt 3 after 10 and 9 again (attempt 2 died before its first).
    points = [ResumePoint(1, 4, (10, 9), "c", ("s0", "s1")),
              ResumePoint(2, 6, (14, 13), "c", ("s0", "s1")),
              ResumePoint(3, 4, (10, 9), "c", ("s0", "s1"))]
    kept = superseded_after(points)
    assert kept == {(a, actor): seq for a in (0, 1, 2) for actor, seq in ((0, 10), (1, 9))}
    assert superseded_after(points[:2]) == {(0, 0): 10, (0, 1): 9, (1, 0): 14, (1, 1): 13}
    records = [{"attempt": a, "actor_id": 0, "seq": s, "group_id": f"{a}-{s}"}
               for a, seqs in ((0, range(1, 13)), (1, range(11, 16)), (3, range(11, 13)))
               for s in seqs]
    records.insert(5, {"heartbeat": True, "attempt": 0, "seq": 40})
    records += [{"attempt": 0, "actor_id": 1, "seq": s, "group_id": f"b0-{s}"}
                for s in range(8, 12)]
    reader = SupersededFilter(_ListReader(records), kept)
    read = reader.read(100, 0.0)
    assert [r.get("group_id") for r in read] == [*(f"0-{s}" for s in range(1, 6)), None,
                                                 *(f"0-{s}" for s in range(6, 11)),
                                                 "3-11", "3-12", "b0-8", "b0-9"]
    # Rows written before several actors (one seq, one snapshot) read as one actor's.
    old = ResumePoint.from_row({"attempt": 1, "step": 4, "seq": 10, "checkpoint": "c",
                                "snapshot": "s"})
    assert old == ResumePoint(1, 4, (10,), "c", ("s",))


class _OffsetReader(_ListReader):
    def offsets(self) -> dict[str, Any]:
        return {"left": len(self.records)}


def _merged_record(actor: int, seq: int, attempt: int = 0) -> dict[str, Any]:
    return {"actor_id": actor, "seq": seq, "attempt": attempt, "group_id": f"{actor}/{seq}"}


def test_the_trainer_takes_several_actors_groups_round_robin_by_seq_whatever_comes_first():
    # Three actors' groups arrive in an order their timing made, a heartbeat among them.
    rng = random.Random(0)
    records = [_merged_record(a, s) for s in range(1, 6) for a in range(3)]
    rng.shuffle(records)
    records.insert(4, {"heartbeat": True, "actor_id": 2})
    merged = MergedReader(_OffsetReader(records[:9]), num_actors=3)
    first = merged.read(100, 0.0)
    assert merged.offsets()["inner"] == {"left": 0}  # the stream's own
    rest = MergedReader(_OffsetReader(records[9:]), 3, merged.offsets())  # a checkpoint's resume
    out = first + rest.read(100, 0.0)
    assert {"heartbeat": True, "actor_id": 2} in first
    assert [r["group_id"] for r in out if not r.get("heartbeat")] == \
        [f"{a}/{s}" for s in range(1, 6) for a in range(3)]


def test_a_resumed_merge_holds_again_the_groups_from_the_first_one_published_again():
    # Two actors resumed from snapshots after 3 and 2 groups: the trainer's checkpoint had
    # taken 0/1..0/4 and 1/1..1/3 (in order: positions 0..6), 1/4 held. Positions from
    # 1/3's (5) on are held again; 1/3 and 0/4 are superseded, 0/3 is not.
    merged = MergedReader(_OffsetReader([]), 2)
    merged.next, merged.held = [5, 4], {(1, 4): _merged_record(1, 4)}
    buffered = [Group.from_dict({**_merged_record(a, s), "prompt": "p", "samples": []})
                for s in (3, 4) for a in (0, 1)][:3]  # 0/3, 1/3, 0/4 (1/4 not yet taken)
    kept = {(0, 0): 3, (0, 1): 2}
    buffered = [g for g in buffered if not (g.seq > kept[0, g.actor_id])]  # SupersededFilter
    before = merged.resume_at((3, 2), buffered, kept)
    assert [g.group_id for g in before] == ["0/3"]
    assert merged.next == [4, 3] and merged.held == {}
    again = [_merged_record(1, 3, attempt=1), _merged_record(0, 4, attempt=1),
             _merged_record(1, 4, attempt=1)]
    merged.reader = _OffsetReader(again)
    assert [r["group_id"] for r in merged.read(10, 0.0)] == ["1/3", "0/4", "1/4"]


def test_an_actors_view_waits_for_the_others_logs_and_skips_what_a_resume_superseded(tmp_path):
    # Actor 1 of 2, lag_groups 1: after its n-th group the mirror has seen 2n + 1 - 1 groups.
    log0 = PublishedLog(tmp_path, 0)
    mirror = TrainerMirror(per_step=2, max_lag=0, publish_every=1, max_steps=100)
    view = MergedView(mirror, actor_id=1, num_actors=2, lag_groups=1,
                      logs={0: PublishedLog(tmp_path, 0, kept={(0, 0): 1})})
    view.publish(1, 0)
    assert not view.catch_up(1, should_stop=lambda: True)  # actor 0's first is not in yet
    log0.append(attempt=0, seq=1, oldest_version=0)
    log0.append(attempt=0, seq=2, oldest_version=0)  # superseded: attempt 1 wrote it again
    with log0.path.open("ab") as f:
        f.write(b'{"attempt": 1, "se')  # cut short by a crash
    assert view.catch_up(1, should_stop=lambda: True) and view.position == 2
    view.publish(2, 0)
    log0.append(attempt=1, seq=2, oldest_version=1)  # the row starts on a line of its own
    assert view.catch_up(2, should_stop=lambda: True) and view.position == 4
    # 0/1, 1/1 at step 0; 0/2 (version 1) at step 1; 1/2 (version 0) stale there (max_lag 0).
    assert (mirror.usable, mirror.dropped) == (3, 1)
    assert PublishedLog(tmp_path, 0).new_rows() == [(1, 0), (2, 0), (2, 1)]  # none kept out


def test_deterministic_checkpoints_fall_on_multiples_of_every_steps():
    free, aligned = CheckpointDue(4, 0.0), CheckpointDue(4, 0.0, aligned=True)
    free.done(3)  # a checkpoint the clock added at step 3
    aligned.done(3)
    assert [s for s in range(4, 13) if free(s)] == [7, 8, 9, 10, 11, 12]
    assert [s for s in range(4, 13) if aligned(s)] == [4, 8, 12]


# ---- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize("override, key", [
    ("sync.backend=broadcast", "sync.backend"),
    ("actor.max_restarts=3", "actor.max_restarts"),
    ("actor.endpoint_port=8000", "actor.endpoint_port"),
    ("engine.backend=vllm", "engine.backend"),
    ("trainer.max_time_s=60", "trainer.max_time_s"),
    ("eval.enabled=true", "eval.every_s"),
    ("deterministic.lag_groups=8", "deterministic.lag_groups"),
    ("task.name=code", "task.params.time_clock"),
    ("task.name=code_tool", "task.params.time_clock"),
])
def test_settings_not_yet_replayed_are_refused_naming_their_key(override, key):
    base = ["deterministic.enabled=true", "actor.max_restarts=0", "trainer.batch_size=16",
            "actor.group_size=4", "actor.max_lag=4", "actor.num_actors=2"]
    with pytest.raises(ConfigError, match=f"deterministic.enabled=true with {key}|{key} "):
        load_config(None, [*base, override])
    load_config(None, [*base[1:], override] if key != "deterministic.lag_groups" else base)


def test_code_with_cpu_time_limits_is_accepted():
    cfg = load_config(None, ["deterministic.enabled=true", "actor.max_restarts=0",
                             "task.name=code", "task.params.time_clock=cpu"])
    assert cfg.task.params["time_clock"] == "cpu"


def test_lag_groups_is_bounded_by_the_step_and_the_staleness_bound():
    def cfg(*extra: str) -> Config:
        return load_config(None, ["deterministic.enabled=true", "actor.max_restarts=0",
                                  "trainer.batch_size=16", "actor.group_size=4", *extra])

    assert cfg("deterministic.lag_groups=3", "actor.max_lag=1").deterministic.lag_groups == 3
    with pytest.raises(ConfigError, match="deterministic.lag_groups .4. must be at most 3"):
        cfg("deterministic.lag_groups=4", "actor.max_lag=1")
    with pytest.raises(ConfigError, match="at most 0"):  # max_lag 0: nothing past the step
        cfg("deterministic.lag_groups=1", "actor.max_lag=0")
    with pytest.raises(ConfigError, match="at most 0"):  # a round is admitted whole
        cfg("deterministic.lag_groups=1", "mode=conventional")
    # Two actors: an actor's next group stands up to one group past its clock's point.
    assert cfg("deterministic.lag_groups=2", "actor.max_lag=4",
               "actor.num_actors=2").deterministic.lag_groups == 2
    with pytest.raises(ConfigError, match="at most 2 .* actor.num_actors 2"):
        cfg("deterministic.lag_groups=3", "actor.max_lag=4", "actor.num_actors=2")
    with pytest.raises(ConfigError, match="at least one group of every actor"):
        cfg("actor.num_actors=5")


def test_an_episodic_task_is_refused_naming_the_task_and_an_environment_is_not():
    cfg = load_config(None, ["deterministic.enabled=true", "actor.max_restarts=0",
                             "task.name=calculator"])
    check_task(cfg)  # multi-turn environments replay
    check_deterministic_task(cfg, make_train_task(cfg.task.name, {}, 0.0))
    episodic = FakeTask()
    episodic.episodic = True  # an environment of another library (verifiers) runs its episodes
    with pytest.raises(ValueError, match="deterministic.enabled=true with task.name='calculator'"):
        check_deterministic_task(cfg, episodic)


# ---- a crash changes nothing ------------------------------------------------------------------

CRASH_STEPS = 8


def _resume_args(runs: Path, cache: Path, name: str, *extra: str) -> list[str]:
    return [f"name={name}", f"output_dir={runs}", f"warmstart.cache_dir={cache}",
            "warmstart.steps=20", "engine.capacity=16",
            "eval.enabled=true", "eval.every_s=0", "eval.every_steps=2", "eval.num_problems=8",
            "actor.group_size=4", "actor.max_lag=2", "actor.max_restarts=0",
            "trainer.batch_size=16", f"trainer.max_steps={CRASH_STEPS}", "trainer.max_time_s=0",
            "trainer.checkpoint_every_steps=2", "trainer.sample_timeout_s=120",
            "metrics.progress=false", "metrics.plot=false", "metrics.samples_per_step=-1",
            "deterministic.enabled=true", "deterministic.lag_groups=2",
            "trainer.loss.entropy_coef=0.01",
            "task.params={min_terms: 2, max_terms: 2, max_operand: 3}", *extra]


# The runs the crash test makes: the demo's with two actors, and the calculator's multi-turn
# tool use (whose replies, calls and failures the actor's snapshot carries across the crash).
TASKS = {"two_actors": ("actor.num_actors=2",),
         "calculator": ("task.name=calculator", "warmstart.steps=150", "actor.env_workers=2",
                        "task.params={tool_demo_prob: 1.0, min_terms: 2, max_terms: 2, "
                        "max_operand: 3}")}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, warm_cache: Path
                  ) -> Callable[[str], Path]:
    """The uninterrupted run of a task of TASKS (each made once)."""
    made: dict[str, Path] = {}

    def run_dir(task: str) -> Path:
        if task not in made:
            runs = tmp_path_factory.mktemp("runs")
            whole = _train(_resume_args(runs, warm_cache, "whole", *TASKS[task]))
            _, err = whole.communicate(timeout=300)
            assert whole.returncode == 0, err[-4000:]
            made[task] = runs / "whole"
        return made[task]

    return run_dir


@pytest.mark.slow
@pytest.mark.timeout(600)
# Each role killed once on two actors (the harder clock: one actor's reads the other's log),
# and an actor of the multi-turn task (its snapshot carries replies in flight).
@pytest.mark.parametrize("role, task", [("trainer", "two_actors"), ("actor", "two_actors"),
                                        ("evaluator", "two_actors"), ("actor", "calculator")])
def test_a_run_killed_at_a_random_step_and_resumed_ends_as_one_never_interrupted(
        tmp_path, warm_cache, uninterrupted, role, task):
    """SIGKILL to a role's process group at a random step: the trainer's, then `--resume`; an
    actor's (of two actors, the second's) or the evaluator's, which the launcher resumes the
    run for (trainer.max_restarts). The run ends with
    the uninterrupted run's final weights hash, its metrics.jsonl rows (every step once, equal
    but for the wall-clock fields: held-out results of versions 0, 2, ..., 8 among them, the
    ones before the resume point evaluated by the killed attempt), samples.jsonl (every
    group) and trained.jsonl."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    # The calculator's is killed past a snapshot: its resumed rollouts must draw what the
    # uninterrupted ones did, from a fresh engine.
    kill_at = rng.randint(5 if task == "calculator" else 1, CRASH_STEPS - 2)
    actor = 1 if task == "two_actors" else 0  # the one whose clock reads the other's log
    why = f"{role} killed after step {kill_at} (seed {seed}): "
    auto_resume = ["trainer.max_restarts=1"] if role != "trainer" else []
    args = _resume_args(tmp_path / "runs", warm_cache, "killed", *TASKS[task], *auto_resume)
    run_dir = tmp_path / "runs" / "killed"
    proc = _train(args)
    _wait_for_step(proc, run_dir, kill_at, poll_s=0.01)
    time.sleep(rng.uniform(0.0, 0.5))  # anywhere in the next step or two
    pattern = {"trainer": f"pipelinerl.cli trainer {run_dir}/config.yaml",
               "actor": f"actor {run_dir}/config.yaml --actor-id {actor}",
               "evaluator": f"pipelinerl.cli evaluator {run_dir}/config.yaml"}[role]
    os.killpg(_pid_of(pattern), signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    if role == "trainer":
        assert proc.returncode == 1, why + err[-4000:]
        resumed = _train(args, "--resume")
        _, err = resumed.communicate(timeout=300)
        assert resumed.returncode == 0, why + err[-4000:]
    else:
        assert proc.returncode == 0, why + err[-4000:]
        dead = f"actor_{actor}" if role == "actor" else role
        assert f"the {dead} died: resuming the run from its newest checkpoint" in err, why + err
    resumed_from = next(line for line in err.splitlines()
                        if line.startswith("deterministic resume (attempt 1) from "))
    print(why + resumed_from)
    evaluated = [json.loads(line) for line in
                 (run_dir / "replay" / "evaluated.jsonl").read_text().splitlines()]
    if kill_at >= 4 and all({"version": v, "attempt": 0} in evaluated for v in (0, 2)):
        # Step 2's checkpoint and snapshot were written by then, and versions 0 and 2 evaluated.
        assert "checkpoint and the actor" in resumed_from, why + resumed_from

    steps = [r["step"] for r in _metrics(run_dir) if "eval/version" not in r]
    assert steps == list(range(1, CRASH_STEPS + 1)), why
    evals = [r["eval/version"] for r in _metrics(run_dir) if "eval/version" in r]
    assert evals == list(range(0, CRASH_STEPS + 1, 2)), why
    whole = uninterrupted(task)
    assert _metrics(run_dir) == _metrics(whole), why
    for name in ("samples.jsonl", "trained.jsonl", "weights.sha256"):
        assert (run_dir / name).read_text() == (whole / name).read_text(), why + name
    if task == "calculator":  # the tool was called, before the crash and after it
        calls = [r["actor_env_calls"] for r in _metrics(run_dir) if "actor_env_calls" in r]
        assert 0 < calls[0] < calls[-1], why
