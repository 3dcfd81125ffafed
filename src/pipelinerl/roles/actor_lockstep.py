"""Deterministic mode's clocks for one actor (docs/determinism.md): the actor's loop asks a
`Lockstep` where timing would otherwise decide.

It holds the trainer mirror and its merged view of the run's order (which groups the trainer
will drop, which it will train, which version is due), the score queue on the decode clock,
and the snapshot drain. The actor calls it at a few points: to admit a group, to seed an
attempt's sampler, when a group's attempts are all in, before and after publishing a group
(after: it lands the version now due, waiting for the trainer), and once per loop turn (the
scores due, a snapshot once the drain emptied the engine). It reads none of the actor's state:
what it needs comes in as arguments, and a snapshot joins its state to the actor's own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from pipelinerl.config import Config
from pipelinerl.engine import Engine
from pipelinerl.rl.batches import oldest_version
from pipelinerl.rollouts.due import DueQueue
from pipelinerl.rollouts.scoring import Scored, Scorer
from pipelinerl.run.replay import (
    MergedView,
    PublishedLog,
    TrainerMirror,
    check_deterministic_task,
    read_snapshot,
    request_seed,
    resume_point,
    resume_points,
    superseded_after,
    write_snapshot,
)
from pipelinerl.sync.base import WeightReceiver
from pipelinerl.tasks.base import Task
from pipelinerl.types import Group, SamplingParams

log = logging.getLogger(__name__)


class Lockstep:
    """One deterministic actor's logical clocks. `load_weights` loads what the receiver holds
    (the actor's own load, which counts the update); `count_idle` adds seconds spent waiting
    for the trainer to the actor's idle time."""

    def __init__(self, cfg: Config, task: Task, engine: Engine, scorer: Scorer | None,
                 receiver: WeightReceiver | None, *, actor_id: int,
                 should_stop: Callable[[], bool], load_weights: Callable[[], None],
                 count_idle: Callable[[float], None]) -> None:
        check_deterministic_task(cfg, task)
        self.cfg = cfg
        self.actor_id = actor_id
        self.engine = engine
        self.scorer = scorer
        self.receiver = receiver
        self.should_stop = should_stop
        self.load_weights = load_weights
        self.count_idle = count_idle
        self.mirror = TrainerMirror.of(cfg)
        self.view = _merged_view(cfg, actor_id, self.mirror)  # the trainer's order of groups
        self.published_log = (PublishedLog(cfg.run_dir, actor_id)  # for the others' views
                              if cfg.actor.num_actors > 1 else None)
        self.score_queue = DueQueue(cfg.deterministic.score_delay_steps)
        self._scored: dict[str, Scored] = {}  # scores in before their group is due
        # After loading a version that is a multiple of this (0: never), admit and publish
        # nothing until the engine is empty, then write a snapshot.
        self.snapshot_every = cfg.trainer.checkpoint_every_steps
        self.draining = False

    # -- admission and sampling -------------------------------------------------------------
    @property
    def admitting(self) -> bool:
        """Whether a new group may start: not during a snapshot's drain, nor once no group
        is published past here."""
        return not self.draining and not self.view.complete

    @property
    def complete(self) -> bool:
        """No group of this actor is trained past here."""
        return self.view.complete

    def admits(self, claimed: int, limit: int) -> bool:
        """Whether the actor's next group (after its `claimed` places) is below `limit`: its
        place in the trainer's order, less the drops the mirror has seen there (those the
        trainer will make, not those it said yet), so no other actor's timing counts."""
        place = claimed * self.cfg.actor.num_actors + self.actor_id
        return place - self.mirror.dropped < limit

    def sampling_of(self, sampling: SamplingParams, group_id: str, attempt: int
                    ) -> SamplingParams:
        """Each attempt draws from a sampler of its own."""
        return replace(sampling, seed=request_seed(self.cfg.seed, group_id, attempt))

    # -- scores and publishing --------------------------------------------------------------
    def expect_scores(self, key: str, decode_steps: int) -> None:
        """Group `key`'s attempts are all in, at this decode step: its scores fall due later."""
        self.score_queue.expect(key, decode_steps)

    def due_scores(self, decode_steps: int, idle: bool) -> Iterator[Scored]:
        """The groups whose scores are due by the decode clock (all, when `idle`), in the
        order they were sent, waiting for their verifiers if need be; none while a
        snapshot's drain holds them. Lazy: publishing one may start a drain."""
        while not self.draining:
            key = self.score_queue.pop_due(decode_steps, idle)
            if key is None:
                return
            self._await_scores([key])
            yield self._scored.pop(key)

    def trains(self, seq: int) -> bool:
        """Whether a step trains this actor's group `seq` (else it is not published: whether
        it comes before the stop record is timing)."""
        return self.view.trains(seq, self.should_stop)

    def on_published(self, group: Group) -> None:
        """Record the group in the run's order, then land the version it makes due."""
        oldest = oldest_version(group)
        if self.published_log is not None:
            self.published_log.append(self.cfg.attempt, group.seq, oldest)
        self.view.publish(group.seq, oldest)
        self._land_due_weights(group.seq)

    def _await_scores(self, keys: list[str]) -> None:
        """Until the verifiers' scores of every group in `keys` are in `_scored`."""
        assert self.scorer is not None
        while missing := [key for key in keys if key not in self._scored]:
            self._scored.update((s.key, s) for s in self.scorer.poll())
            if any(key not in self._scored for key in missing):
                self.scorer.wait(0.005)

    # -- weights ----------------------------------------------------------------------------
    def _land_due_weights(self, published: int) -> None:
        """After each group published: load the version the trainer mirror says is now due,
        waiting for the trainer to publish it (or to stop). Right after the group that makes
        it due, so the trainer cannot have gone past it yet."""
        if (not self.view.catch_up(published, self.should_stop)
                or not self.view.trains(published + 1, self.should_stop)):
            return  # stopped, or no later group of this actor trained: its weights don't matter
        due = self.mirror.version_due()
        if self.receiver is None or due <= self.engine.version:
            return
        self._await_version(due)
        if self.snapshot_every and due % self.snapshot_every == 0:
            self.draining = True

    def _await_version(self, version: int) -> None:
        """Wait for the trainer to publish `version` (or to stop), and load it."""
        assert self.receiver is not None
        t0 = time.monotonic()
        while self.engine.version != version:
            available = self.receiver.poll()
            if available is not None and available > version:
                raise RuntimeError(f"the trainer published version {available} while the actor "
                                   f"waited for {version}: deterministic mode's schedule is "
                                   "broken")
            if available == version:
                self.load_weights()  # loads nothing if a write began meanwhile
                if self.engine.version > version:
                    raise RuntimeError(f"loaded version {self.engine.version}, expected "
                                       f"{version}")
                continue
            if self.should_stop():
                return
            time.sleep(0.002)
        self.count_idle(time.monotonic() - t0)

    # -- snapshots --------------------------------------------------------------------------
    def maybe_snapshot(self, engine_empty: bool, actor_state: Callable[[], dict[str, Any]]
                       ) -> None:
        """Once a snapshot's drain has emptied the engine, write the actor's state
        (`actor_state`: its counters, groups and generators) with this one's (its groups
        waiting for their scores with the scores, its clocks) for a resume from the trainer's
        checkpoint of the version held."""
        if not self.draining or not engine_empty:
            return
        waiting = [key for key, _ in self.score_queue.entries()]
        self._await_scores(waiting)
        state = {**actor_state(), **self.state()}
        assert sorted(waiting) == sorted(state["groups"]), "a started group is neither in "\
            "the engine nor waiting for its scores"
        path = write_snapshot(self.cfg.run_dir, self.actor_id, self.engine.version, state)
        log.info("snapshot of version %d after %d groups written to %s", self.engine.version,
                 state["published"], path)
        self.draining = False

    def state(self) -> dict[str, Any]:
        """This one's part of a snapshot, the engine empty (its weights are the trainer's
        checkpoint of `version`)."""
        return {"version": self.engine.version, "score_queue": self.score_queue.entries(),
                "scored": dict(self._scored), "mirror": (self.mirror.usable, self.mirror.dropped),
                "view": self.view.state()}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a snapshot `state`: first the weights of its version from the trainer
        (which publishes them on resuming from that step), then the clocks as they were; the
        actor restores its own part after (the load counts as a weight update)."""
        self._await_version(state["version"])
        self._scored = dict(state["scored"])
        self.score_queue.restore(state["score_queue"])
        self.mirror.usable, self.mirror.dropped = state["mirror"]
        self.view.restore(state["view"])


def _merged_view(cfg: Config, actor_id: int, mirror: TrainerMirror) -> MergedView:
    kept = superseded_after(resume_points(cfg.run_dir)) if cfg.attempt else {}
    logs = {a: PublishedLog(cfg.run_dir, a, kept)
            for a in range(cfg.actor.num_actors) if a != actor_id}
    return MergedView(mirror, actor_id, cfg.actor.num_actors, cfg.deterministic.lag_groups,
                      logs)


def snapshot_to_resume(cfg: Config, actor_id: int) -> dict[str, Any] | None:
    """A resumed deterministic run's actor continues the snapshot the launcher paired with the
    trainer's checkpoint; None: it starts as the first attempt's did (no such pair, or not a
    resumed deterministic run)."""
    if not (cfg.deterministic.enabled and cfg.attempt):
        return None
    point = resume_point(cfg.run_dir, cfg.attempt)
    if point.snapshots is None:
        log.info("actor %d starts again from the run's start (no checkpoint with a snapshot)",
                 actor_id)
        return None
    log.info("actor %d continues from its snapshot of version %d after %d groups (%s)",
             actor_id, point.step, point.seqs[actor_id], point.snapshots[actor_id])
    return read_snapshot(point.snapshots[actor_id])
