"""The actor role: keeps the engine full, groups attempts, scores them, publishes groups.

Loop (paper, "Actor"): load new weights if the trainer published some (between two decode
steps), top the engine up with new prompt groups while the staleness bound allows, run one
decode step, score and publish the groups whose attempts have all finished.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable

from pipelinerl.engine.base import Engine
from pipelinerl.streams.base import StreamWriter
from pipelinerl.sync.base import WeightReceiver
from pipelinerl.tasks.base import Problem, Score, Task
from pipelinerl.types import GenerationOutput, GenerationRequest, Group, Sample, SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Schedule:
    """Which samples the actor may start, given the weights it holds.

    Sample i (in start order, counted over all actors) is expected to be trained at optimizer
    step i // batch_size. Started under weights of version v, its first token has lag
    i // batch_size - v.
    - pipeline: start it only if that lag is <= max_lag.
    - conventional: with frozen weights of round r = v // G, generate exactly the B*G samples of
      round r, then wait for the trainer's G steps.
    """

    batch_size: int
    max_lag: int
    num_actors: int = 1
    conventional_g: int = 0  # 0: pipeline mode

    def may_start(self, started: int, n: int, version: int) -> bool:
        # Each actor sees only its own count; it assumes the others keep the same pace.
        last_index = (started + n) * self.num_actors - 1
        if self.conventional_g:
            round_size = self.batch_size * self.conventional_g
            return last_index < (version // self.conventional_g + 1) * round_size
        return last_index // self.batch_size - version <= self.max_lag


@dataclass
class _PendingGroup:
    problem: Problem
    outputs: list[GenerationOutput] = field(default_factory=list)


@dataclass
class ActorStats:
    started_at: float = field(default_factory=time.monotonic)
    generated_tokens: int = 0
    idle_s: float = 0.0
    weight_updates: int = 0
    last_update_pause_s: float = 0.0
    total_update_pause_s: float = 0.0
    groups_published: int = 0
    skipped: Counter = field(default_factory=Counter)

    def snapshot(self, version: int) -> dict[str, float]:
        elapsed = max(time.monotonic() - self.started_at, 1e-9)
        return {
            "tokens_per_s": self.generated_tokens / elapsed,
            "idle_frac": self.idle_s / elapsed,
            "weight_updates": self.weight_updates,
            "last_update_pause_s": self.last_update_pause_s,
            "mean_update_pause_s": self.total_update_pause_s / max(self.weight_updates, 1),
            "version": version,
            "groups_published": self.groups_published,
            **{f"skipped_{reason}": count for reason, count in self.skipped.items()},
        }


class Scorer:
    """Runs a task's verifier with a deadline: one that raises or hangs is a counted skip."""

    def __init__(self, task: Task, timeout_s: float) -> None:
        self.task = task
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="verifier")

    def score(self, problem: Problem, completion: str) -> tuple[Score | None, str]:
        future = self._pool.submit(self.task.score, problem, completion)
        try:
            return future.result(timeout=self.timeout_s), ""
        except FutureTimeout:
            # The hung thread cannot be killed; give it up with its pool so later scores run.
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="verifier")
            return None, "verifier_timeout"
        except Exception as exc:  # noqa: BLE001 - any verifier failure is a counted skip
            log.warning("verifier of task %s raised on problem %s: %r",
                        self.task.name, problem.problem_id, exc)
            return None, "verifier_error"

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Actor:
    def __init__(
        self,
        *,
        engine: Engine,
        task: Task,
        encode: Callable[[str], list[int]],
        decode: Callable[[list[int]], str],
        sampling: SamplingParams,
        group_size: int,
        schedule: Schedule,
        writer: StreamWriter,
        receiver: WeightReceiver | None,
        should_stop: Callable[[], bool],
        actor_id: int = 0,
        seed: int = 0,
        verifier_timeout_s: float = 10.0,
    ) -> None:
        self.engine = engine
        self.task = task
        self.encode = encode
        self.decode = decode
        self.sampling = sampling
        self.group_size = group_size
        self.schedule = schedule
        self.writer = writer
        self.receiver = receiver
        self.should_stop = should_stop
        self.actor_id = actor_id
        self.rng = random.Random(seed * 1000 + actor_id)
        self.scorer = Scorer(task, verifier_timeout_s)
        self.stats = ActorStats()
        self.started = 0  # samples started by this actor
        self.in_flight = 0  # requests submitted and not yet finished
        self._groups: dict[str, _PendingGroup] = {}
        self._next_group = 0

    # -- the loop ---------------------------------------------------------------------------
    def run(self, max_groups: int | None = None) -> None:
        try:
            while not self.should_stop():
                if max_groups is not None and self.stats.groups_published >= max_groups:
                    break
                self.maybe_update_weights()
                self.fill()
                if self.in_flight == 0:
                    # Blocked by the staleness bound: wait for the trainer's next weights.
                    t0 = time.monotonic()
                    time.sleep(0.005)
                    self.stats.idle_s += time.monotonic() - t0
                    continue
                for out in self.engine.step():
                    self.on_finished(out)
        finally:
            self.scorer.close()

    def maybe_update_weights(self) -> None:
        if self.receiver is None:
            return
        if self.receiver.poll() is None:
            return
        t0 = time.monotonic()
        version = self.receiver.receive_into(self.engine.named_weights())
        self.engine.set_version(version)
        pause = time.monotonic() - t0
        self.stats.weight_updates += 1
        self.stats.last_update_pause_s = pause
        self.stats.total_update_pause_s += pause

    def fill(self) -> None:
        n = self.group_size
        while self.in_flight + n <= self.engine.capacity and self.schedule.may_start(
            self.started, n, self.engine.version
        ):
            self.start_group()

    def start_group(self) -> None:
        problem = self.task.sample_problem(self.rng)
        group_id = f"a{self.actor_id}-g{self._next_group}"
        self._next_group += 1
        prompt_ids = self.encode(problem.prompt)
        self._groups[group_id] = _PendingGroup(problem)
        for i in range(self.group_size):
            self.engine.add_request(
                GenerationRequest(f"{group_id}-{i}", list(prompt_ids), self.sampling)
            )
        self.started += self.group_size
        self.in_flight += self.group_size

    def on_finished(self, out: GenerationOutput) -> None:
        self.in_flight -= 1
        self.stats.generated_tokens += len(out.token_ids)
        group_id = out.request_id.rsplit("-", 1)[0]
        pending = self._groups[group_id]
        pending.outputs.append(out)
        if len(pending.outputs) == self.group_size:
            del self._groups[group_id]
            self.publish(group_id, pending)

    def publish(self, group_id: str, pending: _PendingGroup) -> None:
        samples = []
        for out in sorted(pending.outputs, key=lambda o: o.request_id):
            completion_ids = out.token_ids
            if out.finish_reason == "stop":
                completion_ids = completion_ids[:-1]
            score, reason = self.scorer.score(pending.problem, self.decode(completion_ids))
            if score is None:
                # The group's baseline needs every attempt: drop the whole group, counted, and
                # give its places back so a replacement keeps the trainer's batches whole.
                self.stats.skipped[reason] += 1
                self.started -= self.group_size
                return
            samples.append(
                Sample(
                    prompt_ids=out.prompt_ids,
                    token_ids=out.token_ids,
                    logprobs=out.logprobs,
                    versions=out.versions,
                    reward=score.reward,
                    success=score.success,
                    finish_reason=out.finish_reason,
                    group_id=group_id,
                    actor_id=self.actor_id,
                )
            )
        self.stats.groups_published += 1
        group = Group(
            group_id=group_id,
            prompt=pending.problem.prompt,
            samples=samples,
            actor_id=self.actor_id,
            actor_stats=self.stats.snapshot(self.engine.version),
        )
        self.writer.write(group.to_dict())


