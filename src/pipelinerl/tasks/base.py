"""The task interface: where prompts come from and how completions are verified."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Protocol


def require_int(name: str, value: object, low: int = 1) -> None:
    """A task parameter that must be an integer >= `low` (a bool is not one): a ValueError
    naming it otherwise."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True)
class Problem:
    problem_id: str
    prompt: str  # text fed to the tokenizer as is
    answer: Any  # whatever the verifier needs (JSON-serialisable)


@dataclass(frozen=True)
class Score:
    reward: float
    success: bool
    # Why it scored so, where a task says (the code task: passed, wrong_answer, timeout, ...).
    outcome: str = ""


class Task(Protocol):
    name: str

    def sample_problem(self, rng: random.Random) -> Problem:
        """Draw the next training problem."""
        ...

    def score(self, problem: Problem, completion: str) -> Score:
        """Verify a completion (decoded text, stop token removed). May raise on bad input."""
        ...
