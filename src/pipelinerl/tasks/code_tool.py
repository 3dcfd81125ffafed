"""`task.name: code_tool`: the code task with the sandbox as a tool, in multi-turn episodes.

The model may run a program before it answers: it writes ``<code>print(add_3(1))</code>``,
its turn ends there, the sandbox runs the program (the limits of the task's tests) and the
environment appends ``<output>...</output>`` with what it printed, or its failure ("timeout",
"memory", the exit code and the end of stderr). The answer is the transcript's last
```python block, scored against the tests as in the code task; the programs run as tools are
never scored. Only the model's tokens are trained (docs/environments.md).
"""

from __future__ import annotations

import re

from pipelinerl.tasks.base import Problem, Score, require_int
from pipelinerl.tasks.code import STARTUP_S, CodeTask
from pipelinerl.tasks.environment import Reply, Turn

CALL = re.compile(r"<code>(.*?)</code>\s*$", re.DOTALL)
MAX_REPLY_CHARS = 400  # what the model reads back: the end of the output beyond it
TOOL_PROMPT = ("\nYou may run Python code first: write it between <code> and </code>, and its "
               "output comes back between <output> and </output>. Then give your final answer "
               "in a ```python block.")


def tool_reply(status: str, exit_code: int | None, stdout: str, stderr: str) -> str:
    """What the model reads back from one run of its program."""
    text = stdout
    if status != "ok":
        tail = stderr.strip().splitlines()[-3:]
        text += f"[{status}, exit code {exit_code}]\n" + "\n".join(tail)
    if len(text) > MAX_REPLY_CHARS:
        text = "[...]" + text[-MAX_REPLY_CHARS:]
    return f"<output>\n{text.strip()}\n</output>"


class CodeToolTask(CodeTask):
    name = "code_tool"
    turn_stops = ("</code>",)

    def __init__(self, max_turns: int = 3, **code: object) -> None:
        code.setdefault("extract", "fenced")  # the answer is a block; tool calls are not
        super().__init__(**code)  # type: ignore[arg-type]
        require_int("max_turns", max_turns)
        self.max_turns = max_turns

    def params(self) -> dict:
        return {**super().params(), "max_turns": self.max_turns}

    def sample_problem(self, rng) -> Problem:  # type: ignore[no-untyped-def]
        problem = super().sample_problem(rng)
        return Problem(problem.problem_id, problem.prompt + TOOL_PROMPT, problem.answer)

    def heldout_problems(self, n: int, seed: int, heldout_frac: float) -> list[Problem]:
        return [Problem(p.problem_id, p.prompt + TOOL_PROMPT, p.answer)
                for p in super().heldout_problems(n, seed, heldout_frac)]

    def respond(self, problem: Problem, turns: list[Turn]) -> Reply:
        call = CALL.search(turns[-1].text)
        program = call.group(1).split("<code>")[-1] if call else ""
        if not program.strip():
            return Reply("<output>\nno program between <code> and </code>\n</output>")
        result = self._run_python(program, STARTUP_S + self.time_limit_s)
        return Reply(tool_reply(result.status, result.exit_code, result.stdout, result.stderr))

    def score(self, problem: Problem, completion: str) -> Score:
        # The transcript holds the tool's replies too: a block inside one is not the answer.
        answer_text = re.sub(r"<output>.*?</output>", "", completion, flags=re.DOTALL)
        return super().score(problem, answer_text)
