"""Scoring finished groups off the decode path.

The actor hands each finished group's completions to a `Scorer` and goes back to decoding;
`poll` returns the groups whose scores are all in. Each completion is verified in a worker
process (pebble's `ProcessPool`) under a deadline of `timeout_s` from the moment it starts
running: a verifier that hangs is killed with its worker (which the pool replaces) and the
group counts as `verifier_timeout`; one that raises counts as `verifier_error`; one whose
process dies counts as `verifier_crash`. A group with any failed attempt is dropped whole,
since its baseline needs every attempt. The task travels to each worker pickled, once, at
the worker's start.

A worker that dies can take innocent groups down with it: before pebble saw its task start,
the whole pool breaks and fails every group in it; after, pebble may blame the death on
another task the worker was handed (seen: a raising verifier's group reported as the crash of
its neighbour). So a group whose verification died, either way, is tried once more, alone on
a pool of its own (at most `workers` such pools at a time): a second death is its own.

A task whose `score` already runs its verifier in a killable process under its own deadline,
and is thread-safe, sets `bounds_score_time = True` (the math task does): it is called from
threads instead, as a second process around it would only add a hop.

The queue is bounded by the actor's schedule: every group waiting here still holds its place
in the staleness bound, so at most the groups the schedule admits can wait.
"""

from __future__ import annotations

import logging
import pickle
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from queue import Empty, SimpleQueue

from pebble import ProcessExpired, ProcessPool

from pipelinerl.proc.workers import retire, spawn_pool
from pipelinerl.tasks.base import Problem, Score, Task

log = logging.getLogger(__name__)

_worker_task: Task | None = None  # the task, in a worker process
# Pools that broke in a row with no verification finished between them: beyond this, the
# workers cannot start at all and the actor stops with an error instead of counting forever.
MAX_POOL_BREAKS_IN_A_ROW = 3


def _load_task(task: Task) -> None:
    global _worker_task
    _worker_task = task


def _score_in_worker(problem: Problem, completion: str) -> Score:
    assert _worker_task is not None, "the pool's initializer loads the task"
    return _worker_task.score(problem, completion)


def check_sendable(task: Task) -> None:
    """Refuse a task the verifier worker processes cannot receive (see the module docstring)."""
    if getattr(task, "bounds_score_time", False) or getattr(task, "episodic", False):
        return  # scores in the caller's process, or its environment scores its episodes
    try:
        pickle.dumps(task)
    except Exception as exc:  # noqa: BLE001 - pickle raises several types
        raise TypeError(
            f"task {task.name!r} cannot be sent to the verifier worker processes ({exc!r}): "
            "make it picklable, or, if its score() is thread-safe and bounds its own time, "
            "set bounds_score_time = True on it"
        ) from None


@dataclass
class Scored:
    """One group's outcome: its scores in completion order, or the reason it was dropped."""

    key: str
    scores: list[Score] | None
    reason: str = ""


@dataclass
class _Job:
    problem: Problem
    completions: list[str]
    futures: list[Future]
    remaining: int  # verifications not yet seen finished
    retried: bool = False  # already sent again, alone, after a verification died under it
    pool: ProcessPool | None = None  # its own pool, once retried


