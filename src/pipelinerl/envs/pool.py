"""Environment steps off the decode loop: worker processes under a deadline.

Each `respond` call runs in a worker process (pebble's `ProcessPool`, started with 'spawn',
the environment pickled to each worker once). The actor submits a call when a rollout's turn
ends on a turn stop and goes back to decoding: a slow call delays only its own rollout, whose
sequence waits parked in the engine. A call that runs past `timeout_s` (counted from when it
starts) is killed with its worker and fails as `env_timeout`; one that raises fails as
`env_error`; one whose process dies (or breaks the pool) as `env_crash`. The pool is replaced
when broken.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from queue import Empty, SimpleQueue

from pebble import ProcessExpired, ProcessPool

from pipelinerl.proc.workers import retire, spawn_pool
from pipelinerl.tasks.base import Problem
from pipelinerl.tasks.environment import Environment, Reply, Turn

log = logging.getLogger(__name__)

_worker_env: Environment | None = None  # the environment, in a worker process


def _load_env(env: Environment) -> None:
    global _worker_env
    _worker_env = env


def _respond_in_worker(problem: Problem, turns: list[Turn]) -> Reply:
    assert _worker_env is not None, "the pool's initializer loads the environment"
    reply = _worker_env.respond(problem, turns)
    if not isinstance(reply, Reply):
        raise TypeError(f"respond() returned {type(reply).__name__}, not a Reply")
    return reply


@dataclass
class EnvResult:
    key: str
    reply: Reply | None  # None: the call failed
    failure: str  # "" or env_timeout / env_error / env_crash
    latency_s: float  # from submission to result, queueing included


class EnvPool:
    def __init__(self, env: Environment, timeout_s: float, workers: int) -> None:
        self.env = env
        self.timeout_s = timeout_s
        self.workers = workers
        self._pool = self._new_pool()
        self._submitted: dict[str, float] = {}
        self._finished: SimpleQueue[tuple[str, Future]] = SimpleQueue()

    def _new_pool(self) -> ProcessPool:
        return spawn_pool(self.workers, _load_env, self.env)

    def pending(self) -> int:
        return len(self._submitted)

    def submit(self, key: str, problem: Problem, turns: list[Turn],
               ended_on: str | None = None) -> None:
        """Ask for the reply to `turns[-1]`; `ended_on`: the text of the stop token the turn
        ended with, if it did (a tool pool's rendering needs it; `respond` does not)."""
        if not self._pool.active:
            log.warning("the environment pool of %s broke: starting a new one", self.env.name)
            retire(self._pool)
            self._pool = self._new_pool()
        self._submitted[key] = time.monotonic()
        future = self._pool.schedule(_respond_in_worker, (problem, turns), timeout=self.timeout_s)
        future.add_done_callback(lambda f, key=key: self._finished.put((key, f)))

    def poll(self) -> list[EnvResult]:
        """The calls that finished, without waiting."""
        results = []
        while not self._finished.empty():
            key, future = self._finished.get()
            started = self._submitted.pop(key)
            failure, reply = _failure(future), None
            if not failure:
                reply = future.result()
            elif failure != "env_timeout":
                log.warning("environment %s failed (%s): %r", self.env.name, failure,
                            future.exception())
            results.append(EnvResult(key, reply, failure, time.monotonic() - started))
        return results

    def wait(self, timeout_s: float) -> None:
        """Block until some call finishes or `timeout_s` passes."""
        try:
            finished = self._finished.get(timeout=timeout_s)
        except Empty:
            return
        self._finished.put(finished)

    def end(self, key: str) -> None:
        """Rollout `key` is over (a pool with per-rollout sessions closes its own)."""

    def close(self) -> None:
        retire(self._pool)


def _failure(future: Future) -> str:
    exc = future.exception()
    if exc is None:
        return ""
    if isinstance(exc, TimeoutError):
        return "env_timeout"
    if isinstance(exc, (BrokenProcessPool, ProcessExpired)):
        return "env_crash"
    return "env_error"


class FutureReplies:
    """The reply-pool bookkeeping of an environment that computes its replies as futures (on
    an event loop of its own: tools, OpenEnv): each rollout's future, once done, becomes an
    EnvResult that `poll` hands out; a future that raised (a bug, not the environment's
    failure) ends its rollout as `env_error`."""

    def __init__(self) -> None:
        self._submitted: dict[str, float] = {}
        self._finished: SimpleQueue[EnvResult] = SimpleQueue()

    def pending(self) -> int:
        return len(self._submitted)

    def _track(self, key: str, future: Future) -> None:
        """`future` gives (reply, failure) for rollout `key`."""
        self._submitted[key] = time.monotonic()
        future.add_done_callback(lambda f, key=key: self._done(key, f))

    def _done(self, key: str, future: Future) -> None:
        latency = time.monotonic() - self._submitted.pop(key)
        if (error := future.exception()) is not None:
            log.warning("the reply to %s failed: %r", key, error)
            self._finished.put(EnvResult(key, None, "env_error", latency))
            return
        reply, failure = future.result()
        self._finished.put(EnvResult(key, reply, failure, latency))

    def poll(self) -> list[EnvResult]:
        """The replies that came back, without waiting."""
        results = []
        while not self._finished.empty():
            results.append(self._finished.get())
        return results

    def wait(self, timeout_s: float) -> None:
        """Block until some reply comes back or `timeout_s` passes."""
        try:
            result = self._finished.get(timeout=timeout_s)
        except Empty:
            return
        self._finished.put(result)