def sampling_from_config(engine_cfg: Any, stop_token_ids: tuple[int, ...]) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=engine_cfg.max_new_tokens,
        temperature=engine_cfg.temperature,
        top_p=engine_cfg.top_p,
        top_k=engine_cfg.top_k,
        stop_token_ids=stop_token_ids,
    )


def run_actor(cfg: Any, actor_id: int) -> None:
    import torch

    from pipelinerl.engine import make_engine
    from pipelinerl.models.hf import load_tokenizer
    from pipelinerl.roles import open_control_reader, open_rollout_writer, open_weight_receiver
    from pipelinerl.tasks import make_task

    torch.set_num_threads(cfg.actor.threads)
    tokenizer = load_tokenizer(cfg.model.path)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer at {cfg.model.path} has no eos token: the engine needs a stop token")
    engine = make_engine(cfg.engine, cfg.model.path, seed=cfg.seed * 1000 + actor_id)
    control = open_control_reader(cfg)
    last_check = [0.0]
    stopped = [False]

    def should_stop() -> bool:
        # The trainer writes one stop record when it is done; check a few times a second.
        now = time.monotonic()
        if now - last_check[0] > 0.25:
            last_check[0] = now
            stopped[0] = stopped[0] or bool(control.read(max_count=1, timeout_s=0.0))
        return stopped[0]

    writer = open_rollout_writer(cfg, actor_id)
    receiver = open_weight_receiver(cfg, actor_id)
    mode_g = cfg.conventional_g if cfg.mode == "conventional" else 0
    actor = Actor(
        engine=engine,
        task=make_task(cfg.task.name, cfg.task.params),
        encode=lambda text: tokenizer.encode(text, add_special_tokens=False),
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        sampling=sampling_from_config(cfg.engine, (tokenizer.eos_token_id,)),
        group_size=cfg.actor.group_size,
        schedule=Schedule(cfg.trainer.batch_size, cfg.actor.max_lag, cfg.actor.num_actors, mode_g),
        writer=writer,
        receiver=receiver,
        should_stop=should_stop,
        actor_id=actor_id,
        seed=cfg.actor.seed + cfg.seed,
        verifier_timeout_s=cfg.actor.verifier_timeout_s,
    )
    try:
        actor.run()
    finally:
        writer.close()
        control.close()
        if receiver is not None:
            receiver.close()