class Scorer:
    """Verifies groups' completions in the background; see the module docstring."""

    def __init__(self, task: Task, timeout_s: float, workers: int = 2) -> None:
        self.task = task
        self.timeout_s = timeout_s
        self.workers = workers
        self._breaks_in_a_row = 0
        self._jobs: dict[str, _Job] = {}
        self._to_retry: deque[str] = deque()  # keys of groups waiting for a pool of their own
        # Finished verifications, (group key, future), put by the futures' callbacks: `poll`
        # looks only at what finished, never scans what is still running.
        self._finished: SimpleQueue[tuple[str, Future]] = SimpleQueue()
        self._threads: ThreadPoolExecutor | None = None
        self._processes: ProcessPool | None = None
        check_sendable(task)
        if getattr(task, "bounds_score_time", False):
            self._threads = ThreadPoolExecutor(workers, thread_name_prefix="verifier")
            return
        self._processes = self._new_pool(self.workers)

    def _new_pool(self, workers: int) -> ProcessPool:
        return spawn_pool(workers, _load_task, self.task)

    def _live_pool(self) -> ProcessPool:
        """The process pool, replaced if pebble marked it broken: that happens when a worker
        dies before the pool's manager saw its task start (a verifier that kills its process at
        once, under load) or when workers die at start; every task then fails with
        BrokenProcessPool (counted as crashes) and the pool refuses new ones."""
        assert self._processes is not None
        if self._processes.active:
            return self._processes
        self._breaks_in_a_row += 1
        if self._breaks_in_a_row > MAX_POOL_BREAKS_IN_A_ROW:
            raise RuntimeError(
                f"the verifier worker processes of task {self.task.name!r} keep dying: "
                f"{self._breaks_in_a_row} pools in a row broke before any verification finished. "
                "Workers start with 'spawn': check that the task's module imports and its score() "
                "runs in a fresh Python process"
            )
        log.warning("the verifier pool of task %s broke (a worker died before its task started, "
                    "or at start): starting a new one", self.task.name)
        retire(self._processes)
        self._processes = self._new_pool(self.workers)
        return self._processes

    def submit(self, key: str, problem: Problem, completions: list[str]) -> None:
        self._start(key, _Job(problem, completions, [], len(completions)))

    def _start(self, key: str, job: _Job) -> None:
        if self._threads is not None:
            futures = [self._threads.submit(self.task.score, job.problem, c)
                       for c in job.completions]
        elif job.retried:
            job.pool = self._new_pool(1)
            futures = self._schedule(job.pool, job.problem, job.completions)
        else:
            pool = self._live_pool()
            try:
                futures = self._schedule(pool, job.problem, job.completions)
            except RuntimeError:
                if pool.active:
                    raise
                # It broke between the check and the call.
                futures = self._schedule(self._live_pool(), job.problem, job.completions)
        job.futures, job.remaining = futures, len(futures)
        self._jobs[key] = job
        for future in futures:
            future.add_done_callback(lambda f, key=key: self._finished.put((key, f)))

    def _schedule(self, pool: ProcessPool, problem: Problem, completions: list[str]
                  ) -> list[Future]:
        return [pool.schedule(_score_in_worker, (problem, c), timeout=self.timeout_s)
                for c in completions]

    def poll(self) -> list[Scored]:
        """The groups whose outcome is known, without waiting."""
        ready = []
        while not self._finished.empty():
            key, future = self._finished.get()
            job = self._jobs.get(key)
            if job is None or not any(future is f for f in job.futures):
                continue  # its group already failed, or was sent again
            if isinstance(future.exception(), (BrokenProcessPool, ProcessExpired)) and not job.retried:
                job.retried = True
                job.futures = []  # the rest of its failed tasks are ignored as they come
                self._to_retry.append(key)
                continue
            if reason := self._failure(job, future):
                for other in job.futures:
                    if not other.running():  # cancelling a running one would kill its worker
                        other.cancel()
                ready.append(Scored(key, None, reason))
                self._end(key)
                continue
            self._breaks_in_a_row = 0
            job.remaining -= 1
            if job.remaining == 0:
                ready.append(Scored(key, [f.result() for f in job.futures]))
                self._end(key)
        self._start_retries()
        return ready

    def _start_retries(self) -> None:
        alone = sum(job.pool is not None for job in self._jobs.values())
        while self._to_retry and alone < self.workers:
            key = self._to_retry.popleft()
            self._start(key, self._jobs[key])
            alone += 1

    def _end(self, key: str) -> None:
        job = self._jobs.pop(key)
        if job.pool is not None:
            retire(job.pool)

    def wait(self, timeout_s: float) -> None:
        """Block until some verification finishes or `timeout_s` passes."""
        try:
            finished = self._finished.get(timeout=timeout_s)
        except Empty:
            return
        self._finished.put(finished)  # for `poll`; the order of finished ones does not matter

    def _failure(self, job: _Job, future: Future) -> str:
        exc = future.exception()
        if exc is None:
            return ""
        if isinstance(exc, TimeoutError):
            return "verifier_timeout"
        if isinstance(exc, BrokenProcessPool):
            return "verifier_crash"  # alone on its own pool, it broke that too
        if isinstance(exc, ProcessExpired):
            log.warning("verifier process of task %s died on problem %s (exit code %s)",
                        self.task.name, job.problem.problem_id, exc.exitcode)
            return "verifier_crash"
        log.warning("verifier of task %s raised on problem %s: %r",
                    self.task.name, job.problem.problem_id, exc)
        return "verifier_error"

    def close(self) -> None:
        """Stop the workers; verifications still running are abandoned."""
        for job in self._jobs.values():
            if job.pool is not None:
                retire(job.pool)
        self._jobs.clear()
        self._to_retry.clear()
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
        if self._processes is not None:
            retire(self._processes)
