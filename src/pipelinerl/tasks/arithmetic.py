"""Chain arithmetic: a synthetic task a ~1M-parameter char-level model can learn on a CPU.

Prompt ``12+7-5+3=``; worked completion ``12+7=19,19-5=14,14+3=17;A=17`` (the engine's stop
token follows). The first term is in [0, max_value], the others in [1, max_operand] with signs
chosen so that every running total stays in [0, max_value]. Two choices make it learnable by
a ~1M-parameter char-level model in a few minutes on a CPU:
- numbers are zero-padded to the width of max_value (``08+7=15,15-9=06;A=06``), so every step
  has the same shape and each result digit depends on digits at fixed offsets;
- the operands of one problem are distinct, so the next term is found by content: it follows,
  in the prompt, the previous step's operand (which sits at a fixed offset back).
Finding the next term is still the hardest part: long chains are what RL has left to fix. The
number of terms is drawn from a skewed distribution, so completion lengths run from ~12 to
~60 characters with a thin tail: the length spread that makes pipelined generation pay off.
With ``term_weights: harmonic`` a problem of k steps has weight 1/k (log-uniform lengths):
with many terms, a long tail of long generations (examples/long_chains.yaml).
"""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Sequence

from pipelinerl.tasks.base import Problem, Score, require_int

ALPHABET = "0123456789+-=,;A"
# Geometric decay of the term-count weights: most problems are short, a few are long.
DEFAULT_DECAY = 0.6
HARMONIC = "harmonic"
_TERM = re.compile(r"[+-]?\d+")
# Bounded digit count: int() refuses >4300 digits, and no real answer is that long.
_FINAL = re.compile(r"(?:^|;)A=(-?\d{1,9})$")


class ChainArithmeticTask:
    name = "arithmetic"
    alphabet = ALPHABET

    def __init__(
        self,
        min_terms: int = 2,
        max_terms: int = 8,
        term_weights: Sequence[float] | str | None = None,
        max_operand: int = 9,
        max_value: int = 99,
    ) -> None:
        require_int("min_terms", min_terms, 2)
        require_int("max_terms", max_terms, min_terms)
        require_int("max_operand", max_operand)
        require_int("max_value", max_value)
        if max_terms - 1 > max_operand:
            raise ValueError(
                f"max_terms - 1 ({max_terms - 1}) must be <= max_operand ({max_operand}): "
                "the operands of one problem are distinct"
            )
        if max_value < 2 * max_operand:
            # Below this some running total could neither add nor subtract the next operand.
            raise ValueError(
                f"max_value must be >= 2 * max_operand ({2 * max_operand}), got {max_value}"
            )
        n_counts = max_terms - min_terms + 1
        if term_weights is None:
            term_weights = [DEFAULT_DECAY**i for i in range(n_counts)]
        elif term_weights == HARMONIC:  # k = n_terms - 1 steps, weight 1/k
            term_weights = [1 / (n - 1) for n in range(min_terms, max_terms + 1)]
        elif isinstance(term_weights, str):
            raise ValueError(f"term_weights must be a list of numbers or {HARMONIC!r}, "
                             f"got {term_weights!r}")
        try:
            term_weights = [float(w) for w in term_weights]
        except (TypeError, ValueError) as e:
            raise ValueError(f"term_weights must be a list of numbers, got {term_weights!r}") from e
        if len(term_weights) != n_counts:
            raise ValueError(
                f"term_weights must have max_terms - min_terms + 1 = {n_counts} entries "
                f"(one per term count), got {len(term_weights)}"
            )
        if any(w < 0 for w in term_weights) or sum(term_weights) <= 0:
            raise ValueError(f"term_weights must be >= 0 with a positive sum, got {term_weights}")
        self.min_terms = min_terms
        self.max_terms = max_terms
        self.term_weights = term_weights
        self.max_operand = max_operand
        self.max_value = max_value
        # Numbers are zero-padded to a fixed width, so every step has the same shape and each
        # digit sits at a fixed offset from the digits it depends on.
        self.width = len(str(max_value))
        self.op_width = len(str(max_operand))

    def params(self) -> dict:
        """Everything that determines the problem distribution (used in cache keys)."""
        return {
            "min_terms": self.min_terms,
            "max_terms": self.max_terms,
            "term_weights": self.term_weights,
            "max_operand": self.max_operand,
            "max_value": self.max_value,
        }

    def _num(self, value: int) -> str:
        return f"{value:0{self.width}d}"

    def sample_problem(self, rng: random.Random) -> Problem:
        counts = range(self.min_terms, self.max_terms + 1)
        n_terms = rng.choices(counts, weights=self.term_weights)[0]
        total = rng.randint(0, self.max_value)
        prompt = self._num(total)
        for op in rng.sample(range(1, self.max_operand + 1), n_terms - 1):
            signs = [
                s for s, v in (("+", total + op), ("-", total - op)) if 0 <= v <= self.max_value
            ]
            sign = rng.choice(signs)
            total = total + op if sign == "+" else total - op
            prompt += f"{sign}{op:0{self.op_width}d}"
        prompt += "="
        return Problem(problem_id=f"arith:{prompt}", prompt=prompt, answer=total)

    def score(self, problem: Problem, completion: str) -> Score:
        m = _FINAL.search(completion.strip())
        ok = m is not None and int(m.group(1)) == int(problem.answer)
        return Score(reward=1.0 if ok else 0.0, success=ok)

    def demonstration(
        self, problem: Problem, rng: random.Random, step_error_prob: float = 0.0
    ) -> str:
        """A worked solution in which each step's result is wrong with probability
        `step_error_prob`; later steps continue consistently from the wrong value, and the
        final answer repeats the last step's result (so a noisy chain ends wrong)."""
        terms = [int(t) for t in _TERM.findall(problem.prompt)]
        total = terms[0]
        steps = []
        for i, term in enumerate(terms[1:], start=1):
            result = total + term
            if rng.random() < step_error_prob:
                result += self._slip(result, terms[i + 1 :], rng)
            sign = "+" if term >= 0 else "-"
            steps.append(
                f"{self._num(total)}{sign}{abs(term):0{self.op_width}d}={self._num(result)}"
            )
            total = result
        return ",".join(steps) + f";A={self._num(total)}"

    def _slip(self, value: int, later_terms: list[int], rng: random.Random) -> int:
        """The error added to a step's result: off by one or two, or a wrong carry/borrow (off
        by ten), chosen so that this and every later running total stays in range and keeps
        the fixed width; 0 (no slip) in the rare case that no error fits."""
        totals = list(itertools.accumulate(later_terms, initial=value))
        lo, hi = -min(totals), self.max_value - max(totals)
        deltas = [d for d in (-10, -2, -1, 1, 2, 10) if lo <= d <= hi]
        return rng.choice(deltas) if deltas else 0
