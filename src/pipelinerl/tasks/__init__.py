"""Tasks: where prompts come from and how completions are scored. `make_task` is the registry."""

from __future__ import annotations

import inspect
import random
from typing import Any, Protocol

from pipelinerl.tasks.arithmetic import ChainArithmeticTask
from pipelinerl.tasks.base import Problem, Score, Task
from pipelinerl.tasks.math import MathTask
from pipelinerl.tasks.split import TrainSplit, heldout_problems

TASKS: dict[str, type] = {
    "arithmetic": ChainArithmeticTask,
    "math": MathTask,
}


class DemonstrationTask(Task, Protocol):
    """A task that can also write (noisy) worked solutions: what the warm-start trains on."""

    alphabet: str  # every character prompts and demonstrations use (for char tokenizers)

    def params(self) -> dict[str, Any]:
        """Everything that determines the problem distribution (for cache keys)."""
        ...

    def demonstration(
        self, problem: Problem, rng: random.Random, step_error_prob: float
    ) -> str: ...


def make_task(name: str, params: dict[str, Any] | None = None) -> Task:
    """Build a registered task; unknown names, unknown or missing params and bad values fail
    with the task and the param named."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {sorted(TASKS)}")
    cls = TASKS[name]
    params = dict(params or {})
    sig = inspect.signature(cls)
    unknown = sorted(set(params) - set(sig.parameters))
    if unknown:
        raise ValueError(
            f"task {name!r}: unknown param(s) {unknown}; accepted: {sorted(sig.parameters)}"
        )
    missing = [
        p.name for p in sig.parameters.values() if p.default is p.empty and p.name not in params
    ]
    if missing:
        raise ValueError(f"task {name!r}: missing required param(s) {missing}")
    try:
        return cls(**params)
    except (ValueError, TypeError) as e:
        raise ValueError(f"task {name!r}: invalid params: {e}") from e


def make_train_task(name: str, params: dict[str, Any] | None, heldout_frac: float) -> Task:
    """The task as training sees it: without its held-out part (`tasks.split`)."""
    task = make_task(name, params)
    return TrainSplit(task, heldout_frac) if heldout_frac > 0 else task


__all__ = [
    "TASKS",
    "ChainArithmeticTask",
    "DemonstrationTask",
    "MathTask",
    "Problem",
    "Score",
    "Task",
    "TrainSplit",
    "heldout_problems",
    "make_task",
    "make_train_task",
]
