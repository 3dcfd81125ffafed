"""The actor role: keeps the engine full, groups attempts, scores them, publishes groups.

Loop (paper, "Actor"): load new weights if the trainer published some (between two decode
steps), top the engine up with new prompt groups while the staleness bound allows, publish the
groups whose scores came back, run one decode step, and hand the groups whose attempts have
all finished to the scorer (worker processes: verification never stops decoding).
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from pipelinerl.admission import Ledger, MemoryLedger
from pipelinerl.engine.base import Engine
from pipelinerl.envs.rollout import Rollouts, Transcript
from pipelinerl.generation import sampling_from_config
from pipelinerl.rl.advantages import Truncated, zero_variance
from pipelinerl.scoring import Scored, Scorer
from pipelinerl.streams.base import StreamWriter
from pipelinerl.sync.base import WeightReceiver
from pipelinerl.tasks.base import Problem, Score, Task
from pipelinerl.tasks.environment import is_environment
from pipelinerl.types import (
    HEARTBEAT_S,
    GenerationOutput,
    GenerationRequest,
    Group,
    Sample,
    SamplingParams,
)

if TYPE_CHECKING:  # aiohttp and verifiers are imported only by an actor that uses them
    from transformers import PreTrainedTokenizerBase

    from pipelinerl.endpoint import GenerateEndpoint
    from pipelinerl.envs.verifiers.episodes import EpisodeRunner, FinishedGroup

log = logging.getLogger(__name__)

MAX_SKIPPED_IDS = 100  # problem ids kept per skip reason (the counts are complete)
MAX_LONG_PROMPTS_IN_A_ROW = 1000  # draws that all fail to fit: the data or config is wrong


@dataclass(frozen=True)
class Schedule:
    """Which groups the actors may start, given the weights an actor holds: exact quotas.

    Groups hold places, numbered from 0 over the whole run (pipelinerl.admission's ledger
    counts them over every actor). With K = batch_size // group_size groups per optimizer
    step, the group in place g is expected to be trained at step g // K, so started under
    weights of version v its first token has lag g // K - v. (The trainer takes groups in
    arrival order: a group whose generation runs long is trained later, and dropped by the
    trainer's filter if that makes it too stale.)
    - pipeline: start a group in place g only if g // K - v <= max_lag: exactly the groups of
      steps up to v + max_lag are admitted, whatever each actor's pace.
    - conventional: with the frozen weights of round r = v // C (C = conventional_g), start
      exactly the groups of round r's C steps, then wait for the trainer's C steps.
    A group an actor drops itself (failed verification, zero reward variance with
    actor.drop_zero_variance) or the trainer drops (stale, malformed: it sends the count on the
    control stream) gives its place back, and a later group takes it: batches stay whole.
    """

    batch_size: int
    group_size: int
    max_lag: int
    conventional_g: int = 0  # 0: pipeline mode

    def limit(self, version: int) -> int:
        """Places below this may be in use while an actor holds weights of `version`."""
        per_step = self.batch_size // self.group_size
        if self.conventional_g:
            return (version // self.conventional_g + 1) * self.conventional_g * per_step
        return (version + self.max_lag + 1) * per_step

    def may_start(self, place: int, version: int) -> bool:
        return place < self.limit(version)


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

    def skip(self, reason: str, problem_id: str) -> None:
        self.skipped[reason] += 1
        if len(self.skipped_ids[reason]) < MAX_SKIPPED_IDS:
            self.skipped_ids[reason].add(problem_id)

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
        }


class Actor:
    def __init__(
        self,
        *,
        engine: Engine,
        task: Task,
        encode: Callable[[str], list[int]],
        decode: Callable[[list[int]], str],
        sampling: SamplingParams,
        schedule: Schedule,
        writer: StreamWriter,
        receiver: WeightReceiver | None,
        should_stop: Callable[[], bool],
        max_seq_len: int,
        actor_id: int = 0,
        seed: int = 0,
        verifier_timeout_s: float = 10.0,
        verifier_workers: int = 2,
        drop_zero_variance: bool = False,
        truncated: Truncated = "keep",
        truncated_reward: float = 0.0,
        ledger: Ledger | None = None,
        returned: Callable[[], int] = lambda: 0,
        predecessor: dict[str, Any] | None = None,
        attempt: int = 0,
        encode_text: Callable[[str], list[int]] | None = None,
        env_timeout_s: float = 10.0,
        env_workers: int = 2,
        endpoint: GenerateEndpoint | None = None,
        episodes: EpisodeRunner | None = None,
    ) -> None:
        """`ledger`: the run's admission ledger (None: this actor alone, in memory).
        `returned`: how many published groups the trainer dropped, over every actor (the
        control stream's count). `predecessor`: the newest record an earlier process of this
        actor wrote (its stream's last): this one continues its count and waits for the
        trainer's current weights before starting anything. With an environment (a task with
        `respond`, pipelinerl.tasks.environment) rollouts are multi-turn: `encode_text` tokenises its turn
        stops and replies, which it computes in `env_workers` processes under `env_timeout_s`.
        `endpoint`: requests from HTTP clients join the engine's batch too (pipelinerl.endpoint).
        `episodes`: the task is an environment of another library (verifiers), whose
        episodes call the endpoint and are scored by the environment (pipelinerl.envs.verifiers);
        a group then holds its place from its start until its episodes come back."""
        self.engine = engine
        self.task = task
        self.encode = encode
        self.decode = decode
        self.sampling = sampling
        self.group_size = schedule.group_size
        self.schedule = schedule
        self.writer = writer
        self.receiver = receiver
        self.should_stop = should_stop
        self.actor_id = actor_id
        self.max_seq_len = max_seq_len
        self.max_prompt_tokens = max_seq_len - sampling.max_new_tokens
        self.episodes = episodes
        # Episodes are scored by their environment: no verifier processes.
        self.scorer = None if episodes else Scorer(task, verifier_timeout_s, verifier_workers)
        self.rollouts: Rollouts | None = None
        if is_environment(task):
            if encode_text is None:
                raise ValueError(f"task {task.name!r} is an environment: the actor needs encode_text")
            self.rollouts = Rollouts(task, engine, encode_text, decode, sampling, env_timeout_s,
                                     env_workers)
        self.drop_zero_variance = drop_zero_variance
        self.endpoint = endpoint
        # How the trainer's advantages read rewards (trainer.loss.truncated), so that a group
        # is called zero-variance exactly when its advantages will all be 0.
        self.truncated, self.truncated_reward = truncated, truncated_reward
        self.stats = ActorStats()
        self.in_flight = 0  # requests submitted to the engine and not yet finished
        self._groups: dict[str, _PendingGroup] = {}  # started and not yet published or dropped
        self.ledger = ledger if ledger is not None else MemoryLedger()
        self.returned = returned
        self.attempt = attempt
        self.published = 0  # groups published, by earlier processes of this actor too
        self._refused: tuple[int, int, float] | None = None  # (limit, returned, when)
        self._last_write = time.monotonic()  # of a group or a heartbeat
        self._next_group = 0  # for unique group ids
        # Which process of this actor: in the ids of its groups, which are numbered as they
        # start and published as they finish (so a predecessor's last one is not its highest).
        self._generation = next_generation(predecessor)
        # Each process draws its own problems: one seeded like its predecessor would replay
        # the run's first ones after every restart or resume.
        self.rng = random.Random(process_seed(seed, actor_id, self._generation))
        # An actor that continues another (a restart, a resumed run) starts nothing under the
        # starting model's weights: it waits for the trainer's current ones.
        self.needs_weights = predecessor is not None and receiver is not None
        if predecessor is not None:
            self.published = int(predecessor["seq"])
            if predecessor.get("data_pos") is not None:
                self.task.seek(predecessor["data_pos"])
        # This actor's claim: published + started and not yet published (none yet).
        self.ledger.set(actor_id, self.published)

    # -- the loop ---------------------------------------------------------------------------
    def run(self, max_groups: int | None = None) -> None:
        try:
            while not self.should_stop():
                if max_groups is not None and self.stats.groups_published >= max_groups:
                    break
                self.maybe_update_weights()
                for scored in self.scorer.poll() if self.scorer else ():
                    self.publish(scored)
                for finished in self.episodes.poll() if self.episodes else ():
                    self.on_episodes(finished)
                if self.rollouts is not None:
                    for transcript in self.rollouts.poll():
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
        self.writer.write({"heartbeat": True, "actor_id": self.actor_id, "attempt": self.attempt,
                           "version": self.engine.version, "in_flight": self.in_flight,
                           "claimed": self.claimed(), "limit": self.schedule.limit(self.engine.version),
                           "returned": self.returned(), "waiting_for_weights": self.needs_weights,
                           # Episodes between two model calls hold no engine request.
                           "blocked": self.in_flight == 0 and not self._episodes_running(),
                           "seq": self.published,
                           "generation": self._generation, "data_pos": self.data_pos(),
                           "skipped": dict(self.stats.skipped)})

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
        if self.receiver is None:
            return
        if self.receiver.poll() is None:
            return
        t0 = time.monotonic()
        self.engine.receive_weights(self.receiver.receive_into)
        self.needs_weights = False
        pause = time.monotonic() - t0
        self.stats.weight_updates += 1
        self.stats.last_update_pause_s = pause
        self.stats.total_update_pause_s += pause

    def claimed(self) -> int:
        """This actor's places (see pipelinerl.admission)."""
        return self.published + len(self._groups)

    def claim_place(self) -> bool:
        """Take the run's next place if the weights held admit it (Schedule, via the ledger).
        After a refusal, ask again only once the weights or the trainer's drops changed or
        0.1 s passed (another actor may have given a place back), not on every loop."""
        limit, returned = self.schedule.limit(self.engine.version), self.returned()
        refused = self._refused
        if refused is not None and refused[:2] == (limit, returned) and time.monotonic() - refused[2] < 0.1:
            return False
        if self.ledger.claim(self.actor_id, self.claimed() + 1, returned, limit):
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
        if self.needs_weights:
            return
        long_in_a_row = 0
        while self._room_for_a_group() and self.claim_place():
            if self.start_group():
                long_in_a_row = 0
                continue
            self.ledger.set(self.actor_id, self.claimed())  # the place claimed goes back
            long_in_a_row += 1
            if long_in_a_row == MAX_LONG_PROMPTS_IN_A_ROW:
                raise RuntimeError(
                    f"{long_in_a_row} prompts in a row were longer than the "
                    f"{self.max_prompt_tokens} tokens that fit (engine.max_seq_len="
                    f"{self.max_seq_len} - engine.max_new_tokens={self.sampling.max_new_tokens}): "
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
        prompt_ids = self.encode(problem.prompt)
        if len(prompt_ids) > self.max_prompt_tokens:
            self._skip_long_prompt(problem, len(prompt_ids))
            return False
        group_id = self._new_group_id()
        self._groups[group_id] = _PendingGroup(problem, data_pos)
        for i in range(self.group_size):
            request_id = f"{group_id}-{i}"
            if self.rollouts is not None:
                request = self.rollouts.request(request_id, problem, prompt_ids)
            else:
                request = GenerationRequest(request_id, list(prompt_ids), self.sampling)
            self.engine.add_request(request)
        self.in_flight += self.group_size
        return True

    def _new_group_id(self) -> str:
        group_id = f"a{self.actor_id}-g{self._next_group}"
        if self._generation:
            group_id = f"a{self.actor_id}-r{self._generation}-g{self._next_group}"
        self._next_group += 1
        return group_id

    def _skip_long_prompt(self, problem: Problem, n_tokens: int) -> None:
        self.stats.skip("prompt_too_long", problem.problem_id)
        if self.stats.skipped["prompt_too_long"] == 1:
            log.warning(
                "prompt %s is too long: %d tokens, at most %d fit (engine.max_seq_len=%d - "
                "engine.max_new_tokens=%d). It and every other such prompt are skipped and "
                "counted (skipped_prompt_too_long); raise engine.max_seq_len or lower "
                "engine.max_new_tokens to train on them.",
                problem.problem_id, n_tokens, self.max_prompt_tokens, self.max_seq_len,
                self.sampling.max_new_tokens,
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
        elif (transcript := self.rollouts.on_turn(out)) is not None:
            self.on_rollout_end(transcript)

    def on_rollout_end(self, out: GenerationOutput | Transcript) -> None:
        self.in_flight -= 1
        group_id = out.request_id.rsplit("-", 1)[0]
        pending = self._groups[group_id]
        pending.outputs.append(out)
        if len(pending.outputs) < self.group_size:
            return
        failed = [o.finish_reason for o in pending.outputs if o.finish_reason.startswith("env_")]
        if failed:
            # An environment call failed: the group's baseline needs every attempt.
            del self._groups[group_id]
            self.stats.skip(failed[0], pending.problem.problem_id)
            self.ledger.set(self.actor_id, self.claimed())
            return
        # Still in _groups, holding its place, until its scores are in.
        pending.outputs.sort(key=lambda o: int(o.request_id.rsplit("-", 1)[1]))
        completions = [self.decode(o.completion_ids()) for o in pending.outputs]
        self.scorer.submit(group_id, pending.problem, completions)

    def publish(self, scored: Scored) -> None:
        pending = self._groups.pop(scored.key)
        if scored.scores is None:
            self._drop(pending, scored.reason)
            return
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
        self.ledger.set(self.actor_id, self.claimed())

    def _publish_samples(self, group_id: str, pending: _PendingGroup, samples: list[Sample]
                         ) -> None:
        if self.drop_zero_variance and zero_variance(samples, self.truncated,
                                                     self.truncated_reward):
            # Every advantage would be 0, so no gradient: dropped like a failed verification.
            self._drop(pending, "zero_variance")
            return
        self.stats.groups_published += 1
        self.published += 1
        group = Group(
            group_id=group_id,
            prompt=pending.problem.prompt,
            samples=samples,
            actor_id=self.actor_id,
            actor_stats=self.snapshot(),
            attempt=self.attempt,
            seq=self.published,
            data_pos=self.data_pos(),
        )
        self.writer.write(group.to_dict())
        self._last_write = time.monotonic()


def open_endpoint(cfg: Any, actor_id: int, tokenizer: PreTrainedTokenizerBase,
                  eos_token_ids: tuple[int, ...], required: bool = False
                  ) -> GenerateEndpoint | None:
    """The actor's generate endpoint (actor.endpoint_port; actor i on port + i; a free port
    when unset but `required`), stopping at the model's `eos_token_ids` unless a request
    says otherwise, its URL in <run_dir>/endpoints/actor_<i> for clients to find while it
    serves (a restarted actor's replaces it); None when not asked for."""
    if cfg.actor.endpoint_port is None and not required:
        return None
    from pipelinerl.endpoint import GenerateEndpoint

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


def next_generation(predecessor: dict[str, Any] | None) -> int:
    """The process number of an actor whose predecessor wrote `predecessor` last (0: none)."""
    if predecessor is None:
        return 0
    last = (predecessor["generation"] if predecessor.get("heartbeat")
            else generation(predecessor["group_id"]))
    return last + 1


def process_seed(seed: int, actor_id: int, generation: int) -> int:
    """A seed per run seed, actor and process of that actor (generation < 1_000_003)."""
    return (seed * 1000 + actor_id) * 1_000_003 + generation


def generation(group_id: str) -> int:
    """The actor process that started a group: 0 for `a<actor>-g<n>`, r for `a<actor>-r<r>-g<n>`."""
    parts = group_id.split("-")
    return int(parts[1][1:]) if len(parts) == 3 and parts[1].startswith("r") else 0


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
    )


def run_actor(cfg: Any, actor_id: int) -> None:
    import torch

    from pipelinerl.engine import make_engine
    from pipelinerl.models.prompts import prompt_format
    from pipelinerl.roles import (
        Control,
        open_admission_ledger,
        open_control_reader,
        open_rollout_writer,
        open_weight_receiver,
    )
    from pipelinerl.streams.base import WriterStateLost
    from pipelinerl.tasks import make_train_task

    if not 0 <= actor_id < cfg.actor.num_actors:
        # Receiver id num_actors is the evaluator's: an actor there would take its place.
        raise ValueError(f"--actor-id {actor_id} is outside [0, actor.num_actors="
                         f"{cfg.actor.num_actors})")
    torch.set_num_threads(cfg.actor.threads)
    encode, stop_ids, tokenizer = prompt_format(cfg, cfg.model.path)
    control = Control(open_control_reader(cfg), cfg.attempt)
    last_check = [0.0]

    def should_stop() -> bool:
        # The trainer writes a stop record when it is done, and the count of this actor's
        # groups it dropped as it goes; read them a few times a second.
        now = time.monotonic()
        if now - last_check[0] > 0.25:
            last_check[0] = now
            control.poll()
        return control.stop is not None

    writer = open_rollout_writer(cfg, actor_id)
    ledger = open_admission_ledger(cfg)
    try:
        predecessor = writer.last_record()  # an earlier process of this actor (restart, resume)
    except WriterStateLost as err:
        raise RuntimeError(f"actor {actor_id} refuses to start: {err}. Without it the actor "
                           "would repeat group ids, under-count its admission claim and "
                           "restart its data") from None
    # The engine samples with a seed of its own process too, not its predecessor's.
    engine = make_engine(cfg.engine, cfg.model.path,
                         seed=process_seed(cfg.seed, actor_id, next_generation(predecessor)))
    if predecessor is not None:
        log.info("actor %d continues after %d groups its earlier process published; its "
                 "groups in flight then are generated again", actor_id, predecessor["seq"])
    receiver = open_weight_receiver(cfg, actor_id, restarted=predecessor is not None)
    mode_g = cfg.conventional_g if cfg.mode == "conventional" else 0
    task = make_train_task(cfg.task.name, cfg.task.params, cfg.task.heldout_frac)
    if hasattr(task, "shard"):  # a dataset: each actor reads its own positions
        task.shard(actor_id, cfg.actor.num_actors)
    episodic = getattr(task, "episodic", False)
    endpoint = open_endpoint(cfg, actor_id, tokenizer, stop_ids, required=episodic)
    episodes = None
    if episodic:
        from pipelinerl.envs.verifiers.episodes import open_episodes

        episodes = open_episodes(cfg, task, endpoint, tokenizer, actor_id)
    actor = Actor(
        engine=engine,
        task=task,
        encode=encode,
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        sampling=sampling_from_config(cfg.engine, stop_ids),
        schedule=Schedule(
            batch_size=cfg.trainer.batch_size,
            group_size=cfg.actor.group_size,
            max_lag=cfg.actor.max_lag,
            conventional_g=mode_g,
        ),
        writer=writer,
        receiver=receiver,
        should_stop=should_stop,
        max_seq_len=cfg.engine.max_seq_len,
        actor_id=actor_id,
        seed=cfg.actor.seed + cfg.seed,
        verifier_timeout_s=cfg.actor.verifier_timeout_s,
        verifier_workers=cfg.actor.verifier_workers,
        drop_zero_variance=cfg.actor.drop_zero_variance,
        truncated=cfg.trainer.loss.truncated,
        truncated_reward=cfg.trainer.loss.truncated_reward,
        ledger=ledger,
        returned=control.returned_total,
        predecessor=predecessor,
        attempt=cfg.attempt,
        encode_text=lambda text: tokenizer.encode(text, add_special_tokens=False),
        env_timeout_s=cfg.actor.env_timeout_s,
        env_workers=cfg.actor.env_workers,
        endpoint=endpoint,
        episodes=episodes,
    )
    try:
        actor.run()
    finally:
        writer.close()
        ledger.close()
        control.close()
        if receiver is not None:
            receiver.close()
