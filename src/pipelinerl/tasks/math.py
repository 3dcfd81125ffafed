"""Math word problems from a local JSONL file, scored with math-verify on the last \\boxed{}.

math-verify bounds its own time with `signal.alarm`, which raises outside the main thread and
cannot stop a C-level hang. So verification runs in a separate worker process with its own
timeouts disabled, and the caller waits at most `verify_timeout_s`: a verification that does
not answer in time gets reward 0, is counted in `stats["timeout"]`, and its worker is killed
and replaced on the next call. math_verify is imported only inside that worker
(optional extra: ``pip install 'pipelinerl[math]'``).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import random
import select
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from pipelinerl.tasks.base import Problem, Score
from pipelinerl.tasks.dataset import one_id_per_prompt

logger = logging.getLogger(__name__)

DEFAULT_PROMPT_TEMPLATE = (
    "{problem}\nPlease reason step by step, and put your final answer within \\boxed{}.\n"
)
MAX_ROW_WARNINGS = 10  # per file; the rest only count, so a broken file cannot flood the log
WORKER_START_TIMEOUT_S = 120.0  # starting Python and importing sympy is slow under load
DEFAULT_VERIFIER = f"{__name__}:math_verify_equal"


def math_verify_equal(gold: str, pred: str) -> bool:
    """math-verify equivalence of two answer strings (LaTeX or plain), its timeouts off:
    the worker process is bounded from outside."""
    from math_verify import parse, verify

    gold_parsed = parse(f"\\boxed{{{gold}}}", parsing_timeout=None)
    pred_parsed = parse(f"\\boxed{{{pred}}}", parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (nested braces allowed), or None if there is none
    or it is unclosed or empty."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    begin = start + len("\\boxed{")
    depth = 1
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                content = text[begin:i].strip()
                return content or None
    return None


def _resolve(spec: str) -> Callable[[str, str], bool]:
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


def _worker_main(spec: str) -> None:
    """Entry point of the verification process: JSON requests on stdin, replies on the
    original stdout (the verifier's own prints are sent to stderr)."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # the "timeout disabled" notice
    verifier = _resolve(spec)
    verifier("0", "0")  # import and warm up before reporting ready: the deadline excludes it
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        gold, pred = json.loads(line)
        try:
            reply = ["ok", bool(verifier(gold, pred))]
        except Exception as e:  # a verifier bug must cost one sample, not the worker
            reply = ["error", repr(e)]
        out.write(json.dumps(reply) + "\n")
        out.flush()


class _VerifierWorker:
    """One verification process, started with `python -c` rather than multiprocessing so it
    never re-imports the caller's __main__; `check` returns None when the deadline passed
    (the caller then kills it)."""

    def __init__(self, spec: str) -> None:
        # The child sees the same import path as this process (as multiprocessing would).
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._proc = subprocess.Popen(
            [sys.executable, "-c", f"from {__name__} import _worker_main; _worker_main({spec!r})"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        ready = self._readline(WORKER_START_TIMEOUT_S)
        if ready != b"ready\n":
            self.kill()
            what = (
                f"did not start within {WORKER_START_TIMEOUT_S:.0f}s"
                if ready is None
                else "exited while starting (see its traceback above)"
            )
            raise RuntimeError(f"math verifier worker for {spec!r} {what}")

    def _readline(self, timeout_s: float) -> bytes | None:
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
        return self._proc.stdout.readline() if ready else None

    def check(self, gold: str, pred: str, timeout_s: float) -> list | None:
        """["ok", bool] or ["error", message]; ["crash", None] if the process died."""
        try:
            self._proc.stdin.write((json.dumps([gold, pred]) + "\n").encode())
            self._proc.stdin.flush()
        except BrokenPipeError:
            return ["crash", None]
        line = self._readline(timeout_s)
        if line is None:
            return None
        return json.loads(line) if line else ["crash", None]

    def kill(self) -> None:
        self._proc.kill()
        self._proc.wait()
        self._proc.stdin.close()
        self._proc.stdout.close()


class MathTask:
    name = "math"
    # score() is thread-safe and bounds its own time in a killable worker: the actor's scorer
    # calls it from threads rather than wrapping it in a second process (pipelinerl.rollouts.scoring).
    bounds_score_time = True

    def __init__(
        self,
        dataset_path: str,
        problem_field: str = "problem",
        answer_field: str = "answer",
        prompt_template: str = DEFAULT_PROMPT_TEMPLATE,
        verify_timeout_s: float = 5.0,
        verifier: str = DEFAULT_VERIFIER,
    ) -> None:
        """`prompt_template` gets the problem text substituted for ``{problem}`` (plain
        replacement, so other braces such as ``\\boxed{}`` are kept). `verifier` names, as
        ``"module:function"``, the function that decides whether gold and predicted answer
        strings agree; it runs in the worker process."""
        if "{problem}" not in prompt_template:
            raise ValueError(f"prompt_template must contain '{{problem}}', got {prompt_template!r}")
        if verify_timeout_s <= 0:
            raise ValueError(f"verify_timeout_s must be > 0, got {verify_timeout_s}")
        if verifier.count(":") != 1:
            raise ValueError(f"verifier must be 'module:function', got {verifier!r}")
        if verifier == DEFAULT_VERIFIER and importlib.util.find_spec("math_verify") is None:
            raise ImportError("the math task needs math-verify: pip install 'pipelinerl[math]'")
        self.dataset_path = Path(dataset_path)
        self.problem_field = problem_field
        self.answer_field = answer_field
        self.prompt_template = prompt_template
        self.verify_timeout_s = verify_timeout_s
        self.verifier = verifier
        self.skipped: Counter[str] = Counter()  # bad dataset rows by reason
        self.stats: Counter[str] = Counter()  # scoring outcomes that gave reward 0 by reason
        self.problems = self._load()
        self._worker: _VerifierWorker | None = None
        self._lock = threading.Lock()  # one request in flight per worker pipe

    def _load(self) -> list[Problem]:
        if not self.dataset_path.is_file():
            raise FileNotFoundError(f"math dataset {str(self.dataset_path)!r} does not exist")
        problems = []
        with self.dataset_path.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                reason, row = self._parse_row(line)
                if reason is not None:
                    self.skipped[reason] += 1
                    if sum(self.skipped.values()) <= MAX_ROW_WARNINGS:
                        logger.warning(
                            "%s:%d: skipped row (%s)", self.dataset_path, line_no, reason
                        )
                    continue
                prompt = self.prompt_template.replace("{problem}", row[self.problem_field])
                answer = str(row[self.answer_field]).strip()
                problems.append(Problem(f"math:{line_no}", prompt, answer))
        if self.skipped:
            logger.warning(
                "%s: skipped %d bad row(s): %s",
                self.dataset_path,
                sum(self.skipped.values()),
                dict(self.skipped),
            )
        if not problems:
            raise ValueError(
                f"math dataset {str(self.dataset_path)!r} has no usable rows "
                f"(need JSON objects with {self.problem_field!r} and {self.answer_field!r}; "
                f"skipped: {dict(self.skipped) or 'file is empty'})"
            )
        return one_id_per_prompt(problems)  # a problem on two lines: one id, one split side

    def _parse_row(self, line: str) -> tuple[str | None, dict]:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            return "invalid_json", {}
        if not isinstance(row, dict):
            return "not_an_object", {}
        problem = row.get(self.problem_field)
        if not isinstance(problem, str) or not problem.strip():
            return f"missing_{self.problem_field}", row
        answer = row.get(self.answer_field)
        if answer is None or isinstance(answer, (dict, list)) or not str(answer).strip():
            return f"missing_{self.answer_field}", row
        return None, row

    def sample_problem(self, rng: random.Random) -> Problem:
        return rng.choice(self.problems)

    def score(self, problem: Problem, completion: str) -> Score:
        pred = last_boxed(completion)
        if pred is None:
            self.stats["no_boxed"] += 1
            return Score(0.0, False)
        if pred == problem.answer:  # the common case needs no worker round trip
            return Score(1.0, True)
        with self._lock:
            if self._worker is None:
                self._worker = _VerifierWorker(self.verifier)
            result = self._worker.check(problem.answer, pred, self.verify_timeout_s)
            if result is None or result[0] == "crash":
                self.stats["timeout" if result is None else "verifier_crash"] += 1
                self._worker.kill()
                self._worker = None
                return Score(0.0, False)
        status, ok = result
        if status == "error":
            self.stats["verifier_error"] += 1
            return Score(0.0, False)
        if not ok:
            self.stats["wrong"] += 1
        return Score(1.0 if ok else 0.0, bool(ok))

    def close(self) -> None:
        """Stop the verification worker (it is a daemon, so it also ends with this process)."""
        with self._lock:
            if self._worker is not None:
                self._worker.kill()
                self._worker = None
