"""Chain arithmetic with a calculator tool: the built-in environment
(pipelinerl.tasks.environment).

The problems are the arithmetic task's (``08+7-5=``). The model may call the calculator by
writing ``<calc>08+7-5</calc>``; its turn ends there, and the environment appends
``<res>10</res>``; the model goes on and ends with the answer, ``;A=10``. A call the
calculator cannot read (anything but integers joined by + and -) gets ``<res>error</res>``.
The verifier is the arithmetic task's: the transcript's last ``A=`` must hold the answer.

Demonstrations use the tool with probability `tool_demo_prob` and otherwise work the chain by
hand with the arithmetic task's noisy steps, so the warm-started policy knows the format and
calls the tool on about that share of problems: RL has to learn that calling it pays.
"""

from __future__ import annotations

import random
import re

from pipelinerl.tasks.environment import Reply, Turn
from pipelinerl.tasks.arithmetic import ALPHABET, ChainArithmeticTask
from pipelinerl.tasks.base import Problem, require_int

CALL = re.compile(r"<calc>([^<]*)</calc>$")
EXPRESSION = re.compile(r"\d{1,9}(?:[+-]\d{1,9}){0,31}")
_SIGNED = re.compile(r"[+-]?\d+")


def calculate(expression: str) -> str:
    """The calculator's answer: the value of integers joined by + and -, or "error"."""
    if not EXPRESSION.fullmatch(expression):
        return "error"
    return str(sum(int(t) for t in _SIGNED.findall(expression)))


class CalculatorTask(ChainArithmeticTask):
    name = "calculator"
    alphabet = ALPHABET + "<>/calcres"
    turn_stops = ("</calc>",)

    def __init__(self, tool_demo_prob: float = 0.3, max_turns: int = 3, **arithmetic: object) -> None:
        super().__init__(**arithmetic)  # type: ignore[arg-type]
        if not 0.0 <= float(tool_demo_prob) <= 1.0:
            raise ValueError(f"tool_demo_prob must be in [0, 1], got {tool_demo_prob!r}")
        require_int("max_turns", max_turns)
        self.tool_demo_prob = float(tool_demo_prob)
        self.max_turns = max_turns

    def params(self) -> dict:
        return {**super().params(), "tool_demo_prob": self.tool_demo_prob,
                "max_turns": self.max_turns}

    def respond(self, problem: Problem, turns: list[Turn]) -> Reply:
        call = CALL.search(turns[-1].text)
        expression = call.group(1) if call else ""
        return Reply(f"<res>{calculate(expression)}</res>")

    def demonstration(self, problem: Problem, rng: random.Random, step_error_prob: float = 0.0) -> str:
        if rng.random() < self.tool_demo_prob:
            expression = problem.prompt.removesuffix("=")
            return f"<calc>{expression}</calc><res>{calculate(expression)}</res>;A={problem.answer}"
        return super().demonstration(problem, rng, step_error_prob)
