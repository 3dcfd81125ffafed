"""Progressions: add a step to a number k times, every step written out with the steps left.
The long-generation workload of examples/long_chains.yaml.

Prompt ``123+7*3=``; worked completion ``3:123+7=130,2:130+7=137,1:137+7=144;A=144``.
Numbers are zero-padded (the sums to the width of `max_value`, the counts to that of
`max_steps`), so every step has the same shape and depends only on the step before it: its
count minus one, its sum and the step at fixed offsets. The count says when to stop (after the
step numbered 1), so stopping early is a slip like any other, never a shortcut: a first version
stopped at the first sum past a limit given in the prompt, and RL taught the policy to stop
after one step (right for the problems of one step, the most frequent, and not worse on the
others, which it failed anyway). A problem of k steps is drawn with weight 1/k (k from 1 to
`max_steps`): most answers are short and a long tail of long ones runs to ~13 x max_steps
tokens, the regime PipelineRL is about. At temperature 1 a warm-started policy slips now and
then; a slip anywhere loses the answer, so long problems are the hard ones.
"""

from __future__ import annotations

import random
import re

from pipelinerl.tasks.base import Problem, Score, require_int

ALPHABET = "0123456789+*=:,;A"
_FINAL = re.compile(r"(?:^|;)A=(\d{1,9})$")
_PROMPT = re.compile(r"(\d+)\+(\d+)\*(\d+)=")


class ProgressionTask:
    name = "progression"
    alphabet = ALPHABET

    def __init__(self, max_steps: int = 60, max_operand: int = 9, max_value: int = 999) -> None:
        for param, value in (("max_steps", max_steps), ("max_operand", max_operand),
                             ("max_value", max_value)):
            require_int(param, value)
        if max_operand > 9:
            raise ValueError(f"max_operand must be <= 9 (one digit), got {max_operand}")
        if max_steps * max_operand > max_value:
            raise ValueError(f"max_steps x max_operand ({max_steps * max_operand}) must be <= "
                             f"max_value ({max_value}): the longest progression must fit")
        self.max_steps, self.max_operand, self.max_value = max_steps, max_operand, max_value
        self.width, self.count_width = len(str(max_value)), len(str(max_steps))
        self.weights = [1 / k for k in range(1, max_steps + 1)]

    def params(self) -> dict:
        """Everything that determines the problem distribution (used in cache keys)."""
        return {"max_steps": self.max_steps, "max_operand": self.max_operand,
                "max_value": self.max_value}

    def _num(self, value: int) -> str:
        return f"{value:0{self.width}d}"

    def _count(self, value: int) -> str:
        return f"{value:0{self.count_width}d}"

    def sample_problem(self, rng: random.Random) -> Problem:
        steps = rng.choices(range(1, self.max_steps + 1), weights=self.weights)[0]
        step = rng.randint(1, self.max_operand)
        start = rng.randint(0, self.max_value - steps * step)
        prompt = f"{self._num(start)}+{step}*{self._count(steps)}="
        return Problem(problem_id=f"prog:{prompt}", prompt=prompt, answer=start + steps * step)

    def score(self, problem: Problem, completion: str) -> Score:
        m = _FINAL.search(completion.strip())
        ok = m is not None and int(m.group(1)) == int(problem.answer)
        return Score(reward=1.0 if ok else 0.0, success=ok)

    def demonstration(self, problem: Problem, rng: random.Random,
                      step_error_prob: float = 0.0) -> str:
        """The worked progression, each sum off by one or ten with probability
        `step_error_prob` (where the slip stays in range); later steps continue from the
        wrong sum, so the answer is wrong (unless slips cancel)."""
        m = _PROMPT.fullmatch(problem.prompt)
        assert m is not None, problem.prompt
        total, step, count = int(m[1]), int(m[2]), int(m[3])
        steps = []
        for left in range(count, 0, -1):
            result = total + step
            slips = [d for d in (-10, -1, 1, 10) if 0 <= result + d <= self.max_value]
            if slips and rng.random() < step_error_prob:
                result += rng.choice(slips)
            steps.append(f"{self._count(left)}:{self._num(total)}+{step}={self._num(result)}")
            total = result
        return ",".join(steps) + f";A={self._num(total)}"
