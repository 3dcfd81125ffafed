"""Run a function on the ranks of a real gloo process group, one spawned process a rank.

A rank that hangs is killed after a deadline and the test fails naming it: a stuck child would
otherwise keep pytest from exiting (multiprocessing joins its non-daemon children at exit), and
one hung test would hold the whole CI run until its time limit."""

from __future__ import annotations

import io
import multiprocessing as mp
import queue
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from pipelinerl.proc.ports import free_port

SPAWN = mp.get_context("spawn")


def _in_group(rank: int, world: int, init: str, fn: Callable[..., Any], args: tuple,
              q: Any) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        out = io.BytesIO()  # by value: tensors sent as such share memory that dies with us
        # `fn` has returned, and its models (a DDP reducer holds the group) are gone before the
        # group is destroyed below.
        torch.save(fn(rank, world, *args), out)
        q.put((rank, out.getvalue()))
    except BaseException:
        q.put((rank, ("error", traceback.format_exc())))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0) -> list[Any]:
    """`fn(rank, world, *args)` on `world` spawned ranks of one gloo group; their results, by
    rank. `fn` must be importable (a module-level function of a test module)."""
    init = f"tcp://127.0.0.1:{free_port()}"
    q = SPAWN.Queue()
    procs = [SPAWN.Process(target=_in_group, args=(r, world, init, fn, args, q))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        while len(results) < world:
            rank, out = q.get(timeout=timeout_s)
            results[rank] = out
    except queue.Empty:
        missing = sorted(set(range(world)) - set(results))
        raise AssertionError(f"ranks {missing} gave no result within {timeout_s:.0f} s") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    for r, out in results.items():
        if isinstance(out, tuple):
            raise AssertionError(f"rank {r} failed:\n{out[1]}")
    hung = [r for r, p in enumerate(procs) if p.exitcode != 0]
    assert not hung, f"ranks {hung} returned their result but did not leave the group (killed)"
    return [torch.load(io.BytesIO(results[r]), weights_only=False) for r in range(world)]
