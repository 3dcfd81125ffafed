"""A verifiers environment as a pipelinerl task: its taskset's tasks are the problems; its
episodes are run and scored by the environment itself (`episodes.EpisodeRunner`).

The held-out set is the env's own evaluation split when `task.params.eval_taskset` names it
(the taskset's params that make it: `{split: test}`, `{path: data/test.jsonl}`): training
draws every task of the taskset, evaluation the split's, as the env's author meant.
Otherwise it is the tasks whose key `task.heldout_frac` holds out (`tasks.split`).
"""

from __future__ import annotations

import itertools
import random
from typing import Any

from pipelinerl.envs.verifiers.loading import (PREFIX, TASK_SAMPLE, EnvRefused, data_refusals,
                                               load_env, load_taskset)
from pipelinerl.tasks.base import Problem, Score
from pipelinerl.tasks.split import is_heldout

# pipelinerl's own keys in task.params; the others are the taskset's config.
RESERVED = {
    "env": "the env's config: `id` of a built-in env, a role's overrides",
    "success_threshold": "a reward at or above it counts as solved (default 1.0)",
    "episode_timeout_s": "each agent's deadline in an episode; past it the group is dropped "
                         "(default 300)",
    "max_tasks": "tasks read from the taskset (default 100000; an infinite one stops there)",
    "eval_taskset": "the taskset's params for its evaluation split (e.g. {split: test}), "
                    "the held-out set (default: none; task.heldout_frac holds tasks out)",
}


class VerifiersTask:
    """`verifiers:<taskset id>`; see `pipelinerl.envs.verifiers.loading` for the params."""

    episodic = True  # the actor runs episodes through its generate endpoint, not `score`

    def __init__(self, taskset_id: str, params: dict[str, Any] | None = None) -> None:
        params = dict(params or {})
        env_params = params.pop("env", None) or {}
        eval_params = params.pop("eval_taskset", None)
        for key, value in (("env", env_params), ("eval_taskset", eval_params or {})):
            if not isinstance(value, dict):
                raise ValueError(f"task.params.{key} must be a mapping, not "
                                 f"{type(value).__name__}")
        self.success_threshold = float(params.pop("success_threshold", 1.0))
        self.episode_timeout_s = float(params.pop("episode_timeout_s", 300.0))
        max_tasks = int(params.pop("max_tasks", 100_000))
        if self.episode_timeout_s <= 0 or max_tasks <= 0:
            raise ValueError("task.params.episode_timeout_s and max_tasks must be > 0")
        self.name = f"{PREFIX}{taskset_id}"
        self.env = load_env(taskset_id, params, env_params, self.episode_timeout_s)
        self.tasks = self._read(self.env.taskset, max_tasks, "its taskset")
        self.train_size = len(self.tasks)  # then the evaluation split's tasks, if any
        if eval_params is not None:
            taskset = load_taskset(taskset_id, {**params, **eval_params}, env_params,
                                   self.episode_timeout_s)
            eval_tasks = self._read(taskset, max_tasks, "its evaluation split")
            if reasons := data_refusals(eval_tasks[:TASK_SAMPLE]):
                raise EnvRefused(f"its evaluation split cannot run here: {'; '.join(reasons)}")
            self.tasks += eval_tasks

    def _read(self, taskset: Any, max_tasks: int, what: str) -> list[Any]:
        try:
            tasks = list(itertools.islice(taskset, max_tasks))
        except Exception as e:  # noqa: BLE001 - a user's Taskset.load may raise anything
            raise ValueError(f"loading {what}'s tasks raised {type(e).__name__}: {e}") from e
        if not tasks:
            raise ValueError(f"{what} has no tasks")
        return tasks

    @property
    def has_test_split(self) -> bool:
        """The env's own evaluation split is the held-out set (training keeps every task)."""
        return len(self.tasks) > self.train_size

    def problem(self, index: int) -> Problem:
        data = self.tasks[index].data
        prompt = data.prompt if isinstance(data.prompt, str) else str(data.prompt)
        # The key hashes the task's content and place: the same in every process, so the
        # held-out split (tasks.split) is too.
        return Problem(problem_id=self.tasks[index].key, prompt=prompt, answer=index)

    def sample_problem(self, rng: random.Random) -> Problem:
        return self.problem(rng.randrange(self.train_size))

    def heldout_problems(self, n: int, seed: int, heldout_frac: float) -> list[Problem]:
        """At most `n` distinct held-out tasks, in an order fixed by `seed`: the evaluation
        split's, or else those `heldout_frac` holds out."""
        if self.has_test_split:
            pool = [self.problem(i) for i in range(self.train_size, len(self.tasks))]
        else:
            pool = [p for p in map(self.problem, range(self.train_size))
                    if is_heldout(p.problem_id, heldout_frac)]
        if not pool:
            raise ValueError(f"task {self.name!r}: no held-out tasks (name its evaluation split, "
                             "task.params.eval_taskset, or raise task.heldout_frac)")
        random.Random(f"heldout-{seed}").shuffle(pool)
        return pool[:n]

    def vf_task(self, problem: Problem) -> Any:
        return self.tasks[problem.answer]

    def success(self, reward: float) -> bool:
        return reward >= self.success_threshold

    def score(self, problem: Problem, completion: str) -> Score:
        raise TypeError(f"task {self.name!r} is a verifiers environment: its episodes are "
                        "scored by the environment, not from a completion")
