"""Environments: tasks whose rollouts are conversations (tool use, multi-turn).

An environment is a task (`pipelinerl.tasks.base.Task`: `sample_problem`, `score`) with
three more members. The model generates until it writes one of `turn_stops` (a tool call's
closing tag), its stop token (EOS) or runs out of budget; on a turn stop the environment's
`respond` answers with text that is tokenised and appended, and the model goes on; the rollout
ends when the model stops by itself, the environment says `done`, or `max_turns` model turns
were made. The reward is `score(problem, transcript)` over the whole transcript (model and
environment text), plus the per-turn rewards of the replies. docs/environments.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from pipelinerl.tasks.base import Problem, Task


@dataclass(frozen=True)
class Turn:
    role: Literal["model", "env"]
    text: str


@dataclass(frozen=True)
class Reply:
    """The environment's answer to a model turn that ended on a turn stop."""

    text: str = ""  # appended after the model's turn (ignored when done)
    done: bool = False  # the rollout ends here
    reward: float = 0.0  # added to the rollout's reward
    # The tool calls this reply answers (pipelinerl.tools: name, arguments, reply, outcome,
    # latency), recorded with the sample.
    calls: tuple[dict[str, Any], ...] = ()


@runtime_checkable
class Environment(Task, Protocol):
    turn_stops: tuple[str, ...]  # texts that end a model turn and hand over to `respond`
    max_turns: int  # model turns at most

    def respond(self, problem: Problem, turns: list[Turn]) -> Reply:
        """Answer the last model turn (`turns[-1]`, ending on a turn stop); `turns` holds the
        whole conversation after the prompt. Runs in a worker process under a deadline; answer
        a malformed call with text the model can read: an exception ends the rollout (its group
        is dropped and counted as skipped_env_error)."""
        ...


def is_environment(task: object) -> bool:
    return callable(getattr(task, "respond", None))


def check_environment(task: object) -> None:
    """Refuse an environment whose protocol members are missing or wrong (at launch)."""
    name = getattr(task, "name", type(task).__name__)
    stops = getattr(task, "turn_stops", None)
    # An environment that answers every turn the model ends with its stop token (tools: the
    # model ends its message, the calls in it are answered) needs no other stops.
    may_be_empty = getattr(task, "respond_on_stop", False)
    if (not isinstance(stops, tuple) or not (stops or may_be_empty)
            or not all(isinstance(s, str) and s for s in stops)):
        raise TypeError(f"environment {name!r}: turn_stops must be a non-empty tuple of non-empty "
                        f"strings, got {stops!r}")
    turns = getattr(task, "max_turns", None)
    if not isinstance(turns, int) or turns < 1:
        raise TypeError(f"environment {name!r}: max_turns must be an int >= 1, got {turns!r}")
