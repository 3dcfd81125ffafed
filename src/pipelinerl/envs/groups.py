"""A group's attempts, collected as they finish: the actor and the evaluator score a group whole.

An attempt's request id is `<group key>-<attempt>`. Once a group's last attempt is in, the
group goes to the scorer, unless an environment call of one of its attempts failed
(finish_reason `env_...`, or `tool_...` under `tools.on_error=drop`): then it is dropped, since
its baseline needs every attempt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pipelinerl.envs.rollout import Transcript
from pipelinerl.rollouts.scoring import Scorer
from pipelinerl.tasks.base import Problem
from pipelinerl.types import GenerationOutput

Attempt = GenerationOutput | Transcript  # an engine output, or a multi-turn rollout's transcript


def is_call_failure(finish_reason: str) -> bool:
    """An environment's (or a tool's) call failed and ended the rollout."""
    return finish_reason.startswith(("env_", "tool_"))


def request_id(group_key: str, attempt: int) -> str:
    return f"{group_key}-{attempt}"


def group_key(request_id: str) -> str:
    return request_id.rsplit("-", 1)[0]


def _attempt_index(out: Attempt) -> int:
    return int(out.request_id.rsplit("-", 1)[1])


@dataclass
class Collected:
    """A whole group: its attempts in attempt order; `failure`, the first failed environment
    call's reason (the group was dropped), else None (the group was submitted to the scorer)."""

    key: str
    attempts: list[Attempt]
    failure: str | None


class GroupCollector:
    """Collects each group's finished attempts and hands a whole group to `scorer` (its
    completions decoded by `decode`), or drops it after a failed environment call."""

    def __init__(self, scorer: Scorer, decode: Callable[[list[int]], str]) -> None:
        self.scorer = scorer
        self.decode = decode
        self._attempts: dict[str, list[Attempt]] = {}  # by group key, in order of finishing

    def add(self, out: Attempt, problem: Problem, size: int) -> Collected | None:
        """Collect a finished attempt of `problem`'s group of `size`; the group once whole."""
        key = group_key(out.request_id)
        attempts = self._attempts.setdefault(key, [])
        attempts.append(out)
        if len(attempts) < size:
            return None
        del self._attempts[key]
        failure = next((o.finish_reason for o in attempts if is_call_failure(o.finish_reason)),
                       None)
        attempts.sort(key=_attempt_index)
        if failure is None:
            self.scorer.submit(key, problem, [self.decode(o.completion_ids()) for o in attempts])
        return Collected(key, attempts, failure)
