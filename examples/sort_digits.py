"""A task written outside pipelinerl, as a user would write one (docs/tasks.md).

The model sorts the digits of the prompt: `5213=` -> `1235`. Run it from this folder, where
`task.name: sort_digits:SortDigits` finds the module:

    cd examples && pipelinerl train sort_digits.yaml
"""

from __future__ import annotations

import random

from pipelinerl.tasks import Problem, Score

DIGITS = "0123456789"


class SortDigits:
    name = "sort_digits"
    alphabet = DIGITS + "="  # every character of prompts and demonstrations (warm-start)

    def __init__(self, min_len: int = 3, max_len: int = 8) -> None:
        if not 1 <= min_len <= max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got {min_len} and {max_len}")
        self.min_len, self.max_len = min_len, max_len

    def params(self) -> dict:
        """What decides the problems: part of the warm-start's cache key."""
        return {"min_len": self.min_len, "max_len": self.max_len}

    def sample_problem(self, rng: random.Random) -> Problem:
        n = rng.randint(self.min_len, self.max_len)
        digits = "".join(rng.choice(DIGITS) for _ in range(n))
        return Problem(f"sort:{digits}", f"{digits}=", "".join(sorted(digits)))

    def score(self, problem: Problem, completion: str) -> Score:
        solved = completion.strip() == problem.answer
        return Score(reward=float(solved), success=solved)

    def demonstration(self, problem: Problem, rng: random.Random,
                      step_error_prob: float = 0.0) -> str:
        """The sorted digits, each neighbouring pair swapped with probability
        `step_error_prob`: noisy worked answers for the warm-start to imitate."""
        out = list(problem.answer)
        for i in range(len(out) - 1):
            if rng.random() < step_error_prob:
                out[i], out[i + 1] = out[i + 1], out[i]
        return "".join(out)
