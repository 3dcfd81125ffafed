"""Code problems as users have them, read into one shape, and the programs that test them.

Three dataset shapes (docs/code.md), recognised by their columns:
- MBPP: `text` (the task in words), `test_list` (assert statements), optional
  `test_setup_code`, `task_id`;
- HumanEval: `prompt` (signature and docstring), `test` (defines `check(candidate)`),
  `entry_point`, `task_id`;
- stdin/stdout: APPS' `question` + `input_output` (JSON: `inputs`, `outputs`), or
  CodeContests' `description` + `public_tests` / `private_tests` / `generated_tests`
  (`input`, `output` lists).

Every row becomes a `Problem` whose answer is a `Tests` dict (JSON, so it travels to the
verifier workers as is): `{"kind": "asserts", "setup", "tests"}`, `{"kind": "humaneval",
"prompt", "test", "entry_point"}` or `{"kind": "stdio", "cases": [[input, output], ...]}`.

The program is taken from the completion by `extract`: `fenced` (the last ```python block, or
the last ``` block), `raw` (the completion as it is), `auto` (fenced when there is a block,
else raw).
"""

from __future__ import annotations

import json
import re
from typing import Any

from pipelinerl.tasks.base import Problem

EXTRACT_RULES = ("auto", "fenced", "raw")
# A fenced block: ``` then an optional language tag, the code, then ``` (or the completion's
# end: a block the generation cut at max_new_tokens is still the program it wrote).
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
MBPP_PROMPT = ("{text}\nWrite a Python function that passes these tests:\n{tests}\n"
               "Reply with the code in a ```python block.")
STDIO_PROMPT = ("{question}\nWrite a Python program that reads the input from stdin and prints "
                "the answer. Reply with the code in a ```python block.")


def extract_program(completion: str, rule: str) -> str:
    """The program in `completion` by `rule` (module docstring); "" when there is none."""
    if rule not in EXTRACT_RULES:
        raise ValueError(f"extract must be one of {EXTRACT_RULES}, got {rule!r}")
    blocks = _FENCE.findall(completion)
    if blocks:
        python = [code for tag, code in blocks if tag.lower() in ("python", "py", "python3")]
        fenced = (python or [code for _, code in blocks])[-1]
    else:
        fenced = ""
    if rule == "fenced" or (rule == "auto" and blocks):
        return fenced.strip("\n")
    return completion.strip("\n")


def row_kind(row: dict[str, Any]) -> str | None:
    """Which shape a row has, by its columns; None when none of them."""
    if "test_list" in row:
        return "asserts"
    if "entry_point" in row and "test" in row:
        return "humaneval"
    if "input_output" in row or any(k in row for k in ("public_tests", "private_tests")):
        return "stdio"
    return None


def row_problem(row: dict[str, Any], split: str, index: int) -> tuple[Problem | None, str]:
    """One dataset row as a problem, or the reason it cannot be one."""
    kind = row_kind(row)
    if kind is None:
        return None, ("no code-problem columns (MBPP: test_list; HumanEval: prompt, test, "
                      "entry_point; stdin/stdout: input_output or public_tests)")
    problem_id = str(row.get("task_id") or row.get("problem_id") or row.get("name")
                     or f"{split}:{index}")
    try:
        if kind == "asserts":
            return _mbpp(row, problem_id)
        if kind == "humaneval":
            return _humaneval(row, problem_id)
        return _stdio(row, problem_id)
    except (TypeError, ValueError, KeyError) as e:
        return None, f"{kind} row unreadable: {type(e).__name__}: {e}"


def _text(row: dict[str, Any], *columns: str) -> str:
    for column in columns:
        value = row.get(column)
        if isinstance(value, str) and value.strip():
            return value
    raise ValueError(f"no text in column(s) {list(columns)}")


def _mbpp(row: dict[str, Any], problem_id: str) -> tuple[Problem | None, str]:
    tests = row["test_list"]
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
        return None, "test_list is not a non-empty list of assert statements"
    text = _text(row, "text", "prompt", "description")
    prompt = MBPP_PROMPT.format(text=text.strip(), tests="\n".join(tests))
    answer = {"kind": "asserts", "setup": row.get("test_setup_code") or "", "tests": tests}
    return Problem(problem_id, prompt, answer), ""


def _humaneval(row: dict[str, Any], problem_id: str) -> tuple[Problem | None, str]:
    entry_point = row["entry_point"]
    if not isinstance(entry_point, str) or not entry_point.isidentifier():
        return None, f"entry_point {entry_point!r} is not a function name"
    prompt = _text(row, "prompt")
    answer = {"kind": "humaneval", "prompt": prompt, "test": _text(row, "test"),
              "entry_point": entry_point}
    return Problem(problem_id, prompt, answer), ""


def _stdio(row: dict[str, Any], problem_id: str) -> tuple[Problem | None, str]:
    cases: list[list[str]] = []
    if "input_output" in row:  # APPS: a JSON string
        io = row["input_output"]
        io = json.loads(io) if isinstance(io, str) else io
        if io.get("fn_name"):
            return None, "APPS call-based problem (fn_name): only stdin/stdout ones are read"
        cases = [[_io_text(i), _io_text(o)] for i, o in zip(io["inputs"], io["outputs"],
                                                             strict=True)]
    for column in ("public_tests", "private_tests", "generated_tests"):  # CodeContests
        tests = row.get(column) or {}
        cases += [[i, o] for i, o in zip(tests.get("input", []), tests.get("output", []),
                                         strict=True)]
    if not cases:
        return None, "no stdin/stdout test cases"
    question = _text(row, "question", "description", "prompt")
    prompt = STDIO_PROMPT.format(question=question.strip())
    return Problem(problem_id, prompt, {"kind": "stdio", "cases": cases}), ""


def _io_text(value: Any) -> str:
    """APPS writes a case's input or output as a string or a list of lines."""
    if isinstance(value, list):
        return "\n".join(str(v) for v in value) + "\n"
    return str(value)


def same_output(got: str, expected: str) -> bool:
    """Outputs compared as the judges of these datasets do: line by line, trailing whitespace
    and trailing empty lines ignored."""
    def lines(text: str) -> list[str]:
        out = [line.rstrip() for line in text.strip("\n").splitlines()]
        while out and not out[-1]:
            out.pop()
        return out

    return lines(got) == lines(expected)


def count_tests(tests: dict[str, Any]) -> int:
    """How many tests a problem has (HumanEval's check() is one)."""
    if tests["kind"] == "asserts":
        return len(tests["tests"])
    if tests["kind"] == "stdio":
        return len(tests["cases"])
    return 1
