"""Tasks: where prompts come from and how completions are scored. `make_task` builds one from
`task.name`: a built-in name, an entry point of group `pipelinerl.tasks` (an installed
package's task), or an import path `module:Class` (a module in the working directory, on
PYTHONPATH or installed). docs/tasks.md has the protocol."""

from __future__ import annotations

import inspect
import random
from importlib.metadata import entry_points
from typing import Any, Protocol

from pipelinerl.proc.plugins import TASK_PREFIXES, import_object
from pipelinerl.tasks.arithmetic import ChainArithmeticTask
from pipelinerl.tasks.base import Problem, Score, Task
from pipelinerl.tasks.calculator import CalculatorTask
from pipelinerl.tasks.code import CodeTask
from pipelinerl.tasks.code_tool import CodeToolTask
from pipelinerl.tasks.countdown import CountdownTask
from pipelinerl.tasks.dataset import DatasetTask
from pipelinerl.tasks.environment import check_environment, is_environment
from pipelinerl.tasks.math import MathTask
from pipelinerl.tasks.numbers import NumbersTask
from pipelinerl.tasks.progression import ProgressionTask
from pipelinerl.tasks.reasoning import ReasoningGymTask
from pipelinerl.tasks.split import TrainSplit, heldout_problems

TASKS: dict[str, type] = {
    "arithmetic": ChainArithmeticTask,
    "calculator": CalculatorTask,
    "code": CodeTask,
    "code_tool": CodeToolTask,
    "countdown": CountdownTask,
    "dataset": DatasetTask,
    "math": MathTask,
    "numbers": NumbersTask,
    "progression": ProgressionTask,
    "reasoning_gym": ReasoningGymTask,
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


ENTRY_POINT_GROUP = "pipelinerl.tasks"


def task_class(name: str) -> Any:
    """What `task.name` names: a class (or any callable) that builds the task from its params."""
    if name in TASKS:
        return TASKS[name]
    if ":" in name:
        return _import_path(name)
    installed = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    if name in installed:
        try:
            return installed[name].load()
        except Exception as e:  # noqa: BLE001 - whatever the package's import raises
            raise ValueError(f"task {name!r}: loading entry point {installed[name].value!r} "
                             f"raised {type(e).__name__}: {e}") from e
    raise ValueError(
        f"unknown task {name!r}: not built in {sorted(TASKS)}, not an installed entry point of "
        f"group {ENTRY_POINT_GROUP!r} {sorted(installed)}, and not an import path "
        "'module:Class'"
    )


def _import_path(name: str) -> Any:
    obj = import_object(name, f"task {name!r}")
    if not callable(obj):
        raise ValueError(f"task {name!r}: {name.partition(':')[2]!r} is a {type(obj).__name__}, "
                         "not a class")
    return obj


def check_task(task: Any, name: str) -> None:
    """Refuse an object that does not have what the roles call on a task."""
    what = [f"method {m}()" for m in ("sample_problem", "score")
            if not callable(getattr(task, m, None))]
    if not isinstance(getattr(task, "name", None), str):
        what.append("a str attribute `name`")
    if what:
        raise ValueError(f"task {name!r}: {type(task).__name__} is not a Task: it lacks "
                         f"{', '.join(what)} (docs/tasks.md)")
    if is_environment(task):
        try:
            check_environment(task)
        except TypeError as e:
            raise ValueError(f"task {name!r}: {e} (docs/environments.md)") from None


def make_task(name: str, params: dict[str, Any] | None = None) -> Task:
    """Build the task `name` names (see `task_class`); an unknown name, an import that fails,
    unknown or missing params and bad values fail with the task and the param named."""
    prefix = next((p for p in TASK_PREFIXES if name.startswith(p)), None)
    if prefix is not None:
        task = _environment_task(name, prefix, dict(params or {}))
        check_task(task, name)
        return task
    cls = task_class(name)
    params = dict(params or {})
    sig = inspect.signature(cls)
    named = {n: p for n, p in sig.parameters.items()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    unknown = sorted(set(params) - set(named))
    if unknown and not takes_any:
        raise ValueError(
            f"task {name!r}: unknown param(s) {unknown}; accepted: {sorted(named)}"
        )
    missing = [n for n, p in named.items() if p.default is p.empty and n not in params]
    if missing:
        raise ValueError(f"task {name!r}: missing required param(s) {missing}")
    try:
        task = cls(**params)
    except (ValueError, TypeError) as e:
        raise ValueError(f"task {name!r}: invalid params: {e}") from e
    except Exception as e:  # noqa: BLE001 - a user's constructor may raise anything
        raise ValueError(f"task {name!r}: building it raised {type(e).__name__}: {e}") from e
    check_task(task, name)
    return task


def _environment_task(name: str, prefix: str, params: dict[str, Any]) -> Task:
    """`<prefix><id>`: an environment written for another library (`plugins.TASK_PREFIXES`;
    `verifiers:<taskset id>`, docs/environments.md)."""
    env_id = name[len(prefix):]
    if not env_id:
        raise ValueError(f"task {name!r}: name the environment, {prefix}<id>")
    build = import_object(TASK_PREFIXES[prefix], f"task {name!r}")
    try:
        return build(env_id, params)
    except (ValueError, TypeError) as e:
        raise ValueError(f"task {name!r}: {e}") from e


def make_train_task(name: str, params: dict[str, Any] | None, heldout_frac: float) -> Task:
    """The task as training sees it: without its held-out part (`tasks.split`; a dataset
    with a test split holds it apart itself)."""
    task = make_task(name, params)
    if heldout_frac > 0 and not getattr(task, "has_test_split", False):
        return TrainSplit(task, heldout_frac)
    return task


__all__ = [
    "TASKS",
    "ChainArithmeticTask",
    "CodeTask",
    "CodeToolTask",
    "CountdownTask",
    "DatasetTask",
    "DemonstrationTask",
    "MathTask",
    "NumbersTask",
    "ProgressionTask",
    "ReasoningGymTask",
    "Problem",
    "Score",
    "Task",
    "TrainSplit",
    "check_task",
    "heldout_problems",
    "make_task",
    "make_train_task",
    "task_class",
]
