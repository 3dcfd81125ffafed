"""Countdown: reach the target with the given numbers, each used at most once, and + - * /.

The second classic small-scale RL benchmark after GSM8K/MATH (TinyZero, "Countdown-Tasks-3to4").
Problems are made backwards: numbers are drawn, a random expression over some (or all, with
`use_all`) of them is built, and its value, when a whole number in [1, max_target], is the
target; so every problem has a solution, which the demonstrations write out.

Two prompt styles: `compact` (`3,5,2>16:` -> `(3+5)*2`) for the CPU warm-start's char-level
model, and `instruct` (a sentence asking for the expression inside <answer></answer>) for real
models. The verifier reads the last <answer>...</answer> if there is one, else the last line,
parses it with `ast` (numbers, + - * / and parentheses; nothing is evaluated by Python),
computes it exactly with fractions, and checks the numbers used against those given.
"""

from __future__ import annotations

import ast
import random
import re
from collections import Counter
from fractions import Fraction
from typing import Any

from pipelinerl.tasks.base import Problem, Score, require_int

OPS = "+-*/"
ALPHABET = "0123456789+-*/(),>:"
MAX_EXPRESSION_CHARS = 200  # longer answers are wrong by definition (and never parsed)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
INSTRUCT = ("Using the numbers {numbers}, write an expression that equals {target}. Use +, -, "
            "* and / and parentheses; each number at most once. Put the expression alone "
            "inside <answer></answer>.")


def evaluate(expression: str) -> tuple[Fraction, list[int]] | None:
    """The exact value of an arithmetic expression and the numbers it uses; None when it is
    not one (other syntax, a name, a call, a float, division by zero)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        return None
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        return None
    used: list[int] = []

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = value(node.left), value(node.right)
            op = _BINOPS[type(node.op)]
            if op == "+":
                return left + right
            if op == "-":
                return left - right
            return left * right if op == "*" else left / right  # Fraction: / 0 raises
        raise ValueError(f"not allowed: {type(node).__name__}")

    try:
        return value(tree.body), used
    except (ValueError, ZeroDivisionError, RecursionError):
        return None


def extract_answer(completion: str) -> str:
    """The last <answer>...</answer>, else the last non-empty line."""
    tagged = _ANSWER.findall(completion)
    if tagged:
        return tagged[-1].strip()
    lines = [line for line in completion.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


class CountdownTask:
    name = "countdown"
    alphabet = ALPHABET

    def __init__(self, min_numbers: int = 3, max_numbers: int = 4, max_number: int = 20,
                 max_target: int = 100, ops: str = OPS, use_all: bool = False,
                 style: str = "compact") -> None:
        for param, value in (("min_numbers", min_numbers), ("max_numbers", max_numbers),
                             ("max_number", max_number), ("max_target", max_target)):
            require_int(param, value)
        if not 2 <= min_numbers <= max_numbers:
            raise ValueError(f"need 2 <= min_numbers <= max_numbers, got {min_numbers} and "
                             f"{max_numbers}")
        if not ops or set(ops) - set(OPS):
            raise ValueError(f"ops must be some of {OPS!r}, got {ops!r}")
        if style not in ("compact", "instruct"):
            raise ValueError(f"style must be 'compact' or 'instruct', got {style!r}")
        self.min_numbers, self.max_numbers = min_numbers, max_numbers
        self.max_number, self.max_target = max_number, max_target
        self.ops, self.use_all, self.style = ops, use_all, style

    def params(self) -> dict[str, Any]:
        return {"min_numbers": self.min_numbers, "max_numbers": self.max_numbers,
                "max_number": self.max_number, "max_target": self.max_target, "ops": self.ops,
                "use_all": self.use_all, "style": self.style}

    # -- problems ---------------------------------------------------------------------------
    def sample_problem(self, rng: random.Random) -> Problem:
        while True:
            numbers = [rng.randint(1, self.max_number)
                       for _ in range(rng.randint(self.min_numbers, self.max_numbers))]
            k = len(numbers) if self.use_all else rng.randint(2, len(numbers))
            solution = self._random_expression(rng.sample(numbers, k), rng)
            found = evaluate(solution)
            if found is None:
                continue
            target = found[0]
            if target.denominator == 1 and 1 <= target <= self.max_target:
                return self._problem(numbers, int(target), solution)

    def _random_expression(self, numbers: list[int], rng: random.Random) -> str:
        """A random binary tree over `numbers` (in this order), fully parenthesised below the
        top, then stripped of the parentheses its operators' precedence makes redundant."""
        parts = [str(n) for n in numbers]
        while len(parts) > 1:
            i = rng.randrange(len(parts) - 1)
            op = rng.choice(self.ops)
            joined = f"{parts[i]}{op}{parts[i + 1]}"
            parts[i: i + 2] = [f"({joined})" if len(parts) > 2 else joined]
        return _unparse(ast.parse(parts[0], mode="eval").body)

    def _problem(self, numbers: list[int], target: int, solution: str) -> Problem:
        listed = ",".join(map(str, numbers))
        prompt = (f"{listed}>{target}:" if self.style == "compact"
                  else INSTRUCT.format(numbers=numbers, target=target))
        return Problem(f"countdown:{listed}>{target}", prompt,
                       {"numbers": numbers, "target": target, "solution": solution})

    # -- scoring ----------------------------------------------------------------------------
    def score(self, problem: Problem, completion: str) -> Score:
        found = evaluate(extract_answer(completion))
        if found is None:
            return Score(0.0, False)
        value, used = found
        given = Counter(problem.answer["numbers"])
        ok = (value == problem.answer["target"] and not Counter(used) - given
              and (not self.use_all or Counter(used) == given))
        return Score(1.0 if ok else 0.0, ok)

    def demonstration(self, problem: Problem, rng: random.Random,
                      step_error_prob: float = 0.0) -> str:
        """The generator's solution; with probability `step_error_prob` per number, that number
        is replaced by another (so a noisy demonstration usually misses the target)."""
        out = re.sub(r"\d+", lambda m: (str(rng.randint(1, self.max_number))
                                        if rng.random() < step_error_prob else m.group()),
                     problem.answer["solution"])
        return out if self.style == "compact" else f"<answer>{out}</answer>"


def _unparse(node: ast.AST, parent: int = 0, right: bool = False) -> str:
    """An expression with only the parentheses it needs (precedence: + - 1, * / 2; the right
    operand of - and / keeps its own at equal precedence)."""
    if isinstance(node, ast.Constant):
        return str(node.value)
    assert isinstance(node, ast.BinOp)
    op = _BINOPS[type(node.op)]
    level = 1 if op in "+-" else 2
    text = f"{_unparse(node.left, level)}{op}{_unparse(node.right, level, right=op in '-/')}"
    needs = level < parent or (right and level == parent)
    return f"({text})" if needs else text
