"""A single-turn task whose tool-using episodes the warm start can demonstrate
(`tool_demonstration`), with the `lookup` function of tool_kit.functions as its tool."""

from __future__ import annotations

import json
import random

from tool_kit.functions import TABLE

from pipelinerl.tasks.base import Problem, Score


class FruitCodes:
    name = "fruit_codes"

    def sample_problem(self, rng: random.Random) -> Problem:
        fruit = rng.choice(sorted(TABLE))
        return Problem(f"fruit:{fruit}", f"What is the code of a {fruit}?", TABLE[fruit])

    def tool_demonstration(self, problem: Problem, rng: random.Random,
                           error_prob: float) -> list[str]:
        fruit = problem.problem_id.removeprefix("fruit:")
        if rng.random() < error_prob:
            return ["The code is 0000."]
        call = json.dumps({"name": "lookup", "arguments": {"key": fruit}})
        return [f"<tool_call>\n{call}\n</tool_call>", f"The code is {problem.answer}."]

    def score(self, problem: Problem, transcript: str) -> Score:
        ok = problem.answer in transcript.rsplit("</tool_response>", 1)[-1]
        return Score(float(ok), ok)
