"""The programs the sandbox runs to test a completion, and how their results are read.

Asserts (MBPP) and `check(candidate)` (HumanEval) run in one sandboxed process: a runner
execs the solution in a namespace of its own, then each test under its own time limit, and
prints one verdict line per test behind a random nonce. stdin/stdout problems run the
solution once per case, and its output is compared here, outside the sandbox.

A verdict printed from the solution's own process can be forged by a solution written to do
so (it shares the runner's memory): the nonce stops accidental look-alikes, not a program that
reads it. Comparing stdin/stdout outputs outside the sandbox has no such hole. docs/code.md.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

# The runner: reads its job from the JSON literal put in place of __JOB__, then prints
# "<nonce> <index> <verdict>" for the solution ("program") and each test.
_RUNNER = r'''
import json as _json, signal as _signal, sys as _sys

class _TestTimeout(BaseException):
    pass

def _alarm(signum, frame):
    raise _TestTimeout()

# "wall": the test's wall-clock time; "cpu": the process's CPU time (user and system), which
# the machine's load changes far less (deterministic mode).
_TIMERS = {"wall": (_signal.ITIMER_REAL, _signal.SIGALRM),
           "cpu": (_signal.ITIMER_PROF, _signal.SIGPROF)}

def _plrl_main(job):
    out = _sys.__stdout__
    def verdict(index, what):
        out.write("\n%s %s %s\n" % (job["nonce"], index, what))
        out.flush()
    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        exec(compile(job["program"], "solution.py", "exec"), namespace)
    except BaseException as error:
        verdict("program", type(error).__name__)
        return
    verdict("program", "ok")
    timer, signum = _TIMERS[job["clock"]]
    _signal.signal(signum, _alarm)
    for index, test in enumerate(job["tests"]):
        _signal.setitimer(timer, job["time_limit_s"])
        try:
            exec(compile(test, "test_%d.py" % index, "exec"), namespace)
            what = "pass"
        except _TestTimeout:
            what = "timeout"
        except AssertionError:
            what = "fail"
        except BaseException as error:
            what = "error:" + type(error).__name__
        finally:
            _signal.setitimer(timer, 0)
        verdict(index, what)

_plrl_main(_json.loads(__JOB__))
'''


@dataclass(frozen=True)
class Runner:
    """A runner program for the sandbox and the nonce its verdicts carry."""

    source: str
    nonce: str
    tests: int


def solution_program(tests: dict[str, Any], program: str) -> str:
    """The solution as the tests see it: MBPP's setup code first; a HumanEval completion that
    does not define the entry point itself continues the prompt (the function's body)."""
    if tests["kind"] == "asserts":
        return f"{tests['setup']}\n{program}" if tests["setup"] else program
    if tests["kind"] == "humaneval" and f"def {tests['entry_point']}(" not in program:
        return tests["prompt"] + program
    return program


def runner_program(tests: dict[str, Any], program: str, time_limit_s: float,
                   clock: str = "wall") -> Runner:
    """The runner for an asserts or HumanEval problem's tests of `program`, each test
    limited to `time_limit_s` of `clock` ("wall" or "cpu" time)."""
    if tests["kind"] == "asserts":
        cases = list(tests["tests"])
    elif tests["kind"] == "humaneval":
        cases = [f"{tests['test']}\ncheck({tests['entry_point']})"]
    else:
        raise ValueError(f"tests of kind {tests['kind']!r} do not run through the runner")
    nonce = secrets.token_hex(8)
    job = {"nonce": nonce, "program": solution_program(tests, program), "tests": cases,
           "time_limit_s": time_limit_s, "clock": clock}
    return Runner(_RUNNER.replace("__JOB__", repr(json.dumps(job))), nonce, len(cases))


def read_verdicts(stdout: str, runner: Runner) -> tuple[str | None, list[str]]:
    """The program's verdict ("ok" or the exception's name; None: it never reported) and each
    test's in order ("missing" for one never reported: the process died or exited first)."""
    program: str | None = None
    found: dict[int, str] = {}
    prefix = runner.nonce + " "
    for line in stdout.splitlines():
        if not line.startswith(prefix):
            continue
        index, _, what = line[len(prefix):].partition(" ")
        if index == "program":
            program = what
        elif index.isdigit() and int(index) < runner.tests:
            found.setdefault(int(index), what)
    return program, [found.get(i, "missing") for i in range(runner.tests)]
