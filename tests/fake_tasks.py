"""A fake task for the actor tests and the scoring benchmark: numbered prompts, and a verifier
that sleeps, hangs, raises or crashes on the problems it is told to.

Kept apart from the test modules and free of torch: verifier worker processes import it to
unpickle the task, and should start fast.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

from pipelinerl.tasks.base import Problem, Score


class FakeTask:
    name = "fake"

    def __init__(
        self,
        delay_s: float = 0.0,
        hang: frozenset[str] = frozenset(),
        fail: frozenset[str] = frozenset(),
        crash: frozenset[str] = frozenset(),
        pid_dir: str | None = None,
        prompt: str = "abcd",
    ) -> None:
        self.delay_s = delay_s
        self.hang, self.fail, self.crash = hang, fail, crash
        self.pid_dir = pid_dir  # a hanging verifier leaves its process id here
        self.prompt = prompt
        self.drawn = 0

    def sample_problem(self, rng: random.Random) -> Problem:
        self.drawn += 1
        return Problem(f"fake:{self.drawn - 1}", self.prompt, None)

    def score(self, problem: Problem, completion: str) -> Score:
        if problem.problem_id in self.hang:
            if self.pid_dir is not None:
                (Path(self.pid_dir) / str(os.getpid())).touch()
            time.sleep(3600)
        if problem.problem_id in self.fail:
            raise ValueError(f"verifier bug on {problem.problem_id}")
        if problem.problem_id in self.crash:
            os._exit(3)
        time.sleep(self.delay_s)
        return Score(float(len(completion) % 2), len(completion) % 2 == 1)


class OutcomeTask(FakeTask):
    """Scores as FakeTask does, saying why: "odd" or "even" (the completion's length)."""

    def score(self, problem: Problem, completion: str) -> Score:
        score = super().score(problem, completion)
        return Score(score.reward, score.success, "odd" if score.success else "even")


class DiesAtStartTask(FakeTask):
    """Kills the verifier worker that unpickles it: always, or only the first one (it leaves
    a mark in `mark_dir`). A worker dying at start makes pebble mark its pool broken."""

    def __init__(self, mark_dir: str, always: bool, crash: frozenset[str] = frozenset()) -> None:
        super().__init__(crash=crash)
        self.mark_dir, self.always = mark_dir, always

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        mark = Path(self.mark_dir) / "died"
        if self.always or not mark.exists():
            mark.touch()
            os._exit(1)


class AnswerTask:
    """Problem i's answer says whether any completion of it succeeds: held-out accuracy is
    then known in advance whatever the model writes."""

    name = "answer"

    def __init__(self, solvable: list[bool]) -> None:
        self.solvable = solvable

    def problems(self) -> list[Problem]:
        return [Problem(f"answer:{i}", "x", ok) for i, ok in enumerate(self.solvable)]

    def sample_problem(self, rng: random.Random) -> Problem:
        return rng.choice(self.problems())

    def score(self, problem: Problem, completion: str) -> Score:
        if problem.answer is None:
            raise ValueError(f"no answer for {problem.problem_id}")
        return Score(float(problem.answer), bool(problem.answer))


class FirstAttemptTask(AnswerTask):
    """Scored in threads (`bounds_score_time`): of the attempts at a solvable problem, exactly
    the first one scored succeeds, so pass@1 = (solvable fraction) / k and pass@k = the
    solvable fraction, whatever the model writes."""

    bounds_score_time = True

    def __init__(self, solvable: list[bool]) -> None:
        super().__init__(solvable)
        import threading

        self._lock = threading.Lock()
        self._seen: set[str] = set()

    def score(self, problem: Problem, completion: str) -> Score:
        with self._lock:
            first = problem.problem_id not in self._seen
            self._seen.add(problem.problem_id)
        ok = first and bool(problem.answer)
        return Score(float(ok), ok)


class FakeEnv(FakeTask):
    """An environment (pipelinerl.tasks.environment) over FakeTask's problems: a model turn
    ending on `stop` gets `reply` back (with `turn_reward`); its respond hangs, raises or takes
    0.3 s on the problems it is told to."""

    max_turns = 3

    def __init__(self, stop: str, reply: str = "xy", turn_reward: float = 0.0,
                 env_hang: frozenset[str] = frozenset(), env_fail: frozenset[str] = frozenset(),
                 env_slow: frozenset[str] = frozenset(), **fake: object) -> None:
        super().__init__(**fake)  # type: ignore[arg-type]
        self.turn_stops = (stop,)
        self.reply, self.turn_reward = reply, turn_reward
        self.env_hang, self.env_fail, self.env_slow = env_hang, env_fail, env_slow

    def respond(self, problem: Problem, turns: list) -> object:
        from pipelinerl.tasks.environment import Reply

        if problem.problem_id in self.env_hang:
            time.sleep(3600)
        if problem.problem_id in self.env_fail:
            raise ValueError(f"tool bug on {problem.problem_id}")
        if problem.problem_id in self.env_slow:
            time.sleep(0.3)
        return Reply(self.reply, reward=self.turn_reward)
