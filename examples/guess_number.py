"""A multi-turn environment written outside pipelinerl (docs/environments.md).

The model finds a hidden number in [1, high] by guessing; after each guess the environment
answers whether it was too low or too high. Prompt `?31:`; a rollout:
`<g>16</g>` `<h>+</h>` `<g>24</g>` `<h>-</h>` `<g>20</g>` (found: the environment says done).
Success is finding it within `max_turns` guesses; binary search always does for high < 2^max_turns.
The demonstrations guess uniformly inside the interval the hints leave (they always find it,
in more guesses than bisection): RL has to learn to bisect. Run it from this folder:

    cd examples && pipelinerl train guess_number.yaml
"""

from __future__ import annotations

import random
import re

from pipelinerl.tasks import Problem, Score
from pipelinerl.tasks.environment import Reply, Turn

GUESS = re.compile(r"<g>(\d{1,3})</g>")


class GuessNumber:
    name = "guess_number"
    alphabet = "0123456789?:<>/gh+-"
    turn_stops = ("</g>",)

    def __init__(self, high: int = 31, max_turns: int = 5) -> None:
        if high < 2 or max_turns < 1:
            raise ValueError(f"need high >= 2 and max_turns >= 1, got {high} and {max_turns}")
        self.high, self.max_turns = high, max_turns

    def params(self) -> dict:
        return {"high": self.high, "max_turns": self.max_turns}

    def sample_problem(self, rng: random.Random) -> Problem:
        secret = rng.randint(1, self.high)
        return Problem(f"guess:{self.high}:{secret}", f"?{self.high}:", secret)

    def respond(self, problem: Problem, turns: list[Turn]) -> Reply:
        guess = GUESS.search(turns[-1].text)
        if guess is None or int(guess.group(1)) == problem.answer:
            return Reply(done=True)  # found, or no readable guess: nothing more to say
        return Reply("<h>+</h>" if int(guess.group(1)) < problem.answer else "<h>-</h>")

    def score(self, problem: Problem, transcript: str) -> Score:
        guesses = [int(g) for g in GUESS.findall(transcript)]
        found = bool(guesses) and guesses[-1] == problem.answer
        return Score(float(found), found)

    def demonstration(self, problem: Problem, rng: random.Random, step_error_prob: float = 0.0) -> str:
        """Guesses drawn inside the interval the hints leave (bisection with probability
        1 - step_error_prob at each guess), with the environment's hints in between."""
        lo, hi, text = 1, self.high, ""
        while True:
            guess = (lo + hi) // 2 if rng.random() >= step_error_prob else rng.randint(lo, hi)
            text += f"<g>{guess}</g>"
            if guess == problem.answer:
                return text
            text += "<h>+</h>" if guess < problem.answer else "<h>-</h>"
            lo, hi = (guess + 1, hi) if guess < problem.answer else (lo, guess - 1)
