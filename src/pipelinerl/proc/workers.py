"""Worker process pools (pebble) for the user code the actor runs off its decode loop: the
verifiers (`scoring`) and the environments (`envs.pool`)."""

from __future__ import annotations

import multiprocessing
from typing import Any, Callable

from pebble import ProcessPool

# How long retiring a pool waits for its workers to exit; pebble kills a running one at stop.
RETIRE_TIMEOUT_S = 10.0


def spawn_pool(workers: int, initializer: Callable[[Any], None], payload: Any) -> ProcessPool:
    """A pool whose workers start with 'spawn' (never inheriting the actor's threads, CUDA
    context or engine memory) and receive `payload` pickled, once, through `initializer`."""
    return ProcessPool(workers, initializer=initializer, initargs=(payload,),
                       context=multiprocessing.get_context("spawn"))


def retire(pool: ProcessPool) -> None:
    """Stop `pool` and wait for its workers to exit. pebble's stop() alone leaves an idle
    worker process alive for as long as the actor lives: one leaked per retried group's pool."""
    pool.stop()
    pool.join(timeout=RETIRE_TIMEOUT_S)
