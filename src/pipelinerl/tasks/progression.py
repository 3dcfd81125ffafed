"""Progressions: add a step to a number until it passes a limit, every step written out. The
long-generation workload of examples/long_chains.yaml.

Prompt ``123+7>150=``; worked completion ``123+7=130,130+7=137,137+7=144,144+7=151;A=151``
(the first sum past the limit). Numbers are zero-padded to the width of `max_value`, so every
step has the same shape and depends only on the step before it (its sum and its operand at
fixed offsets) and on the limit, the one `>` of the prompt: unlike chain arithmetic there is
no term to find by content, which a ~1M-parameter char model does not learn over hundreds of
tokens. A problem of k steps is drawn with weight 1/k (k from 1 to `max_steps`): most answers
are short and a long tail of long ones runs to ~10 x max_steps tokens, the regime PipelineRL
is about. At temperature 1 a warm-started policy slips now and then; a slip anywhere loses the
answer, so long problems are the hard ones.
"""

from __future__ import annotations

import random
import re

from pipelinerl.tasks.base import Problem, Score

ALPHABET = "0123456789+>=,;A"
_FINAL = re.compile(r"(?:^|;)A=(\d{1,9})$")
_PROMPT = re.compile(r"(\d+)\+(\d+)>(\d+)=")


class ProgressionTask:
    name = "progression"
    alphabet = ALPHABET

    def __init__(self, max_steps: int = 60, max_operand: int = 9, max_value: int = 999) -> None:
        for param, value in (("max_steps", max_steps), ("max_operand", max_operand),
                             ("max_value", max_value)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{param} must be a positive integer, got {value!r}")
        if max_operand > 9:
            raise ValueError(f"max_operand must be <= 9 (one digit), got {max_operand}")
        if max_steps * max_operand > max_value:
            raise ValueError(f"max_steps x max_operand ({max_steps * max_operand}) must be <= "
                             f"max_value ({max_value}): the longest progression must fit")
        self.max_steps, self.max_operand, self.max_value = max_steps, max_operand, max_value
        self.width = len(str(max_value))
        self.weights = [1 / k for k in range(1, max_steps + 1)]

    def params(self) -> dict:
        """Everything that determines the problem distribution (used in cache keys)."""
        return {"max_steps": self.max_steps, "max_operand": self.max_operand,
                "max_value": self.max_value}

    def _num(self, value: int) -> str:
        return f"{value:0{self.width}d}"

    def sample_problem(self, rng: random.Random) -> Problem:
        steps = rng.choices(range(1, self.max_steps + 1), weights=self.weights)[0]
        step = rng.randint(1, self.max_operand)
        start = rng.randint(0, self.max_value - steps * step)
        # The limit lies between the (steps - 1)-th sum and the steps-th: exactly `steps` sums.
        limit = rng.randint(start + (steps - 1) * step, start + steps * step - 1)
        prompt = f"{self._num(start)}+{step}>{self._num(limit)}="
        return Problem(problem_id=f"prog:{prompt}", prompt=prompt, answer=start + steps * step)

    def score(self, problem: Problem, completion: str) -> Score:
        m = _FINAL.search(completion.strip())
        ok = m is not None and int(m.group(1)) == int(problem.answer)
        return Score(reward=1.0 if ok else 0.0, success=ok)

    def demonstration(self, problem: Problem, rng: random.Random,
                      step_error_prob: float = 0.0) -> str:
        """The worked progression, each sum off by one (either way) or ten (up: a slip
        down by ten would add up to ten steps) with probability `step_error_prob`; later
        steps continue from the wrong sum, so the answer is wrong (unless slips cancel)."""
        m = _PROMPT.fullmatch(problem.prompt)
        assert m is not None, problem.prompt
        total, step, limit = int(m[1]), int(m[2]), int(m[3])
        steps = []
        while total <= limit and len(steps) < 2 * self.max_steps:
            result = total + step
            slips = [d for d in (-1, 1, 10) if 0 <= result + d <= self.max_value]
            if slips and rng.random() < step_error_prob:
                result += rng.choice(slips)
            steps.append(f"{self._num(total)}+{step}={self._num(result)}")
            total = result
        return ",".join(steps) + f";A={self._num(total)}"
