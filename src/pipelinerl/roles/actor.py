"""The actor role: keeps the engine full, groups attempts, scores them, publishes groups.

`run_actor` builds one actor process (its streams, tokenizer, engine, weight receiver, task,
generate endpoint and episodes) and runs it. Each turn of the loop (`Actor.run`), between two
decode steps: load the trainer's new weights if it published some; publish the groups whose
scores came back and the environment episodes that came back scored; apply the environment
replies that came back; add the endpoint's waiting HTTP requests to the batch; start new
groups while the staleness bound (`Schedule`) admits them; heartbeat if nothing was written
for a while; run one decode step (or wait, when nothing can be decoded). A finished sequence
answers its HTTP request or ends an attempt; a group whose attempts are all in goes to the
scorer (worker processes: verification never stops decoding).

Deterministic mode (`deterministic.enabled`, docs/determinism.md) lives in
`roles/actor_lockstep.py`: the actor holds one `Lockstep` (None when off) and asks it where
timing would otherwise decide: admitting a group, seeding an attempt, which scores are due,
whether a group is trained, landing the version due after a publish, and snapshots.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
from transformers import PreTrainedTokenizerBase

from pipelinerl.config import Config
from pipelinerl.engine import Engine, make_engine
from pipelinerl.envs.groups import GroupCollector, group_key, request_id
from pipelinerl.envs.rollout import Rollouts, Transcript
from pipelinerl.models.prompts import Codec, text_codec
from pipelinerl.rl.advantages import zero_variance
from pipelinerl.roles.actor_lockstep import Lockstep, snapshot_to_resume
from pipelinerl.roles.wiring import (
    Control,
    open_admission_ledger,
    open_control_reader,
    open_rollout_writer,
    open_weight_receiver,
    predecessor_record,
)
from pipelinerl.rollouts.admission import Ledger, MemoryLedger
from pipelinerl.rollouts.generation import sampling_from_config
from pipelinerl.rollouts.scoring import Scored, Scorer
from pipelinerl.run.group_ids import format_group_id, next_restart, process_seed
from pipelinerl.run.replay import reply_delay_steps, use_deterministic_torch
from pipelinerl.streams.base import StreamWriter
from pipelinerl.sync.base import WeightReceiver
from pipelinerl.tasks import make_train_task
from pipelinerl.tasks.base import Problem, Score, Task
from pipelinerl.tasks.environment import is_environment
from pipelinerl.tools.task import equip
from pipelinerl.types import (
    HEARTBEAT_S,
    GenerationOutput,
    GenerationRequest,
    Group,
    Sample,
    SamplingParams,
)

if TYPE_CHECKING:  # imported when used: aiohttp costs 0.2-0.6 s (python -X importtime)
    from pipelinerl.envs.verifiers.episodes import EpisodeRunner, FinishedGroup
    from pipelinerl.rollouts.endpoint import GenerateEndpoint

log = logging.getLogger(__name__)

MAX_SKIPPED_IDS = 100  # problem ids kept per skip reason (the counts are complete)
MAX_LONG_PROMPTS_IN_A_ROW = 1000  # draws that all fail to fit: the data or config is wrong


@dataclass(frozen=True)
class Schedule:
    """Which groups may start under weights of version v: places are numbered over the run
    (pipelinerl.rollouts.admission counts them over every actor) and place g is trained at step g // K,
    K = batch_size // group_size. Pipeline: g // K - v <= max_lag. Conventional: the groups of
    the C = conventional_g steps of round v // C. A dropped group gives its place back."""

    batch_size: int
    group_size: int
    max_lag: int
    conventional_g: int = 0  # 0: pipeline mode

    @classmethod
    def of(cls, cfg: Config) -> Schedule:
        return cls(batch_size=cfg.trainer.batch_size, group_size=cfg.actor.group_size,
                   max_lag=cfg.actor.max_lag,
                   conventional_g=cfg.conventional_g if cfg.mode == "conventional" else 0)

    def limit(self, version: int) -> int:
        """Places below this may be in use while an actor holds weights of `version`."""
        per_step = self.batch_size // self.group_size
        if self.conventional_g:
            return (version // self.conventional_g + 1) * self.conventional_g * per_step
        return (version + self.max_lag + 1) * per_step


@dataclass
class Streams:
    """An actor's ends of the run's streams: groups and heartbeats out (`writer`), weights in
    (`receiver`; None: they never change), its admission claims (`ledger`), and the trainer's
    stop and dropped groups, over every actor (`should_stop`, `returned`)."""

    writer: StreamWriter
    receiver: WeightReceiver | None = None
    ledger: Ledger = field(default_factory=MemoryLedger)  # this actor alone, in memory
    should_stop: Callable[[], bool] = lambda: False
    returned: Callable[[], int] = lambda: 0

    def close(self) -> None:
        self.writer.close()
        self.ledger.close()
        if self.receiver is not None:
            self.receiver.close()


@dataclass
class _PendingGroup:
    """A started group, in the engine or waiting for its scores: it holds a place."""

    problem: Problem
    data_pos: int | None = None  # the task's position before its problem was drawn
    # Finished attempts: engine outputs, or transcripts of multi-turn rollouts.
    outputs: list[GenerationOutput | Transcript] = field(default_factory=list)


@dataclass
class ActorStats:
    started_at: float = field(default_factory=time.monotonic)
    generated_tokens: int = 0
    idle_s: float = 0.0
    # Slot occupancy: sequences decoded per step, summed over steps and over their seconds.
    decode_steps: int = 0
    decode_s: float = 0.0
    busy_slot_steps: int = 0
    busy_slot_s: float = 0.0
    weight_updates: int = 0
    last_update_pause_s: float = 0.0
    total_update_pause_s: float = 0.0
    groups_published: int = 0
    skipped: Counter = field(default_factory=Counter)
    skipped_ids: defaultdict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    outcomes: Counter = field(default_factory=Counter)  # scores' outcomes, where a task says

    # Counted on the logical clocks: a resumed actor continues them (`counts`).
    COUNTS = ("generated_tokens", "decode_steps", "busy_slot_steps", "weight_updates",
              "groups_published", "skipped", "skipped_ids", "outcomes")

    def counts(self) -> dict[str, Any]:
        """The counters a deterministic snapshot keeps (the rest are wall-clock)."""
        return {name: getattr(self, name) for name in self.COUNTS}

    def restore_counts(self, counts: dict[str, Any]) -> None:
        for name in self.COUNTS:
            setattr(self, name, counts[name])

    def skip(self, reason: str, problem_id: str) -> None:
        self.skipped[reason] += 1
        if len(self.skipped_ids[reason]) < MAX_SKIPPED_IDS:
            self.skipped_ids[reason].add(problem_id)

    def count_idle(self, seconds: float) -> None:
        self.idle_s += seconds

    def count_step(self, decoded: int, seconds: float) -> None:
        """One engine step that decoded `decoded` sequences in `seconds`."""
        self.decode_steps += 1
        self.decode_s += seconds
        self.busy_slot_steps += decoded
        self.busy_slot_s += decoded * seconds

    def snapshot(self, version: int, capacity: int) -> dict[str, float]:
        elapsed = max(time.monotonic() - self.started_at, 1e-9)
        return {
            "tokens_per_s": self.generated_tokens / elapsed,
            "idle_frac": self.idle_s / elapsed,
            # Of the slots the engine's steps could have decoded, the share they did (a
            # draining batch lowers it); of capacity x wall-clock, the share busy decoding,
            # bounded by the share of wall-clock in decode steps (time with no step: waiting
            # for weights, scoring, admission). Slot time weighs a step by its seconds, so it
            # can exceed the per-step occupancy where a full step takes longer than a drained one.
            "slot_occupancy": self.busy_slot_steps / max(capacity * self.decode_steps, 1),
            "slot_time_frac": self.busy_slot_s / (capacity * elapsed),
            "decode_time_frac": self.decode_s / elapsed,
            "weight_updates": self.weight_updates,
            "last_update_pause_s": self.last_update_pause_s,
            "mean_update_pause_s": self.total_update_pause_s / max(self.weight_updates, 1),
            "version": version,
            "groups_published": self.groups_published,
            **{f"skipped_{reason}": count for reason, count in self.skipped.items()},
            **{f"outcome_{outcome}": count for outcome, count in self.outcomes.items()},
        }


class Actor:
    """One actor process's loop (see the module docstring), as `cfg` says. `predecessor`: the
    newest record an earlier process of this actor wrote (its stream's last): this one
    continues its count and waits for the trainer's current weights before starting anything.
    `endpoint`: requests from HTTP clients join the engine's batch too (pipelinerl.rollouts.endpoint).
    `episodes`: the task is an environment of another library (verifiers), whose episodes call
    the endpoint and are scored by the environment (pipelinerl.envs.verifiers); a group then
    holds its place from its start until its episodes come back. A task with `respond`
    (pipelinerl.tasks.environment) is an environment: its rollouts are multi-turn."""

    def __init__(self, cfg: Config, engine: Engine, task: Task, codec: Codec, streams: Streams,
                 *, actor_id: int = 0, predecessor: dict[str, Any] | None = None,
                 endpoint: GenerateEndpoint | None = None, episodes: EpisodeRunner | None = None
                 ) -> None:
        self.cfg = cfg
        self.engine = engine
        self.task = task
        self.codec = codec
        self.streams = streams
        self.actor_id = actor_id
        self.endpoint = endpoint
        self.episodes = episodes
        self.sampling = sampling_from_config(cfg.engine, codec.stop_ids)
        self.schedule = Schedule.of(cfg)
        self.group_size = cfg.actor.group_size
        self.max_prompt_tokens = cfg.engine.max_seq_len - cfg.engine.max_new_tokens
        # Episodes are scored by their environment: no verifier processes.
        self.scorer = (None if episodes else
                       Scorer(task, cfg.actor.verifier_timeout_s, cfg.actor.verifier_workers))
        self.collector = (None if self.scorer is None else
                          GroupCollector(self.scorer, codec.decode))
        self.rollouts = (Rollouts(task, engine, codec.encode_text, codec.decode, self.sampling,
                                  cfg.actor.env_timeout_s, cfg.actor.env_workers,
                                  reply_delay_steps(cfg), codec.token_text)
                         if is_environment(task) else None)
        self.stats = ActorStats()
        # Deterministic mode (roles/actor_lockstep.py): weights, scores and the trainer's
        # drops are taken at points of logical clocks; None: free-running.
        self.lockstep = (Lockstep(cfg, task, engine, self.scorer, streams.receiver,
                                  actor_id=actor_id, should_stop=streams.should_stop,
                                  load_weights=self.maybe_update_weights,
                                  count_idle=self.stats.count_idle)
                         if cfg.deterministic.enabled else None)
        self.in_flight = 0  # requests submitted to the engine and not yet finished
        self._groups: dict[str, _PendingGroup] = {}  # started and not yet published or dropped
        self.published = 0  # groups published, by earlier processes of this actor too
        self._refused: tuple[int, int, float] | None = None  # (limit, returned, when)
        self._last_write = time.monotonic()  # of a group or a heartbeat
        self._next_group = 0  # for unique group ids
        # Which process of this actor: in the ids of its groups, which are numbered as they
        # start and published as they finish (so a predecessor's last one is not its highest).
        self.restart = next_restart(predecessor)
        # Each process draws its own problems: one seeded like its predecessor would replay
        # the run's first ones after every restart or resume.
        self.rng = random.Random(process_seed(cfg.actor.seed + cfg.seed, actor_id, self.restart))
        # An actor that continues another (a restart, a resumed run) starts nothing under the
        # starting model's weights: it waits for the trainer's current ones.
        self.needs_weights = predecessor is not None and streams.receiver is not None
        if predecessor is not None:
            self.published = int(predecessor["seq"])
            if predecessor.get("data_pos") is not None:
                self.task.seek(predecessor["data_pos"])
        # This actor's claim: published + started and not yet published (none yet).
        self.streams.ledger.set(actor_id, self.published)

    # -- the loop ---------------------------------------------------------------------------
    def run(self, max_groups: int | None = None, resume: dict[str, Any] | None = None) -> None:
        """The loop until the trainer stops (or `max_groups` are published); `resume`: a
        deterministic snapshot's state to continue first (`restore`)."""
        try:
            if resume is not None:
                self.restore(resume)
            while not self.streams.should_stop():
                if max_groups is not None and self.stats.groups_published >= max_groups:
                    break
                if (lockstep := self.lockstep) is not None:
                    lockstep.maybe_snapshot(self.in_flight == 0, self.state)
                    for scored in lockstep.due_scores(self.stats.decode_steps,
                                                      idle=self.in_flight == 0):
                        self.publish(scored)
                    if lockstep.complete:
                        # No group is published past here: take what comes, as a broadcast
                        # channel needs (the trainer's final publish waits for every actor).
                        self.maybe_update_weights()
                else:
                    self.maybe_update_weights()
                    for scored in self.scorer.poll() if self.scorer else ():
                        self.publish(scored)
                for finished in self.episodes.poll() if self.episodes else ():
                    self.on_episodes(finished)
                if self.rollouts is not None:
                    # Nothing else to decode: deterministic mode takes every reply now.
                    idle = self.rollouts.waiting() == self.in_flight
                    for transcript in self.rollouts.poll(self.stats.decode_steps, idle):
                        self.on_rollout_end(transcript)
                self.serve()
                self.fill()
                self.maybe_heartbeat()
                if self.in_flight == 0:
                    # Blocked by the staleness bound: wait for scores or the trainer's weights.
                    t0 = time.monotonic()
                    if self.scorer is not None:
                        self.scorer.wait(0.005)
                    else:
                        time.sleep(0.005)
                    self.stats.idle_s += time.monotonic() - t0
                    continue
                if self.rollouts is not None and self.rollouts.waiting() == self.in_flight:
                    # Every rollout waits for its environment: nothing to decode.
                    t0 = time.monotonic()
                    self.rollouts.pool.wait(0.005)
                    self.stats.idle_s += time.monotonic() - t0
                    continue
                t0 = time.monotonic()
                outs = self.engine.step()
                self.stats.count_step(self.engine.num_running() + len(outs), time.monotonic() - t0)
                for out in outs:
                    self.on_finished(out)
            self.heartbeat()  # an orderly stop: the audit reads this process's final counts
        finally:
            if self.scorer is not None:
                self.scorer.close()
            if self.rollouts is not None:
                self.rollouts.close()
            if self.episodes is not None:
                self.episodes.close()
            if self.endpoint is not None:
                self.endpoint.close()
            self._log_skips()

    def snapshot(self) -> dict[str, float]:
        stats = self.stats.snapshot(self.engine.version, self.engine.capacity)
        if self.rollouts is not None:
            elapsed = time.monotonic() - self.stats.started_at
            stats.update(self.rollouts.stats.snapshot(elapsed, self.engine.capacity))
            if (tool_stats := getattr(self.rollouts.pool, "snapshot", None)) is not None:
                stats.update(tool_stats())
        if self.endpoint is not None:
            stats["endpoint_aborted"] = self.endpoint.aborted
        if self.episodes is not None:
            stats.update(self.episodes.stats())
        return stats

    def maybe_heartbeat(self) -> None:
        """When nothing was published for HEARTBEAT_S, say why on the rollout stream, so a
        trainer waiting for groups tells a blocked actor from a dead one."""
        if time.monotonic() - self._last_write >= HEARTBEAT_S:
            self.heartbeat()

    def heartbeat(self) -> None:
        """What this actor is doing, and the groups it dropped so far (for the audit)."""
        self._last_write = time.monotonic()
        version = self.engine.version
        self.streams.writer.write({
            "heartbeat": True, "actor_id": self.actor_id, "attempt": self.cfg.attempt,
            "version": version, "in_flight": self.in_flight, "claimed": self.claimed(),
            "limit": self.schedule.limit(version), "returned": self.streams.returned(),
            "waiting_for_weights": self.needs_weights,
            # Episodes between two model calls hold no engine request.
            "blocked": self.in_flight == 0 and not self._episodes_running(),
            "seq": self.published,
            "generation": self.restart,  # the restart number, under its key in existing runs
            "data_pos": self.data_pos(), "skipped": dict(self.stats.skipped)})

    def data_pos(self) -> int | None:
        """Where a successor's draws resume: the position of the oldest problem still in
        flight (generated again then), else the task's next one. Groups in flight that were
        drawn after it are drawn again too: at most a pipeline's worth of repeats."""
        position = getattr(self.task, "position", None)
        if position is None:
            return None
        pending = [g.data_pos for g in self._groups.values() if g.data_pos is not None]
        return min(pending, default=position)

    def maybe_update_weights(self) -> None:
        if self.streams.receiver is None:
            return
        if self.streams.receiver.poll() is None:
            return
        t0 = time.monotonic()
        self.engine.receive_weights(self.streams.receiver.receive_into)
        self.needs_weights = False
        pause = time.monotonic() - t0
        self.stats.weight_updates += 1
        self.stats.last_update_pause_s = pause
        self.stats.total_update_pause_s += pause

    def state(self) -> dict[str, Any]:
        """The actor's part of a deterministic snapshot (the lockstep adds its clocks): its
        counts, groups waiting for their scores and generators."""
        return {"published": self.published, "restart": self.restart,
                "next_group": self._next_group, "rng": self.rng.getstate(),
                "task_position": getattr(self.task, "position", None),
                "groups": dict(self._groups), "stats": self.stats.counts(),
                "env": None if self.rollouts is None else self.rollouts.stats.counts()}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a snapshot `state`: the lockstep lands its version and takes back its
        clocks, then every counter of the actor's is as it was."""
        assert self.lockstep is not None
        self.lockstep.restore(state)
        self.published, self.restart = state["published"], state["restart"]
        self._next_group = state["next_group"]
        self.rng.setstate(state["rng"])
        if state["task_position"] is not None:
            self.task.seek(state["task_position"])
        self._groups = dict(state["groups"])
        self.stats.restore_counts(state["stats"])
        if self.rollouts is not None:
            self.rollouts.stats.restore_counts(state["env"])
        self.streams.ledger.set(self.actor_id, self.claimed())

    def claimed(self) -> int:
        """This actor's places (see pipelinerl.rollouts.admission)."""
        return self.published + len(self._groups)

    def claim_place(self) -> bool:
        """Take the run's next place if the weights held admit it (Schedule, via the ledger).
        After a refusal, ask again only once the weights or the trainer's drops changed or
        0.1 s passed (another actor may have given a place back), not on every loop."""
        limit = self.schedule.limit(self.engine.version)
        if self.lockstep is not None:
            return self.lockstep.admits(self.claimed(), limit)
        returned = self.streams.returned()
        refused = self._refused
        if refused is not None and refused[:2] == (limit, returned) and time.monotonic() - refused[2] < 0.1:
            return False
        if self.streams.ledger.claim(self.actor_id, self.claimed() + 1, returned, limit):
            self._refused = None
            return True
        self._refused = (limit, returned, time.monotonic())
        return False

    def serve(self) -> None:
        """Abort the endpoint's requests whose client went away; add its waiting ones to the
        engine, ahead of new groups (their tokens are not trained: no admission place)."""
        if self.endpoint is None:
            return
        self.in_flight -= self.endpoint.abort_abandoned(self.engine)
        if self.needs_weights:
            return
        for request in self.endpoint.take(self.engine.capacity - self.in_flight):
            self.engine.add_request(request)
            self.in_flight += 1

    def fill(self) -> None:
        if self.needs_weights or (self.lockstep is not None and not self.lockstep.admitting):
            return
        long_in_a_row = 0
        while self._room_for_a_group() and self.claim_place():
            if self.start_group():
                long_in_a_row = 0
                continue
            self.streams.ledger.set(self.actor_id, self.claimed())  # the place claimed goes back
            long_in_a_row += 1
            if long_in_a_row == MAX_LONG_PROMPTS_IN_A_ROW:
                raise RuntimeError(
                    f"{long_in_a_row} prompts in a row were longer than the "
                    f"{self.max_prompt_tokens} tokens that fit (engine.max_seq_len="
                    f"{self.cfg.engine.max_seq_len} - engine.max_new_tokens="
                    f"{self.cfg.engine.max_new_tokens}): "
                    "raise engine.max_seq_len or lower engine.max_new_tokens"
                )

    def _episodes_running(self) -> bool:
        return self.episodes is not None and bool(self._groups)

    def _room_for_a_group(self) -> bool:
        if self.episodes is not None:
            # An episode makes about one engine request at a time: as many as the engine
            # holds run at once (the endpoint queues any beyond).
            return (len(self._groups) + 1) * self.group_size <= self.engine.capacity
        return self.in_flight + self.group_size <= self.engine.capacity

    def start_group(self) -> bool:
        """Start a group in the next admitted place; False (counted, no place used) if the
        prompt drawn does not fit in the engine."""
        data_pos = getattr(self.task, "position", None)
        problem = self.task.sample_problem(self.rng)
        if self.episodes is not None:  # the environment renders its prompts itself
            group_id = self._new_group_id()
            self._groups[group_id] = _PendingGroup(problem, data_pos)
            self.episodes.start(group_id, problem, self.group_size)
            return True
        prompt_ids = self.codec.encode(problem.prompt)
        if len(prompt_ids) > self.max_prompt_tokens:
            self._skip_long_prompt(problem, len(prompt_ids))
            return False
        group_id = self._new_group_id()
        self._groups[group_id] = _PendingGroup(problem, data_pos)
        for i in range(self.group_size):
            rid = request_id(group_id, i)
            params = self._sampling_of(group_id, i)
            if self.rollouts is not None:
                request = self.rollouts.request(rid, problem, prompt_ids, params)
            else:
                request = GenerationRequest(rid, list(prompt_ids), params)
            self.engine.add_request(request)
        self.in_flight += self.group_size
        return True

    def _sampling_of(self, group_id: str, attempt: int) -> SamplingParams:
        if self.lockstep is None:
            return self.sampling
        return self.lockstep.sampling_of(self.sampling, group_id, attempt)

    def _new_group_id(self) -> str:
        self._next_group += 1
        return format_group_id(self.actor_id, self.restart, self._next_group - 1)

    def _skip_long_prompt(self, problem: Problem, n_tokens: int) -> None:
        self.stats.skip("prompt_too_long", problem.problem_id)
        if self.stats.skipped["prompt_too_long"] == 1:
            log.warning(
                "prompt %s is too long: %d tokens, at most %d fit (engine.max_seq_len=%d - "
                "engine.max_new_tokens=%d). It and every other such prompt are skipped and "
                "counted (skipped_prompt_too_long); raise engine.max_seq_len or lower "
                "engine.max_new_tokens to train on them.",
                problem.problem_id, n_tokens, self.max_prompt_tokens,
                self.cfg.engine.max_seq_len, self.cfg.engine.max_new_tokens,
            )

    def _log_skips(self) -> None:
        for reason, ids in self.stats.skipped_ids.items():
            log.warning("skipped %d %s, problem ids (up to %d): %s", self.stats.skipped[reason],
                        reason, MAX_SKIPPED_IDS, sorted(ids))

    def on_finished(self, out: GenerationOutput) -> None:
        """A sequence finished, or, in a multi-turn rollout, a turn."""
        self.stats.generated_tokens += len(out.token_ids)
        if self.endpoint is not None and self.endpoint.finish(out):
            self.in_flight -= 1
        elif self.rollouts is None:
            self.on_rollout_end(out)
        elif (transcript := self.rollouts.on_turn(out, self.stats.decode_steps)) is not None:
            self.on_rollout_end(transcript)

    def on_rollout_end(self, out: GenerationOutput | Transcript) -> None:
        self.in_flight -= 1
        pending = self._groups[group_key(out.request_id)]
        group = self.collector.add(out, pending.problem, self.group_size)
        if group is None:
            return
        if group.failure is not None:
            del self._groups[group.key]
            self._drop(pending, group.failure)
            return
        pending.outputs = group.attempts  # held, with its place, until its scores are in
        if self.lockstep is not None:
            self.lockstep.expect_scores(group.key, self.stats.decode_steps)

    def publish(self, scored: Scored) -> None:
        pending = self._groups.pop(scored.key)
        if scored.scores is None:
            self._drop(pending, scored.reason)
            return
        self.stats.outcomes.update(score.outcome for score in scored.scores if score.outcome)
        samples = [to_sample(out, score, scored.key, self.actor_id)
                   for out, score in zip(pending.outputs, scored.scores)]
        self._publish_samples(scored.key, pending, samples)

    def on_episodes(self, finished: FinishedGroup) -> None:
        """A group of an environment's episodes came back, scored, or dropped."""
        pending = self._groups.pop(finished.group_id)  # its tokens were counted as served
        if finished.samples is None:
            self._drop(pending, finished.reason)
            return
        self._publish_samples(finished.group_id, pending, finished.samples)

    def _drop(self, pending: _PendingGroup, reason: str) -> None:
        # The group's baseline needs every attempt: drop the whole group, counted; its place
        # goes back, so a replacement keeps the trainer's batches whole.
        self.stats.skip(reason, pending.problem.problem_id)
        self.streams.ledger.set(self.actor_id, self.claimed())

    def _publish_samples(self, group_id: str, pending: _PendingGroup, samples: list[Sample]
                         ) -> None:
        loss = self.cfg.trainer.loss  # how the trainer's advantages read rewards
        if self.cfg.actor.drop_zero_variance and zero_variance(samples, loss.truncated,
                                                               loss.truncated_reward):
            # Every advantage would be 0, so no gradient: dropped like a failed verification.
            self._drop(pending, "zero_variance")
            return
        if self.lockstep is not None and not self.lockstep.trains(self.published + 1):
            return
        self.stats.groups_published += 1
        self.published += 1
        group = Group(
            group_id=group_id,
            prompt=pending.problem.prompt,
            samples=samples,
            actor_id=self.actor_id,
            actor_stats=self.snapshot(),
            attempt=self.cfg.attempt,
            seq=self.published,
            data_pos=self.data_pos(),
        )
        self.streams.writer.write(group.to_dict())
        self._last_write = time.monotonic()
        if self.lockstep is not None:
            self.lockstep.on_published(group)  # before the next group: the version due lands


def open_endpoint(cfg: Config, actor_id: int, tokenizer: PreTrainedTokenizerBase,
                  eos_token_ids: tuple[int, ...], required: bool = False
                  ) -> GenerateEndpoint | None:
    """The actor's generate endpoint (actor.endpoint_port; actor i on port + i; a free port
    when unset but `required`), stopping at the model's `eos_token_ids` unless a request
    says otherwise, its URL in <run_dir>/endpoints/actor_<i> for clients to find while it
    serves (a restarted actor's replaces it); None when not asked for."""
    if cfg.actor.endpoint_port is None and not required:
        return None
    from pipelinerl.rollouts.endpoint import (
        GenerateEndpoint,  # aiohttp: see the imports above
    )

    port = cfg.actor.endpoint_port + actor_id if cfg.actor.endpoint_port else 0
    # vLLM crashes on a request's own seed once an update clears its cache (docs/vllm.md, 6).
    vllm_recomputes = cfg.engine.backend == "vllm" and cfg.engine.recompute_kv_on_update
    endpoint = GenerateEndpoint(model=cfg.model.path, max_model_len=cfg.engine.max_seq_len,
                                vocab_size=len(tokenizer), default_max_tokens=cfg.engine.max_new_tokens,
                                eos_token_ids=eos_token_ids, tokenizer=tokenizer,
                                refused={"seed"} if vllm_recomputes else (),
                                url_file=cfg.run_dir / "endpoints" / f"actor_{actor_id}", port=port)
    log.info("actor %d serves its engine's generate endpoint at %s", actor_id, endpoint.url)
    return endpoint


def to_sample(out: GenerationOutput | Transcript, score: Score, group_id: str, actor_id: int
              ) -> Sample:
    multi_turn = isinstance(out, Transcript)
    return Sample(
        prompt_ids=out.prompt_ids,
        token_ids=out.token_ids,
        logprobs=out.logprobs,
        versions=out.versions,
        reward=score.reward + (out.turn_reward if multi_turn else 0.0),
        success=score.success,
        finish_reason=out.finish_reason,
        group_id=group_id,
        actor_id=actor_id,
        model_mask=out.model_mask if multi_turn else None,
        turns=out.model_turns if multi_turn else 1,
        tool_calls=list(out.tool_calls) if multi_turn and out.tool_calls else None,
    )


def run_actor(cfg: Config, actor_id: int) -> None:
    """Actor process `actor_id` of the run: build it, run it until the trainer stops, close."""
    _check_actor_id(cfg, actor_id)
    torch.set_num_threads(cfg.actor.threads)
    if cfg.deterministic.enabled:
        use_deterministic_torch()
    task = _train_task(cfg, actor_id)
    codec, tokenizer = text_codec(cfg, cfg.model.path)
    if cfg.tools.enabled:  # the task's rollouts call tools (docs/tools.md)
        task, codec = equip(cfg, task, codec, tokenizer, f"actor{actor_id}", cfg.run_dir)
    control = Control(open_control_reader(cfg), cfg.attempt)
    writer, ledger = open_rollout_writer(cfg, actor_id), open_admission_ledger(cfg)
    # A deterministic actor continues its snapshot, if any (`_resume_deterministic`), never
    # its predecessor's last record: what that process did after the snapshot is superseded.
    predecessor = None if cfg.deterministic.enabled else predecessor_record(writer, actor_id)
    restart = next_restart(predecessor)
    # The engine samples with a seed of its own process too, not its predecessor's.
    engine = make_engine(cfg.engine, cfg.model.path, seed=process_seed(cfg.seed, actor_id, restart))
    if predecessor is not None:
        log.info("actor %d continues after %d groups its earlier process published; its "
                 "groups in flight then are generated again", actor_id, predecessor["seq"])
    receiver = open_weight_receiver(cfg, actor_id, restarted=predecessor is not None)
    streams = Streams(writer, receiver, ledger, should_stop=_stop_check(control),
                      returned=control.returned_total)
    endpoint, episodes = _endpoint_and_episodes(cfg, actor_id, task, tokenizer, codec.stop_ids)
    actor = Actor(cfg, engine, task, codec, streams, actor_id=actor_id, predecessor=predecessor,
                  endpoint=endpoint, episodes=episodes)
    try:
        actor.run(resume=snapshot_to_resume(cfg, actor_id))
    finally:
        streams.close()
        control.close()


def _check_actor_id(cfg: Config, actor_id: int) -> None:
    if not 0 <= actor_id < cfg.actor.num_actors:
        # Receiver id num_actors is the evaluator's: an actor there would take its place.
        raise ValueError(f"--actor-id {actor_id} is outside [0, actor.num_actors="
                         f"{cfg.actor.num_actors})")


def _stop_check(control: Control) -> Callable[[], bool]:
    """Whether the trainer wrote its stop record. The control stream (which also counts the
    groups the trainer dropped) is read a few times a second."""
    last_check = 0.0

    def should_stop() -> bool:
        nonlocal last_check
        now = time.monotonic()
        if now - last_check > 0.25:
            last_check = now
            control.poll()
        return control.stop is not None

    return should_stop


def _train_task(cfg: Config, actor_id: int) -> Task:
    task = make_train_task(cfg.task.name, cfg.task.params, cfg.task.heldout_frac)
    if hasattr(task, "shard"):  # a dataset: each actor reads its own positions
        task.shard(actor_id, cfg.actor.num_actors)
    return task


def _endpoint_and_episodes(cfg: Config, actor_id: int, task: Task,
                           tokenizer: PreTrainedTokenizerBase, stop_ids: tuple[int, ...]
                           ) -> tuple[GenerateEndpoint | None, EpisodeRunner | None]:
    """The generate endpoint, if asked for; an episodic task's (verifiers) needs one."""
    episodic = getattr(task, "episodic", False)
    endpoint = open_endpoint(cfg, actor_id, tokenizer, stop_ids, required=episodic)
    if not episodic:
        return endpoint, None
    from pipelinerl.envs.verifiers.episodes import (
        open_episodes,  # imports the endpoint's aiohttp
    )

    return endpoint, open_episodes(cfg, task, endpoint, tokenizer, actor_id)
