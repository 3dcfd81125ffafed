"""Short number questions in plain English for small instruct models: addition and "which is
larger". The starting point RL needs on a 135M model (SmolLM2-135M-Instruct answers about a
quarter of them at temperature 1, more greedily: docs/models.md), verifiable exactly.

Prompt: ``What is 7 + 5? Answer with just the number.`` or ``Which number is larger, 47 or 38?
Answer with just the number.`` A completion succeeds when every number it writes is the answer
("8", "The answer is 8.") in at most `max_answer_words` words. Both rules close a way to earn
reward without answering, each seen in a run: reading only the last number, SmolLM2 learned
to write "87 is indeed 95" (the first number given, then the larger); without a length
limit, a long ramble ending on a lucky number would count (a truncated completion fails too,
through `trainer.loss.truncated`). Problem ids are the
questions themselves, so a held-out question (tasks.split) is never asked in training.
"""

from __future__ import annotations

import random
import re

from pipelinerl.tasks.base import Problem, Score, require_int

KINDS = ("add", "compare")
SUFFIX = " Answer with just the number."
_NUMBER = re.compile(r"-?\d+")


class NumbersTask:
    name = "numbers"

    def __init__(self, kinds: list[str] | tuple[str, ...] = KINDS, max_addend: int = 9,
                 max_compared: int = 99, max_answer_words: int = 12) -> None:
        unknown = [k for k in kinds if k not in KINDS]
        if not kinds or unknown:
            raise ValueError(f"kinds must be a non-empty list of {list(KINDS)}, got {kinds!r}")
        for param, value, low in (("max_addend", max_addend, 1),
                                  ("max_compared", max_compared, 2),
                                  ("max_answer_words", max_answer_words, 1)):
            require_int(param, value, low)
        self.kinds = list(kinds)
        self.max_addend, self.max_compared = max_addend, max_compared
        self.max_answer_words = max_answer_words

    def sample_problem(self, rng: random.Random) -> Problem:
        if rng.choice(self.kinds) == "add":
            a, b = rng.randint(0, self.max_addend), rng.randint(0, self.max_addend)
            question, answer = f"What is {a} + {b}?", a + b
        else:
            a, b = rng.sample(range(1, self.max_compared + 1), 2)
            question, answer = f"Which number is larger, {a} or {b}?", max(a, b)
        return Problem(problem_id=f"numbers:{question}", prompt=question + SUFFIX, answer=answer)

    def score(self, problem: Problem, completion: str) -> Score:
        numbers = _NUMBER.findall(completion)
        ok = (bool(numbers) and len(completion.split()) <= self.max_answer_words
              and all(int(n) == int(problem.answer) for n in numbers))
        return Score(reward=1.0 if ok else 0.0, success=ok)
