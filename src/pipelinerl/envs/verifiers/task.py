"""A verifiers environment as a pipelinerl task: its taskset's tasks are the problems; its
episodes are run and scored by the environment itself (`episodes.EpisodeRunner`)."""

from __future__ import annotations

import itertools
import random
from typing import Any

from pipelinerl.envs.verifiers.loading import PREFIX, load_env
from pipelinerl.tasks.base import Problem, Score

# pipelinerl's own keys in task.params; the others are the taskset's config.
RESERVED = {
    "env": "the env's config: `id` of a built-in env, a role's overrides",
    "success_threshold": "a reward at or above it counts as solved (default 1.0)",
    "episode_timeout_s": "each agent's deadline in an episode; past it the group is dropped "
                         "(default 300)",
    "max_tasks": "tasks read from the taskset (default 100000; an infinite one stops there)",
}


class VerifiersTask:
    """`verifiers:<taskset id>`; see `pipelinerl.envs.verifiers.loading` for the params."""

    episodic = True  # the actor runs episodes through its generate endpoint, not `score`

    def __init__(self, taskset_id: str, params: dict[str, Any] | None = None) -> None:
        params = dict(params or {})
        env_params = params.pop("env", None) or {}
        if not isinstance(env_params, dict):
            raise ValueError(f"task.params.env must be a mapping (the env's config), not "
                             f"{type(env_params).__name__}")
        self.success_threshold = float(params.pop("success_threshold", 1.0))
        self.episode_timeout_s = float(params.pop("episode_timeout_s", 300.0))
        max_tasks = int(params.pop("max_tasks", 100_000))
        if self.episode_timeout_s <= 0 or max_tasks <= 0:
            raise ValueError("task.params.episode_timeout_s and max_tasks must be > 0")
        self.name = f"{PREFIX}{taskset_id}"
        self.env = load_env(taskset_id, params, env_params, self.episode_timeout_s)
        try:
            self.tasks = list(itertools.islice(self.env.taskset, max_tasks))
        except Exception as e:  # noqa: BLE001 - a user's Taskset.load may raise anything
            raise ValueError(f"task {self.name!r}: loading its tasks raised "
                             f"{type(e).__name__}: {e}") from e
        if not self.tasks:
            raise ValueError(f"task {self.name!r}: its taskset has no tasks")

    def problem(self, index: int) -> Problem:
        data = self.tasks[index].data
        prompt = data.prompt if isinstance(data.prompt, str) else str(data.prompt)
        # The key hashes the task's content and place: the same in every process, so the
        # held-out split (tasks.split) is too.
        return Problem(problem_id=self.tasks[index].key, prompt=prompt, answer=index)

    def sample_problem(self, rng: random.Random) -> Problem:
        return self.problem(rng.randrange(len(self.tasks)))

    def vf_task(self, problem: Problem) -> Any:
        return self.tasks[problem.answer]

    def success(self, reward: float) -> bool:
        return reward >= self.success_threshold

    def score(self, problem: Problem, completion: str) -> Score:
        raise TypeError(f"task {self.name!r} is a verifiers environment: its episodes are "
                        "scored by the environment, not from a completion")
