"""The held-out split: a fixed part of a task's problems that training never sees.

A problem is held out when a hash of its id, read as a number in [0, 1), falls below
`task.heldout_frac`. The rule needs no list of problems, so it holds for synthetic tasks
with unbounded problem spaces as for datasets, for any number of evaluated problems and any
evaluation seed, in every process (blake2b, not Python's per-process salted `hash`).
Training (the RL actors and the warm-start) draws from `TrainSplit`, which redraws a held-out
problem; evaluation draws i.i.d. from the held-out part with its own seed (`heldout_problems`).
Before this split, a third of 500 arithmetic evaluation problems also occurred among 8,000
training prompts: short chains form a small problem space.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from pipelinerl.tasks.base import Problem, Score, Task

# Redraws in a row before giving up: the split (or the task) leaves nothing to draw.
MAX_REDRAWS = 10_000


def heldout_fraction_of(problem_id: str) -> float:
    """The problem's place in [0, 1): held out iff below the held-out fraction."""
    digest = hashlib.blake2b(problem_id.encode(), digest_size=8, person=b"plrl-heldout").digest()
    return int.from_bytes(digest, "big") / 2**64


def is_heldout(problem_id: str, heldout_frac: float) -> bool:
    return heldout_fraction_of(problem_id) < heldout_frac


class TrainSplit:
    """`task` without its held-out problems: `sample_problem` redraws them. Every other
    attribute (score, demonstration, alphabet, ...) is the task's own."""

    def __init__(self, task: Task, heldout_frac: float) -> None:
        self.task = task
        self.heldout_frac = heldout_frac

    def sample_problem(self, rng: random.Random) -> Problem:
        for _ in range(MAX_REDRAWS):
            problem = self.task.sample_problem(rng)
            if not is_heldout(problem.problem_id, self.heldout_frac):
                return problem
        raise RuntimeError(
            f"task {self.task.name!r}: {MAX_REDRAWS} draws in a row were all held out "
            f"(task.heldout_frac={self.heldout_frac}); lower task.heldout_frac"
        )

    def score(self, problem: Problem, completion: str) -> Score:
        return self.task.score(problem, completion)

    def params(self) -> dict[str, Any]:
        """The task's params and the split: both decide what the warm-start trains on."""
        own = self.task.params() if hasattr(self.task, "params") else {}  # a user's may lack it
        return {**own, "heldout_frac": self.heldout_frac}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "task":  # pickling looks these up before __init__
            raise AttributeError(name)
        return getattr(self.task, name)


def heldout_problems(task: Task, n: int, seed: int, heldout_frac: float) -> list[Problem]:
    """`n` problems drawn i.i.d. from the task's held-out part (repeats possible, as in the
    task's own distribution), the same for every process given the same seed."""
    if hasattr(task, "heldout_problems"):  # a task that holds its own (a dataset's test split)
        return task.heldout_problems(n, seed, heldout_frac)
    if heldout_frac <= 0:
        raise ValueError("task.heldout_frac is 0: the task has no held-out problems to evaluate")
    rng = random.Random(f"heldout-{seed}")
    problems: list[Problem] = []
    misses = 0
    while len(problems) < n:
        problem = task.sample_problem(rng)
        if is_heldout(problem.problem_id, heldout_frac):
            problems.append(problem)
            misses = 0
            continue
        misses += 1
        if misses == MAX_REDRAWS:
            raise RuntimeError(
                f"task {task.name!r}: {MAX_REDRAWS} draws in a row were none held out "
                f"(task.heldout_frac={heldout_frac}); raise task.heldout_frac"
            )
    return problems
